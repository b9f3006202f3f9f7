"""The root of the config tree and the rules that span sections."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.algo import AlgoConfig
from asyncrl.config.base import ADVANTAGE_ESTIMATORS, GROUP_BASELINE_ESTIMATORS, ConfigError, Section
from asyncrl.config.critic import check_critic_vocabulary
from asyncrl.config.rollout import RolloutConfig
from asyncrl.config.services import MonitorConfig, QueueConfig
from asyncrl.config.training import ControlConfig, LearnerConfig, SyncConfig

log = logging.getLogger("asyncrl.config")


class Config(Section):
    """The whole run: one section per component, validated once at start-up."""

    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-safe values (tuples as lists), the loss as {type: ..., ...}."""
        return self.model_dump(mode="json")

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        validate(self)
        return self


def validate(cfg: Config) -> None:
    """Cross-section rules. Raises ConfigError naming the fields; may switch on required features."""
    a, r, q, lr, s, c = cfg.algo, cfg.rollout, cfg.queue, cfg.learner, cfg.sync, cfg.control
    if a.advantage_estimator in GROUP_BASELINE_ESTIMATORS and r.n_samples < 2 and a.policy_loss.type != "cross_entropy":
        raise ConfigError(
            f"rollout.n_samples={r.n_samples}: algo.advantage_estimator={a.advantage_estimator!r} "
            f"measures each sample against the other samples of its prompt, so a group of one has no "
            f"baseline, every advantage is 0 and nothing is trained. Use rollout.n_samples >= 2, or "
            f"algo.advantage_estimator='reinforce_pp' (baseline over the whole batch)."
        )
    if a.advantage_estimator == "maxrl":
        why = _negative_rewards_possible(r)
        if why:
            log.warning(
                "algo.advantage_estimator='maxrl' gives advantage 0 to every group whose mean reward is <= 0 "
                "(it divides by the mean, which must be a success rate), and %s: such groups will not train. "
                "MaxRL is meant for rewards in [0, 1]; consider grpo or dr_grpo.",
                why,
            )
    _dapo_rules(a, r)
    if c.eval_every > c.total_steps:
        log.warning(
            "control.eval_every=%d is past control.total_steps=%d: no evaluation will run",
            c.eval_every,
            c.total_steps,
        )
    if a.critic.enabled and r.teacher is not None:
        raise ConfigError(
            "algo.critic with rollout.teacher: the teacher's term is added to the advantages on the driver, "
            "which a critic's advantages (computed in the learner) would not carry; use one or the other"
        )
    if a.critic.enabled:
        check_critic_vocabulary(a.critic, r.model)
    if a.critic.enabled and lr.context_parallel > 1:
        raise ConfigError(
            f"algo.critic with learner.context_parallel={lr.context_parallel}: the critic's value model runs "
            "whole rows on each rank; split rows are not built for it yet. Use learner.context_parallel=1"
        )
    if r.env == "verifiers" and c.eval_prompts and c.eval_every:
        # Its episodes are its taskset's tasks, found by the index make_prompt gives them: a
        # prompt read from a file names no task, so every held-out prompt would fail.
        raise ConfigError(
            f"control.eval_prompts={c.eval_prompts!r}: a verifiers environment plays the tasks of its own "
            f"taskset, so evaluation draws control.eval_size of them from it; unset control.eval_prompts"
        )
    if a.correction.tis_auto and not r.logprobs:
        a.correction.tis = "none"  # the default yields to engine logprobs turned off on purpose
    if (
        c.mode == "async"
        and c.max_staleness > 0
        and not a.correction.enabled
        and not a.rollout_anchored
        and a.policy_loss.type != "cross_entropy"
    ):
        log.warning(
            "control.mode='async' with control.max_staleness=%d trains on data up to that many versions old, "
            "and no off-policy correction is on (algo.correction.tis='none', no mask): the stale data is "
            "trained as if on-policy. Set algo.correction.tis=%s (capped at algo.correction.tis_cap) or a mask.",
            c.max_staleness,
            "'sequence'" if a.policy_loss.sequence_level else "'token'",
        )
    if a.needs_rollout_logprobs and not r.logprobs:
        log.warning(
            "algo.correction / algo.rollout_kl_coef / algo.policy_loss=%r need engine logprobs: "
            "setting rollout.logprobs=true",
            a.policy_loss.type,
        )
        r.logprobs = True
    # Entries stay un-acked until the checkpoint that covers them and count against maxlen;
    # a smaller bound would make generators and trainer wait on each other forever.
    need = c.groups_per_step * (c.checkpoint_every + c.max_staleness + 2)
    if q.maxlen < need:
        raise ConfigError(
            f"queue.maxlen={q.maxlen}: must be >= control.groups_per_step * (control.checkpoint_every + "
            f"control.max_staleness + 2) = {need}, since entries stay queued until a checkpoint acks them"
        )
    if c.groups_per_step % lr.mini_batches_per_step:
        raise ConfigError(
            f"control.groups_per_step={c.groups_per_step} must be divisible by "
            f"learner.mini_batches_per_step={lr.mini_batches_per_step}"
        )
    # Weights are published at the end of the trainer step in which the version reaches a
    # multiple of sync_every; the last mini-batch of a step trains on data up to this old.
    floor = s.sync_every + lr.mini_batches_per_step - 2
    if c.mode == "sync" and floor > 0:
        # The sync mode trains with the bound forced to 0, whatever control.max_staleness
        # says: checked against the configured value, every group would be dropped as stale
        # and the run would wait forever.
        raise ConfigError(
            f"control.mode='sync' trains with a staleness bound of 0 (control.max_staleness is not used), "
            f"which needs sync.sync_every=1 and learner.mini_batches_per_step=1; got sync.sync_every="
            f"{s.sync_every} and learner.mini_batches_per_step={lr.mini_batches_per_step}, whose data is "
            f"{floor} version(s) old when its last mini-batch trains, so every group would be dropped as "
            f"stale. Use control.mode='async' with control.max_staleness >= {floor}, or set both to 1."
        )
    if c.max_staleness < floor:
        raise ConfigError(
            f"control.max_staleness={c.max_staleness} must be >= sync.sync_every + "
            f"learner.mini_batches_per_step - 2 = {floor}: generators only see new weights every "
            f"sync_every optimizer steps, so fresher data cannot exist"
        )
    overlap = (c.max_staleness + 1) // lr.mini_batches_per_step - 1
    if c.mode == "async" and lr.mini_batches_per_step > 1 and overlap < 1:
        log.warning(
            "control.max_staleness=%d with learner.mini_batches_per_step=%d: a step raises the version by %d, "
            "so admission lets generators run only the next step's groups and generation cannot overlap "
            "training. control.max_staleness=%d allows one step ahead.",
            c.max_staleness,
            lr.mini_batches_per_step,
            lr.mini_batches_per_step,
            2 * lr.mini_batches_per_step - 1,
        )
    if c.mode == "async" and r.num_generators < 1:
        raise ConfigError("rollout.num_generators=0: async mode needs at least one generator")


