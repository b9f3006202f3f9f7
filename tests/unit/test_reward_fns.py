"""rollout.rewards: plain (TRL-style) reward functions by import path, summed with weights."""

from __future__ import annotations

import math
import random
import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.rollout.envs import RewardError, make_env, score
from asyncrl.rollout.envs.reward_fns import WeightedRewards

COPY = {"alphabet": "abc", "min_len": 3, "max_len": 3}


def rewards(*specs):
    return load_config(
        None, ["rollout.env_kwargs=" + str(COPY).replace("'", ""), f"rollout.rewards=[{', '.join(specs)}]"]
    )


def test_weighted_sum_of_trl_style_functions_on_the_envs_prompts():
    cfg = rewards("{fn: examples.custom_reward:exact_copy}", "{fn: examples.custom_reward:brevity, weight: -0.25}")
    assert [(s.fn, s.weight) for s in cfg.rollout.rewards] == [
        ("examples.custom_reward:exact_copy", 1.0),
        ("examples.custom_reward:brevity", -0.25),
    ]
    env = WeightedRewards(make_env("copy", COPY), cfg.rollout.rewards)
    prompt, meta = env.make_prompt(random.Random(0))  # the copy env's own prompts: "bab=" -> target "bab"
    assert (prompt, meta) == ("bab=", {"target": "bab"})
    assert score(env, prompt, "bab", meta) == 1.0 - 0.25  # exact, and short
    assert score(env, prompt, " bab  x", meta) == 0.0  # neither
    assert score(env, prompt, "ba", meta) == -0.25  # short only
    assert score(env, prompt, "  ", meta) == 0.0  # brevity says None for an empty answer: adds nothing


def test_a_function_that_fails_fails_only_that_sample():
    class Spec:
        def __init__(self, fn):
            self.fn, self.weight = fn, 1.0

    env = WeightedRewards(make_env("copy", COPY), [Spec("math:sqrt")])  # sqrt(prompts=...) raises TypeError
    with pytest.raises(RewardError, match=re.escape("WeightedRewards.reward raised TypeError")):
        score(env, "abc=", "abc", {"target": "abc"})
    env = WeightedRewards(make_env("copy", COPY), [Spec("tests.unit.test_reward_fns:returns_nan")])
    with pytest.raises(RewardError, match=r"returns_nan returned nan, expected a finite number"):
        score(env, "abc=", "abc", {"target": "abc"})


def returns_nan(prompts, completions, **_):
    return [math.nan for _ in completions]


def test_bad_reward_specs_fail_at_load_naming_the_entry():
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].fn='exact': must be an import path"):
        rewards("{fn: exact}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[1\].fn='nope.mod:f': module 'nope.mod' cannot be found"):
        rewards("{fn: examples.custom_reward:exact_copy}", "{fn: nope.mod:f}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].weight='x': expected a number"):
        rewards("{fn: examples.custom_reward:exact_copy, weight: x}")
    unknown = r"rollout.rewards\[0\].scale: unknown field; RewardFnConfig has: fn, weight, timeout_s"
    with pytest.raises(ConfigError, match=unknown):
        rewards("{fn: examples.custom_reward:exact_copy, scale: 2}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\]: missing field 'fn' \(RewardFnConfig needs: fn\)"):
        rewards("{weight: 2}")
    with pytest.raises(ConfigError, match=r"rollout.rewards=.*expected a list"):
        load_config(None, ["rollout.rewards=examples.custom_reward:exact_copy"])


def test_a_multi_turn_environment_keeps_its_own_rewards():
    cfg = rewards("{fn: examples.custom_reward:exact_copy}")
    with pytest.raises(ValueError, match="CountdownChatEnv is multi-turn"):
        WeightedRewards(make_env("countdown_chat"), cfg.rollout.rewards)
