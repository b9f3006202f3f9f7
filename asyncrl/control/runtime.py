"""Bring-up and tear-down of everything a run needs, in one ExitStack.

    with Runtime(cfg, run_dir) as rt:
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
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.control.restart import own_generator_ids
from asyncrl.queue import RolloutQueue, RunState
from asyncrl.rundir import CONFIG_FILE

if TYPE_CHECKING:
    from asyncrl.learner import LearnerGroup

log = logging.getLogger(__name__)


def resolve_model(cfg: Config, run_dir: Path) -> str:
    """'tiny' writes a tiny random Llama for the environment's alphabet into the run dir."""
    if cfg.rollout.model != "tiny":
        return cfg.rollout.model
    from asyncrl.rollout.tiny import write_tiny_model

    path = run_dir / "tiny-model"
    if not (path / "config.json").exists():
        write_tiny_model(path, seed=cfg.control.seed)
    return str(path)


class Runtime(contextlib.ExitStack):
    """Owns the processes and actors of one run; closing it stops exactly those."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, start_generators: bool = True):
        super().__init__()
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.start_generators = start_generators
        self.redis_url: str | None = None
        self.embedded_redis = None
        self.queue: RolloutQueue | None = None
        """The rollout stream (this trainer's consumer)."""
        self.run_state: RunState | None = None
        """The run's state hash, counters, admission and heartbeats, over the queue's connection."""
        self.learner: LearnerGroup | None = None
        self.weight_sync: Any = None
        """The sync backend (asyncrl.sync: shm, nccl or object_store), built before the learner."""
        self.generators: list = []
        self.generator_nodes: list[str] = []
        """The Ray node each generator was started on (for the lost-actor report)."""
        self.model_path: str | None = None
        self.model_package: dict | None = None
        self.highest_version = 0
        """The highest weights version this run's Redis announced before this start (a crashed
        predecessor's): the restored weights are numbered past it (LoopState.continue_past)."""
        self._t0 = time.perf_counter()
        self.startup: dict[str, float] = {}
        """Seconds from the runtime's start until each part was ready."""

    def mark(self, what: str) -> None:
        self.startup[what] = round(time.perf_counter() - self._t0, 1)

    # ------------------------------------------------------------------ bring-up

    def __enter__(self) -> Runtime:
        super().__enter__()
        try:
            self._t0 = time.perf_counter()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._start_redis()
            # Before any generator exists: a predecessor's announced weights and open admission
            # would have them load discarded weights and start work against its budget.
            self.highest_version = self.run_state.retire_weights()
            self.mark("redis")
            self._start_ray()
            self.mark("ray")
            self.model_path = resolve_model(self.cfg, self.run_dir)
            self._check_prompts()
            from asyncrl.sync.model_ship import ship_model
            from asyncrl.sync.weight_sync import cluster_is_multinode

            # Other nodes get a local model directory through Ray, as weights "version 0".
            self.model_package = ship_model(self.model_path) if cluster_is_multinode() else None
            self._start_weight_sync()
            if self.start_generators:
                self._create_generators()  # their engines load while the learners do
            self._start_learner()
            # The sync is built before the learners so generators can register while those
            # load; the object-store backend reads the learner's exports only at publish time.
            self.weight_sync.learner = self.learner
            self.mark("learner")
        except BaseException:
            self.close()
            raise
        return self

    def _check_prompts(self) -> None:
        """Open the prompt sources and check the chat template once, here: a missing column or
        split, or a tokenizer without a template, would otherwise fail every generator's start
        (which Ray retries for ever) and the evaluator's."""
        from asyncrl.rollout.prompts import check_chat_template, open_prompts

        r, c = self.cfg.rollout, self.cfg.control
        fields = dict(prompt_field=r.prompt_field, answer_field=r.answer_field, seed=0, id_prefix="check")
        if r.prompts:
            next(open_prompts(r.prompts, None, split=r.prompt_split, **fields))
        if c.eval_every and c.eval_prompts:
            next(open_prompts(c.eval_prompts, None, split=c.eval_split, where="control.eval_prompts", **fields))
        if r.chat_template:
            from transformers import AutoTokenizer

            from asyncrl.rollout.envs.chat import check_turn_template

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            check_chat_template(tokenizer, r.model)
            check_turn_template(tokenizer, r.env)

    def _start_redis(self) -> None:
        q = self.cfg.queue
        if q.redis_url is None:
            from asyncrl.queue.server import EmbeddedRedis

            server = EmbeddedRedis(self.run_dir / "redis", password=q.password, aof=q.aof, bind=q.bind)
            server.start()
            self.callback(server.stop)
            self.embedded_redis = server
            self.redis_url = server.url
        else:
            self.redis_url = q.redis_url
        self.queue = RolloutQueue.connect(
            self.redis_url,
            self.cfg.control.run_name,
            password=q.password,
            consumer="learner-0",
            maxlen=q.maxlen,
            max_record_bytes=q.max_record_bytes,
            claim_idle_s=q.claim_idle_s,
            retry_deadline_s=q.retry_deadline_s,
            outage_deadline_s=q.outage_deadline_s,
            ledger=q.ledger,
            stale_reissues=q.stale_reissues,
        )
        self.callback(self.queue.close)
        self.run_state = RunState.of(self.queue)

    def _start_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return  # a caller (tests, notebooks) owns Ray; leave it running
        c = self.cfg.control
        env_vars = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.rollout.kvcache_gib),
            "TOKENIZERS_PARALLELISM": "false",
            # vLLM's per-engine INFO lines drown the trainer's progress; WARNING keeps problems.
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            # So user code named by import path (envs, losses) imports in every worker too.
            "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p),
        }
        from asyncrl.control.cluster import connect_ray

        connect_ray(c, env_vars, verbose=self.cfg.monitor.verbose)
        self.callback(ray.shutdown)
        self._link_ray_logs()

    def _link_ray_logs(self) -> None:
        """run_dir/logs/ray -> this Ray session's log directory (worker and engine output)."""
        import ray

        try:
            session = Path(ray._private.worker._global_node.get_session_dir_path())
        except AttributeError:  # a client or an attached driver without a local node
            return
        link = self.run_dir / "logs" / "ray"
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(session / "logs", target_is_directory=True)
        if not self.cfg.monitor.verbose:
            log.info("Ray worker and vLLM engine logs: %s (asyncrl train --verbose streams them here)", link)

    def _start_learner(self) -> None:
        from asyncrl.learner import LearnerGroup
        from asyncrl.rollout.envs import resolve_env_class

        self.learner = LearnerGroup(
            self.cfg,
            self.model_path,
            sample_special_tokens=resolve_env_class(self.cfg.rollout.env).sample_special_tokens,
            collective_timeout_s=self.cfg.learner.collective_timeout_s,
            model_package=self.model_package,
        )
        self.callback(self.learner.shutdown)

    def _start_weight_sync(self) -> None:
        from asyncrl.sync import build_weight_sync

        self.weight_sync = build_weight_sync(
            self.cfg.sync,
            run_state=self.run_state,
            run=self.cfg.control.run_name,
            learner=self.learner,
            model_package=self.model_package,
        )
        self.callback(self.weight_sync.close)

    def _create_generators(self) -> None:
        """Create cfg.rollout.num_generators Ray actors (each restarts on a crash) without
        waiting for them: their engines come up in the background, idle until started."""
        from asyncrl.rollout.generator import GeneratorActor

        self.callback(self._stop_generators)
        for generator_id in own_generator_ids(self.cfg):  # a restart counts their notes as ours
            handle = GeneratorActor.remote_actor(
                self.cfg,
                model_path=self.model_path,
                generator_id=generator_id,
                redis_url=self.redis_url,
                run=self.cfg.control.run_name,
                password=self.cfg.queue.password,
                model_package=self.model_package,
            )
            self.generators.append(handle)
            self.weight_sync.register(handle)

    def launch_generators(self) -> list:
        """Start generating (creating the actors first if the runtime did not); waits until
        every engine is up."""
        import ray

        if not self.generators:
            self._create_generators()
        ray.get([g.start.remote() for g in self.generators])
        self.generator_nodes = ray.get([g.__ray_call__.remote(_node_id) for g in self.generators])
        self.mark("generators")
        return self.generators

    def placed_actors(self) -> dict[str, tuple]:
        """name -> (actor handle, node id it was started on): learner ranks and generators."""
        out = {}
        if self.learner is not None:
            out.update(
                {
                    f"learner rank {r}": (a, info["node_id"])
                    for r, (a, info) in enumerate(zip(self.learner.actors, self.learner.rank_info))
                }
            )
        out.update({f"gen-{i}": (g, node) for i, (g, node) in enumerate(zip(self.generators, self.generator_nodes))})
        return out

    def report_lost_actors(self, error: BaseException) -> list[str]:
        """After a failure, log which actors are gone (a dead node takes all of its own) and what
        Ray does about each: generators restart where their resources exist, ranks do not."""
        from ray.exceptions import RayError

        from asyncrl.control.cluster import lost_actors
        from asyncrl.learner.group import LearnerError

        # Only an actor's death is worth waiting for the GCS to see its node go; a plain
        # exception in the loop is reported (and raised) at once.
        wait_s = 30.0 if isinstance(error, (LearnerError, RayError)) else 0.0
        try:
            lines = lost_actors(self.placed_actors(), wait_s=wait_s)
        except Exception as e:  # noqa: BLE001 - a report must never hide the failure itself
            log.warning("could not tell which actors were lost: %s", e)
            return []
        for line in lines:
            log.error("lost actor: %s", line)
        return lines

    def _stop_generators(self) -> None:
        import ray

        # An actor Ray is still restarting (its node died) would take the call only once it
        # is back: ask only the live ones to stop their engines; every one is killed below.
        refs = [g.shutdown.remote() for g in self.generators if _alive(g)]
        with contextlib.suppress(Exception):
            ray.get(refs, timeout=60)
        for g in self.generators:
            with contextlib.suppress(Exception):
                ray.kill(g, no_restart=True)
        self.generators.clear()

    # ------------------------------------------------------------------ helpers

    def write_config(self) -> Path:
        import yaml

        path = self.run_dir / CONFIG_FILE
        # 0600: it may hold queue.password (resume reads it back from here).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        return path


def _node_id(_actor) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _alive(handle) -> bool:
    from asyncrl.control.cluster import actor_state

    try:
        return actor_state(handle)[0] == "ALIVE"
    except Exception:  # noqa: BLE001 - unknown: try the call, it is bounded by a timeout
        return True
