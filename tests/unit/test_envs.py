"""Environments: partial-credit rewards, GSM8K extraction, registry errors, multi-turn trajectories.

.venv/bin/python -m pytest tests/unit/test_envs.py -q
"""

from __future__ import annotations

import asyncio
import math
import random
import re

import numpy as np
import pytest

from asyncrl.config import ENVIRONMENTS
from asyncrl.rollout.envs import BUILTIN, RewardError, make_env, score
from asyncrl.rollout.envs.gsm8k import extract_answer
from asyncrl.rollout.envs.multiturn import (
    Turn,
    run_trajectory,
    to_interleaved_sample,
    to_step_samples,
)
from asyncrl.rollout.tiny import DEFAULT_ALPHABET


def test_registry_matches_config_names():
    assert tuple(BUILTIN) == ENVIRONMENTS


def test_copy_partial_credit_and_length_penalty():
    env = make_env("copy", {"length_penalty": 0.1})
    assert env.reward("abcd=", "abcd", {"target": "abcd"}) == 1.0
    # 2 of 4 positions right, one char short: 0.5 - 0.1
    assert env.reward("abcd=", "abx", {"target": "abcd"}) == pytest.approx(0.4)
    # target derived from the prompt when metadata has none; 3/3 right, 2 extra chars
    assert env.reward("cab=", "cabaa", {}) == pytest.approx(1.0 - 0.2)


def test_reverse_and_arithmetic_targets():
    rev = make_env("reverse", {"length_penalty": 0.0})
    assert rev.reward("abc<", "cba", {}) == 1.0
    assert rev.reward("abc<", "abc", {}) == pytest.approx(1 / 3)  # only the middle 'b' matches
    ar = make_env("arithmetic", {"length_penalty": 0.05})
    assert ar.reward("9*8=", "72", {}) == 1.0
    assert ar.reward("9*8=", "71", {}) == pytest.approx(0.5)
    assert ar.reward("3-5=", "-2", {}) == 1.0
    assert ar.reward("3+4=", "7", {"target": "7"}) == 1.0


@pytest.mark.parametrize("name", ["copy", "reverse", "arithmetic", "countdown_chat"])
def test_made_prompts_are_short_and_in_the_tiny_alphabet(name):
    env = make_env(name)
    rng = random.Random(0)
    for _ in range(50):
        prompt, meta = env.make_prompt(rng)
        assert 2 <= len(prompt) <= 6
        assert set(prompt) <= set(DEFAULT_ALPHABET)
        assert all(isinstance(v, (str, int)) for v in meta.values())


