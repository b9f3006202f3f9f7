"""The loop's own per-step metrics: where the step's time went, the queue, staleness, and the
generators as the run's state hash reports them (the learner's come in its StepResult)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.monitor.metrics import is_known, staleness_summary
from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY

if TYPE_CHECKING:
    from asyncrl.control.watchdog import GeneratorWatchdog
    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.queue.readback import Heartbeat
    from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one trainer step, by phase."""

    wait_data: float
    train: float
    sync: float
    """Publishing the weights (the export, and in the synchronous modes the engines' load)."""
    apply: float
    """The engines' load of the last publish that finished."""
    step: float


def step_metrics(
    groups: list[RolloutGroup],
    staleness: list[int],
    times: StepTimes,
    *,
    version: int,
    max_staleness: int,
    queue: RolloutQueue,
    run_state: RunState,
    watchdog: GeneratorWatchdog,
    dropped_uniform: int = 0,
) -> dict[str, float]:
    """time/*, sync/*, queue/*, staleness/*, throughput/*, rollout/* and generator/* after a step
    that reached policy `version` (its watchdog news are logged here too). ``dropped_uniform``:
    groups the generators dropped as uniform while this step's data was collected."""
    counters = run_state.counters()
    gen_tokens = sum(g.num_tokens for g in groups)
    out = {
        "time/wait_data": times.wait_data,
        "time/train": times.train,
        "time/sync": times.sync,
        "time/step": times.step,
        "sync/seconds": times.sync,
        "sync/apply_s": times.apply,
        "queue/depth": float(queue.depth()),
        "queue/pending": float(queue.pending()),
        "queue/dropped_stale": float(counters.get("dropped_stale", 0)),
        "queue/dead_lettered": float(counters.get("dead_lettered", 0)),
        "queue/stale_reissued": float(counters.get("stale_reissued", 0)),
        "queue/stale_abandoned": float(counters.get("stale_abandoned", 0)),
        "rollout/dropped_uniform_groups": float(counters.get("dropped_uniform", 0)),
        "rollout/dropped_uniform_groups_step": float(max(dropped_uniform, 0)),
        "sync/load_failures": float(counters.get("weight_load_failures", 0)),
        "generators/restarts": float(counters.get("generator_restarts", 0)),
        # The trainer's own client: what it lived through (a resumed trainer counts from 0).
        "queue/outages": float(run_state.retry.outages),
        "queue/outage_s": float(run_state.retry.outage_s),
        "learner/version": float(version),
        "throughput/samples_per_s": sum(len(g.samples) for g in groups) / max(times.step, 1e-9),
        "throughput/step_tokens_per_s": gen_tokens / max(times.step, 1e-9),
    }
    for kind in ("dropped", "trained"):  # are the dropped groups the long ones?
        if counters.get(f"{kind}_samples", 0):
            mean = counters.get(f"{kind}_response_tokens", 0) / counters[f"{kind}_samples"]
            out[f"queue/{kind}_response_len_mean"] = mean
    # A label newer than the learner's version (negative staleness) is counted apart rather
    # than hidden as 0. A resume can no longer make one: it numbers the restored weights past
    # every version the crashed run announced (asyncrl.control.restart), so this stays 0
    # unless versions are reused again, which is what it is there to show.
    out["staleness/ahead"] = float(sum(1 for s in staleness if s < 0))
    out.update(staleness_summary([max(0, s) for s in staleness], max_staleness))
    gens = run_state.generators()
    for news in watchdog.news(gens):
        log.warning(news)
    for gid, beat in gens.items():
        out[f"generator/{gid}/lag"] = float(version - beat.version)
    out.update(reward_failures(gens))
    out.update(episode_counts(groups))
    tps = [beat.tokens_per_s for beat in gens.values()]
    if tps:
        out["throughput/gen_tokens_per_s"] = sum(tps)
    return out


def reward_failures(gens: dict[str, Heartbeat]) -> dict[str, float]:
    """rollout/reward_errors and rollout/reward_timeouts: the generators' heartbeat counts so
    far, summed over the generators alive now (heartbeats are checked as they are read:
    asyncrl.queue.readback)."""
    return {
        "rollout/reward_errors": float(sum(b.reward_errors for b in gens.values())),
        "rollout/reward_timeouts": float(sum(b.reward_timeouts for b in gens.values())),
    }


def episode_counts(groups: list[RolloutGroup]) -> dict[str, float]:
    """rollout/<name> for each count multi-turn environments report per episode (tool calls,
    tool errors...), summed over this step's groups; only the names the catalogue knows."""
    totals: dict[str, int] = {}
    for g in groups:
        counts = g.metadata.get(EPISODE_COUNTS_KEY)
        for name, n in (counts if isinstance(counts, dict) else {}).items():
            totals[name] = totals.get(name, 0) + _count(n)
    return {f"rollout/{name}": float(n) for name, n in totals.items() if is_known(f"rollout/{name}")}


def _count(value: object) -> int:
    """A metadata count, 0 when absent or not a count."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
