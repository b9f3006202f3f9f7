"""On-policy distillation's teacher (rollout.teacher) in a real local Ray, and its records in a
real redis-server: the actor batches every generator's requests and gives transformers' own
log-probs of the student's tokens; a crashed teacher is restarted and its pending request
retried, as a reward model is (a teacher with another vocabulary: tests/unit/test_distill.py,
on the actor's class without Ray); a generator's group gets the log-probs of its policy tokens,
or fails whole; a record whose teacher log-probs are bad, or missing in a distilling run, is
dead-lettered with its reason."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.data.codec import encode_group
from asyncrl.data.contract import RecordContract
from asyncrl.queue import RolloutQueue, keys
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.reward_model import stop_reward_models, wait_ready
from asyncrl.rollout.scoring import RewardLimits, RewardScorer
from asyncrl.rollout.teacher import TeacherClient, attach_teacher_logprobs, start_teacher
from asyncrl.rollout.tiny import write_tiny_model
from asyncrl.types import RolloutGroup, Sample
from tests.support.waiting import wait_for

RUN = "teacher-tests"
PROMPTS = [[1, 3, 4], [1, 5], [1, 3, 3, 4, 5, 4], [1, 4]]
RESPONSES = [[3, 4, 5, 2], [4], [5, 5, 3], [3, 3, 3, 3, 3]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(teacher, student): two tiny random models of one vocabulary, different weights."""
    root = tmp_path_factory.mktemp("distill")
    return (
        str(write_tiny_model(root / "teacher", alphabet="abc", seed=1)),
        str(write_tiny_model(root / "student", alphabet="abc", seed=2)),
    )


def direct_logprobs(path: str, temperature: float) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for p, r in zip(PROMPTS, RESPONSES, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].double() / temperature
        out.append([torch.log_softmax(logits[len(p) - 1 + j], -1)[t].item() for j, t in enumerate(r)])
    return out


@pytest.fixture(scope="module")
def teacher_actor(ray_session, models):
    """The run's teacher (one start shared). A batch runs only once 4 samples are there, so a
    test's requests wait in it deterministically."""
    teacher, student = models
    spec = f"{{model: {teacher}, batch_size: 4, max_wait_ms: 600000, timeout_s: 120}}"
    cfg = load_config(None, [f"control.run_name={RUN}", f"rollout.teacher={spec}", "rollout.temperature=0.8"])
    started = start_teacher(cfg, student)
    try:
        wait_ready(started)
        yield cfg, started[0][1]
    finally:
        stop_reward_models(started)