def test_make_prompt_is_deterministic_per_seed():
    env = make_env("copy")
    a = [env.make_prompt(random.Random(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    assert a[0][0][:-1] == a[0][1]["target"]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72.0),
        ("The answer is $1,250.", 1250.0),
        ("first 3 then -4.5", -4.5),
        ("#### 1,000,000", 1_000_000.0),
        ("no numbers here", None),
    ],
)
def test_gsm8k_extraction(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_reward_and_strict_mode():
    env = make_env("gsm8k")
    meta = {"answer": "She has 16 - 3 - 4 = 9 eggs.\n#### 9"}
    assert env.reward("q", "so 9 eggs", meta) == 1.0
    assert env.reward("q", "#### 8", meta) == 0.0
    strict = make_env("gsm8k", {"strict": True})
    assert strict.reward("q", "so 9 eggs", meta) == 0.0  # no '####' marker
    with pytest.raises(KeyError, match="answer"):
        env.reward("q", "9", {})


def test_registry_errors_are_specific():
    with pytest.raises(ValueError, match="not a built-in"):
        make_env("nope")
    with pytest.raises(ValueError, match="module 'no_such_mod' cannot be found on the Python path"):
        make_env("no_such_mod:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        make_env("asyncrl.rollout.envs.synthetic:Missing")
    with pytest.raises(ValueError, match=re.escape("bad rollout.env_kwargs")):
        make_env("copy", {"bogus": 1})
    with pytest.raises(ValueError, match="min_len"):
        make_env("copy", {"min_len": 4, "max_len": 2})
    # an import path works like a name
    assert type(make_env("asyncrl.rollout.envs.synthetic:ReverseEnv")).__name__ == "ReverseEnv"


class _BadEnv:
    def __init__(self, value):
        self.value = value

    def reward(self, prompt, response, metadata):
        if self.value == "raise":
            raise ZeroDivisionError("boom")
        return self.value


@pytest.mark.parametrize(
    "value,match",
    [
        ("raise", "ZeroDivisionError: boom"),
        (None, "returned None"),
        (float("nan"), "returned nan"),
        ("1.0", "returned '1.0'"),
        (math.inf, "returned inf"),
    ],
)
def test_score_turns_bad_rewards_into_reward_error(value, match):
    with pytest.raises(RewardError, match=match):
        score(_BadEnv(value), "p", "r", {})
    assert score(_BadEnv(2), "p", "r", {}) == 2.0


def _encode(text):  # one id per character, like the tiny tokenizer
    return [ord(c) for c in text]


def _decode(ids):
    return "".join(chr(i) for i in ids)


class _CharTurns:
    """A TurnCodec with one id per character and no chat template."""

    def prompt(self, text):
        return _encode(text)

    def observation(self, text, reply_ids, finish_reason):
        return _encode(text)

    def reply_text(self, reply_ids):
        return _decode(reply_ids)


def test_countdown_trajectory_step_wise_and_interleaved():
    env = make_env("countdown_chat", {"max_turns": 3})
    replies = iter(["4", "x", "2"])  # right, wrong, right
    versions = iter([[5], [5], [6]])

    async def policy(context):
        text = next(replies)
        return Turn(token_ids=_encode(text), logprobs=[-0.5] * len(text), versions=next(versions))

    traj = asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, _CharTurns(), 64))
    assert traj.rewards == pytest.approx([1 / 3, 0.0, 1 / 3])
    assert traj.total_reward == pytest.approx(2 / 3)
    # the env restates the true count after each reply; no observation after the last step
    assert [_decode(o) for o in traj.observation_ids] == [";4>", ";3>", ""]

    steps = to_step_samples(traj, trajectory_id=2, generator_id="g")
    assert [_decode(s.prompt_ids.tolist()) for s in steps] == ["5>", "5>4;4>", "5>4;4>x;3>"]
    assert [s.step_index for s in steps] == [0, 1, 2]
    assert all(s.trajectory_id == 2 and s.reward == pytest.approx(2 / 3) for s in steps)
    assert [s.behavior_version for s in steps] == [5, 5, 6]

    flat = to_interleaved_sample(traj)
    assert _decode(flat.prompt_ids.tolist()) == "5>"
    assert _decode(flat.response_ids.tolist()) == "4;4>x;3>2"
    assert flat.loss_mask.tolist() == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    np.testing.assert_allclose(flat.rollout_logprobs, [-0.5, 0, 0, 0, -0.5, 0, 0, 0, -0.5])
    assert flat.behavior_version == 5
    assert flat.token_versions.tolist() == [5, 5, 5, 5, 5, 5, 5, 5, 6]


