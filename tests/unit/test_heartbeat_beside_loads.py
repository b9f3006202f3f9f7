"""A generator's heartbeat goes on while a weight load it polled for waits: an evaluation holds
the engine's update lock while its rollouts run (up to control.eval_timeout_s), and a generator
whose beats stopped meanwhile would be killed by the watchdog as hung.

.venv/bin/python -m pytest tests/unit/test_heartbeat_beside_loads.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from asyncrl.rollout.heartbeat import Heartbeat


class Beats:
    """RunState's heartbeat as the Heartbeat writes it."""

    def __init__(self) -> None:
        self.beats: list[str] = []

    def heartbeat(self, generator_id: str, beat: object) -> None:
        self.beats.append(generator_id)


class HeldLoad:
    """A watcher whose poll found newer weights and waits for the update lock (held elsewhere)."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock, self.polls = lock, 0

    async def poll(self) -> None:
        self.polls += 1
        async with self.lock:
            pass


def test_beats_go_on_while_a_polled_load_waits_for_the_update_lock(monkeypatch):
    monkeypatch.setattr("asyncrl.rollout.heartbeat.HEARTBEAT_S", 0.01)
    beats = Beats()

    async def main() -> HeldLoad:
        lock = asyncio.Lock()
        await lock.acquire()  # an evaluation's rollouts run
        weights = HeldLoad(lock)
        record = SimpleNamespace(outdated=lambda: False)
        beat = Heartbeat(beats, "gen-0", weights, record, report=lambda: SimpleNamespace(heartbeat=lambda: {}))  # type: ignore[arg-type]
        task = asyncio.ensure_future(beat.run())
        for _ in range(500):
            if len(beats.beats) >= 5:
                break
            await asyncio.sleep(0.01)
        lock.release()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return weights

    weights = asyncio.run(main())
    assert len(beats.beats) >= 5, beats.beats  # not one beat while the load waited
    assert weights.polls == 1  # one poll in flight, not one more per beat
