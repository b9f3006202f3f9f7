"""The FSDP2 learner group on a real local Ray with real gloo process groups.

Two groups are started once per module (1 rank and 2 ranks) and reset between runs by
loading a checkpoint of their initial state; resume and the killed rank use fresh groups.
The loss has every term on: KL to a reference model, rollout KL, entropy and token TIS.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from asyncrl.config import Config
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab
from asyncrl.types import TrainSequence

VOCAB_LOW = 4  # ids below are special tokens (pad = 0)
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]


def make_config() -> Config:
    cfg = Config()
    a = cfg.algo
    a.kl_coef, a.rollout_kl_coef, a.entropy_coef = 0.05, 0.1, 0.01
    a.correction.tis = "token"
    cfg.rollout.temperature = 0.7
    lc = cfg.learner
    lc.lr, lc.warmup_steps, lc.lr_schedule, lc.grad_clip = 1e-3, 1, "cosine", 1.0
    cfg.control.total_steps = 10
    return cfg


def minibatch(lengths: list[int], seed: int, vocab: int) -> list[TrainSequence]:
    """Sequences with a 3-token prompt; token_mean reduction weights over the whole mini-batch."""
    rng = np.random.default_rng(seed)
    masks = []
    for n in lengths:
        m = np.zeros(n, dtype=np.float32)
        m[3:] = 1
        masks.append(m)
    total = sum(m.sum() for m in masks)
    out = []
    for i, (n, m) in enumerate(zip(lengths, masks, strict=True)):
        out.append(
            TrainSequence(
                input_ids=rng.integers(VOCAB_LOW, vocab, n).astype(np.int32),
                loss_mask=m,
                rollout_logprobs=(m * (-4.0 + 0.2 * rng.standard_normal(n))).astype(np.float32),
                advantages=(m * rng.standard_normal()).astype(np.float32),
                reduction_weights=(m / total).astype(np.float32),
                token_versions=np.zeros(n, dtype=np.int32),
                behavior_version=0,
                group_id=f"s{seed}-g{i}",
                sample_index=i,
            )
        )
    return out


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    return [
        minibatch([20, 12, 30, 9, 17, 25], seed=1, vocab=vocab),
        # Uneven: on 2 ranks one long sequence faces four short ones, so with small budgets
        # rank 0 runs padding micro-batches while rank 1 works through its share.
        minibatch([48, 6, 6, 6, 6], seed=2, vocab=vocab),
        # One sequence: on 2 ranks, rank 1 has no data at all.
        minibatch([15], seed=3, vocab=vocab),
    ]


def _start(ray_session, model_dir, num_ranks, activation_checkpointing: bool = False, **kw):
    from asyncrl.learner import LearnerGroup
    from asyncrl.rollout.envs import resolve_env_class

    cfg = make_config()
    cfg.learner.activation_checkpointing = activation_checkpointing
    special = resolve_env_class(cfg.rollout.env).sample_special_tokens
    return LearnerGroup(cfg, model_dir, num_ranks=num_ranks, sample_special_tokens=special, **kw)


@pytest.fixture(scope="module")
def groups(ray_session, tiny_model_dir, tmp_path_factory):
    """{1: group, 2: group} plus the checkpoint of their initial state to reset them. The
    2-rank group recomputes its activations (learner.activation_checkpointing), so every
    comparison with the 1-rank group also checks that this leaves training unchanged."""
    started = {}
    try:
        for n in (1, 2):
            started[n] = _start(ray_session, tiny_model_dir, n, activation_checkpointing=n == 2)
        init = {}
        for n, g in started.items():
            path = tmp_path_factory.mktemp(f"init{n}") / "step_000000"
            g.save_checkpoint(str(path), extra={"initial": True})
            init[n] = path
        yield started, init
    finally:
        for g in started.values():
            g.shutdown()


def run(group, init, batches, budget):
    """Reset to the initial weights/optimizer, train the 3 mini-batches, return (state, step results)."""
    group.load_checkpoint(str(init))
    group.micro_batch_tokens = budget
    results = [group.train_step([mb]) for mb in batches]
    return group.export_state_dict(), results


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_ranks_and_microbatch_budgets_give_identical_parameters(groups, batches, tiny_model_dir):
    """2 ranks vs 1 rank, one / a few / all sequences per micro-batch, padding micro-batches
    included: the same parameters after 3 optimizer steps (reduction weights + DP compensation)."""
    from transformers import AutoModelForCausalLM

    started, init = groups
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    reference, ref_results = run(started[1], init[1], batches, budget=100_000)
    assert started[1].version == 3
    assert [r.version for r in ref_results] == [1, 2, 3]
    ref_metrics = [r.metrics for r in ref_results]
    # The steps moved the weights by far more than the tolerance below (Adam: ~lr per step).
    assert max_diff(reference, {k: initial[k] for k in reference}) > 1e-3

    for ranks, budget in [(1, 1), (1, 40), (2, 1), (2, 40), (2, 100_000)]:
        state, results = run(started[ranks], init[ranks], batches, budget)
        metrics = [r.metrics for r in results]
        assert max_diff(state, reference) <= 1e-5, (ranks, budget)
        # Packed micro-batches (learner.packing, on by default) compute no pad token (one row
        # each), where padded rows of mini-batch 1 in one micro-batch would be 37% padding.
        assert all(m["learner/padding_frac"] == 0.0 and m["throughput/train_tokens_per_s"] > 0 for m in metrics)
        for got, want in zip(metrics, ref_metrics, strict=True):
            assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-5), (ranks, budget)
            assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-4)
            assert got["learner/lr"] == want["learner/lr"]
        if ranks == 2 and budget == 1:
            # Mini-batch 2: rank 0 has 1 micro-batch, rank 1 has 4 -> 3 padding ones;
            # mini-batch 3: rank 1 has no data -> 1 padding micro-batch.
            assert [m["learner/padding_microbatches"] for m in metrics] == [0.0, 3.0, 1.0]
    # lr: warm-up of 1 step ((0+1)/1), then cosine over the 9 remaining: progress 0, 1/9.
    lrs = [m["learner/lr"] for m in ref_metrics]
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3 * 0.5 * (1 + np.cos(np.pi / 9))], rel=1e-12)


def test_exported_state_dict_loads_into_plain_hf_model(groups, batches, tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    started, init = groups
    group = started[2]
    state, _ = run(group, init[2], batches[:2], budget=40)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert set(state) == set(hf.state_dict())
    hf.load_state_dict(state, strict=True)
    hf.eval()

    path, version = group.export_to_file(str(tmp_path / "weights.safetensors"))
    assert version == 2 == group.version
    with safe_open(path, "pt") as f:
        assert f.metadata()["version"] == "2"
    from_file = load_file(path)
    assert max_diff(from_file, state) == 0.0
    hf2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    hf2.load_state_dict(from_file, strict=True)
    hf2.eval()

    seqs = batches[0]
    temperature = 0.7
    learner_logp = group.compute_logprobs(seqs, temperature)
    with torch.no_grad():
        for seq, got in zip(seqs, learner_logp, strict=True):
            ids = torch.as_tensor(seq.input_ids, dtype=torch.long)[None]
            logits, logits2 = hf(ids).logits, hf2(ids).logits
            assert torch.equal(logits, logits2)
            # the config's task (copy) never samples <pad>/<bos>/<unk>: the learner's policy masks them too
            z = logits[0, :-1].clone()
            z[:, NOT_SAMPLED] = -torch.inf
            want = torch.log_softmax(z / temperature, -1).gather(-1, ids[0, 1:, None])[:, 0]
            assert got.shape == (seq.num_tokens,) and got[0] == 0.0
            np.testing.assert_allclose(got[1:], want.numpy(), atol=1e-5)


def test_bad_batch_fails_on_the_driver_before_any_rank_work(groups, batches):
    started, init = groups
    group = started[2]
    group.load_checkpoint(str(init[2]))
    good = batches[0]

    def with_nan_rollout():
        seqs = list(good)
        s = seqs[1]
        bad = s.rollout_logprobs.copy()
        bad[5] = np.nan
        seqs[1] = TrainSequence(**{**s.__dict__, "rollout_logprobs": bad})
        return [seqs]

    def with_short_advantages():
        s = good[2]
        return [[TrainSequence(**{**s.__dict__, "advantages": s.advantages[:-1]})]]

    def too_long():
        s = good[0]
        n = group.max_positions + 1
        return [
            [
                TrainSequence(
                    **{
                        **s.__dict__,
                        **{
                            k: np.resize(getattr(s, k), n)
                            for k in (
                                "input_ids",
                                "loss_mask",
                                "rollout_logprobs",
                                "advantages",
                                "reduction_weights",
                                "token_versions",
                            )
                        },
                    }
                )
            ]
        ]

    cases = [
        (with_nan_rollout, r"sequence 1 \(group_id='s1-g1'.*'rollout_logprobs'.*rollout_kl_coef"),
        (lambda: [good, []], "mini-batch 1 is empty"),
        (lambda: [], "non-empty list of mini-batches"),
        (with_short_advantages, r"sequence 0 .*field 'advantages' has shape \(29,\), input_ids has \(30,\)"),
        (too_long, "513 tokens exceed the model's max_position_embeddings=512"),
    ]
    for make, pattern in cases:
        batch = make()
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match=pattern):
            group.train_step(batch)
        assert time.perf_counter() - t0 < 1.0
        assert group.version == 0
    # Nothing reached the ranks: the group is in step and trains the good batch.
    assert group.train_step([good]).version == 1


def test_checkpoint_resume_matches_an_uninterrupted_run(ray_session, groups, batches, tiny_model_dir, tmp_path):
    from asyncrl.learner import checkpoint

    started, init = groups
    group = started[2]
    group.load_checkpoint(str(init[2]))
    group.micro_batch_tokens = 40
    group.train_step(batches[:2])  # versions 1 and 2
    ckpt = tmp_path / "checkpoints" / "step_000002"
    extra = {"step": 2, "acked": ["1-0", "2-0"]}
    group.save_checkpoint(str(ckpt), extra=extra)
    uninterrupted = group.train_step(batches[2:])
    uninterrupted_state = group.export_state_dict()

    assert (ckpt / checkpoint.COMPLETE_MARKER).exists()
    assert (ckpt.parent / "latest").read_text().strip() == "step_000002"
    assert [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")] == []  # no staging left

    fresh = _start(ray_session, tiny_model_dir, 2, activation_checkpointing=True)
    try:
        fresh.micro_batch_tokens = 40
        assert fresh.load_checkpoint(str(ckpt.parent)) == extra  # via the `latest` pointer
        assert fresh.version == 2
        resumed = fresh.train_step(batches[2:])
        resumed_state = fresh.export_state_dict()
    finally:
        fresh.shutdown()
    assert max_diff(resumed_state, uninterrupted_state) <= 1e-6
    assert resumed.version == uninterrupted.version == 3
    assert resumed.metrics["learner/lr"] == uninterrupted.metrics["learner/lr"]
    assert resumed.metrics["loss/total"] == pytest.approx(uninterrupted.metrics["loss/total"], abs=1e-7)


def test_killed_rank_raises_learner_error_quickly(ray_session, tiny_model_dir, batches):
    import ray

    from asyncrl.learner import LearnerError

    group = _start(ray_session, tiny_model_dir, 2, collective_timeout_s=60)
    try:
        group.train_step([batches[0]])
        ray.kill(group.actors[1], no_restart=True)
        t0 = time.perf_counter()
        with pytest.raises(LearnerError, match="rank 1 died"):
            group.train_step([batches[0]])
        assert time.perf_counter() - t0 < 30
        with pytest.raises(LearnerError, match="broken"):
            group.train_step([batches[0]])
    finally:
        group.shutdown()
