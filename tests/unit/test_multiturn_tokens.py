"""Multi-turn contexts: the ids the engine is given turn by turn are the templated conversation
(or, without a template, the bare text with no special token mid-context), and every sample
carries them to the learner.

.venv/bin/python -m pytest tests/unit/test_multiturn_tokens.py -q

The tokenizer is the tests' character tokenizer made Llama-style (it adds a BOS to every
``encode``) and given a ChatML-like template whose end of turn, ``<eos>|``, has a token the
engine never samples after the ``<eos>`` it stops on.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from asyncrl.config import AlgoConfig
from asyncrl.data.batch import build_minibatches
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.envs.chat import ChatTemplateError, ChatTurns, PlainTurns, check_turn_template, turn_codec
from asyncrl.rollout.envs.multiturn import (
    TurnAborted,
    run_trajectory,
    to_interleaved_sample,
    to_step_samples,
)
from asyncrl.rollout.prompts import encode_prompt
from asyncrl.types import RolloutGroup
from tests.support.chat import CHATML, llama_style_tokenizer, scripted_policy

# The generation prompt "assistant: " is not how an assistant message is rendered ("<bos>assistant: ...").
HEADER_MISMATCH = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Ends the last assistant message differently from the same message once another turn follows.
LAST_DIFFERS = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' and loop.last %}.{% else %};{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def llama_style(tmp_path, template):
    tok = llama_style_tokenizer(tmp_path, template)
    assert tok.encode("5>")[0] == tok.bos_token_id  # really Llama-style: plain encode adds a BOS
    return tok


@pytest.fixture
def chat_tok(tmp_path):
    return llama_style(tmp_path, CHATML)


def scripted(tok, replies):
    """A policy answering with fixed (text, finish_reason) turns; it records every context it was given."""
    return scripted_policy(tok, replies, logprob=-0.25, version=7)


def rendered(tok, messages, generation_prompt=True):
    text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_chat_turns_give_the_engine_the_templated_conversation_at_every_turn(chat_tok):
    tok = chat_tok
    env = make_env("countdown_chat", {"max_turns": 3})
    # A reply that stopped on <eos> (the template's end of turn starts with it), one cut at
    # max_tokens (the whole end of turn is added for it), and a last one.
    policy, contexts = scripted(tok, [("4<eos>", "stop"), ("3x", "length"), ("2<eos>", "stop")])
    traj = asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, ChatTurns(tok), 256))
    contents = ["4", "3x", "2"]
    observations = [";4>", ";3>"]
    conversation = [{"role": "user", "content": "5>"}]
    for k, context in enumerate(contexts):
        assert context == rendered(tok, conversation), (k, tok.decode(context))
        conversation += [{"role": "assistant", "content": contents[k]}]
        if k < len(observations):
            conversation += [{"role": "user", "content": observations[k]}]
    # The first prompt is exactly what a single-turn prompt with the template gets.
    assert traj.prompt_ids == encode_prompt(tok, "5>", chat_template=True) == contexts[0]
    # After the <eos> the engine stopped on, only the rest of the end of turn ("|") is added.
    end = tok.encode("<eos>|", add_special_tokens=False)
    assert traj.observation_ids[0][:1] == end[1:] and traj.observation_ids[1][:2] == end

    steps = to_step_samples(traj, trajectory_id=0)
    assert [s.prompt_ids.tolist() for s in steps] == contexts
    flat = to_interleaved_sample(traj)
    assert flat.prompt_ids.tolist() == contexts[0]
    whole = flat.prompt_ids.tolist() + flat.response_ids.tolist()
    assert whole == contexts[-1] + traj.turns[-1].token_ids
    # Only the sampled tokens are trained; the template's tokens are context.
    sampled = [i for t in traj.turns for i in t.token_ids]
    assert flat.response_ids[flat.loss_mask == 1].tolist() == sampled


def test_plain_turns_put_no_bos_mid_context(tmp_path):
    tok = llama_style(tmp_path, None)
    env = make_env("countdown_chat", {"max_turns": 3})
    policy, contexts = scripted(tok, [("4<eos>", "stop"), ("3<eos>", "stop"), ("2", "length")])
    traj = asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, turn_codec(tok, chat_template=False), 256))
    bos = tok.bos_token_id
    assert contexts[0] == tok.encode("5>") and contexts[0][0] == bos  # as single-turn prompts are encoded
    for context in contexts:
        assert context.count(bos) == 1  # the prompt's, nowhere else
    assert contexts[2] == tok.encode("5>4<eos>;4>3<eos>;3>")
    flat = to_interleaved_sample(traj)
    assert (flat.prompt_ids.tolist() + flat.response_ids.tolist()).count(bos) == 1


def test_interleaved_samples_are_trained_on_their_own_prompt(chat_tok):
    """The group's prompt ids (what a single-turn group would use) are not what the engine got."""
    tok = chat_tok
    env = make_env("countdown_chat", {"max_turns": 2})
    policy, contexts = scripted(tok, [("4<eos>", "stop"), ("3<eos>", "stop")])
    traj = asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, ChatTurns(tok), 256))
    other = RolloutGroup("g", "p", np.asarray(tok.encode("5>"), np.int32), [to_interleaved_sample(traj)])
    (mb,), _ = build_minibatches([other], AlgoConfig(), num_minibatches=1)
    assert mb[0].input_ids.tolist() == contexts[-1] + traj.turns[-1].token_ids
    loss = mb[0].loss_mask > 0
    assert mb[0].input_ids[loss].tolist() == [i for t in traj.turns for i in t.token_ids]


