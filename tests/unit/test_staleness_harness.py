"""The staleness study's harness (bench/staleness_harness.py) on a tiny real model: the
snapshot ring hands back exactly the version asked for, and the sampler standing in for the
engine records the log-probs the learner computes for the same tokens (at staleness 0 the
learner's drift metrics read 0), under the task's ban on special tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from asyncrl.config import Config
from asyncrl.data import microbatch as mbatch
from asyncrl.data.batch import build_minibatches
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.tiny import write_tiny_model
from bench.staleness_harness import HarnessLearner, Sampler, SnapshotRing


def test_ring_returns_exactly_version_t_minus_k():
    ring = SnapshotRing(3)
    for v in range(6):
        ring.put(v, {"w": torch.full((2,), float(v))})
    assert ring.versions == [3, 4, 5]
    for v in (3, 4, 5):
        assert torch.equal(ring.get(v)["w"], torch.full((2,), float(v)))
    with pytest.raises(KeyError, match="version 2 is not held"):
        ring.get(2)
    with pytest.raises(ValueError, match="consecutive"):
        ring.put(7, {"w": torch.zeros(2)})


def test_ring_keeps_its_own_copy():
    ring = SnapshotRing(1)
    w = torch.zeros(2)
    ring.put(0, {"w": w})
    w += 1  # the learner's weights move on after a publish
    assert torch.equal(ring.get(0)["w"], torch.zeros(2))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=64))
    cfg = Config.model_validate(
        {
            "rollout": {"model": model_dir, "env": "reverse", "n_samples": 4, "max_tokens": 6, "temperature": 0.9},
            "learner": {"lr": 1e-3, "packing": False},
            "control": {"total_steps": 2},
        }
    )
    env = make_env("reverse", {})
    owned = not dist.is_initialized()
    learner = HarnessLearner.start(cfg, model_dir, sample_special_tokens=False)
    sampler = Sampler(model_dir, env, cfg.rollout, sample_special_tokens=False)
    yield cfg, learner, sampler
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def test_sampler_logprobs_are_the_learners(harness):
    cfg, learner, sampler = harness
    prompts = sampler.prompts(random.Random(0), 3)
    groups = sampler.groups(learner.weights(), prompts, version=0, gen=torch.Generator().manual_seed(0), tag="t")
    (seqs,), _ = build_minibatches(groups, cfg.algo, num_minibatches=1)
    fields = [{"input_ids": s.input_ids.astype(np.int64)} for s in seqs]
    lengths = [len(f["input_ids"]) for f in fields]
    (plan,), count = mbatch.plan_microbatches([lengths], 1 << 16)
    (learner_logp,) = learner.logprobs([[fields[i] for i in idx] for idx in plan], count, cfg.rollout.temperature)
    by_row = {i: lp for idx, lps in zip(plan, [learner_logp], strict=True) for i, lp in zip(idx, lps, strict=True)}
    for i, s in enumerate(seqs):
        live = s.loss_mask > 0
        assert live.any()
        np.testing.assert_allclose(by_row[i][live], s.rollout_logprobs[live], atol=1e-5)
    special = set(sampler.tokenizer.all_special_ids) - {sampler.eos}
    sampled = {int(t) for g in groups for smp in g.samples for t in smp.response_ids}
    assert not sampled & special  # the task bans them: the sampler applies the learner's mask


def test_staleness_zero_trains_on_policy(harness):
    """Data sampled by the learner's current weights: the learner's own drift metric is 0."""
    _, learner, sampler = harness
    groups = sampler.groups(
        learner.weights(),
        sampler.prompts(random.Random(1), 4),
        version=learner.version,
        gen=torch.Generator().manual_seed(1),
        tag="u",
    )
    before = learner.version
    metrics = learner.train(groups)
    assert learner.version == before + 1
    assert metrics["drift/logprob_abs_diff_max"] < 1e-5
    assert metrics["drift/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # One update later the same data is one version stale: the learner sees the gap.
    again = learner.train(groups)
    assert again["drift/abs_logp_diff"] > 1e-4
