"""`asyncrl generate`: join a running job as one more generator, from any process.

    asyncrl generate --redis redis://127.0.0.1:PORT/0 --run demo [--max-groups 100]

Everything comes from the job's Redis: the resolved config and model path (the trainer
writes them at start), the current weights location and version (the generator polls it
and loads newer weights itself), and admission (so an extra generator never pushes the
job past its staleness budget). The generator heartbeats while it runs and removes itself
on a clean exit (SIGINT/SIGTERM or --max-groups reached); if it dies instead, its
heartbeat goes stale and its in-flight prompts wait in Redis for a generator of the same
id. Weights are read from the location the trainer publishes to (/dev/shm on the
trainer's machine), so a generator on another machine needs that path shared.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading

from asyncrl.config import ConfigError, config_from_dict

log = logging.getLogger(__name__)


def job_config(queue):
    """The running job's config and model path, read from its state hash."""
    state = queue.state()
    if "config" not in state or "model_path" not in state:
        raise ConfigError(
            f"run {queue.run!r} has no config in Redis: is its trainer running (asyncrl train) on this Redis?"
        )
    return config_from_dict(json.loads(state["config"])), str(state["model_path"])


def run_elastic_generator(redis_url: str, run: str, *, password: str | None = None,
                          generator_id: str | None = None, max_groups: int | None = None,
                          poll_s: float = 1.0) -> dict:
    """Generate for `run` until stopped (or `max_groups` produced); return the final stats."""
    from asyncrl.queue import RolloutQueue
    from asyncrl.rollout.generator import GeneratorActor

    queue = RolloutQueue.connect(redis_url, run, password=password, consumer="elastic-probe")
    try:
        cfg, model_path = job_config(queue)
    finally:
        queue.close()
    generator_id = generator_id or f"elastic-{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    gen = GeneratorActor(cfg, model_path=model_path, generator_id=generator_id, redis_url=redis_url,
                         run=run, password=password, autostart=True)
    log.info("%s joined run %r (model %s)", generator_id, run, model_path)
    try:
        while not stop.wait(poll_s):
            stats = gen.stats()
            if max_groups is not None and stats["groups"] >= max_groups:
                break
        stats = gen.stop()  # drain in-flight groups, then leave the job
        log.info("%s leaving run %r after %d groups", generator_id, run, stats["groups"])
        return stats
    finally:
        gen.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
