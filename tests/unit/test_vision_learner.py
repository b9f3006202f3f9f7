"""The learner trains a vision-language model (a tiny random Idefics3, SmolVLM's architecture)
on records whose prompts carry images: the group's PNG bytes become pixel values on the driver
(asyncrl.data.pixels), travel with each sequence through the mini-batches and micro-batches
(padded and packed), and reach the FSDP2 forward, whose log-probs equal transformers' plain
forward (1e-5, float32) and whose gradient reaches the vision tower and the connector, on one
gloo rank and on two (one of them running a padding micro-batch, which gets a stand-in image:
every rank runs the vision tower's collectives); a group's image is encoded once per
micro-batch. The publish carries the checkpoint's names and shapes, which vLLM's Idefics3
loader took at start-up. Refusals: tests/unit/test_vision_refusals.py.

    .venv/bin/python -m pytest tests/unit/test_vision_learner.py -q    # about 60 s on 2 cores
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from asyncrl.data import microbatch as mbatch  # noqa: E402
from asyncrl.data.batch import build_minibatches  # noqa: E402
from asyncrl.data.pixels import ImagePixels  # noqa: E402
from tests.support.vision_records import (  # noqa: E402
    TEMP,
    group,
    load_plain,
    micro,
    padding,
    plain_logprobs,
    sequences,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tiny_idefics3) -> str:
    return str(tiny_idefics3)


@pytest.fixture(scope="module")
def pixels(model_dir):
    return ImagePixels.of(model_dir)


def loss_fn(logits, mb):
    """-sum of the loss tokens' log-probs: a gradient on every token the model scores."""
    from asyncrl.learner.loss import token_logprobs

    logp = token_logprobs(logits, mbatch.forward_ids(mb), TEMP)
    if mbatch.is_packed(mb):
        logp = mbatch.unpack(logp, mb)
    return -(logp * mb["loss_mask"]).sum(), {}


def sharded_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = torch.zeros(p.shape) if g is None else g
    return out


def run_step(model, mbs) -> dict[str, torch.Tensor]:
    from asyncrl.learner import step

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    step.train_step(model, opt, sched, mbs, loss_fn, grad_clip=1e9, device=torch.device("cpu"))
    return sharded_grads(model)


def prepass(model, mbs) -> list[torch.Tensor]:
    from asyncrl.learner import step
    from asyncrl.learner.loss import token_logprobs

    step.add_prepass_logprobs(model, None, mbs, temperature=TEMP, logprob_fn=token_logprobs, device=torch.device("cpu"))
    return [mb["old_logprobs"] for mb in mbs]


def plain_grads(hf, seqs) -> dict[str, torch.Tensor]:
    hf.zero_grad(set_to_none=True)
    loss = sum(-(plain_logprobs(hf, s) * torch.as_tensor(s.loss_mask)).sum() for s in seqs)
    loss.backward()
    return {n: torch.zeros(p.shape) if p.grad is None else p.grad.clone() for n, p in hf.named_parameters()}


def assert_close_grads(got, want):
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    for name in want:
        assert float((got[name] - want[name]).abs().max()) <= TOL * scale, name
    for part in ("model.vision_model.encoder.layers.0.", "model.vision_model.embeddings.", "model.connector."):
        assert any(float(g.abs().max()) > 1e-6 * scale for n, g in got.items() if n.startswith(part)), part


# ---------------------------------------------------------------- one rank


def test_one_rank_logprobs_and_gradients_with_images_equal_transformers(model_dir, pixels, mesh):
    from asyncrl.learner import fsdp

    rng = np.random.default_rng(0)
    groups = [
        group(model_dir, "g0", ["red"], rng),
        group(model_dir, "g1", ["blue", "green"], rng),  # two images in one prompt
        group(model_dir, "g2", [], rng),  # a text prompt in the same run
    ]
    seqs, metrics = sequences(model_dir, pixels, groups)
    assert metrics["vision/refused_samples"] == 0
    assert [len(s.pixel_values) for s in seqs] == [1, 1, 2, 2, 0, 0]
    hf = load_plain(model_dir)
    want = [plain_logprobs(hf, s).detach() for s in seqs]

    model = fsdp.load_sharded_model(model_dir, mesh, device=torch.device("cpu"), dtype="float32")
    assert len(fsdp.vision_units(model)) == 3  # the encoder layer, the tower, the connector
    encoded = []  # tiles per pass of the vision tower
    model.model.vision_model.register_forward_pre_hook(
        lambda _m, _a, kw: encoded.append(len(kw["pixel_values"])), with_kwargs=True
    )
    for packed in (False, True):
        mbs = [micro(seqs[:3], packed), micro(seqs[3:], packed)]
        mbs.append(padding(mbs[0]))  # no images: it runs on a stand-in one
        encoded.clear()
        got = prepass(model, mbs)
        # g0's two samples share their image (1 tile), g1's first sample has 2; then g1's
        # second sample (2) with g2's text; the padding micro-batch's stand-in.
        assert encoded == [3, 2, 1]
        rows = [row for lp, mb in zip(got[:2], mbs[:2], strict=True) for row in lp[: len(mb["input_ids"])]]
        for k, (s, w) in enumerate(zip(seqs, want, strict=True)):
            assert float((rows[k][: s.num_tokens] - w).abs().max()) <= TOL, (packed, k)
        assert_close_grads(run_step(model, mbs), plain_grads(hf, seqs))

    # Another image, the same ids: other log-probs.
    other = group(model_dir, "g0", ["green"], np.random.default_rng(0))
    (changed, *_), _ = sequences(model_dir, pixels, [other])
    assert np.array_equal(changed.input_ids, seqs[0].input_ids)
    moved = prepass(model, [micro([changed], False)])[0][0]
    assert float((moved - want[0]).abs().max()) > 1e-3


