"""The PPO critic inside a learner rank, with no job: a one-rank gloo group in this process (the
`mesh` fixture), a LearnerActor built as setup builds it (policy + critic, FSDP2), fed
mini-batches that asyncrl.data.batch made from rollout groups with a sparse terminal reward
(multi-turn: an observation in the middle of each response).

- the critic learns (its value loss falls over repeated steps on one batch) and reports every
  critic/* metric, finite;
- the policy at lr 0 is untouched by it (its logits are the same before and after: the critic
  is its own module with its own optimizer);
- the advantages the policy trained on are GAE (whitened) over the critic's values;
- checkpoint and resume: the resumed critic's values equal the saved ones, and one more step
  of each gives equal critics (the critic's optimizer moments and schedule came back).

    .venv/bin/python -m pytest tests/unit/test_critic_learner.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from asyncrl.algo.advantages import AdvantageParams, gae
from asyncrl.algo.value import moments, whiten
from asyncrl.config import Config, ConfigError, load_config
from asyncrl.config.critic import check_value_model_family
from asyncrl.data import microbatch as mbatch
from asyncrl.data.batch import build_minibatches
from asyncrl.learner import checkpoint, fsdp, loss, optim
from asyncrl.learner.actor import LearnerActor
from asyncrl.learner.critic import CRITIC_DIR, Critic, load_value_model, token_values
from asyncrl.learner.group import FIELD_DTYPES
from asyncrl.rollout.tiny import write_tiny_model
from asyncrl.rundir import CHECKPOINTS_DIR, CONFIG_FILE
from asyncrl.types import RolloutGroup, Sample

D = torch.float64
FIELDS = FIELD_DTYPES | {f: "float32" for f in mbatch.CRITIC_FIELDS}


def learner(cfg: Config, model_path: str, mesh) -> LearnerActor:
    """A learner rank as LearnerActor.setup builds it, on the `mesh` fixture's group."""
    actor = LearnerActor(cfg, model_path, rank=0, world_size=1, sample_special_tokens=True)
    torch.manual_seed(0)
    actor.device = torch.device("cpu")
    actor.model = fsdp.load_sharded_model(model_path, mesh, device=actor.device, dtype="float32")
    actor.critic = Critic.load(cfg, model_path, mesh, device=actor.device)
    actor.optimizer = optim.build_optimizer(actor.model.parameters(), cfg.learner)
    actor.scheduler = optim.build_scheduler(actor.optimizer, cfg.learner, total_steps=cfg.control.total_steps)
    actor.sampling = loss.Sampling.of(cfg.rollout)
    actor.logprob_fn = actor.sampling.logprob_fn()
    actor.disallowed, actor.pad_token_id, actor.reference = None, 0, None
    return actor


def groups() -> list[RolloutGroup]:
    """Two prompts x two samples; 6 response tokens: 2 policy, 2 observation, 2 policy; reward at the end."""
    rng = np.random.default_rng(0)
    out = []
    for g in range(2):
        samples = [
            Sample(
                response_ids=rng.integers(3, 30, 6),
                rollout_logprobs=np.full(6, -1.0),
                loss_mask=np.array([1, 1, 0, 0, 1, 1]),
                reward=float(s),
                behavior_version=0,
            )
            for s in range(2)
        ]
        out.append(RolloutGroup(f"g{g}", f"p{g}", rng.integers(3, 30, 3), samples))
    return out


def plan(cfg: Config):
    minibatches, _ = build_minibatches(groups(), cfg.algo, num_minibatches=1)
    seqs = [mbatch.seq_fields(s) for s in minibatches[0]]
    return [seqs[:2], seqs[2:]], 2, minibatches[0]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Config:
    base = write_tiny_model(tmp_path_factory.mktemp("model"), seed=0)
    return load_config(
        None,
        [
            f"rollout.model={base}",
            "learner.lr=0",
            "control.total_steps=50",
            "algo.advantage_estimator=gae",
            "algo.gamma=0.9",
            "algo.lam=0.8",
            "algo.critic.enabled=true",
            "algo.critic.lr=0.01",
        ],
    )


