"""Rewards scored off the generator's loop (asyncrl.rollout.scoring): real threads and a real
event loop; a slow, hung, raising or ``async def`` reward fails its own sample only."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Any

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.rollout.envs import Environment
from asyncrl.rollout.envs.reward_fns import WeightedRewards
from asyncrl.rollout.scoring import RewardLimits, RewardScorer

COPY = "rollout.env_kwargs={alphabet: abc, min_len: 3, max_len: 3}"


class SleepyEnv(Environment):
    """Sleeps as long as the response says; "hang" waits for ``release`` (a hung verifier)."""

    def __init__(self):
        self.release = threading.Event()

    # Its own parameter names: the contract calls reward(prompt, response, metadata) positionally.
    def reward(self, text: str, response: str, info: dict[str, Any]) -> float:  # type: ignore[override]
        if response == "hang":
            self.release.wait(30)
            return 1.0
        if response == "raise":
            raise KeyError("no such test case")
        time.sleep(float(response))
        return 1.0


async def score_all(scorer: RewardScorer, responses: list[str]) -> list[tuple[float, str | None]]:
    return list(await asyncio.gather(*(scorer.score("p", r, {}) for r in responses)))


def test_a_slow_reward_fails_its_sample_and_the_others_score_concurrently():
    env = SleepyEnv()
    scorer = RewardScorer(env, RewardLimits(timeout_s=0.5, workers=8))
    gaps: list[float] = []

    async def while_generating():  # a 10 ms ticker stands in for the rest of the generator
        async def ticker():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        tick = asyncio.ensure_future(ticker())
        try:
            return await score_all(scorer, ["2.0"] + ["0.3"] * 7)
        finally:
            tick.cancel()

    try:
        t0 = time.perf_counter()
        out = asyncio.run(while_generating())
        wall = time.perf_counter() - t0
    finally:
        scorer.close()
    assert len(gaps) > 10 and max(gaps) < 0.25  # the loop never waited on a reward (on it: 0.3 s+)
    assert math.isnan(out[0][0]) and "SleepyEnv.reward did not return within 0.5 s" in str(out[0][1])
    assert out[1:] == [(1.0, None)] * 7
    assert scorer.timeouts == 1 and scorer.errors == 0
    # One after the other they would take 2.0 + 7 * 0.3 s (0.5 + 2.1 with the timeout).
    assert wall < 0.5 * (0.5 + 7 * 0.3), wall


def test_a_raising_reward_is_counted_logged_once_and_the_loop_keeps_scoring(caplog):
    scorer = RewardScorer(SleepyEnv(), RewardLimits(timeout_s=5.0, workers=2))

    async def two_groups():  # the loop stays alive across failures: a second group follows
        first = await score_all(scorer, ["raise", "0", "raise", "raise"])
        second = await score_all(scorer, ["0", "raise"])
        return first, second

    with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.scoring"):
        first, second = asyncio.run(two_groups())
    scorer.close()
    assert first[1] == (1.0, None) and second[0] == (1.0, None)
    failed = [first[0], first[2], first[3], second[1]]
    assert all(math.isnan(r) and e == "SleepyEnv.reward raised KeyError: 'no such test case'" for r, e in failed)
    assert scorer.errors == 4 and scorer.timeouts == 0
    assert len([r for r in caplog.records if "reward failed (error)" in r.message]) == 1


def test_reward_on_failure_scores_a_failed_sample_and_trains_on_it():
    scorer = RewardScorer(SleepyEnv(), RewardLimits(timeout_s=0.2, workers=2, on_failure=0.0))
    out = asyncio.run(score_all(scorer, ["raise", "1.0", "0"]))
    scorer.close()
    assert out == [(0.0, None), (0.0, None), (1.0, None)]  # no error: the learner keeps these samples
    assert scorer.errors == 1 and scorer.timeouts == 1


def test_a_hung_reward_does_not_block_the_next_group(caplog):
    env = SleepyEnv()
    scorer = RewardScorer(env, RewardLimits(timeout_s=0.3, workers=2))

    async def run():
        hung = await score_all(scorer, ["hang", "hang"])  # both workers stuck for good
        t0 = time.perf_counter()
        after = await score_all(scorer, ["0", "0", "0", "0"])
        return hung, after, time.perf_counter() - t0

    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl.rollout.scoring"):
            hung, after, wall = asyncio.run(run())
        assert "2 reward threads are hung" in caplog.text  # as many hung as workers: said loudly
        assert all(math.isnan(r) for r, _ in hung) and scorer.timeouts == 2
        assert after == [(1.0, None)] * 4 and wall < 0.3  # fresh threads took the hung ones' places
        assert scorer.pool.hung == 2 and scorer.pool.abandoned == 2
    finally:
        env.release.set()
    deadline = time.time() + 5
    while scorer.pool.hung and time.time() < deadline:  # released, they finish and are not reused
        time.sleep(0.01)
    assert scorer.pool.hung == 0
    assert sum(t.name == "asyncrl-reward" for t in threading.enumerate()) >= 2
    scorer.close()


class AsyncEnv(Environment):
    async def reward(self, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        await asyncio.sleep(float(response))
        return 0.5


def test_an_async_reward_is_awaited_on_the_loop_under_its_timeout():
    scorer = RewardScorer(AsyncEnv(), RewardLimits(timeout_s=0.3, workers=1))
    t0 = time.perf_counter()
    out = asyncio.run(score_all(scorer, ["0.2"] * 20 + ["5"]))
    assert time.perf_counter() - t0 < 2.0  # awaited together, not 20 * 0.2 s in one worker
    scorer.close()
    assert out[:20] == [(0.5, None)] * 20
    assert math.isnan(out[20][0]) and "AsyncEnv.reward did not return within 0.3 s" in str(out[20][1])
    assert scorer.timeouts == 1


async def async_exact(prompts, completions, target, **_):
    await asyncio.sleep(0.01)
    return [1.0 if c == t else 0.0 for c, t in zip(completions, target, strict=True)]


async def async_slow(prompts, completions, **_):
    await asyncio.sleep(10)
    return [1.0]


def sync_length(prompts, completions, **_):
    return [float(len(completions[0]))]


def test_reward_functions_each_run_under_their_own_timeout():
    cfg = load_config(
        None,
        [
            COPY,
            "rollout.reward_timeout_s=5",
            "rollout.rewards=[{fn: tests.unit.test_reward_scoring:async_exact}, "
            "{fn: tests.unit.test_reward_scoring:sync_length, weight: 0.5}]",
        ],
    )
    env = WeightedRewards(Environment(), cfg.rollout.rewards)
    scorer = RewardScorer(env, RewardLimits.from_rollout(cfg.rollout))
    assert asyncio.run(scorer.score("abc=", "abc", {"target": "abc"})) == (1.0 + 0.5 * 3, None)
    assert env.reward("abc=", "ab", {"target": "abc"}) == 0.0 + 0.5 * 2  # evaluation's path runs async fns too
    cfg = load_config(None, [COPY, "rollout.rewards=[{fn: tests.unit.test_reward_scoring:async_slow, timeout_s: 0.2}]"])
    scorer = RewardScorer(WeightedRewards(Environment(), cfg.rollout.rewards), RewardLimits.from_rollout(cfg.rollout))
    t0 = time.perf_counter()
    reward, error = asyncio.run(scorer.score("abc=", "abc", {"target": "abc"}))
    assert time.perf_counter() - t0 < 2.0  # its own 0.2 s, not rollout.reward_timeout_s (30 s)
    assert math.isnan(reward) and error == "tests.unit.test_reward_scoring:async_slow did not return within 0.2 s"
    assert scorer.timeouts == 1
    scorer.close()


def test_bad_reward_limits_fail_at_load():
    with pytest.raises(ConfigError, match=r"rollout.reward_timeout_s"):
        load_config(None, ["rollout.reward_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].timeout_s"):
        load_config(None, ["rollout.rewards=[{fn: examples.custom_reward:exact_copy, timeout_s: -1}]"])
    with pytest.raises(ConfigError, match=r"rollout.reward_on_failure=nan: must be a finite number or null"):
        load_config(None, ["rollout.reward_on_failure=nan"])
