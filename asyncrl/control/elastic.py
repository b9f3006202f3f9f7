"""`asyncrl generate`: join a running job as one more generator, from any process.

    asyncrl generate --redis redis://127.0.0.1:PORT/0 --run demo [--max-groups 100]

Everything comes from the job's Redis: the resolved config and model path (the trainer
writes them at start; the config without its secrets, so the generator's own Redis URL and
password stand in for the job's), the current weights location and version (the generator polls it
and loads newer weights itself), and admission (so an extra generator never pushes the
job past its staleness budget). The generator heartbeats while it runs and removes itself
on a clean exit (SIGINT/SIGTERM or --max-groups reached); if it dies instead, its
heartbeat goes stale and its in-flight prompts wait in Redis for a generator of the same
id.

Weights are read from the location the trainer announces. On one host that is a file in
/dev/shm. On a multi-node job (sync.backend=object_store) it is an object in the job's Ray
cluster, and so is the model when it is a local directory of the trainer's host: give
``--ray-address ray://HEAD:10001`` and the generator attaches to the cluster through Ray
Client (a driver with no raylet on its own host; nothing is shared but the network), or
``auto``/``HEAD:PORT`` on a host that joined the cluster with ``ray start``. A generator
that cannot load the announced weights stops admitting work and says why
(``stats()["weights_blocked"]``) instead of generating groups that would only be dropped as
stale.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading

from asyncrl.config import ConfigError, config_from_dict, rejoin_config
from asyncrl.control.cluster import probe
from asyncrl.queue import RunState
from asyncrl.rollout.generator import GeneratorActor
from asyncrl.sync.objstore import open_store

log = logging.getLogger(__name__)


def job_config(run_state, *, redis_url: str, password: str | None):
    """The running job's config and model path, read from its state hash. The job publishes it
    without secrets: the Redis URL and password this generator connected with take their place."""
    state = run_state.state()
    if "config" not in state or "model_path" not in state:
        raise ConfigError(
            f"run {run_state.run!r} has no config in Redis: is its trainer running (asyncrl train) on this Redis?"
        )
    published = json.loads(state["config"])
    return config_from_dict(rejoin_config(published, redis_url=redis_url, password=password)), str(state["model_path"])


def run_elastic_generator(
    redis_url: str,
    run: str,
    *,
    password: str | None = None,
    generator_id: str | None = None,
    max_groups: int | None = None,
    poll_s: float = 1.0,
    ray_address: str | None = None,
) -> dict:
    """Generate for `run` until stopped (or `max_groups` produced); return the final stats."""
    run_state = RunState.connect(redis_url, run, password=password)
    try:
        cfg, model_path = job_config(run_state, redis_url=redis_url, password=password)
    finally:
        run_state.close()
    model_package = _attach_ray(ray_address, run) if ray_address else None
    generator_id = generator_id or f"elastic-{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    gen = GeneratorActor(
        cfg,
        model_path=model_path,
        generator_id=generator_id,
        redis_url=redis_url,
        run=run,
        password=password,
        autostart=True,
        model_package=model_package,
    )
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
        if ray_address:
            import ray

            ray.shutdown()


def _attach_ray(ray_address: str, run: str):
    """Join the job's Ray cluster as a driver; return the shipped model package (or None)."""
    import ray

    probe(ray_address)
    if ray_address.startswith("ray://"):  # Ray Client: no raylet of its own needed on this host
        _client_init(ray_address)
    else:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    try:
        return ray.get(open_store(run).model.remote(), timeout=60)
    except ValueError:  # no weight store: the job publishes files (sync.backend=shm)
        return None


def _client_init(ray_address: str, tries: int = 4, pause_s: float = 5.0) -> None:
    """ray.init through Ray Client, tried again when the cluster's client server fails to start
    this client's server process (seen on a loaded 2-core box: "Initialization failure from
    server"); the last failure is raised as it is."""
    import time

    import ray

    for attempt in range(1, tries + 1):
        try:
            ray.init(address=ray_address)
            return
        except ConnectionError as e:  # ConnectionAbortedError from the client server
            if attempt == tries:
                raise
            log.warning(
                "Ray Client at %s refused this generator (%s); trying again in %.0f s (%d/%d)",
                ray_address,
                str(e).strip().splitlines()[-1][:200],
                pause_s,
                attempt,
                tries,
            )
            time.sleep(pause_s)
