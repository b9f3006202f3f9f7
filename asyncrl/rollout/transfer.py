"""NCCL weight transfer into a rollout engine (GPU): vLLM's weight-transfer API, engine side.

    await transfer.begin(engine, inflight)     # pause, layers to the meta device
    await transfer.receive(engine, update_info)
    await transfer.finish(engine, version, inflight, path)   # label, resume
    await transfer.abort(engine)                # after a failed broadcast: layers back, resume

sync/nccl.py drives these through GeneratorActor.transfer_*; the engine was built with
``weight_transfer_config`` (rollout/sampling.py: engine_args' ``weight_transfer``). Between
``begin`` and ``finish``/``abort`` the engine's layers are on the meta device, so it stays paused.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)


def world_size(engine: RolloutEngine) -> int:
    return engine.llm.vllm_config.parallel_config.world_size


async def init(engine: RolloutEngine, init_info: dict) -> None:
    await engine.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})


async def begin(engine: RolloutEngine, inflight: str) -> None:
    """Pause (keep requests) and start an update; from here until ``finish`` or ``abort`` the
    layers are on the meta device, so the engine stays paused."""
    await engine.pause(clear_cache=inflight == "recompute")
    try:
        await engine.llm.start_weight_update()
    except BaseException:
        await engine.llm.resume_generation()  # nothing was touched: go on with the old weights
        raise


async def receive(engine: RolloutEngine, update_info: dict) -> None:
    await engine.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})


async def finish(engine: RolloutEngine, version: int, inflight: str, path: str | None = None) -> None:
    """Finish the update, label ``version``, resume; ``path`` (the same weights as a file)
    becomes the last good weights a failed update restores."""
    await engine.llm.finish_weight_update()
    await engine.set_version(version)
    if path is not None and os.path.isfile(path):
        engine.last_good_path = engine.keep_copy(path)
    if inflight == "recompute":
        await engine.llm.reset_prefix_cache(reset_running_requests=True)
    await engine.llm.resume_generation()


async def abort(engine: RolloutEngine, timeout_s: float = 60.0) -> None:
    """After a failed transfer: put every layer back from the meta device, end the worker's
    update and resume on the weights it ran before (the caller then loads the file). A
    worker that does not answer (stuck in a collective its peer left) gets the engine rebuilt."""
    try:
        await asyncio.wait_for(engine.llm.collective_rpc("asyncrl_abandon_transfer"), timeout_s)
    except Exception as e:
        log.error("abandoning a failed weight transfer failed (%s): rebuilding the engine", e)
        await engine.rebuild()
        return
    if not engine.llm.errored:
        await engine.llm.resume_generation()
