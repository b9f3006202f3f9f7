"""verifiers environments (``rollout.env: {type: verifiers, ...}``) without an engine: config and
import allowlist, prompts from the taskset, the rubric as the return, and the ids, masks,
logprobs and versions an episode builds, which must equal the native multi-turn environment's
for the same conversation (the engine's side is tests/integration/test_multiturn_engine.py).

.venv/bin/python -m pytest tests/unit/test_verifiers_env.py -q
"""

from __future__ import annotations

import asyncio
import math
import random
import re

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.allowlist import ImportAllowList, named_imports
from asyncrl.control.preflight import check_imports
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.envs.chat import turn_codec
from asyncrl.rollout.envs.multiturn import MultiTurnEnvironment, Turn, run_trajectory, to_interleaved_sample
from asyncrl.rollout.envs.verifiers_agents import EpisodeError
from asyncrl.rollout.prompts import PromptSourceError
from tests.support.chat import CHATML, llama_style_tokenizer
from tests.support.vf_env import env_reply, write_vf_env

BUDGET = 200


@pytest.fixture
def vf_module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return write_vf_env(tmp_path, "vf_copy_unit")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return llama_style_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


def scripted(tok, replies):
    """A policy answering ``replies`` in turn (text + <eos>); it records every context it was given."""
    seen, it = [], iter(replies)

    async def policy(context):
        seen.append(list(context))
        ids = [*tok.encode(next(it), add_special_tokens=False), tok.eos_token_id]
        return Turn(ids, [-0.25 * (i + 1) for i in range(len(ids))], [3] * len(ids), "stop")

    return policy, seen


def episode(env, tok, replies, chat=True):
    prompt, meta = env.make_prompt(random.Random(0))
    policy, seen = scripted(tok, replies)
    codec = turn_codec(tok, chat_template=chat)
    return prompt, meta, asyncio.run(env.run_episode(prompt, meta, policy, codec, BUDGET)), seen


class Mirror(MultiTurnEnvironment):
    """The same conversation as the test environment's EchoEnv, as a native multi-turn env."""

    max_turns = 2

    def reset(self, prompt, metadata):
        return prompt

    def step(self, response):
        return env_reply(response.strip()), 0.0, False


