"""Context parallelism (learner.context_parallel) is exact: a packed row split over a CP group
of two gloo ranks (FSDP2 over both, as the learner shards) gives the same token log-probs,
loss, metrics, gradient and grad norm as one process running the whole row, in float64,
with and without activation checkpointing. The rows hold sequences that straddle the chunk
boundaries and have odd lengths (the row is padded to a multiple of 2 x CP).

    .venv/bin/python -m pytest tests/unit/test_context_parallel.py -q
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.data import microbatch as mbatch
from asyncrl.learner import context_parallel, fsdp, step
from asyncrl.learner.context_parallel import ContextParallel, zigzag
from asyncrl.learner.loss import Sampling, learner_loss_fn, token_logprobs
from tests.support import models
from tests.unit.test_grad_invariance import TEMP, VOCAB, algo_for, full_batch, make_groups, packed

CP = 2
TOL = 1e-10


def test_zigzag_gives_every_rank_one_early_and_one_late_chunk():
    assert zigzag(0, 2, 16) == [(0, 4), (12, 16)]
    assert zigzag(1, 2, 16) == [(4, 8), (8, 12)]
    cover = sorted(p for r in range(3) for a, b in zigzag(r, 3, 12) for p in range(a, b))
    assert cover == list(range(12))


def micro_batches(algo) -> list[dict]:
    """Three packed rows: several sequences (odd total, some straddling chunk edges), one
    sequence of odd length alone, and the rest; then a one-token padding micro-batch."""
    mb = full_batch(make_groups(np.random.default_rng(0)), algo, "policy")
    n = mb["input_ids"].shape[0]
    rows = [packed(mb, [0, 1, 2]), packed(mb, [4]), packed(mb, [3, *range(5, n)])]
    # 19, 9 and 39 tokens: odd, so padded; every chunk edge of the first row cuts a sequence.
    assert [int(r[mbatch.PACKED_IDS].shape[1]) % 2 for r in rows] == [1, 1, 1]
    out = [{k: v.to(torch.float64) if v.is_floating_point() else v for k, v in r.items()} for r in rows]
    for r in out:
        r[mbatch.PADDING_KEY] = False
    out.append(mbatch.padding_microbatch(mbatch.field_dtypes(out[0]), pad_token_id=0))
    out[-1] = {k: v for k, v in out[-1].items() if k not in mbatch.PACKING_FIELDS}
    return out


def _stats(model, algo, micro, cp):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    fn = learner_loss_fn(algo, Sampling(temperature=TEMP), num_microbatches=len(micro))
    stats = step.train_step(
        model, opt, sched, [dict(m) for m in micro], fn, grad_clip=1e9, device=torch.device("cpu"), cp=cp
    )
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return stats, torch.cat([g.flatten() for g in grads])


def _logprobs(model, micro, cp):
    """The proximal pre-pass's log-probs (the learner's own no-grad pass)."""
    mbs = [dict(m) for m in micro]
    kw = dict(temperature=TEMP, logprob_fn=token_logprobs, device=torch.device("cpu"), cp=cp)
    step.add_prepass_logprobs(model, None, mbs, **kw)
    return [m["old_logprobs"] for m in mbs if not m[mbatch.PADDING_KEY]]


def _worker(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=CP)
    try:
        torch.set_num_threads(1)
        base = models.tiny_llama(VOCAB, num_hidden_layers=2)
        mesh = fsdp.build_mesh(torch.device("cpu"), CP)
        cp = ContextParallel.build(rank=rank, world_size=CP, size=CP, sampling=Sampling(temperature=TEMP))
        for checkpointing in (False, True):
            # With checkpointing, query spans are also cut into blocks of 3, so masks start mid-sequence.
            context_parallel.QUERY_BLOCK = 3 if checkpointing else 512
            sharded = fsdp.shard_model(copy.deepcopy(base), mesh, None, activation_checkpointing=checkpointing)
            check_against_one_rank(base, sharded, cp, checkpointing)
        context_parallel.QUERY_BLOCK = 3
        check_soft_capped_attention(mesh, cp)
        context_parallel.QUERY_BLOCK = 512
        assert context_parallel.active() is None
    finally:
        dist.destroy_process_group()


def check_against_one_rank(base, sharded, cp, checkpointing: bool) -> None:
    for term, reduction in (("entropy", "token_mean"), ("kl_ref", "seq_mean_token_sum_norm")):
        what = (term, reduction, "checkpointing" if checkpointing else "plain")
        algo = algo_for(term, reduction).model_copy(update={"entropy_coef": 0.05})
        micro = micro_batches(algo)
        for want, got in zip(_logprobs(base, micro, None), _logprobs(sharded, micro, cp), strict=True):
            assert want.abs().max() > 0.1
            assert (got - want).abs().max() <= TOL, (what, float((got - want).abs().max()))
        want_stats, want_grad = _stats(base, algo, micro, None)
        got_stats, got_grad = _stats(sharded, algo, micro, cp)
        assert want_grad.abs().max() > 1e-3
        assert float((got_grad - want_grad).abs().max()) <= TOL * float(want_grad.abs().max()), what
        assert abs(got_stats.grad_norm - want_stats.grad_norm) <= TOL * want_stats.grad_norm, what
        assert got_stats.metrics.keys() == want_stats.metrics.keys()
        for k, m in want_stats.metrics.items():
            assert abs(got_stats.metrics[k].value - m.value) <= TOL * max(1.0, abs(m.value)), (what, k)


def tiny_gemma2():
    """Gemma 2's attention: scores soft-capped before the mask, every other layer windowed."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,
        attn_logit_softcapping=2.0,
    )
    config._attn_implementation = fsdp.attention_implementation(torch.device("cpu"), "float32", config, CP)
    return Gemma2ForCausalLM(config).to(torch.float64).train(False)


