"""What a generating generator does besides generating: a heartbeat to Redis every HEARTBEAT_S
(the trainer's console and watchdog read it), and newer published weights loaded every
WEIGHTS_POLL_S if nobody pushed them (elastic generators).

    beat = Heartbeat(run_state, "gen-0", weights, engine_record, report=gen.snapshot)
    task = asyncio.ensure_future(beat.run())      # on the generator's loop while it generates; cancel it to stop

A missed beat or a failed load is logged and tried again, never fatal: the watchdog judges a
generator by its beats' age, and the watcher closes admission while announced weights fail
to load (rollout/watcher.py). The poll runs beside the beats, one at a time: a load it starts
may wait minutes for an evaluation's hold on weight updates, and the beats must not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from asyncrl.queue.runstate import RunState
from asyncrl.rollout.recovery import EngineRecord
from asyncrl.rollout.stats import GeneratorStats
from asyncrl.rollout.watcher import WeightWatcher

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
WEIGHTS_POLL_S = 0.1
"""An elastic generator (nobody pushes it weights) checks for a newer version this often: a
trainer doing several steps a second outruns a once-a-second poll by more than the
staleness bound, and every group the generator made would be dropped as stale."""


class Heartbeat:
    """Beats and polls for one generator until cancelled."""

    def __init__(
        self,
        run_state: RunState,
        generator_id: str,
        weights: WeightWatcher,
        engine_record: EngineRecord,
        report: Callable[[], GeneratorStats],
    ):
        self.run_state, self.generator_id = run_state, generator_id
        self.weights, self.engine_record = weights, engine_record
        self.report = report
        """The generator's stats now (raises once its loop died: a dead generator stops beating)."""

    async def run(self) -> None:
        last_beat = 0.0
        # The poll runs beside the beats: a load waits for the engine's update lock, which an
        # evaluation holds while its rollouts run (minutes, at most control.eval_timeout_s), and
        # a generator that stopped beating meanwhile would be killed by the watchdog as hung.
        polling: asyncio.Task | None = None
        try:
            while True:
                try:
                    if time.monotonic() - last_beat >= HEARTBEAT_S:
                        last_beat = time.monotonic()
                        beat = self.report().heartbeat()
                        await asyncio.to_thread(self.run_state.heartbeat, self.generator_id, beat)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # a missed beat is retried next second
                    log.warning("%s: heartbeat failed: %s", self.generator_id, e)
                if polling is None or polling.done():
                    polling = asyncio.ensure_future(self._poll())
                await asyncio.sleep(WEIGHTS_POLL_S)
        finally:
            if polling is not None:
                polling.cancel()

    async def _poll(self) -> None:
        try:
            try:
                await self.weights.poll()
            finally:
                if self.engine_record.outdated():  # a failed load rebuilt the engine: new processes
                    await asyncio.to_thread(self.engine_record.write)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed self-update is retried at the next poll
            log.warning("%s: weights poll failed: %s", self.generator_id, e)