def test_config_mapping_form_expands_and_allowlist_names_the_module(vf_module):
    cfg = load_config(None, [f"rollout.env={{type: verifiers, id: {vf_module}, args: {{turns: 2}}}}"])
    assert (cfg.rollout.env, cfg.rollout.env_kwargs) == ("verifiers", {"id": vf_module, "args": {"turns": 2}})
    path = f"{vf_module}:load_environment"
    assert [p.path for p in named_imports(cfg.to_dict())] == [path]
    with pytest.raises(ConfigError, match=f"rollout.env.id={path!r}"):
        ImportAllowList().check(named_imports(cfg.to_dict()))
    ImportAllowList(frozenset([path])).check(named_imports(cfg.to_dict()))
    for bad, why in [
        ("rollout.env={type: gym, id: x}", "rollout.env='gym': must be one of"),
        ("rollout.env={type: verifiers}", "rollout.env.id=None"),
        ("rollout.env={type: verifiers, id: no_such_vf_env}", "module 'no_such_vf_env' cannot be found"),
        ("rollout.env={type: verifiers, id: x, turns: 2}", "unknown keys ['turns']"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            load_config(None, [bad])


def test_check_imports_builds_it_and_bad_args_name_the_environment(vf_module):
    cfg = load_config(None, [f"rollout.env={{type: verifiers, id: {vf_module}}}"])
    assert check_imports(cfg)[0] == "rollout.env=verifiers: imported and built (makes the prompts)"
    bad = load_config(None, [f"rollout.env={{type: verifiers, id: {vf_module}, args: {{nope: 1}}}}"])
    with pytest.raises(ConfigError, match=f"verifiers environment '{vf_module}': bad args .*nope"):
        check_imports(bad)


def test_prompts_come_from_the_taskset_every_task_once_per_epoch(vf_module):
    env = make_env("verifiers", {"id": vf_module, "args": {}})
    rng = random.Random(1)
    drawn = [env.make_prompt(rng) for _ in range(4)]
    assert sorted(p for p, _ in drawn[:2]) == sorted(p for p, _ in drawn[2:]) == ["abc=", "bad="]
    assert all(env.tasks[m["vf_task"]].data.prompt == p for p, m in drawn)


def test_single_turn_reward_is_the_rubric_and_tokens_are_the_engines(vf_module, tok):
    env = make_env("verifiers", {"id": vf_module, "args": {"turns": 1}})
    prompt, _, traj, seen = episode(env, tok, [prompt_word := "abz"])
    answer = prompt[:-1]
    assert seen == [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
    ]
    expected = 1.0 * (prompt_word == answer) + 0.5 * (prompt_word[0] == answer[0])
    assert traj.rewards == [expected] and traj.error is None
    s = to_interleaved_sample(traj)
    reply = [*tok.encode(prompt_word, add_special_tokens=False), tok.eos_token_id]
    assert s.prompt_ids.tolist() == seen[0] and s.response_ids.tolist() == reply
    assert s.loss_mask.tolist() == [1] * len(reply) and s.token_versions.tolist() == [3] * len(reply)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_multi_turn_episode_builds_what_the_native_env_builds(vf_module, tok, chat):
    env = make_env("verifiers", {"id": vf_module, "args": {"turns": 2}})
    replies = ["ab", "abc"]
    prompt, meta, traj, seen = episode(env, tok, replies, chat)
    policy, native_seen = scripted(tok, replies)
    native = asyncio.run(run_trajectory(Mirror(), prompt, meta, policy, turn_codec(tok, chat_template=chat), BUDGET))
    assert seen == native_seen and len(seen) == 2
    ours, theirs = to_interleaved_sample(traj), to_interleaved_sample(native)
    for field in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_versions"):
        np.testing.assert_array_equal(getattr(ours, field), getattr(theirs, field), err_msg=field)
    answer = prompt[:-1]
    assert ours.reward == 1.0 * (replies[-1] == answer) + 0.5 * (replies[-1][0] == answer[0])


def test_stop_predicate_ends_the_exchange(vf_module, tok):
    env = make_env("verifiers", {"id": vf_module, "args": {"turns": 3}})
    _, _, traj, seen = episode(env, tok, ["stop", "never"])
    assert len(seen) == len(traj.turns) == 1 and traj.rewards == [0.0]


def test_agent_max_turns_ends_the_exchange_before_the_next_observation(vf_module, tok):
    env = make_env("verifiers", {"id": vf_module, "args": {"turns": 3, "max_turns": 2}})
    _, _, traj, seen = episode(env, tok, ["ab", "abc", "never"])
    assert len(seen) == len(traj.turns) == 2 and traj.observation_ids[-1] == []
    sample = to_interleaved_sample(traj)
    assert sample.response_ids.tolist()[-len(traj.turns[-1].token_ids) :] == traj.turns[-1].token_ids


def test_system_prompt_is_rendered_by_the_template_and_needs_one(vf_module, tok):
    env = make_env("verifiers", {"id": vf_module, "args": {"system": "be brief"}})
    prompt, meta, _, seen = episode(env, tok, ["abc"])
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert seen == [tok.encode(rendered, add_special_tokens=False)] and meta["prompt_messages"] == conversation
    with pytest.raises(PromptSourceError, match="chat template"):
        episode(env, tok, ["abc"], chat=False)


def test_failed_scoring_is_the_samples_error_and_shape_errors_are_named(vf_module, tok):
    env = make_env("verifiers", {"id": vf_module, "args": {"fail": True}})
    _, _, traj, _ = episode(env, tok, ["abc"])
    assert math.isnan(traj.rewards[-1]) and "the rubric broke" in traj.error
    env = make_env("verifiers", {"id": vf_module, "args": {"two": True}})
    with pytest.raises(EpisodeError, match=r"exactly one trainable agent run .* it left 2"):
        episode(env, tok, ["abc", "abc"])


def test_a_context_that_fills_up_cuts_the_exchange_and_marks_it_length(vf_module, tok):
    """As a native episode cut by the budget: scored, and its sample's stop reason is "length"."""
    env = make_env("verifiers", {"id": vf_module, "args": {"turns": 30}})
    long = "abc" * 20
    _, _, traj, seen = episode(env, tok, [long] * 30)
    assert 1 <= len(traj.turns) < 30 and max(map(len, seen)) < BUDGET
    assert traj.context_full and traj.error is None and math.isfinite(traj.rewards[-1])
    assert to_interleaved_sample(traj).stop_reason == "length"
    _, _, short, _ = episode(make_env("verifiers", {"id": vf_module, "args": {"turns": 1}}), tok, ["ab"])
    assert not short.context_full and to_interleaved_sample(short).stop_reason == "stop"


def test_eval_prompts_are_refused_with_a_verifiers_environment(vf_module, tmp_path):
    """Its episodes are its taskset's tasks: a held-out prompt read from a file names none."""
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text('{"prompt": "ab", "answer": "ab"}\n')
    env = f"rollout.env={{type: verifiers, id: {vf_module}}}"
    with pytest.raises(ConfigError, match=re.escape(f"control.eval_prompts='{prompts}': a verifiers environment")):
        load_config(None, [env, "control.eval_every=5", f"control.eval_prompts={prompts}"])
    assert load_config(None, [env, "control.eval_every=5"]).control.eval_prompts is None  # drawn from the taskset
