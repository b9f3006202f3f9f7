"""Generators that stopped making progress: restart the hung ones, and tell whether any can run.

    dog = GeneratorWatchdog(rt.generators, rt.run_state, timeout_s=cfg.rollout.heartbeat_timeout_s)
    dog.check()           # while the trainer waits for data: kill (so Ray restarts) the hung ones
    dog.runnable()        # ["gen-0 (RESTARTING)", "elastic-3 (heartbeat 2 s ago)"] or [] if none can

A generator heartbeats every second from its own event loop. One whose last heartbeat is
older than `timeout_s` (a wedged engine, a SIGSTOPped process, a swapping host) is killed
through Ray, which restarts it (generators have max_restarts=-1); the successor reaps the
old engine processes and re-issues the prompts its predecessor had admitted, so nothing is
lost and nothing is trained twice. A successor gets `timeout_s` to come up before it can be
judged hung itself, and an actor Ray is still (re)creating is never killed. Heartbeats
could not be written while Redis was down: their age counts from when it came back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from asyncrl.control.cluster import STARTING, actor_state

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from asyncrl.queue import RunState
    from asyncrl.queue.readback import Heartbeat

log = logging.getLogger(__name__)


class GeneratorWatchdog:
    def __init__(self, generators: list, run_state: RunState, timeout_s: float, reward_failure_alert: float = 0.5):
        self.generators = generators  # the run's own actors, gen-0 .. gen-N-1 (a live list)
        self.run_state = run_state
        self.timeout_s = timeout_s
        self.reward_failure_alert = reward_failure_alert
        self._rewards_failing: dict[str, bool] = {}
        self.restarts: dict[str, int] = {}
        self._starting_at: dict[str, float] = {}
        self._blocked: dict[str, str | None] = {}

    def _own(self) -> dict[str, ActorHandle]:
        return {f"gen-{i}": handle for i, handle in enumerate(self.generators)}

    def check(self) -> list[str]:
        """Kill every own generator whose heartbeat is older than the timeout; return their ids."""
        import ray

        now, killed = time.time(), []
        beats = self.run_state.generators()
        for gid, handle in self._own().items():
            beat = self._beat(beats.get(gid))
            if beat is None or now - beat <= self.timeout_s:
                continue
            if now - self._starting_at.get(gid, float("-inf")) <= self.timeout_s:
                continue  # a successor coming up has not had its first beat yet
            if actor_state(handle)[0] != "ALIVE":
                self._starting_at[gid] = now  # Ray is (re)creating it: judge it once it is up
                continue
            log.warning(
                "%s: no heartbeat for %.0f s (rollout.heartbeat_timeout_s=%g): killing it; Ray restarts it "
                "and the successor re-issues the prompts it had admitted",
                gid,
                now - beat,
                self.timeout_s,
            )
            ray.kill(handle, no_restart=False)
            self._starting_at[gid] = now
            self.restarts[gid] = self.restarts.get(gid, 0) + 1
            killed.append(gid)
        return killed

    def _beat(self, info: Heartbeat | None) -> float | None:
        """A heartbeat's time, or when Redis last came back if that is later."""
        return None if info is None else max(info.heartbeat, self.run_state.retry.recovered_at)

    def news(self, beats: dict[str, Heartbeat]) -> list[str]:
        """Warnings the user needs from the generators' heartbeats, each said once: a generator
        that stopped admitting work (weights it cannot load), one whose rewards mostly fail
        (above monitor.alert_reward_failure_rate), and when either is over. Their own logs stay
        in Ray's worker logs, out of the console."""
        out = []
        for gid, info in beats.items():
            out += self._reward_news(gid, info)
            blocked = info.blocked
            if blocked != self._blocked.get(gid):
                if blocked:
                    out.append(f"{gid} stopped admitting work: {blocked}")
                elif gid in self._blocked:
                    out.append(f"{gid} admits work again")
                self._blocked[gid] = blocked
        return out

    def _reward_news(self, gid: str, info: Heartbeat) -> list[str]:
        rate = info.reward_failure_rate
        if rate is None:
            return []
        failing = rate > self.reward_failure_alert
        if failing == self._rewards_failing.get(gid, False):
            return []
        self._rewards_failing[gid] = failing
        if not failing:
            return [f"{gid}: rewards score again ({rate:.0%} of the latest failed)"]
        last = info.reward_last_failure[:300]
        return [
            f"{gid}: {rate:.0%} of its latest reward scorings failed (> monitor.alert_reward_failure_rate="
            f"{self.reward_failure_alert:g}); the last: {last} (is the verifier or reward model down?)"
        ]

    def runnable(self) -> list[str]:
        """Generators that can still produce data, each with why: own actors alive or being
        (re)started by Ray, and elastic ones whose heartbeat is fresh."""
        now, out = time.time(), []
        for gid, handle in self._own().items():
            state = actor_state(handle)[0]
            if state == "ALIVE" or state in STARTING:
                out.append(f"{gid} ({state})")
        own = set(self._own())
        for gid, info in self.run_state.generators().items():
            beat = self._beat(info)
            if gid not in own and beat is not None and now - beat <= self.timeout_s:
                out.append(f"{gid} (heartbeat {now - beat:.0f} s ago)")
        return out
