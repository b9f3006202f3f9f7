"""What a generator reports about itself: a typed snapshot of its counts, and its recent rate.

    snap = gen.snapshot()            # GeneratorStats (raises GeneratorFailed if its loop died)
    snap.groups, snap.weights_blocked
    snap.as_dict()                   # what gen.stats() returns: a plain dict across Ray
    snap.heartbeat()                 # the part the trainer's console and watchdog read from Redis

Each part of a generator counts what it does itself (rollout/production.py: admission,
groups put, re-issues; rollout/scoring.py: reward failures; rollout/watcher.py: weight loads);
GeneratorStats.read() reads them into one snapshot, so no part writes another's counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from asyncrl.rollout.engine import RolloutEngine
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.production import Production
from asyncrl.rollout.watcher import WeightWatcher

RATE_WINDOW_S = 10.0
"""tokens_per_s in stats() and the heartbeat is the rate over about this long."""


@dataclasses.dataclass(frozen=True)
class GeneratorStats:
    """One generator's counts since it started (this incarnation), and its state now."""

    groups: int
    """Groups put into the queue."""
    samples: int
    tokens: int
    """Response tokens of the groups put."""
    prompts_skipped: int
    """Drawn prompts longer than rollout.max_prompt_tokens (never admitted)."""
    reward_errors: int
    """Reward calls that raised or returned a non-number (the sample scored as failed, not fatal)."""
    reward_timeouts: int
    """Reward calls that ran past their timeout (likewise)."""
    reward_threads_hung: int
    reward_failure_rate: float | None
    """Failed share of the latest reward scorings (None before there are enough)."""
    reward_last_failure: str
    """The latest failure's message (it names the reward), "" if none."""
    """Threads still running an abandoned (timed-out) reward call."""
    group_errors: int
    """Rollouts that failed (engine trouble) and were re-issued."""
    aborted: int
    """Of those, rollouts a request abort tore (an engine rebuild)."""
    reissued: int
    """A crashed predecessor's admitted prompts taken over at start."""
    dropped_uniform: int
    """Finished groups whose rewards all tied, dropped instead of put (rollout.drop_uniform_groups)."""
    weight_updates: int
    weight_update_errors: int
    admission_calls: int
    admission_s: float
    """Seconds spent in admission calls (admission_s / admission_calls: the cost of one)."""
    version: int
    """The weight version the engine runs."""
    inflight: int
    """Groups generating or waiting to be put."""
    tokens_per_s: float
    """Over the last RATE_WINDOW_S (see TokenRate)."""
    generator_id: str
    weights_blocked: str | None
    """Why the generator admits nothing (announced weights failed to load), or None."""

    @classmethod
    def read(
        cls,
        generator_id: str,
        engine: RolloutEngine,
        production: Production,
        groups: GroupMaker,
        weights: WeightWatcher,
        rate: TokenRate,
    ) -> GeneratorStats:
        """One generator's parts, read now (``rate`` notes the tokens so far)."""
        made = production.counts
        return cls(
            groups=made.groups,
            samples=made.samples,
            tokens=made.tokens,
            prompts_skipped=made.prompts_skipped,
            reward_errors=groups.scorer.errors,
            reward_timeouts=groups.scorer.timeouts,
            reward_threads_hung=groups.scorer.pool.hung,
            reward_failure_rate=groups.scorer.failure_rate,
            reward_last_failure=groups.scorer.last_failure,
            group_errors=made.group_errors,
            aborted=made.aborted,
            reissued=made.reissued,
            dropped_uniform=made.dropped_uniform,
            weight_updates=weights.updates,
            weight_update_errors=weights.update_errors,
            admission_calls=made.admission_calls,
            admission_s=made.admission_s,
            version=engine.version,
            inflight=len(production.tasks),
            tokens_per_s=rate.update(made.tokens),
            generator_id=generator_id,
            weights_blocked=weights.blocked,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def heartbeat(self) -> dict[str, Any]:
        """The heartbeat's payload (RunState.heartbeat): what the trainer's console shows."""
        return {
            "version": self.version,
            "groups": self.groups,
            "tokens_per_s": self.tokens_per_s,
            "inflight": self.inflight,
            # why it admits nothing, if so: the trainer shows it on its console
            "blocked": self.weights_blocked,
            # failed rewards so far: the trainer sums them into rollout/reward_*
            "reward_errors": self.reward_errors,
            "reward_timeouts": self.reward_timeouts,
            # the trainer's console and the dashboard alert on it (monitor.alert_reward_failure_rate)
            "reward_failure_rate": self.reward_failure_rate,
            "reward_last_failure": self.reward_last_failure,
        }


class TokenRate:
    """Tokens/s over the last RATE_WINDOW_S (an average since start would climb for minutes
    after start-up and hide a slowdown); since start until a window has passed."""

    def __init__(self, started_at: float):
        self.started_at = started_at
        self.samples: deque[tuple[float, int]] = deque()  # (time, tokens so far)

    def update(self, tokens: int) -> float:
        """Note ``tokens`` so far, now; return the recent rate."""
        now = time.time()
        samples = self.samples
        samples.append((now, tokens))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, k0 = samples[0] if now - samples[0][0] >= 1.0 else (self.started_at, 0)
        return (tokens - k0) / max(now - t0, 1e-9)
