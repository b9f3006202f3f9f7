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
the engine's processes, which would outlive this one, are stopped first. After SIGTERM (a
scheduler's stop) the drain is bounded by the job's control.shutdown_grace_s, after which it
leaves the same way (handing back the admission of prompts it never produced, if Redis answers
within seconds); `asyncrl generate` then exits with status 143 either way.

Weights are read from the location the trainer announces. On one host that is a file in
/dev/shm. On a multi-node job (sync.backend=object_store) it is an object in the job's Ray
cluster, and so is the model when it is a local directory of the trainer's host: give
``--ray-address ray://HEAD:10001`` and the generator attaches to the cluster through Ray
Client (a driver with no raylet on its own host; nothing is shared but the network), or
``auto``/``HEAD:PORT`` on a host that joined the cluster with ``ray start``. A generator
that cannot load the announced weights stops admitting work and says why
(``stats()["weights_blocked"]``) instead of generating groups that would only be dropped as
stale.

The config from Redis is not trusted: given the trainer key's fingerprint (``--trust-key``, the
trainer logs it) it must carry that key's signature, with a queue password it must carry the
password signature (asyncrl.queue.signing), and every import path (environment, reward
functions, custom losses), engine setting beyond the safe ones and prompt source in it must be
allowed on this host (asyncrl.control.allowlist):

    asyncrl generate --redis URL --run demo --trust-key FINGERPRINT --allow-imports-from job.yaml
    asyncrl generate --redis URL --run demo --allow-import my_pkg.rewards:exact_match \
        --allow-prompts data/train.jsonl --allow-engine-key speculative_config
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
from asyncrl.control.state import PREEMPTED_EXIT
from asyncrl.lifeline import Lifeline
from asyncrl.queue import RunState
from asyncrl.rollout.generator import GeneratorActor
from asyncrl.rollout.recovery import reap_processes, unlink_segments
from asyncrl.sync.objstore import open_store

log = logging.getLogger(__name__)


MAX_CONFIG_DEPTH = 32
"""Nesting a published config may have (the real one is a few levels deep): deeper JSON is
refused before anything walks it, so no recursion limit is met on the way."""


def job_config(
    run_state: RunState,
    allowed: ImportAllowList,
    *,
    redis_url: str,
    password: str | None,
    trust_key: str | None = None,
) -> tuple[Config, str]:
    """The running job's config and model path, read from its state hash and trusted only as
    far as this host says: with `trust_key` (the trainer key's fingerprint) the trainer's
    signature must hold; with a queue password, the password signature must hold; with or
    without either, every import path, engine setting and prompt source it names must be in
    `allowed`. All are checked before the config is parsed (parsing looks modules up). The job
    publishes it without secrets: the Redis URL and password this generator connected with take
    their place. ConfigError saying why, otherwise."""
    run = run_state.run
    job = run_state.published_job()
    if job is None:
        raise ConfigError(f"run {run!r} has no config in Redis: is its trainer running (asyncrl train) on this Redis?")
    password = run_state.password
    seen = job.trainer_fingerprint
    if trust_key is not None:
        if seen != trust_key or not job.trainer_signed(run):
            why = (
                "carries no trainer signature"
                if seen is None
                else f"is signed by trainer key {seen}"
                if seen != trust_key
                else "has a trainer signature that does not match it"
            )
            raise ConfigError(
                f"run {run!r}: the job's config in Redis {why}, not by the trainer key this generator "
                f"trusts (--trust-key {trust_key}): refusing to run it"
            )
    elif password is not None and not job.signed_for(run, password):
        # Checked only when the trainer's key is not pinned: the pinned key's signature proves
        # more, and a generator holding the run's generator credential (a Redis user of its own,
        # not the queue password) cannot check this one.
        why = "carries no signature" if job.signature is None else "has a signature that does not match it"
        raise ConfigError(
            f"run {run!r}: the job's config in Redis {why} under this queue password, so its "
            f"trainer did not write it as it is (or signs with another password): refusing to run it; "
            f"a generator connected with the run's generator credential pins the trainer key instead "
            f"(--trust-key, which the trainer logs)"
        )
    elif seen is not None and job.trainer_signed(run):
        log.warning(
            "the job's config is signed by trainer key %s, which this generator does not pin: a holder "
            "of the queue's credentials could have written it; pin it with --trust-key %s",
            seen,
            seen,
        )
    elif password is None:
        log.warning(
            "the job's config in Redis is not signed (no queue password, no --trust-key); only built-in "
            "names and what this generator allows (--allow-import, ...) are taken from it"
        )
    data = _parse(run, job.config)
    try:
        model_path = job.model_path.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"run {run!r}: the job's model path in Redis is not UTF-8 text") from None
    allowed.check(named_imports(data), remote_code=wants_remote_code(data))
    allowed.check_inputs(data)
    cfg = config_from_dict(rejoin_config(data, redis_url=redis_url, password=password))
    allowed.check(typed_imports(cfg), remote_code=bool(cfg.rollout.engine_kwargs.get("trust_remote_code")))
    allowed.check_inputs(cfg.to_dict())
    return cfg, model_path