def test_teacher_logprobs_of_concurrent_samples_come_in_batches_as_transformers_gives_them(
    ray_session, teacher_actor, models
):
    _, handle = teacher_actor
    client = TeacherClient(RUN, timeout_s=120)
    before = ray_session.get(handle.stats.remote())

    async def two_groups():  # as two generators' groups: two samples each, at once
        return await asyncio.gather(
            client.logprobs(PROMPTS[:2], RESPONSES[:2]), client.logprobs(PROMPTS[2:], RESPONSES[2:])
        )

    first, second = asyncio.run(two_groups())
    after = ray_session.get(handle.stats.remote())
    assert dict(after.batch_sizes - before.batch_sizes) == {4: 1}  # one forward pass for both
    expected = direct_logprobs(models[0], temperature=0.8)  # rollout.temperature, as the learner's
    for got, want in zip(first + second, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_crashed_teacher_is_restarted_and_its_pending_request_retried(ray_session, teacher_actor, models):
    from ray._private.state import actors  # no public call reads restarts without the dashboard

    ray, (_, handle) = ray_session, teacher_actor

    def restarts() -> int:
        return actors(actor_id=handle._actor_id.hex())["NumRestarts"]

    requests, before = ray.get(handle.stats.remote()).requests, restarts()
    pending = handle.score.remote(PROMPTS[:1], RESPONSES[:1])  # waits in the actor for 3 more samples
    wait_for(lambda: ray.get(handle.stats.remote()).requests > requests, 60, "the request to reach the actor")
    ray.kill(handle, no_restart=False)  # a crash: Ray restarts the actor
    wait_for(lambda: restarts() > before, 60, "the actor to restart")
    others = [handle.score.remote([p], [r]) for p, r in zip(PROMPTS[1:], RESPONSES[1:], strict=True)]
    values = ray.get([pending, *others], timeout=120)
    stats = ray.get(handle.stats.remote())
    # The restarted actor (its counts start afresh) ran the retried request with the new ones, as one batch.
    assert (stats.requests, dict(stats.batch_sizes)) == (4, {4: 1})
    for got, want in zip(values, direct_logprobs(models[0], temperature=0.8), strict=True):
        assert got[0] == pytest.approx(want, abs=1e-5)


def _samples() -> list[Sample]:
    """As a generator's group holds them: sample 0 multi-turn (its own prompt, an observation
    token in its response), 1 on the group's prompt, 2 and 3 with their own prompts, 4 whose
    reward failed, 5 with no response token."""
    out = []
    for k, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        mask = [1, 1, 0, 1] if k == 0 else [1] * len(r)
        out.append(Sample(r, [-0.5] * len(r), mask, 1.0, 0, prompt_ids=None if k == 1 else p))
    out.append(Sample([3, 4], [-0.5, -0.5], [1, 1], float("nan"), 0, error="reward raised"))
    out.append(Sample([], [], [], 0.0, 0))
    return out


def test_a_group_gets_the_teacher_logprobs_of_its_policy_tokens_and_fails_whole_without_them(
    ray_session, teacher_actor, models
):
    """Runs after the tests above: its timed-out request stays in the actor's batch."""
    scorer = RewardScorer(make_env("copy", {}), RewardLimits())
    samples = _samples()
    failed = asyncio.run(attach_teacher_logprobs(TeacherClient(RUN, timeout_s=120), scorer, PROMPTS[1], samples, [4]))
    assert failed == [4]
    for s, want in zip(samples, direct_logprobs(models[0], temperature=0.8), strict=False):
        assert s.teacher_logprobs.tolist() == pytest.approx(np.array(want) * s.loss_mask, abs=1e-5)
    assert samples[0].teacher_logprobs[2] == 0.0  # the observation token: context, never a term
    assert samples[4].teacher_logprobs is None and samples[5].teacher_logprobs.shape == (0,)
    # A teacher that does not answer in time (a batch of 4 never fills here): the group's samples
    # fail as a timed-out reward does, reward NaN even with rollout.reward_on_failure set.
    scorer = RewardScorer(make_env("copy", {}), RewardLimits(on_failure=0.0))
    lone = _samples()[1:2]
    failed = asyncio.run(attach_teacher_logprobs(TeacherClient(RUN, timeout_s=1), scorer, PROMPTS[1], lone, []))
    assert failed == [0] and scorer.timeouts == 1
    assert math.isnan(lone[0].reward) and "rollout.teacher did not answer within 1 s" in lone[0].error
    assert lone[0].teacher_logprobs is None


def _group(gid: str, teacher: list[float] | None) -> RolloutGroup:
    samples = [
        Sample([5, 6, 7], [-0.5, -0.1, -1.0], [1, 1, 1], 1.0, 2, generator_id="gen-0", teacher_logprobs=teacher)
        for _ in range(2)
    ]
    return RolloutGroup(gid, gid, [1, 2, 3], samples, env="copy")


def test_records_with_bad_or_missing_teacher_logprobs_are_dead_lettered(redis_url):
    import redis

    contract = RecordContract(vocab_size=32, max_len=16, group_size=2, stepwise=False, max_version=4, teacher=True)
    q = RolloutQueue.connect(redis_url, "distill", consumer="learner-0")
    raw = redis.Redis.from_url(redis_url)
    nan = _group("nan", [-0.5, float("nan"), -1.0])
    short = _group("short", [-0.5, -0.2])
    short.samples[0].teacher_logprobs = np.array([-0.5, -0.2], np.float32)  # 2 entries for 3 tokens
    absurd = _group("absurd", [-0.5, -1e30, -1.0])  # finite, yet a -1e30 advantage
    for g in (nan, short, _group("positive", [-0.5, 2.0, -1.0]), _group("missing", None), absurd):
        raw.xadd(keys.rollouts("distill"), {keys.RECORD_FIELD: encode_group(g)})
    q.put(_group("good", [-0.6, -0.3, -1.5]))
    got = q.get_batch(6, min_version=0, timeout=1.0, contract=contract)
    assert [g.group_id for _, g in got] == ["good"]
    assert got[0][1].samples[1].teacher_logprobs.tolist() == pytest.approx([-0.6, -0.3, -1.5])
    reasons = {e["group_id"]: e["reason"] for e in q.deadletter_entries()}
    assert reasons == {
        "nan": "nonfinite_teacher_logprob",
        "short": "length_mismatch",
        "positive": "positive_logprob",
        "missing": "missing_teacher_logprobs",
        "absurd": "logprob_out_of_range",
    }
    q.close()