def test_an_observation_never_followed_by_a_turn_is_not_in_the_sample(chat_tok):
    tok = chat_tok
    env = make_env("countdown_chat", {"max_turns": 2})  # the env is not done after 2 of 5 counts
    policy, _ = scripted(tok, [("4<eos>", "stop"), ("3<eos>", "stop")])
    traj = asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, ChatTurns(tok), 256))
    assert traj.observation_ids[-1] == []
    flat = to_interleaved_sample(traj)
    assert flat.response_ids.tolist()[-len(traj.turns[-1].token_ids) :] == traj.turns[-1].token_ids


@pytest.mark.parametrize("reply", [("", "abort"), ("4", "abort"), ("", "stop")])
def test_an_aborted_or_empty_turn_voids_the_trajectory(tmp_path, reply):
    """Never a sample labelled with behaviour version 0 (which dropped its whole group as stale)."""
    tok = llama_style(tmp_path, None)
    env = make_env("countdown_chat", {"max_turns": 3})
    policy, _ = scripted(tok, [("4<eos>", "stop"), reply])
    with pytest.raises(TurnAborted, match="turn 1 came back"):
        asyncio.run(run_trajectory(env, "5>", {"start": 5}, policy, PlainTurns(tok), 256))


@pytest.mark.parametrize(
    ("template", "match"),
    [(HEADER_MISMATCH, "generation prompt"), (LAST_DIFFERS, "not prefix-stable")],
)
def test_a_template_that_cannot_grow_turn_by_turn_is_refused_at_start_up(tmp_path, template, match):
    tok = llama_style(tmp_path, template)
    with pytest.raises(ChatTemplateError, match=match):
        ChatTurns(tok)
    with pytest.raises(ChatTemplateError, match=re.escape("rollout.env='countdown_chat'")):
        check_turn_template(tok, "countdown_chat")
    check_turn_template(tok, "copy")  # single-turn: one rendering, nothing to extend


def test_an_env_can_render_observations_in_another_role(chat_tok):
    delta = ChatTurns(chat_tok, role="tool").observation(";4>", [], "length")
    assert chat_tok.decode(delta) == "<eos>|<bos>tool:;4><eos>|<bos>assistant:"
