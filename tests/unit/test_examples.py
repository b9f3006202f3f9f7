"""The examples run: a custom loss and custom environments load by import path and work."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def test_custom_loss_reads_its_kwargs_from_the_config():
    import math

    from asyncrl.algo import get_policy_loss
    from asyncrl.config import load_config

    spec = "{type: 'examples.custom_loss:tanh_ratio_pg', kwargs: {eps: 0.5}}"
    loss_cfg = load_config(None, [f"algo.policy_loss={spec}"]).algo.policy_loss
    fn = get_policy_loss(loss_cfg.type)
    logp, old = torch.tensor([[math.log(2.0)]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64)
    loss, _ = fn(logp, old, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1), params=loss_cfg)
    assert math.isclose(loss.item(), -(1 + 0.5 * math.tanh(1 / 0.5)))  # eps 0.2 (the default) would differ


def test_custom_loss_by_import_path_goes_through_microbatch_loss():
    from asyncrl.config import load_config
    from asyncrl.learner.loss import microbatch_loss

    algo = load_config(None, ["algo.policy_loss=examples.custom_loss:tanh_ratio_pg", "algo.correction.tis=token"]).algo
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([[0, 1.0, 1.0, 1.0, 0], [0, 0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mb = {
        "input_ids": ids,
        "loss_mask": mask,
        "advantages": adv,
        "reduction_weights": mask / mask.sum(),
        "rollout_logprobs": torch.zeros(2, 5, dtype=torch.float64),
    }
    loss, metrics = microbatch_loss(logits, mb, algo, temperature=1.0, old_from_current=True)
    # At r = 1 the custom loss is -A_t; token TIS multiplies it by exp(old - rollout) = exp(logp)
    # (rollout logprobs are 0 here, so the cap of 2 never binds).
    from asyncrl.learner.loss import token_logprobs

    logp = token_logprobs(logits.detach(), ids, 1.0)
    expected = (mb["reduction_weights"] * torch.exp(logp) * -adv * mask).sum()
    assert torch.allclose(loss.detach(), expected, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().sum() > 0
    assert "drift/tis_ratio_mean" in metrics


def test_custom_and_multiturn_environments_load_and_score():
    from asyncrl.rollout.envs.base import make_env

    env = make_env("examples.custom_reward:EchoFirstEnv", {"alphabet": "ab", "length": 3})
    prompt, meta = env.make_prompt(random.Random(0))
    assert prompt.endswith(">") and env.reward(prompt, meta["first"], meta) == pytest.approx(1.2)
    assert env.reward(prompt, "zzz", meta) == 0.0

    game = make_env("examples.multiturn_env:GuessDigitEnv", {"max_turns": 3})
    prompt, meta = game.make_prompt(random.Random(1))
    assert game.reset(prompt, meta) == prompt
    target = meta["target"]
    wrong = (target + 1) % 10
    obs, reward, done = game.step(str(wrong))
    assert (obs, reward, done) == ("<" if target < wrong else ">", 0.0, False)
    assert game.step(str(target)) == ("", 1.0, True)
    assert "examples" in sys.modules


def test_the_readmes_reward_gives_partial_credit_where_exact_copy_gives_none():
    from examples.custom_reward import exact_copy, letters_in_place

    answers = ["abc", " abc ", "abx", "ab", "abcd", "xyz", "", "cba"]
    target = ["abc"] * len(answers)
    scores = letters_in_place(None, answers, target)
    assert scores == pytest.approx([1.0, 1.0, 2 / 3, 2 / 3 - 0.1, 1.0 - 0.1, 0.0, -0.3, 1 / 3])
    assert exact_copy(None, answers, target) == [1.0, 1.0, 0, 0, 0, 0, 0, 0]
    # Hostile answers: a runaway one costs no more than -1 (it must not outweigh a whole group),
    # an empty target is no division by zero, unicode is compared as characters.
    assert letters_in_place(None, ["a" * 1_000_000, "", "xy", "äbc"], ["abc", "", "", "abc"]) == pytest.approx(
        [-1.0, 0.0, -0.2, 2 / 3]
    )


def test_slow_reward_config_times_out_the_stuck_verifier_and_scores_the_rest():
    import asyncio

    from asyncrl.config import load_config
    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.envs.reward_fns import WeightedRewards
    from asyncrl.rollout.scoring import RewardLimits, RewardScorer

    rollout = load_config(ROOT / "configs/slow_rewards.yaml").rollout
    assert [s.timeout_s for s in rollout.rewards] == [2.0, None] and rollout.reward_on_failure == 0.0
    verifier = rollout.rewards[0].model_copy(update={"timeout_s": 0.3})  # the test's time is short
    env = WeightedRewards(make_env(rollout.env, rollout.env_kwargs), [verifier, rollout.rewards[1]])
    scorer = RewardScorer(env, RewardLimits.from_rollout(rollout))
    prompt, meta = make_env("copy", rollout.env_kwargs).make_prompt(random.Random(0))

    async def score(responses):
        return await asyncio.gather(*(scorer.score(prompt, r, meta) for r in responses))

    out = asyncio.run(score([meta["target"], "cbb", "abcabc"]))  # the verifier chokes on "cbb"
    scorer.close()
    assert out == [(1.1, None), (0.0, None), (0.0, None)]  # the stuck one scored reward_on_failure
    assert scorer.timeouts == 1 and scorer.errors == 0
