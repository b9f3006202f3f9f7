"""Bring-up and tear-down of everything a run needs, in one ExitStack.

    with Runtime(cfg, run_dir) as rt:          # rt: a StartedRun, every handle set
        rt.queue, rt.run_state, rt.learner, rt.weight_sync, rt.generators ...

Order matters only where one part needs another: Redis first (everything reports there),
then Ray; then the generator actors are created (their engines take the longest to come up:
a vLLM import and an engine process) *while* the learner group loads, instead of after it.
Generators only sample once `launch_generators()` starts them, after the trainer has
opened admission, so an engine that is ready early just waits. Right after Redis is up, the
weights a predecessor announced are retired and admission is closed (asyncrl.control.restart),
so a generator started or restarted meanwhile neither loads them nor starts work. Tear-down runs in reverse
and only stops what this runtime started (an external Redis is left alone).

`startup` records how long each part took to be ready (seconds since the runtime began);
train() logs it, so a slow start says where it went.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.config.attention_rules import check_context_parallel
from asyncrl.config.critic import check_value_model_family
from asyncrl.control import bringup
from asyncrl.control.cluster import actor_state, lost_actors
from asyncrl.control.restart import own_generator_ids
from asyncrl.queue import RolloutQueue, RunState
from asyncrl.rollout import families
from asyncrl.rollout.generator import GeneratorActor
from asyncrl.rollout.reward_model import wait_ready
from asyncrl.rollout.tiny import write_tiny_model
from asyncrl.rundir import CONFIG_FILE, private_files
from asyncrl.rundir.store import RunPath, check_writable, is_remote, local_dir_for, run_path, write_atomic
from asyncrl.sync.model_ship import ship_model
from asyncrl.sync.objstore import ObjectStoreWeightSync
from asyncrl.sync.weight_sync import cluster_is_multinode

if TYPE_CHECKING:
    from asyncrl.learner import LearnerGroup
    from asyncrl.queue.server import EmbeddedRedis
    from asyncrl.sync import WeightSync

GENERATOR_CREDENTIAL = "generator_url"
"""In control.local_dir (0600): the Redis URL of the run's generator user."""

log = logging.getLogger(__name__)


def resolve_model(cfg: Config, run_dir: Path) -> str:
    """'tiny' writes a tiny random Llama for the environment's alphabet into the run's local
    dir (`run_dir`: the run dir itself when it is local; it is deterministic, so another
    machine writes the same one)."""
    if cfg.rollout.model != "tiny":
        return cfg.rollout.model

    path = run_dir / "tiny-model"
    if not (path / "config.json").exists():
        write_tiny_model(path, seed=cfg.control.seed)
    return str(path)