def test_token_rewards_reach_the_learner_with_the_outcome_on_the_last_policy_token(cfg):
    _, _, seqs = plan(cfg)
    for seq in seqs:
        assert seq.token_rewards is not None and not seq.advantages.any()  # the learner computes them
        live = np.flatnonzero(seq.loss_mask)
        assert seq.token_rewards[live[-1]] == seq.token_rewards.sum()  # 0 or 1, on the last policy token
    assert sorted(float(s.token_rewards.sum()) for s in seqs) == [0.0, 0.0, 1.0, 1.0]


def test_critic_learns_without_moving_the_policy(cfg, mesh):
    actor = learner(cfg, cfg.rollout.model, mesh)
    per_rank, count, _ = plan(cfg)
    ids = torch.as_tensor(np.stack([s["input_ids"] for s in per_rank[0]]))
    before = actor.model(input_ids=ids).logits.detach()
    losses = []
    for _ in range(8):
        metrics = actor.train_minibatch(per_rank, count, FIELDS).metrics
        names = ("value_loss", "value_mean", "explained_variance", "clip_frac", "grad_norm")
        for name in names:
            assert np.isfinite(metrics[f"critic/{name}"].value), name
        losses.append(metrics["critic/value_loss"].value)
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["critic/explained_variance"].value > 0.0  # the last step's: the critic explains some
    torch.testing.assert_close(actor.model(input_ids=ids).logits.detach(), before, rtol=0, atol=0)


def test_policy_trains_on_whitened_gae_of_the_critic_values(cfg, mesh):
    actor = learner(cfg, cfg.rollout.model, mesh)
    actor.critic.train = lambda mbs: {}  # type: ignore[method-assign]  # keep the values fixed
    per_rank, count, _ = plan(cfg)
    mbs = actor._microbatches(per_rank, count, FIELDS)
    # One step so the (zero-initialised) head is not 0 everywhere: then compare on fresh values.
    critic = actor.critic
    with torch.no_grad():
        for p in critic.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    values = critic.values(mbs)
    critic.prepare(mbs, values)
    raw = [
        gae(
            torch.zeros(mb["loss_mask"].shape[0]),
            torch.arange(mb["loss_mask"].shape[0]),
            mb["loss_mask"],
            params=AdvantageParams(gamma=0.9, lam=0.8),
            token_rewards=mb["token_rewards"],
            values=v,
        )
        for mb, v in zip(mbs, values, strict=True)
    ]
    stats = sum((moments(a, mb["loss_mask"]) for a, mb in zip(raw, mbs, strict=True)), torch.zeros(3, dtype=D))
    for mb, a in zip(mbs, raw, strict=True):
        torch.testing.assert_close(mb["advantages"], whiten(a, mb["loss_mask"], stats).float())
        torch.testing.assert_close(mb["returns"], (a + mb["old_values"]) * (mb["loss_mask"] > 0))
        assert (mb["advantages"][mb["loss_mask"] == 0] == 0).all()  # prompt and observation tokens


