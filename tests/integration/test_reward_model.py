"""Reward models (rollout.rewards: [{model: DIR, ...}]): one Ray actor per entry batches the
requests of every sample in flight; a tiny random classifier is written here and scored
through the generators' own scoring path, against a direct Hugging Face forward."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import load_config
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.reward_model import NAMESPACE, actor_name, start_reward_models, stop_reward_models, wait_ready
from asyncrl.rollout.scoring import RewardLimits, RewardScorer
from examples.tiny_reward_model import write_tiny_reward_model
from tests.support.waiting import wait_for

COPY = "rollout.env_kwargs={alphabet: abc, min_len: 3, max_len: 3}"
# Prompts and completions of different lengths, so a batch is padded; every fourth one exact.
SAMPLES = [
    (f"{t}=", c, t)
    for t, c in [
        ("abc", "abc"),
        ("cab", "c"),
        ("bba", "bb a ca"),
        ("aaa", ""),
        ("cba", "cba"),
        ("acb", "ac"),
        ("bac", "b"),
        ("ccc", "cccccccc"),
    ]
    * 2
]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> str:
    return str(write_tiny_reward_model(tmp_path_factory.mktemp("reward-model")))


def direct_scores(path: str, pairs: list[tuple[str, str]], *, chat: bool = True) -> list[float]:
    """The model's logit for each (prompt, completion), one unpadded forward each."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for prompt, completion in pairs:
        if chat:
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            ids = tokenizer.apply_chat_template(turns, tokenize=True)["input_ids"]
        else:
            ids = tokenizer(prompt + completion)["input_ids"]
        with torch.no_grad():
            out.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    return out


@pytest.fixture(scope="module")
def reward_actor(ray_session, tiny_rm):
    """The run's reward-model actor for the tests (one start shared: each costs seconds). A batch
    runs only once 8 samples are there, so a test's requests wait in it deterministically."""
    run = "rm-tests"
    model = f"{{model: {tiny_rm}, weight: 0.5, batch_size: 8, max_wait_ms: 600000}}"
    rewards = f"[{{fn: examples.custom_reward:exact_copy}}, {model}]"
    cfg = load_config(None, [COPY, f"control.run_name={run}", f"rollout.rewards={rewards}"])
    started = start_reward_models(cfg)
    try:
        wait_ready(started)
        yield cfg, started[0][1]
    finally:
        stop_reward_models(started)
    # The actor lives as long as its run: gone at tear-down (its name freed once Ray marks it dead).
    wait_for(lambda: not named_actor_exists(ray_session, actor_name(run, 1)), 60, "the reward model's actor to end")


def named_actor_exists(ray, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def test_concurrent_samples_are_scored_in_batches_as_a_direct_forward_and_weighted_with_a_rule(
    ray_session, reward_actor, tiny_rm
):
    cfg, handle = reward_actor
    scorer = RewardScorer(make_rollout_env(cfg.rollout, cfg.control.run_name), RewardLimits.from_rollout(cfg.rollout))
    before = ray_session.get(handle.stats.remote())

    async def score_all():  # as a generator scores a group: every sample at once, off its loop
        return await asyncio.gather(*(scorer.score(p, c, {"target": t}) for p, c, t in SAMPLES))

    try:
        scored = asyncio.run(score_all())
    finally:
        scorer.close()
    after = ray_session.get(handle.stats.remote())
    # 16 requests, one per sample: two full batches, not 16 forward passes.
    assert after.requests - before.requests == 16
    assert dict(after.batch_sizes - before.batch_sizes) == {8: 2}
    pairs = [(p, c) for p, c, _ in SAMPLES]
    logits = direct_scores(tiny_rm, pairs)
    # By hand: exact_copy (1 or 0) times 1.0, plus the model's logit times 0.5.
    expected = [(1.0 if c.strip() == t else 0.0) + 0.5 * z for (_, c, t), z in zip(SAMPLES, logits, strict=True)]
    assert [error for _, error in scored] == [None] * len(SAMPLES)
    assert [reward for reward, _ in scored] == pytest.approx(expected, abs=1e-5)
    assert sum(1.0 if c == t else 0.0 for _, c, t in SAMPLES) == 4  # the rule reward is in the sums
    # The input went through the reward model's chat template: plain text scores otherwise.
    plain = direct_scores(tiny_rm, pairs, chat=False)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain, logits, strict=True))


def test_a_crashed_reward_model_is_restarted_and_its_pending_request_retried(ray_session, reward_actor, tiny_rm):
    from ray._private.state import actors  # no public call reads restarts without the dashboard

    ray, (_, handle) = ray_session, reward_actor

    def restarts() -> int:
        return actors(actor_id=handle._actor_id.hex())["NumRestarts"]

    requests, before = ray.get(handle.stats.remote()).requests, restarts()
    pending = handle.score.remote(["abc="], ["abc"])  # waits in the actor for 7 more samples
    wait_for(lambda: ray.get(handle.stats.remote()).requests > requests, 60, "the request to reach the actor")
    ray.kill(handle, no_restart=False)  # a crash: Ray restarts the actor
    # ray.kill returns before the kill lands: requests sent before the restart began could
    # still reach the old actor and fill its batch there.
    wait_for(lambda: restarts() > before, 60, "the actor to restart")
    completions = ["c", "ca", "cab", "cabc", "b", "bb", "bbb"]
    others = [handle.score.remote(["cab="], [c]) for c in completions]
    values = ray.get([pending, *others], timeout=120)
    stats = ray.get(handle.stats.remote())
    # The restarted actor (its counts start afresh) ran the retried request with the new ones, as one batch.
    assert (stats.requests, dict(stats.batch_sizes)) == (8, {8: 1})
    expected = direct_scores(tiny_rm, [("abc=", "abc")] + [("cab=", c) for c in completions])
    assert [v[0] for v in values] == pytest.approx(expected, abs=1e-5)