class Runtime:
    """Owns the processes and actors of one run; leaving it stops exactly those. Entering
    brings them up and returns the StartedRun that holds them."""

    def __init__(self, cfg: Config, run_dir: str | Path | RunPath, *, start_generators: bool = True):
        self.cfg = cfg
        self.run_dir = run_path(run_dir, cfg.control.storage_options)
        self.local_dir = local_dir_for(self.run_dir, cfg.control.local_dir)
        self.start_generators = start_generators
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StartedRun:
        stack = self._stack.__enter__()
        try:
            return self._bring_up(stack)
        except BaseException:
            stack.close()
            raise

    def __exit__(self, *exc: Any) -> bool | None:
        return self._stack.__exit__(*exc)

    def _bring_up(self, stack: contextlib.ExitStack) -> StartedRun:
        cfg, run_dir, local_dir = self.cfg, self.run_dir, self.local_dir
        t0 = time.perf_counter()
        startup: dict[str, float] = {}

        def mark(what: str) -> None:
            startup[what] = round(time.perf_counter() - t0, 1)

        # A family that cannot train here is refused before anything starts (one line, the reason).
        families.check_model(cfg.rollout.model)
        if cfg.algo.critic.enabled:  # its value model's form, before anything starts too
            check_value_model_family(cfg.algo.critic.model or cfg.rollout.model)
        check_context_parallel(
            repr(cfg.rollout.model), families.read_config(cfg.rollout.model), cfg.learner.context_parallel
        )
        families.check_vision_learner(
            cfg.rollout.model,
            families.read_config(cfg.rollout.model),
            critic=cfg.algo.critic.enabled,
            lora=cfg.learner.lora is not None,
            context_parallel=cfg.learner.context_parallel,
        )
        # Before anything starts: the redis-server and Ray started below keep the umask they start with.
        stack.enter_context(private_files(cfg.control.private_files))
        local_dir.mkdir(parents=True, exist_ok=True)
        if is_remote(run_dir):  # a bucket that is missing or refuses us fails here, not at the first checkpoint
            check_writable(run_dir)
            log.info("run dir %s; local files (Redis, metrics spool, logs) in %s", run_dir, local_dir)
        redis_url, embedded_redis = bringup.start_redis(cfg, local_dir, stack)
        if embedded_redis is not None and embedded_redis.generator_url is not None:
            # The run's generator user (its keys and data commands only), for elastic generators:
            # a host given this URL and the trainer key's fingerprint never needs the queue password.
            cred = local_dir / GENERATOR_CREDENTIAL
            write_atomic(cred, embedded_redis.generator_url.encode(), private=True)
            log.info('elastic generators can join as the run\'s generator user: --redis "$(cat %s)"', cred)
        queue = bringup.connect_queue(cfg, redis_url, stack)
        run_state = RunState.of(queue)
        # Before any generator exists: a predecessor's announced weights and open admission
        # would have them load discarded weights and start work against its budget.
        highest_version = run_state.retire_weights()
        mark("redis")
        bringup.start_ray(cfg, local_dir, stack)
        mark("ray")
        model_path = resolve_model(cfg, local_dir)
        mark("model")
        bringup.check_prompts(cfg, model_path)

        # Other nodes get a local model directory through Ray, as weights "version 0".
        model_package = ship_model(model_path) if cluster_is_multinode() else None
        weight_sync = bringup.start_weight_sync(cfg, run_state, model_package, stack)
        reward_models = bringup.start_reward_model_actors(cfg, stack, model_path)  # they load while the rest comes up
        generators: list[Any] = []
        if self.start_generators:  # their engines load while the learners do
            _create_generators(
                cfg,
                generators,
                weight_sync,
                stack,
                model_path,
                bringup.generator_connection(cfg, redis_url, embedded_redis),
                model_package,
            )
        learner = bringup.start_learner(cfg, model_path, model_package, stack)
        # The sync is built before the learners so generators can register while those
        # load; the object-store backend reads the learner's exports only at publish time.

        if isinstance(weight_sync, ObjectStoreWeightSync):
            weight_sync.learner = learner
        mark("learner")
        if reward_models:  # loaded before any generator can score with them
            wait_ready(reward_models)
            mark("reward_models")
        return StartedRun(
            cfg=cfg,
            run_dir=run_dir,
            local_dir=local_dir,
            redis_url=redis_url,
            embedded_redis=embedded_redis,
            queue=queue,
            run_state=run_state,
            weight_sync=weight_sync,
            learner=learner,
            model_path=model_path,
            model_package=model_package,
            highest_version=highest_version,
            generators=generators,
            startup=startup,
            stack=stack,
            t0=t0,
        )