def test_critic_checkpoint_resumes_its_weights_and_optimizer(cfg, mesh, tmp_path):
    per_rank, count, _ = plan(cfg)
    trained = learner(cfg, cfg.rollout.model, mesh)
    for _ in range(2):
        trained.train_minibatch(per_rank, count, FIELDS)
    run = Path(tmp_path) / "run"
    (run / CHECKPOINTS_DIR).mkdir(parents=True)
    (run / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    final = run / CHECKPOINTS_DIR / "step_000002"
    staging = checkpoint.staging_dir(final)
    assert trained.save(str(staging)) == 2
    checkpoint.publish(staging, final, {})
    assert (final / CRITIC_DIR / "dcp").is_dir()

    resumed = learner(cfg, cfg.rollout.model, mesh)
    mbs = trained._microbatches(per_rank, count, FIELDS)
    fresh = resumed.critic.values(mbs)
    assert resumed.load(str(final)) == 2
    want = trained.critic.values(mbs)
    assert not torch.equal(fresh[0], want[0])  # the load changed something
    for a, b in zip(resumed.critic.values(mbs), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # `asyncrl export RUN --step 2`: the policy's folder, and the critic's beside it, which
    # transformers loads to the same values and a later run's algo.critic.model takes back.
    from transformers import AutoModelForTokenClassification

    from asyncrl.control.export import export_checkpoint

    assert export_checkpoint(run, step=2) == run / "hf" / "step_2"
    exported = run / "hf" / "step_2-critic"
    plain = AutoModelForTokenClassification.from_pretrained(exported, dtype=torch.float32)
    assert plain.config.num_labels == 1 and plain.score.weight.abs().sum() > 0  # the trained head, not a fresh one
    again = Critic.load(cfg, str(exported), mesh, device=torch.device("cpu"))  # algo.critic.model unset
    for a, b in zip(again.values(mbs), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    trained.train_minibatch(per_rank, count, FIELDS)
    resumed.train_minibatch(per_rank, count, FIELDS)  # equal only if the moments and schedule came back
    for a, b in zip(resumed.critic.values(mbs), trained.critic.values(mbs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_without_a_critic_is_refused(cfg, mesh, tmp_path):
    actor = learner(cfg, cfg.rollout.model, mesh)
    with pytest.raises(ValueError, match="holds no critic"):
        actor.critic.load_state(tmp_path, rank=0)


def test_values_are_shifted_to_the_action_position(cfg, mesh):
    """V_t depends on input_ids[:t] only: changing token t leaves V_0..V_t as they are."""
    critic = learner(cfg, cfg.rollout.model, mesh).critic
    with torch.no_grad():
        for p in critic.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        a = torch.tensor([[1, 5, 9, 14, 20, 7]])
        b = a.clone()
        b[0, 3] = 21
        va, vb = token_values(critic.model, {"input_ids": a}), token_values(critic.model, {"input_ids": b})
    assert va[0, 0] == 0 and torch.equal(va[0, :4], vb[0, :4]) and not torch.equal(va[0, 4:], vb[0, 4:])


def test_a_diverged_critic_stops_the_step_before_the_policy_takes_its_nan(cfg, mesh):
    """NaN values would make every advantage NaN and the policy's AdamW step would write NaN
    into its weights (even at lr 0: 0 * NaN); the step stops first, with the reason."""
    actor = learner(cfg, cfg.rollout.model, mesh)
    per_rank, count, _ = plan(cfg)
    with torch.no_grad():
        for p in actor.critic.model.parameters():
            p.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="the critic diverged"):
        actor.train_minibatch(per_rank, count, FIELDS)
    ids = torch.as_tensor(np.stack([s["input_ids"] for s in per_rank[0]]))
    assert torch.isfinite(actor.model(input_ids=ids).logits).all()


def test_a_non_finite_critic_gradient_is_not_stepped_into_its_weights(cfg, mesh):
    critic = learner(cfg, cfg.rollout.model, mesh).critic
    per_rank, count, _ = plan(cfg)
    mbs = learner(cfg, cfg.rollout.model, mesh)._microbatches(per_rank, count, FIELDS)
    critic.prepare(mbs, critic.values(mbs))
    mbs[0]["returns"][mbs[0]["loss_mask"] > 0] = float("inf")
    with pytest.raises(FloatingPointError, match="the critic's gradient norm is"):
        critic.train(mbs)
    assert all(torch.isfinite(v).all() for v in critic.values(mbs))


def test_a_family_without_a_token_classifier_is_refused_by_name(cfg, mesh, tmp_path):
    """OLMo-2 (like Granite and Gemma 3) has no *ForTokenClassification in transformers: the run
    is refused before anything starts (runtime calls the check) and the loader says the same,
    rather than failing in every learner after Ray and the engines are up."""
    olmo = write_tiny_model(tmp_path / "olmo2", arch="olmo2")
    with pytest.raises(ConfigError, match=r"algo\.critic: the value model .* is a 'olmo2'"):
        check_value_model_family(str(olmo))
    with pytest.raises(ConfigError, match=r"'olmo2', a family transformers has no \*ForTokenClassification"):
        load_value_model(str(olmo), mesh, device=torch.device("cpu"), dtype="float32")
    check_value_model_family(cfg.rollout.model)  # a Llama: accepted