def test_countdown_ends_at_zero_and_rejects_extra_steps():
    env = make_env("countdown_chat", {"max_turns": 5})
    env.reset("2>", {})
    assert env.step("1") == (";1>", 0.5, False)
    assert env.step("0") == (";0>", 0.5, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("0")
    with pytest.raises(ValueError, match="not of the form"):
        env.reset("abc", {})


def test_long_tail_sets_per_prompt_token_budgets_without_changing_the_task():
    import random

    from asyncrl.rollout.envs import make_env

    plain = make_env("copy", {"alphabet": "abc"})
    tail = make_env("copy", {"alphabet": "abc", "long_tail": True})
    budgets = [tail.make_prompt(random.Random(i))[1]["max_tokens"] for i in range(2000)]
    assert set(budgets) == {8, 48}
    assert 0.05 < budgets.count(48) / len(budgets) < 0.15
    p1, m1 = plain.make_prompt(random.Random(7))
    p2, m2 = tail.make_prompt(random.Random(7))
    assert p1 == p2 and m1["target"] == m2["target"] and "max_tokens" not in m1


def test_prompt_ids_carry_the_generator_prefix_and_streams_are_reproducible(tmp_path):
    import json

    from asyncrl.rollout.prompts import open_prompts

    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{c}=", "target": c}) for c in "abc"))
    env = make_env("copy")

    def take(prefix, seed, k, file=None):
        stream = open_prompts(file, env, seed=seed, id_prefix=prefix)
        return [next(stream) for _ in range(k)]

    # a file: ids "<prefix>:<stem>:<epoch>:<row>", every row once per epoch
    first = take("g0.1", 4, 6, str(path))
    assert [i.rsplit(":", 2)[0] for i, _, _ in first] == ["g0.1:tasks"] * 6
    assert sorted(i for i, _, _ in first[:3]) == ["g0.1:tasks:0:0", "g0.1:tasks:0:1", "g0.1:tasks:0:2"]
    assert {t for _, t, _ in first[:3]} == {"a=", "b=", "c="}
    assert first == take("g0.1", 4, 6, str(path))  # same prefix and seed: the same stream
    # a second generator (or the next incarnation) reading the same file never shares an id
    assert not {i for i, _, _ in first} & {i for i, _, _ in take("g0.2", 4, 6, str(path))}
    # env-made prompts: "<prefix>:<n>"
    made = take("g1.1", 9, 3)
    assert [i for i, _, _ in made] == ["g1.1:0", "g1.1:1", "g1.1:2"] and made == take("g1.1", 9, 3)


def test_unlink_segments_deletes_only_psm_segments(tmp_path):
    import os

    from asyncrl.rollout.recovery import unlink_segments

    with pytest.raises(ValueError, match="refusing to unlink"):
        unlink_segments(["/dev/shm/psm_abc", str(tmp_path / "psm_abc")])
    with pytest.raises(ValueError, match="refusing to unlink"):
        unlink_segments(["/dev/shm/psm_../etc"])
    name = f"/dev/shm/psm_{os.getpid():x}f00d"
    with open(name, "wb") as f:
        f.write(b"x")
    absent = f"/dev/shm/psm_{os.getpid():x}dead"
    assert not os.path.exists(absent)
    assert unlink_segments([name, absent]) == [name]
    assert not os.path.exists(name)


def test_synthetic_tasks_ban_special_tokens_but_eos(tmp_path):
    """Decoding for the reward strips special tokens, so a synthetic task must never sample
    them (free padding); EOS stays, or the policy could not stop. gsm8k & co sample anything."""
    from asyncrl.rollout.envs import allowed_token_ids
    from asyncrl.rollout.tiny import write_tokenizer

    tok = write_tokenizer(tmp_path)
    specials = {tok.convert_tokens_to_ids(t) for t in ("<pad>", "<bos>", "<unk>")}
    for name in ("copy", "reverse", "arithmetic"):
        allowed = allowed_token_ids(name, tok)
        assert set(allowed) == set(range(len(tok))) - specials, name
        assert tok.eos_token_id in allowed
    assert allowed_token_ids("gsm8k", tok) is None
    assert allowed_token_ids("countdown_chat", tok) is None


def test_target_lengths_of_the_synthetic_tasks():
    from asyncrl.rollout.envs.synthetic import ArithmeticEnv, CopyEnv, ReverseEnv

    assert CopyEnv(min_len=3, max_len=5).target_length() == 4.0
    assert ReverseEnv(min_len=3, max_len=3).target_length() == 3.0
    # 0..1 op 0..1 with "+": results 0, 1, 1, 2 -> one digit each
    assert ArithmeticEnv(max_operand=1, ops="+").target_length() == 1.0
    # "-": 0-1 = -1 is two characters, the other three one
    assert ArithmeticEnv(max_operand=1, ops="-").target_length() == 1.25