def check_soft_capped_attention(mesh, cp) -> None:
    """A soft-capped model (Gemma 2) trains under CP as on one rank: the cap is applied to the
    scores of every query block against the gathered keys. Gemma 2's norms compute in
    float32 (their weights' gradients sum over tokens there), so those match to float32."""
    base = tiny_gemma2()
    sharded = fsdp.shard_model(copy.deepcopy(base), mesh, None)
    algo = algo_for("entropy", "token_mean").model_copy(update={"entropy_coef": 0.05})
    micro = micro_batches(algo)
    for want, got in zip(_logprobs(base, micro, None), _logprobs(sharded, micro, cp), strict=True):
        assert (got - want).abs().max() <= TOL
    want_stats, want_grad = _stats(base, algo, micro, None)
    got_stats, got_grad = _stats(sharded, algo, micro, cp)
    norms = torch.cat([torch.full((p.numel(),), "norm" in n) for n, p in base.named_parameters()])
    scale = float(want_grad.abs().max())
    assert float((got_grad - want_grad)[~norms].abs().max()) <= TOL * scale
    assert float((got_grad - want_grad)[norms].abs().max()) <= 1e-6 * scale
    assert abs(got_stats.grad_norm - want_stats.grad_norm) <= 1e-6 * want_stats.grad_norm


def test_cp2_equals_cp1_in_float64_with_and_without_activation_checkpointing(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=CP, join=True)


def test_a_logprob_pass_between_steps_leaves_the_next_gradient_alone(mesh):
    """An FSDP2 model run without gradients between two training steps (the proximal pass of
    a later mini-batch, compute_logprobs) used to add the previous step's gradient into the
    units that stay gathered after forward (the root, the last block)."""
    base = models.tiny_llama(VOCAB, num_hidden_layers=2)
    sharded = fsdp.shard_model(copy.deepcopy(base), mesh, None)
    for reduction in ("token_mean", "seq_mean_token_sum_norm"):
        algo = algo_for("kl_ref", reduction)
        micro = micro_batches(algo)
        _logprobs(sharded, micro, None)
        want_stats, want = _stats(base, algo, micro, None)
        got_stats, got = _stats(sharded, algo, micro, None)
        assert float((got - want).abs().max()) <= TOL * float(want.abs().max()), reduction
        assert abs(got_stats.grad_norm - want_stats.grad_norm) <= TOL * want_stats.grad_norm


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"num_ranks": 3, "context_parallel": 2}, "must divide learner.num_ranks=3"),
        ({"num_ranks": 2, "context_parallel": 2, "packing": False}, "needs learner.packing=true"),
    ],
)
def test_config_refuses_what_context_parallelism_cannot_run(overrides, says):
    from asyncrl.config import ConfigError
    from asyncrl.config.training import LearnerConfig

    with pytest.raises((ConfigError, ValueError), match=says):
        LearnerConfig(**overrides)
    assert LearnerConfig(num_ranks=4, context_parallel=2).context_parallel == 2