def test_the_reference_the_parity_path_and_checkpointing_use_the_images(model_dir, pixels, mesh):
    """The KL reference's pass, the log-probs the parity gate asks for (LearnerGroup.compute_logprobs:
    forward_fields through the rank's micro-batches, as LearnerActor.logprobs), and a model whose
    text blocks recompute under activation checkpointing all see the images."""
    from asyncrl.learner import fsdp, step
    from asyncrl.learner.loss import token_logprobs

    rng = np.random.default_rng(6)
    seqs, _ = sequences(
        model_dir, pixels, [group(model_dir, "g0", ["red"], rng), group(model_dir, "g1", ["blue"], rng)]
    )
    hf = load_plain(model_dir)
    want = [plain_logprobs(hf, s).detach() for s in seqs]
    cpu = torch.device("cpu")

    reference = fsdp.load_sharded_model(model_dir, mesh, device=cpu, dtype="float32", trainable=False)
    mbs = [micro(seqs, True)]
    mbs.append(padding(mbs[0]))
    step.add_prepass_logprobs(None, reference, mbs, temperature=TEMP, logprob_fn=token_logprobs, device=cpu)
    for k, (s, w) in enumerate(zip(seqs, want, strict=True)):
        assert float((mbs[0]["ref_logprobs"][k][: s.num_tokens] - w).abs().max()) <= TOL, k

    plan = [[0, 1], [2, 3]]
    gate = mbatch.build_rank_microbatches(
        [mbatch.forward_fields(s) for s in seqs], plan, 3, {"input_ids": torch.int64}, pad_token_id=0, packing=True
    )
    lengths = [[seqs[i].num_tokens for i in mb] for mb in plan] + [[]]
    got = step.sequence_logprobs(reference, gate, lengths, temperature=TEMP, logprob_fn=token_logprobs, device=cpu)
    rows = [torch.as_tensor(row) for mb in got for row in mb]
    assert all(float((r - w).abs().max()) <= TOL for r, w in zip(rows, want, strict=True))

    checkpointed = fsdp.load_sharded_model(model_dir, mesh, device=cpu, dtype="float32", activation_checkpointing=True)
    assert_close_grads(run_step(checkpointed, [micro(seqs[:3], True), micro(seqs[3:], False)]), plain_grads(hf, seqs))


def test_a_learner_rank_trains_on_image_records(model_dir, pixels, mesh):
    """LearnerActor's own endpoints, as LearnerActor.setup builds a rank (no Ray): records through
    the wire codec, the driver's batch and checks, two mini-batches (the proximal pass stored
    first), a KL reference, the parity gate's log-probs, a publish. The step moves the vision
    tower and the connector."""
    from asyncrl.config import load_config
    from asyncrl.data.codec import decode_group, encode_group
    from asyncrl.learner import fsdp, loss, optim
    from asyncrl.learner.actor import LearnerActor
    from asyncrl.learner.group import FIELD_DTYPES
    from asyncrl.learner.validate import validate_minibatches

    cfg = load_config(None, [f"rollout.model={model_dir}", "control.total_steps=4", "learner.lr=1e-2"])
    cfg.algo.kl_coef, cfg.rollout.temperature = 0.1, TEMP
    actor = LearnerActor(cfg, model_dir, rank=0, world_size=1, sample_special_tokens=False)
    cpu = actor.device = torch.device("cpu")
    actor.model = fsdp.load_sharded_model(model_dir, mesh, device=cpu, dtype="float32")
    actor.reference = fsdp.load_sharded_model(model_dir, mesh, device=cpu, dtype="float32", trainable=False)
    actor.optimizer = optim.build_optimizer(actor.model.parameters(), cfg.learner)
    actor.scheduler = optim.build_scheduler(actor.optimizer, cfg.learner, total_steps=4)
    actor.sampling = loss.Sampling.of(cfg.rollout)
    actor.logprob_fn = actor.sampling.logprob_fn()
    actor.disallowed = actor._disallowed_tokens()  # the text config's vocabulary
    actor.pad_token_id = 0
    assert actor.disallowed is not None and bool(actor.disallowed[pixels.image_token_id])

    rng = np.random.default_rng(7)
    records = [group(model_dir, f"g{i}", c, rng) for i, c in enumerate([["red"], ["blue", "green"]])]
    records = [decode_group(encode_group(g)) for g in records]
    minibatches, _ = build_minibatches(records, cfg.algo, num_minibatches=2, pixels=pixels)
    validate_minibatches(minibatches, cfg.algo, max_positions=512, vocab_size=None, pixels=pixels)
    plans = [[[mbatch.seq_fields(s) for s in mb]] for mb in minibatches]
    before = {k: v.clone() for k, v in fsdp.full_state_dict(actor.model).items()}
    actor.store_proximal(1, plans[1], 1, dict(FIELD_DTYPES))
    for j, plan in enumerate(plans):
        result = actor.train_minibatch(plan, 1, dict(FIELD_DTYPES), proximal_key=j if j else None)
        assert np.isfinite(result.grad_norm) and result.grad_norm > 0
    assert actor.version == 2
    after = actor._weights(full=False)
    assert after.keys() == before.keys()
    for part in (
        "model.vision_model.encoder.layers.0.mlp.fc1.weight",
        "model.connector.modality_projection.proj.weight",
    ):
        assert float((after[part] - before[part]).abs().max()) > 1e-4, part

    seqs = [s for mb in minibatches for s in mb]
    got = actor.logprobs([[mbatch.forward_fields(s) for s in seqs]], 1, TEMP)[0]
    trained = load_plain(model_dir)
    trained.load_state_dict(after)
    for row, s in zip(got, seqs, strict=True):  # the response: a prompt's special tokens are masked out
        want = plain_logprobs(trained, s, actor.disallowed).detach().numpy()
        assert float(np.abs(row[s.loss_mask > 0] - want[s.loss_mask > 0]).max()) <= TOL