def _parse(run: str, text: bytes) -> dict:
    """The published config as a JSON object; ConfigError for anything else (not JSON, another
    JSON type, nested past MAX_CONFIG_DEPTH)."""
    too_deep = ConfigError(f"run {run!r}: the job's config in Redis nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"run {run!r}: the job's config in Redis is not JSON text: {e}") from None
    except RecursionError:  # nested past the parser's own limit
        raise too_deep from None
    if _depth(data) > MAX_CONFIG_DEPTH:
        raise too_deep
    if not isinstance(data, dict):
        kind = {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(type(data), "null")
        raise ConfigError(f"run {run!r}: the job's config in Redis is a JSON {kind}, not an object of config sections")
    return data


def _depth(value: object) -> int:
    """How deep lists and objects nest in a JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_CONFIG_DEPTH:
            break
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return deepest


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
    trust_key: str | None = None,
) -> dict:
    """Generate for `run` until stopped (or `max_groups` produced); return the final stats.
    `allowed`: what this host lets the job's config load and read (none: built-ins only);
    `trust_key`: the fingerprint of the trainer key the config must be signed by.
    QueueUnavailable if the job's Redis does not answer within `connect_timeout_s`."""
    run_state = RunState.connect(redis_url, run, password=password, retry_deadline_s=connect_timeout_s)
    try:
        cfg, model_path = job_config(
            run_state, allowed or ImportAllowList(), redis_url=redis_url, password=password, trust_key=trust_key
        )
    finally:
        run_state.close()
    model_package = _attach_ray(ray_address, run) if ray_address else None
    generator_id = generator_id or f"elastic-{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    started: list[GeneratorActor] = []
    stopped_by: list[str] = []
    grace_s = cfg.control.shutdown_grace_s
    deadlines: list[threading.Timer] = []

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set() and started:
            _abandon(started[0], f"second {name}")
            os._exit(128 + signum)
        stopped_by.append(name)
        stop.set()
        if signum == signal.SIGTERM:  # a scheduler's stop: it kills us once its grace is over
            log.warning("received %s: draining in-flight groups for at most %.0f s", name, grace_s)
            timer = threading.Timer(grace_s, _deadline, [started, f"{name}: shutdown grace of {grace_s:g} s passed"])
            timer.daemon = True
            timer.start()
            deadlines.append(timer)

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
    lifeline = _Registered(gen)
    log.info("%s joined run %r (model %s)", generator_id, run, model_path)
    try:
        while not stop.wait(poll_s):
            lifeline.refresh()
            stats = gen.stats()
            if max_groups is not None and stats["groups"] >= max_groups:
                break
        stats = gen.stop()  # drain in-flight groups, then leave the job
        log.info("%s leaving run %r after %d groups", generator_id, run, stats["groups"])
        return {**stats, "stopped_by": stopped_by[0] if stopped_by else None}
    finally:
        gen.shutdown()
        for timer in deadlines:
            timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray_address:
            import ray

            ray.shutdown()


class _Registered:
    """Keeps the lifeline (asyncrl.lifeline) told of the engine's processes: vLLM forks them
    here, so they do not carry the lifeline's token; a rebuilt engine has new ones."""

    def __init__(self, gen: GeneratorActor):
        self.gen = gen
        self._pids: list[list] | None = None
        self.refresh()

    def refresh(self) -> None:
        line, pids = Lifeline.current, self.gen.engine.engine_pids
        if line is not None and pids is not self._pids:
            line.register(pids)
            self._pids = pids


def _deadline(started: list[GeneratorActor], why: str) -> None:
    """The shutdown grace ran out while draining: leave now (exit status 143)."""
    if started:
        _abandon(started[0], why)
    os._exit(PREEMPTED_EXIT)


def _abandon(gen: GeneratorActor, signame: str) -> None:
    """A second SIGINT/SIGTERM while the first one's drain waits (on a Redis that is gone when
    the job has ended: an outage is waited out, by default for ever): stop the engine's
    processes and delete its shared memory without the engine's client, which may be the part
    that waits. Left running, they outlive this process (~2 GB for the tiny demo model)."""
    engine = gen.engine
    log.warning("%s: leaving without draining; stopping the engine's processes", signame)
    # Hand back what it admitted (else its budget is held until the trainer restarts), but
    # bounded: the job's Redis may be the thing that is gone.
    run_state = gen.run_state

    def release_and_leave() -> None:
        run_state.release_inflight(gen.generator_id)
        run_state.remove_generator(gen.generator_id)

    release = threading.Thread(target=release_and_leave, daemon=True)
    release.start()
    release.join(timeout=3.0)
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
