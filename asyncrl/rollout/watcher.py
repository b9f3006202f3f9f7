"""Loading published weights into a generator's engine, pushed or polled, and what happens when
they cannot be loaded.

    watcher = WeightWatcher(engine, run_state, cfg, "gen-0", "demo")
    await watcher.update(location, 3)               # a push from the trainer (or the poll below)
    await watcher.poll()                            # newer published weights than the engine's? load them
    watcher.blocked                                 # why admission is closed, or None
    watcher.updates, watcher.update_errors          # loads so far, and failed ones

A version that fails to load closes admission (``blocked``): generating on the old weights
would only make groups that are dropped as stale. The poll tries the same failed version
again only after WEIGHTS_RETRY_S, since each attempt pauses the engine; a load that succeeds
opens admission again. A failed load may rebuild the engine: the caller, who owns the
engine's crash record, compares ``engine.engine_pids`` (rollout/recovery.py: EngineRecord.refresh).
"""

from __future__ import annotations

import asyncio
import logging
import time

from asyncrl.config import Config
from asyncrl.queue.runstate import RunState
from asyncrl.rollout.engine import RolloutEngine, WeightLoadError
from asyncrl.sync import objstore
from asyncrl.types import WeightLocation

log = logging.getLogger(__name__)

WEIGHTS_RETRY_S = 30.0
"""A published version that failed to load is tried again after this long (not every poll)."""


class WeightWatcher:
    """Keeps one engine on the newest weights it can load, and says when it cannot."""

    def __init__(
        self,
        engine: RolloutEngine,
        run_state: RunState,
        cfg: Config,
        generator_id: str,
        run: str,
    ):
        self.engine, self.run_state, self.cfg = engine, run_state, cfg
        self.generator_id, self.run = generator_id, run
        self.updates = 0  # versions loaded (a push, a poll or an NCCL transfer)
        self.update_errors = 0
        self.failed: tuple[WeightLocation, int, float] | None = None  # (location, version, when)
        self.blocked: str | None = None  # why admission is closed: announced weights failed to load

    @property
    def tag(self) -> str:
        """Names this generator's fetched weight files (sync/objstore.py)."""
        return f"{self.run}-{self.generator_id}"

    def close(self) -> None:
        """Delete the fetched files parked for reuse (the generator is stopping)."""
        objstore.drop_spares(self.cfg.sync.shm_dir, self.tag)

    def note_failed(self, location: WeightLocation, version: int) -> None:
        self.failed = (location, version, time.monotonic())

    def note_transferred(self) -> None:
        """Weights arrived another way (an NCCL transfer, rollout/transfer.py): admission opens."""
        self.updates += 1
        self.blocked = None

    async def update(self, location: WeightLocation, version: int) -> dict:
        """Fetch (an object-store location to a local file first, see sync/objstore.py) and load
        ``version``; raises WeightLoadError / OSError with admission closed if it cannot."""
        if version <= self.engine.version:
            return {"version": self.engine.version, "skipped": True}
        path, t0 = None, time.perf_counter()
        try:
            path = await asyncio.to_thread(objstore.fetch, location, version, self.cfg.sync.shm_dir, self.tag)
            fetch_s = time.perf_counter() - t0
            info = await self.engine.load_weights(path, version, inflight=self.cfg.sync.inflight)
        except (WeightLoadError, OSError) as e:
            self.update_errors += 1
            if self.blocked is None:
                log.error(
                    "%s: stopped admitting work: cannot load the announced weights v%d (%s): %s",
                    self.generator_id,
                    version,
                    location,
                    e,
                )
            self.blocked = f"cannot load the announced weights v{version} ({location}): {e}"
            raise
        finally:
            objstore.discard(path, location, self.tag)
        if self.blocked is not None:
            log.warning("%s: weights v%d loaded; admitting work again", self.generator_id, version)
        self.blocked = None
        if not info.get("skipped"):
            self.updates += 1
        return dict(info, fetch_s=fetch_s)

    async def poll(self) -> None:
        """Load newer published weights if nobody pushed them (elastic generators)."""
        location, version = await asyncio.to_thread(self.run_state.weights)
        if location is None or version <= self.engine.version or not self._may_try(location, version):
            return
        try:
            await self.update(location, version)
        except (WeightLoadError, OSError):
            self.note_failed(location, version)
            raise

    def _may_try(self, location: WeightLocation, version: int) -> bool:
        """Not the weights that just failed to load: each failed attempt pauses the engine."""
        failed = self.failed
        return failed is None or failed[:2] != (location, version) or time.monotonic() - failed[2] > WEIGHTS_RETRY_S
