"""Episodes and rewards at their edges, through the generator's GroupMaker: a tool episode that
fills the context is scored and marked cut, a tools env's failed reward follows the shared rules,
dynamic sampling never takes a reward outage for a tie, and a high failure rate is announced
(console and dashboard) naming the reward.

.venv/bin/python -m pytest tests/unit/test_failed_rewards.py -q

Only the model's text is scripted (``ScriptedEngine`` answers every request with one reply, as
the generator's vLLM engine would with a policy that always says the same); the tokenizer is a
real one written by the test and the tools and rewards are real functions.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncrl.algo.overlong import is_truncated
from asyncrl.config import Config
from asyncrl.control.watchdog import GeneratorWatchdog
from asyncrl.data.batch import build_minibatches
from asyncrl.monitor.alerts import Thresholds, evaluate_alerts
from asyncrl.monitor.dashboard.data import thresholds_of
from asyncrl.queue.readback import Heartbeat, parse_heartbeat
from asyncrl.rollout.completions import Completion
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.prompts import PromptItem, encode_prompt
from asyncrl.rollout.stats import GeneratorStats
from tests.support.tools import tool_tokenizer

CALC = "asyncrl.rollout.envs.calculator:calculator"
ALWAYS_CALLS = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
N = 3


class ScriptedEngine:
    """What GroupMaker reads of its engine: every request is answered with ``reply``."""

    version = 3

    def __init__(self, tok, reply: str):
        self.ids = tok.encode(reply, add_special_tokens=False)
        self.contexts: list[list[int]] = []

    async def generate(self, prompt_ids, n, request_id, **kw):
        self.contexts.append(list(prompt_ids))
        return [Completion(list(self.ids), [-0.5] * len(self.ids), [3] * len(self.ids), "stop") for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tool_tokenizer(tmp_path_factory.mktemp("edge-tok"))


def tools_config(reward: str, *, stepwise: bool = False, on_failure: float | None = None, **env) -> Config:
    cfg = Config()
    kwargs = {"tools": [CALC], "reward": reward, **env}
    cfg.rollout = cfg.rollout.model_copy(
        update={
            "env": "tools",
            "env_kwargs": kwargs,
            "chat_template": True,
            "n_samples": N,
            "max_tokens": 100,
            "engine_max_model_len": 1000,
            "reward_on_failure": on_failure,
        }
    )
    cfg.algo.stepwise = stepwise
    return cfg


def make_group(cfg: Config, tok, reply: str, question: str = "1+1=", answer=2):
    env = make_env(cfg.rollout.env, cfg.rollout.env_kwargs)
    engine = ScriptedEngine(tok, reply)
    maker = GroupMaker(cfg, env, tok, engine, "g")  # type: ignore[arg-type]
    item = PromptItem("p:0", question, {"answer": answer}, encode_prompt(tok, question, True))
    return asyncio.run(maker.make(item)), maker, engine


# ----------------------------------------------------------------------------- a context that fills up


@pytest.mark.parametrize("stepwise", [False, True], ids=["interleaved", "stepwise"])
def test_a_tool_loop_that_fills_the_context_is_scored_and_cut(tok, stepwise):
    """A policy that always calls the calculator never answers: at a small budget the context
    fills long before max_turns. The reward still judges the episode (on its last reply: wrong,
    -1, not a free 0), the samples are "length" so algo.overlong.mask drops them, and the cut is counted."""
    cfg = tools_config("tests.support.tools:signed_number", stepwise=stepwise, max_turns=50)
    cfg.algo.overlong.mask = True
    group, maker, engine = make_group(cfg, tok, ALWAYS_CALLS)
    budget = cfg.rollout.engine_max_model_len - cfg.rollout.max_tokens
    assert 2 <= len(engine.contexts) // N < 50 and max(map(len, engine.contexts)) < budget  # cut by the budget
    assert all(s.reward == -1.0 and s.error is None for s in group.samples), [s.reward for s in group.samples]
    assert all(is_truncated(s.stop_reason) for s in group.samples)
    assert group.metadata[EPISODE_COUNTS_KEY]["context_full"] == N
    _, metrics = build_minibatches([group], cfg.algo, num_minibatches=1)
    assert metrics["overlong/truncated_frac"] == 1.0
    assert metrics["overlong/masked_samples"] == len(group.samples)  # left out of the loss
    assert maker.scorer.errors == maker.scorer.timeouts == 0


def test_an_episode_that_answers_in_budget_is_not_cut(tok):
    cfg = tools_config("tests.support.tools:signed_number", max_turns=50)
    group, _, engine = make_group(cfg, tok, "It is 2.")
    assert len(engine.contexts) == N and [s.reward for s in group.samples] == [1.0] * N
    assert [s.stop_reason for s in group.samples] == ["stop"] * N
    assert group.metadata[EPISODE_COUNTS_KEY]["context_full"] == 0


# ----------------------------------------------------------------------------- the tools env's failed rewards


@pytest.mark.parametrize("on_failure", [None, 0.0], ids=["nan", "on_failure"])
def test_a_tools_reward_failure_follows_the_shared_rules(tok, on_failure):
    cfg = tools_config("tests.support.tools:broken_reward", on_failure=on_failure)
    group, maker, _ = make_group(cfg, tok, "It is 2.")
    assert maker.scorer.errors == N and maker.scorer.timeouts == 0  # rollout/reward_errors counts them
    for s in group.samples:
        if on_failure is None:
            assert math.isnan(s.reward)
            assert s.error == "tests.support.tools:broken_reward raised RuntimeError: the verifier is down"
        else:
            assert (s.reward, s.error) == (0.0, None)  # rollout.reward_on_failure, trained on
    assert maker.scorer.last_failure.startswith("tests.support.tools:broken_reward raised RuntimeError")


def test_a_tools_reward_timeout_is_counted_as_one(tok):
    cfg = tools_config("tests.support.tools:slow_reward", on_failure=-1.0, reward_timeout_s=0.2)
    group, maker, _ = make_group(cfg, tok, "It is 2.")
    assert (maker.scorer.timeouts, maker.scorer.errors) == (N, 0)
    assert [s.reward for s in group.samples] == [-1.0] * N
    assert "tests.support.tools:slow_reward did not return within 0.2 s" in maker.scorer.last_failure


# ----------------------------------------------------------------------------- dynamic sampling in an outage


def copy_maker(tok, on_failure: float | None, reward_env: str = "copy") -> GroupMaker:
    cfg = Config()
    cfg.rollout = cfg.rollout.model_copy(update={"n_samples": 4, "reward_on_failure": on_failure})
    cfg.rollout.drop_uniform_groups = True
    env = make_env(reward_env, {})
    return GroupMaker(cfg, env, tok, ScriptedEngine(tok, "abc"), "g")  # type: ignore[arg-type]


class DownVerifier:
    """An environment whose verifier is unreachable: every reward call raises."""

    multi_turn = False

    def reward(self, prompt, response, metadata):
        raise ConnectionError("verifier at 127.0.0.1:9 refused the connection")


@pytest.mark.parametrize("on_failure", [0.0, None], ids=["on_failure", "nan"])
def test_a_reward_outage_is_not_a_uniform_group(tok, on_failure):
    """With every reward failing, the stand-ins (or NaNs) tie: the group must still reach the
    trainer, where the failures show, instead of being dropped as a solved or hopeless task."""
    maker = copy_maker(tok, on_failure)
    maker.scorer.env = DownVerifier()  # type: ignore[assignment]
    item = PromptItem("p:1", "abc=", {"target": "abc"}, tok.encode("abc=", add_special_tokens=False))
    group = asyncio.run(maker.make(item))
    assert [s.reward for s in group.samples if not math.isnan(s.reward)] == ([0.0] * 4 if on_failure == 0.0 else [])
    assert maker.scorer.errors == 4
    assert not maker.uniform(group)


def test_a_stand_in_that_ties_with_the_task_given_rewards_is_still_a_tie(tok):
    """Failures take no part in the verdict, as NaN ones never did: the rewards the task gave
    decide, and a stand-in equal to them leaves no gradient either."""
    maker = copy_maker(tok, 0.0)
    item = PromptItem("p:2", "abc=", {"target": "xyz"}, tok.encode("abc=", add_special_tokens=False))
    group = asyncio.run(maker.make(item))  # "abc" against "xyz": every sample scores the same
    assert maker.uniform(group)
    group.metadata["reward_failed"] = [0, 1]  # two of them stood in for by 0.0: the others still tie
    rewards = {s.reward for s in group.samples}
    assert maker.uniform(group) == (rewards == {0.0})
    group.metadata["reward_failed"] = [0, 1, 2, 3]
    assert not maker.uniform(group)


# ----------------------------------------------------------------------------- the alert


def test_a_failure_rate_above_the_threshold_is_announced_naming_the_reward(tok):
    from asyncrl.rollout.scoring import FAILURE_MIN_SCORED

    maker = copy_maker(tok, 0.0)
    maker.scorer.env = DownVerifier()  # type: ignore[assignment]
    assert maker.scorer.failure_rate is None  # nothing scored yet: no rate
    for k in range(FAILURE_MIN_SCORED // 4 + 1):
        asyncio.run(maker.make(PromptItem(f"p:{k}", "abc=", {"target": "abc"}, [5, 6])))
    assert maker.scorer.failure_rate == 1.0
    stats = {k: 0 for k in GeneratorStats.__dataclass_fields__}
    stats.update(
        generator_id="gen-0",
        weights_blocked=None,
        reward_failure_rate=maker.scorer.failure_rate,
        reward_last_failure=maker.scorer.last_failure,
    )
    beat = GeneratorStats(**stats).heartbeat()
    assert "DownVerifier.reward raised ConnectionError" in beat["reward_last_failure"]

    dog = GeneratorWatchdog([], None, 60.0, reward_failure_alert=0.5)  # type: ignore[arg-type]

    def hb(record: dict) -> Heartbeat:  # as the trainer reads it back from Redis
        return parse_heartbeat({"heartbeat": 1.0, **record})

    (news,) = dog.news({"gen-0": hb(beat)})
    assert "gen-0: 100% of its latest reward scorings failed" in news and "DownVerifier.reward raised" in news
    assert dog.news({"gen-0": hb(beat)}) == []  # said once
    assert dog.news({"gen-0": hb({**beat, "reward_failure_rate": 0.1})}) == [
        "gen-0: rewards score again (10% of the latest failed)"
    ]
    assert dog.news({"gen-0": hb({"version": 1})}) == []  # an older generator's heartbeat: nothing to say

    alerts = evaluate_alerts(
        {},
        thresholds=thresholds_of({"alert_reward_failure_rate": 0.5}),
        max_staleness=1,
        policy_version=1,
        generators={"gen-0": {**beat, "heartbeat": 100.0}},
        now=100.0,
    )
    (alert,) = alerts
    assert alert["kind"] == "reward_failures" and alert["subject"] == "gen-0" and alert["value"] == 1.0
    assert "DownVerifier.reward raised ConnectionError" in alert["message"]
    quiet = Thresholds(reward_failure_rate=1.0)  # equal to the threshold is not an alert
    gens = {"gen-0": {**beat, "heartbeat": 100.0}}
    assert evaluate_alerts({}, thresholds=quiet, max_staleness=1, policy_version=1, generators=gens, now=100.0) == []


def test_the_threshold_is_configured_and_bounded():
    from asyncrl.config import ConfigError, load_config

    assert load_config(None, ["monitor.alert_reward_failure_rate=0.2"]).monitor.alert_reward_failure_rate == 0.2
    with pytest.raises(ConfigError, match="alert_reward_failure_rate"):
        load_config(None, ["monitor.alert_reward_failure_rate=1.5"])