def test_the_publish_carries_the_checkpoints_names_and_shapes(model_dir, mesh):
    """What vLLM's Idefics3 loader took at start-up (the checkpoint: model.vision_model.*,
    model.connector.*, model.text_model.*, lm_head) is what a publish sends, vision and
    connector included."""
    from safetensors.torch import load_file

    from asyncrl.learner import fsdp, hf_format

    model = fsdp.load_sharded_model(model_dir, mesh, device=torch.device("cpu"), dtype="float32")
    sent = hf_format.engine_format(model, fsdp.full_state_dict(model))
    on_disk = load_file(f"{model_dir}/model.safetensors")
    assert {k: tuple(v.shape) for k, v in sent.items()} == {k: tuple(v.shape) for k, v in on_disk.items()}
    assert all(torch.equal(sent[k], on_disk[k]) for k in on_disk)
    assert (
        any(k.startswith("model.vision_model.") for k in sent)
        and "model.connector.modality_projection.proj.weight" in sent
    )


# ---------------------------------------------------------------- two ranks


def _two_rank_worker(rank: int, store: str, model_dir: str, result: str) -> None:
    import datetime

    import torch.distributed as dist

    from asyncrl.learner import fsdp

    # A bounded timeout: a rank left waiting in a collective fails the test instead of hanging it.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        torch.set_num_threads(1)
        pixels = ImagePixels.of(model_dir)
        rng = np.random.default_rng(5)
        groups = [group(model_dir, f"g{i}", c, rng) for i, c in enumerate([["red"], ["blue", "green"], ["green"]])]
        seqs, _ = sequences(model_dir, pixels, groups)
        # Rank 0: two micro-batches (padded, then packed); rank 1: one, then a padding one.
        mine = [micro(seqs[:2], False), micro(seqs[2:4], True)] if rank == 0 else [micro(seqs[4:], True)]
        if rank == 1:
            mine.append(padding(mine[0]))
        model = fsdp.load_sharded_model(
            model_dir, fsdp.build_mesh(torch.device("cpu"), 2), device=torch.device("cpu"), dtype="float32"
        )
        logp = prepass(model, mine)
        grads = run_step(model, mine)  # summed over both ranks (the learner's divide factor 1)
        rows = [row for lp, mb in zip(logp, mine, strict=False) if not mb[mbatch.PADDING_KEY] for row in lp]
        torch.save({"rows": rows, "grads": grads if rank == 0 else None}, f"{result}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_one_with_a_padding_microbatch_equal_transformers(model_dir, tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), model_dir, out), nprocs=2, join=True)
    pixels = ImagePixels.of(model_dir)
    rng = np.random.default_rng(5)
    groups = [group(model_dir, f"g{i}", c, rng) for i, c in enumerate([["red"], ["blue", "green"], ["green"]])]
    seqs, _ = sequences(model_dir, pixels, groups)
    hf = load_plain(model_dir)
    got = torch.load(f"{out}.0")["rows"] + torch.load(f"{out}.1")["rows"]
    for k, s in enumerate(seqs):
        assert float((got[k][: s.num_tokens] - plain_logprobs(hf, s).detach()).abs().max()) <= TOL, k
    assert_close_grads(torch.load(f"{out}.0")["grads"], plain_grads(hf, seqs))