MULTI_TURN_ENVIRONMENTS = ("countdown_chat", "tools", "verifiers")


def _dapo_rules(a: AlgoConfig, r: RolloutConfig) -> None:
    """algo.overlong.soft_penalty against the token budget; rollout.teacher against a loss that
    ignores advantages; rollout.drop_uniform_groups against the estimator (import-path
    environments are checked again by the generator, which knows whether they are multi-turn)."""
    soft = a.overlong.soft_penalty
    if soft is not None:
        if soft.buffer >= r.max_tokens:
            raise ConfigError(
                f"algo.overlong.soft_penalty.buffer={soft.buffer}: must be < rollout.max_tokens={r.max_tokens} "
                f"(the penalty starts buffer tokens before the budget)"
            )
        if r.env in MULTI_TURN_ENVIRONMENTS:
            raise ConfigError(
                f"algo.overlong.soft_penalty is for single-turn environments: rollout.env={r.env!r} is "
                f"multi-turn (rollout.max_tokens bounds each turn, not the trajectory); use algo.overlong.mask"
            )
    if r.teacher is not None and a.policy_loss.type == "cross_entropy":
        raise ConfigError(
            "rollout.teacher with algo.policy_loss.type='cross_entropy': that loss ignores the advantages, "
            "where the teacher's term lives, so the student would only imitate its own samples; use a "
            "policy-gradient loss (ppo, the default)"
        )
    if r.drop_uniform_groups and a.advantage_estimator not in GROUP_BASELINE_ESTIMATORS:
        if a.advantage_estimator in ADVANTAGE_ESTIMATORS:
            raise ConfigError(
                f"rollout.drop_uniform_groups=true drops groups whose rewards tie because a group baseline "
                f"gives them advantage 0; algo.advantage_estimator={a.advantage_estimator!r} has a batch "
                f"baseline, so such groups still train. Use one of {', '.join(GROUP_BASELINE_ESTIMATORS)}."
            )
        log.warning(
            "rollout.drop_uniform_groups=true assumes algo.advantage_estimator=%r gives advantage 0 to a "
            "group whose rewards all tie (a group baseline)",
            a.advantage_estimator,
        )


def _negative_rewards_possible(r: RolloutConfig) -> str | None:
    """Why the configured environment's rewards can be negative, or None when they cannot."""
    if r.env in ("copy", "reverse", "arithmetic"):
        penalty = r.env_kwargs.get("length_penalty", 0.05)
        if isinstance(penalty, (int, float)) and penalty <= 0:
            return None
        return (
            f"rollout.env={r.env!r} subtracts length_penalty={penalty!r} per character of length error, "
            f"so its rewards go below 0"
        )
    if r.env in ("gsm8k", "math"):
        low = min(r.env_kwargs.get("correct_reward", 1.0), r.env_kwargs.get("format_reward", 0.0))
        return None if low >= 0 else f"rollout.env={r.env!r} has a reward of {low!r}"
    if r.env == "code":
        low = min(r.env_kwargs.get("violation_reward", 0.0), 0.0)
        return None if low >= 0 else f"rollout.env='code' has violation_reward={low!r}"
    if r.env == "countdown_chat":
        return "rollout.env='countdown_chat' subtracts 0.05 per character of length error in every turn"
    return f"the rewards of rollout.env={r.env!r} are not known to be >= 0"
