"""`asyncrl generate`: join a running job as one more generator, from any process.

    asyncrl generate --redis redis://127.0.0.1:PORT/0 --run demo [--max-groups 100]

Everything comes from the job's Redis: the resolved config and model path (the trainer
writes them at start; the config without its secrets, so the generator's own Redis URL and
password stand in for the job's), the current weights location and version (the generator polls it
and loads newer weights itself), and admission (so an extra generator never pushes the
job past its staleness budget). The generator heartbeats while it runs and removes itself
on a clean exit (SIGINT/SIGTERM or --max-groups reached); if it dies instead, its
heartbeat goes stale and its in-flight prompts wait in Redis for a generator of the same
id. A second SIGINT/SIGTERM leaves at once, without draining (the job's Redis may be gone):
the engine's processes, which would outlive this one, are stopped first.

Weights are read from the location the trainer announces. On one host that is a file in
/dev/shm. On a multi-node job (sync.backend=object_store) it is an object in the job's Ray
cluster, and so is the model when it is a local directory of the trainer's host: give
``--ray-address ray://HEAD:10001`` and the generator attaches to the cluster through Ray
Client (a driver with no raylet on its own host; nothing is shared but the network), or
``auto``/``HEAD:PORT`` on a host that joined the cluster with ``ray start``. A generator
that cannot load the announced weights stops admitting work and says why
(``stats()["weights_blocked"]``) instead of generating groups that would only be dropped as
stale.

The config from Redis is not trusted as code: with a queue password it must carry its
trainer's signature (asyncrl.queue.signing), and every import path in it (environment,
reward functions, custom losses) must be allowed on this host (asyncrl.control.allowlist):

    asyncrl generate --redis URL --run demo --allow-import my_pkg.rewards:exact_match
    asyncrl generate --redis URL --run demo --allow-imports-from job.yaml
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading

from asyncrl.config import Config, ConfigError, config_from_dict, rejoin_config
from asyncrl.control.allowlist import ImportAllowList, named_imports, typed_imports, wants_remote_code
from asyncrl.control.cluster import ClusterUnavailable, probe, redact_error, shown_address, warn_if_open_cluster
from asyncrl.queue import RunState
from asyncrl.rollout.generator import GeneratorActor
from asyncrl.rollout.recovery import reap_processes, unlink_segments
from asyncrl.sync.objstore import open_store

log = logging.getLogger(__name__)


def job_config(
    run_state: RunState, allowed: ImportAllowList, *, redis_url: str, password: str | None
) -> tuple[Config, str]:
    """The running job's config and model path, read from its state hash and trusted only as
    far as this host says: with a queue password, its trainer's signature must hold; with or
    without one, every import path it names must be in `allowed`. Both are checked before the
    config is parsed (parsing looks modules up). The job publishes it without secrets: the
    Redis URL and password this generator connected with take their place. ConfigError saying
    why, otherwise."""
    job = run_state.published_job()
    if job is None:
        raise ConfigError(
            f"run {run_state.run!r} has no config in Redis: is its trainer running (asyncrl train) on this Redis?"
        )
    password = run_state.password
    if password is not None and not job.signed_for(run_state.run, password):
        why = "carries no signature" if job.signature is None else "has a signature that does not match it"
        raise ConfigError(
            f"run {run_state.run!r}: the job's config in Redis {why} under this queue password, so its "
            f"trainer did not write it as it is (or signs with another password): refusing to run it"
        )
    if password is None:
        log.warning(
            "no queue password: the job's config in Redis is not signed; only built-in names and "
            "the import paths this generator allows (--allow-import) are loaded from it"
        )
    try:
        data = json.loads(job.config)
        model_path = job.model_path.decode()
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"run {run_state.run!r}: the job's config in Redis is not JSON text: {e}") from None
    allowed.check(named_imports(data), remote_code=wants_remote_code(data))
    cfg = config_from_dict(rejoin_config(data, redis_url=redis_url, password=password))
    allowed.check(typed_imports(cfg), remote_code=bool(cfg.rollout.engine_kwargs.get("trust_remote_code")))
    return cfg, model_path


def run_elastic_generator(
    redis_url: str,
    run: str,
    *,
    password: str | None = None,
    generator_id: str | None = None,
    max_groups: int | None = None,
    poll_s: float = 1.0,
    ray_address: str | None = None,
    allowed: ImportAllowList | None = None,
    connect_timeout_s: float = 30.0,
) -> dict:
    """Generate for `run` until stopped (or `max_groups` produced); return the final stats.
    `allowed`: the import paths this host lets the job's config load (none: built-ins only).
    QueueUnavailable if the job's Redis does not answer within `connect_timeout_s`."""
    run_state = RunState.connect(redis_url, run, password=password, retry_deadline_s=connect_timeout_s)
    try:
        cfg, model_path = job_config(run_state, allowed or ImportAllowList(), redis_url=redis_url, password=password)
    finally:
        run_state.close()
    model_package = _attach_ray(ray_address, run) if ray_address else None
    generator_id = generator_id or f"elastic-{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    started: list[GeneratorActor] = []

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set() and started:
            _abandon(started[0], signal.Signals(signum).name)
            os._exit(128 + signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
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
    started.append(gen)
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


def _abandon(gen: GeneratorActor, signame: str) -> None:
    """A second SIGINT/SIGTERM while the first one's drain waits (on a Redis that is gone when
    the job has ended: an outage is waited out, by default for ever): stop the engine's
    processes and delete its shared memory without the engine's client, which may be the part
    that waits. Left running, they outlive this process (~2 GB for the tiny demo model)."""
    engine = gen.engine
    log.warning("second %s: leaving without draining; stopping the engine's processes", signame)
    reap_processes(engine.engine_pids, timeout_s=5)
    unlink_segments(engine.shm_segments)
    engine.drop_kept()


def _attach_ray(ray_address: str, run: str):
    """Join the job's Ray cluster as a driver; return the shipped model package (or None)."""
    import ray

    try:
        probe(ray_address)
    except OSError as e:
        raise ClusterUnavailable(
            f"--ray-address {shown_address(ray_address)}: no Ray cluster answers there ({redact_error(e, ray_address)})"
        ) from e
    if ray_address.startswith("ray://"):  # Ray Client: no raylet of its own needed on this host
        _client_init(ray_address)
    else:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
    warn_if_open_cluster(ray_address, key="--ray-address")
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
