"""RolloutEngine's weights: labelling, in-flight updates, and getting whole after a failed one.

    await engine.load_weights("/dev/shm/asyncrl-demo-v3.safetensors", version=3)   # pause, load, resume
    engine.keep_copy(path)      # the hard-linked copy a failed load restores from

An update pauses with ``mode="keep"`` so requests survive it; ``inflight="recompute"`` also
clears the KV and prefix cache, so every token after the update is computed with the new
weights (SkyRL measured mean |dlogp| 0.87 when stale KV survived); ``"keep"`` finishes running
requests on KV computed by older weights. A load that keeps failing is undone from the last
good weights (or the original checkpoint) before generation resumes, never on half-loaded ones.

``WeightUpdates`` is a part of RolloutEngine (rollout/engine.py), which holds the state below
and rebuilds a broken engine; it is split off so each module stays readable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from asyncrl.rollout.adapters import AdapterSlot

log = logging.getLogger(__name__)


class WeightLoadError(RuntimeError):
    """New weights could not be loaded; the engine still runs the version it reports, or (if even
    those could not be restored) samples nothing until new weights load."""


class WeightUpdates:
    """The weight side of RolloutEngine, whose __init__ sets (and describes) the state below."""

    llm: Any
    version: int
    base_version: int
    closed: str | None
    last_good_path: str | None
    keep_path: str | None
    adapter: AdapterSlot | None
    _requests: set[str]
    _update_lock: asyncio.Lock
    _open: asyncio.Event

    async def rebuild(self) -> None:
        """Replace a broken engine with a fresh one on the last good weights (RolloutEngine's)."""
        raise NotImplementedError

    async def set_version(self, version: int) -> None:
        """Label tokens sampled from now on with ``version``."""
        await self.llm.update_weight_version(str(version))
        self.version = version

    async def pause(self, clear_cache: bool) -> None:
        """pause_generation(mode="keep") without its trailing 20 ms sleep, which only orders
        log output (vLLM's own comment: "not required for correctness") and, paid at every
        publish, was half of an update's pause. The multimodal cache it clears is unused here."""
        core = getattr(self.llm, "engine_core", None)
        if core is None or not hasattr(core, "pause_scheduler_async"):
            await self.llm.pause_generation(mode="keep", clear_cache=clear_cache)
            return
        await core.pause_scheduler_async(mode="keep", clear_cache=clear_cache)

    async def _rpc_load(self, path: str) -> None:
        if self.adapter is not None:  # the file holds the adapter alone
            await self.adapter.load(self.llm, path)
            return
        await self.llm.collective_rpc("asyncrl_load_safetensors", args=(path,))

    async def load_weights(self, path: str, version: int, inflight: str = "recompute", retries: int = 1) -> dict:
        """Pause (keep requests), load ``path``, label ``version``, drop stale caches, resume.

        A failed load is retried; if it keeps failing the last good weights are loaded back
        (or the engine is rebuilt) before resuming, and WeightLoadError is raised: generation
        never resumes on half-loaded weights.
        """
        if inflight not in ("recompute", "keep"):
            raise ValueError(f"inflight={inflight!r}: must be 'recompute' or 'keep'")
        async with self._update_lock:
            if version <= self.version:  # applied while we waited (publish and heartbeat poll race)
                return {"version": self.version, "skipped": True}
            if not os.path.isfile(path):  # e.g. deleted since it was announced: nothing to pause for
                raise WeightLoadError(f"weights file {path} (version {version}) does not exist")
            t0 = time.perf_counter()
            recompute = inflight == "recompute"
            self._open.clear()
            await self.pause(recompute)
            t_pause = time.perf_counter()
            error = None
            try:
                for attempt in range(retries + 1):
                    try:
                        await self._rpc_load(path)
                        error = None
                        break
                    except Exception as e:  # the worker's exception, re-raised by collective_rpc
                        error = e
                        log.warning("weight load %s (v%d) failed, attempt %d: %s", path, version, attempt + 1, e)
                if error is not None:
                    await self._restore_last_good()
                    still = (
                        f"still running version {self.version}"
                        if self.closed is None
                        else f"the engine samples nothing until new weights load: {self.closed}"
                    )
                    raise WeightLoadError(
                        f"loading {path} as version {version} failed after {retries + 1} attempts; {still}: {error}"
                    ) from error
                t_load = time.perf_counter()
                await self.set_version(version)
                self.closed = None
                # With "recompute" the pause already dropped the prefix cache and preempted the
                # running requests (clear_cache), and a paused engine computes no KV, so nothing
                # computed with old weights is left to reset: one engine round trip fewer. With
                # "keep" the running requests hold their blocks, so vLLM cannot reset the cache
                # without preempting them (reset_prefix_cache refuses while blocks are in use);
                # requests from now on carry the new version's cache salt instead (generate).
                self.last_good_path = self.keep_copy(path)
            finally:
                if not self.llm.errored:
                    await self.llm.resume_generation()
                if self.closed is None:
                    self._open.set()
            t1 = time.perf_counter()
            return {
                "version": version,
                "pause_s": t_pause - t0,
                "load_s": t_load - t_pause,
                "total_s": t1 - t0,
                "inflight": inflight,
                "requests_inflight": len(self._requests),
            }

    def keep_copy(self, path: str) -> str:
        """Hard-link ``path`` to ``keep_path`` and return the path that will stay loadable."""
        if self.keep_path is None:
            return path
        tmp = f"{self.keep_path}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.link(path, tmp)
            os.replace(tmp, self.keep_path)
            return self.keep_path
        except OSError as e:  # another filesystem: fall back to the published file itself
            log.warning(
                "cannot keep %s as %s (%s); a failed update restores from the original", path, self.keep_path, e
            )
            return path

    def drop_kept(self) -> None:
        """Delete the kept copy of the last good weights (on shutdown)."""
        if self.keep_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.keep_path)

    def _last_good(self) -> str | None:
        if self.last_good_path is not None and os.path.exists(self.last_good_path):
            return self.last_good_path
        return None

    async def _restore_last_good(self) -> None:
        """Make the model whole again after a failed load: last good file, the original checkpoint
        if that is what ``version`` is, else rebuild the engine. Sets ``closed`` if no weights of
        ``version`` are left to load."""
        try:
            if (path := self._last_good()) is not None:
                await self._rpc_load(path)
                self.closed = None
                return
            if self.adapter is not None:  # the base weights never changed: the zero adapter
                await self.adapter.load_base(self.llm)
            else:
                await self.llm.collective_rpc("asyncrl_reload_checkpoint")  # the original checkpoint
            if self.version != self.base_version:
                self.closed = f"version {self.version}'s weights are gone; it holds version {self.base_version}'s"
            return
        except Exception as e:
            log.error("restoring weights failed (%s): rebuilding the engine", e)
        await self.rebuild()

    async def _load_last_good(self) -> str | None:
        """Bring a fresh engine to ``version``'s weights; why it could not, or None."""
        if self.version == self.base_version:  # what a fresh engine holds already
            if self.adapter is not None:  # in the slot's own folder, which outlives the fresh one's
                try:
                    await self.adapter.load_base(self.llm)
                except Exception as e:
                    return f"rebuilt, but the base model's zero adapter did not load: {e}"
            return None
        path = self._last_good()
        try:
            if path is None:
                raise FileNotFoundError(f"the last good weights file {self.last_good_path} is gone")
            await self._rpc_load(path)
        except Exception as e:
            return f"rebuilt, but version {self.version}'s weights did not load: {e}"
        await self.set_version(self.version)
        return None

    async def weights_sum(self) -> float:
        return (await self.llm.collective_rpc("asyncrl_weights_sum"))[0]
