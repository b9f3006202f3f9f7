"""What a training step hands back: per rank to the group, and from the group to the loop.

    result = group.train_step(minibatches)     # StepResult
    state.version = result.version             # the policy version is a field, not a metric

Kept free of torch so the control loop can name these types without importing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.types import MetricValue


@dataclass(frozen=True)
class RankStepResult:
    """One rank's report for one mini-batch's optimizer step (LearnerActor.train_minibatch)."""

    metrics: dict[str, MetricValue]
    """The loss metrics of the rank's real micro-batches, merged, already floats."""
    grad_norm: float
    lr: float
    """The learning rate the step used (before the scheduler advanced)."""
    version: int
    """The rank's policy version after the step."""
    tokens: int
    """Real tokens in the rank's share of the mini-batch."""
    padded_tokens: int
    """Tokens the real micro-batches occupy, padding included."""
    microbatches: int
    padding_microbatches: int
    """Empty micro-batches run only to match the other ranks' collectives."""
    seconds_prepass: float
    seconds_forward_backward: float
    seconds_optimizer: float


@dataclass(frozen=True)
class StepResult:
    """One LearnerGroup.train_step: the policy version it reached and its metrics."""

    version: int
    """The policy version after the step's last mini-batch (optimizer steps taken, plus any
    renumbering by set_version)."""
    metrics: dict[str, float]
    """learner/*, loss/*, time/learner_* and the like, one float each (asyncrl.monitor.metrics)."""