def test_a_model_whose_attention_rules_live_in_its_mask_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(attention_chunk_size=8)
    with pytest.raises(ValueError, match="context_parallel=2: LlamaConfig has attention rules"):
        fsdp.attention_implementation(torch.device("cpu"), "float32", config, context_parallel=2)


def test_a_model_whose_attention_cp_cannot_honour_stops_a_run_before_anything_starts(tmp_path):
    """Refused by `asyncrl train` (and its --check) in one line, before Redis or Ray start,
    not when the learner ranks load the model."""
    import json
    from pathlib import Path

    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.preflight import preflight
    from asyncrl.control.train import train
    from asyncrl.rollout.tiny import write_tiny_model

    model = Path(write_tiny_model(tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_chunk_size": 8}))
    root = Path(__file__).resolve().parents[2]
    overrides = [f"rollout.model={model}", f"control.run_dir={tmp_path / 'run'}", "learner.num_ranks=2"]
    cfg = load_config(root / "configs" / "demo.yaml", [*overrides, "learner.context_parallel=2"])
    says = "learner.context_parallel=2: .* has attention rules"
    with pytest.raises(ConfigError, match=says):  # first: should it pass, train below would start a run
        preflight(cfg)
    with pytest.raises(ConfigError, match=says) as refused:
        train(cfg)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "redis").exists()  # no Redis (nor Ray, started after it)
    preflight(load_config(root / "configs" / "demo.yaml", overrides))  # without CP the model is fine


def test_the_start_up_check_reads_a_config_json_without_loading_torch():
    """Start-up and --check refuse such a model from its config.json alone: the rules' module
    imports no torch, and its answer on the dict is the learner's on the loaded config."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from asyncrl.config.attention_rules import check_context_parallel, supports_varlen\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert supports_varlen({'model_type': 'llama'}) and not supports_varlen({'is_causal': False})\n"
        "assert not supports_varlen({'attention_chunk_size': 8})\n"
        "check_context_parallel('m', {'attention_chunk_size': 8}, 1)\n"
        "check_context_parallel('m', None, 2)\n"
        "try:\n"
        "    check_context_parallel('m', {'attention_chunk_size': 8}, 2)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().startswith("learner.context_parallel=2: m has attention rules"), out.stdout


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("llama", {}),
        ("llama4_text", {}),  # chunked attention by its class's default
        ("gemma4_text", {"use_bidirectional_attention": "all"}),  # non-causal, set when loaded
        ("gemma4_text", {}),
    ],
)
def test_a_config_json_gets_the_answer_the_learner_gives_on_the_config_it_loads(tmp_path, model_type, fields):
    """A config.json that leaves a rule to its config class's default (a hand-written one), and
    one as save_pretrained writes it: the start-up check on the file answers as the learner does
    on the config transformers loads from it."""
    import json

    from transformers import AutoConfig

    from asyncrl.config.attention_rules import supports_varlen
    from asyncrl.rollout.families import read_config

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **fields}))
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert supports_varlen(read_config(str(tmp_path))) == supports_varlen(loaded), supports_varlen(loaded)
    loaded.save_pretrained(tmp_path / "saved")
    assert supports_varlen(read_config(str(tmp_path / "saved"))) == supports_varlen(loaded)
    # A config.json that names the field itself is read as it says.
    assert not supports_varlen({"model_type": "llama4_text", "attention_chunk_size": 4})
    assert supports_varlen({"model_type": "llama4_text", "attention_chunk_size": None})