@dataclass(frozen=True, eq=False)
class StartedRun:
    """A run that is up: every handle is set. The handles never change; the generator list
    fills in once (at bring-up or at launch_generators) and empties at tear-down."""

    cfg: Config
    run_dir: RunPath
    """A local path or an object-store URL (asyncrl.rundir.store)."""
    local_dir: Path
    """What stays on this machine (Redis AOF, metrics spool, logs): run_dir itself when local."""
    redis_url: str
    embedded_redis: EmbeddedRedis | None
    """The Redis this runtime started; None when queue.redis_url names one (left running)."""
    queue: RolloutQueue
    """The rollout stream (this trainer's consumer)."""
    run_state: RunState
    """The run's state hash, counters, admission and heartbeats, over the queue's connection."""
    weight_sync: WeightSync
    """The sync backend (asyncrl.sync: shm, nccl or object_store), built before the learner."""
    learner: LearnerGroup
    model_path: str
    model_package: dict | None
    """A local model directory shipped through Ray for other nodes; None on one node."""
    highest_version: int
    """The highest weights version this run's Redis announced before this start (a crashed
    predecessor's): the restored weights are numbered past it (LoopState.continue_past)."""
    generators: list[Any]
    """The generator actors' handles."""
    startup: dict[str, float]
    """Seconds from the runtime's start until each part was ready."""
    stack: contextlib.ExitStack = field(repr=False)
    """Tear-down, run in reverse when the Runtime is left."""
    t0: float = field(repr=False)
    generator_nodes: list[str] = field(default_factory=list)
    """The Ray node each generator was started on (for the lost-actor report)."""

    def mark(self, what: str) -> None:
        self.startup[what] = round(time.perf_counter() - self.t0, 1)

    def callback(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        """Run fn(*args, **kwargs) at tear-down, before everything brought up so far is stopped."""
        self.stack.callback(fn, *args, **kwargs)

    def launch_generators(self) -> list[Any]:
        """Start generating (creating the actors first if the runtime did not); waits until
        every engine is up."""
        import ray

        if not self.generators:
            _create_generators(
                self.cfg,
                self.generators,
                self.weight_sync,
                self.stack,
                self.model_path,
                bringup.generator_connection(self.cfg, self.redis_url, self.embedded_redis),
                self.model_package,
            )
        ray.get([g.start.remote() for g in self.generators])
        self.generator_nodes[:] = ray.get([g.__ray_call__.remote(_node_id) for g in self.generators])
        self.mark("generators")
        return self.generators

    def placed_actors(self) -> dict[str, tuple[Any, str]]:
        """name -> (actor handle, node id it was started on): learner ranks and generators."""
        # Not strict: this feeds a failure report, which may come before the generators were
        # launched (no nodes yet) or after the learner group shut down (no actors left).
        pairs = zip(self.learner.actors, self.learner.rank_info, strict=False)
        out = {f"learner rank {r}": (a, info["node_id"]) for r, (a, info) in enumerate(pairs)}
        nodes = zip(self.generators, self.generator_nodes, strict=False)
        out.update({f"gen-{i}": (g, node) for i, (g, node) in enumerate(nodes)})
        return out

    def report_lost_actors(self, error: BaseException) -> list[str]:
        """After a failure, log which actors are gone (a dead node takes all of its own) and what
        Ray does about each: generators restart where their resources exist, ranks do not."""
        from ray.exceptions import RayError

        # The learner loads torch: imported only here, after a failure, so this module does not.
        from asyncrl.learner.group import LearnerError

        # Only an actor's death is worth waiting for the GCS to see its node go; a plain
        # exception in the loop is reported (and raised) at once.
        wait_s = 30.0 if isinstance(error, (LearnerError, RayError)) else 0.0
        try:
            lines = lost_actors(self.placed_actors(), wait_s=wait_s)
        except Exception as e:  # a report must never hide the failure itself
            log.warning("could not tell which actors were lost: %s", e)
            return []
        for line in lines:
            log.error("lost actor: %s", line)
        return lines

    def write_config(self) -> RunPath:
        import yaml

        path = self.run_dir / CONFIG_FILE
        # 0600: it may hold queue.password (resume reads it back from here). On an object
        # store the bucket's policy decides who reads it.
        write_atomic(path, yaml.safe_dump(self.cfg.to_dict(), sort_keys=False).encode(), private=True)
        return path


def _create_generators(
    cfg: Config,
    into: list[Any],
    weight_sync: WeightSync,
    stack: contextlib.ExitStack,
    model_path: str,
    connection: tuple[str, str | None],
    model_package: dict | None,
) -> None:
    """Create cfg.rollout.num_generators Ray actors (each restarts on a crash) into `into`
    without waiting for them: their engines come up in the background, idle until started."""
    stack.callback(_stop_generators, into)
    for generator_id in own_generator_ids(cfg):  # a restart counts their notes as ours
        handle = GeneratorActor.remote_actor(
            cfg,
            model_path=model_path,
            generator_id=generator_id,
            redis_url=connection[0],
            run=cfg.control.run_name,
            password=connection[1],
            model_package=model_package,
        )
        into.append(handle)
        weight_sync.register(handle)


def _stop_generators(generators: list[Any]) -> None:
    import ray

    # An actor Ray is still restarting (its node died) would take the call only once it
    # is back: ask only the live ones to stop their engines; every one is killed below.
    refs = [g.shutdown.remote() for g in generators if _alive(g)]
    with contextlib.suppress(Exception):
        ray.get(refs, timeout=60)
    for g in generators:
        with contextlib.suppress(Exception):
            ray.kill(g, no_restart=True)
    generators.clear()


def _node_id(_actor) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _alive(handle) -> bool:
    try:
        return actor_state(handle)[0] == "ALIVE"
    except Exception:  # unknown: try the call, it is bounded by a timeout
        return True
