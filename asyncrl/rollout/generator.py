"""GeneratorActor: keeps a vLLM engine busy sampling rollout groups into the Redis queue.

    gen = GeneratorActor.remote_actor(cfg, model_path=d, generator_id="gen-0",
                                      redis_url=url, run="demo")          # Ray actor, restarts on crash
    gen.start.remote()
    ray.get(gen.update_weights.remote(WeightsFile("/dev/shm/asyncrl-demo-v1.safetensors"), 1))
    ray.get(gen.stats.remote());  ray.get(gen.shutdown.remote())    # stats(): GeneratorStats as a dict

    # in-process (the elastic `asyncrl generate` CLI): the same class, called directly
    gen = GeneratorActor(cfg, d, "host-123", url, "demo"); gen.start(); gen.snapshot().groups; gen.shutdown()

The engine and the generation loop live on an asyncio loop in a thread of their own, so
every public method is a plain blocking call, safe from any thread (Ray runs the actor
with max_concurrency > 1, so stats() answers while update_weights() runs).

The parts, one module each: rollout/production.py (admission, the in-flight slots, put),
rollout/groups.py (a prompt -> a scored group), rollout/watcher.py (loading published weights),
rollout/heartbeat.py (beats, and the weights poll of a generator nobody pushes weights to),
rollout/recovery.py (a crashed predecessor's processes, segments and admitted prompts),
rollout/evaluation.py (the trainer's held-out prompts), rollout/engine.py (vLLM). Each
counts what it does; snapshot() reads them into one GeneratorStats (rollout/stats.py). If the
loop or a put fails (Redis gone past queue.outage_deadline_s, or refusing the write), stats()
raises GeneratorFailed, and a Ray actor exits so that Ray restarts it; the successor reaps its
predecessor's engine, re-issues its in-flight prompts without a second admission, and goes on
generating if it was.

Reproducible, never repeating: each start takes an incarnation number from Redis (INCR, so
1 on a fresh run). Prompt ids are "{generator_id}.{incarnation}:..." and double as group ids
and request ids, and request ids fix the sampling seeds: two fresh runs of one config sample
the same prompts with the same seeds, while a restarted actor or a resumed trainer never
reuses an id. No uuid or clock goes into a seed.

Redis keys written for it (through RunState, self.run_state; names from ``asyncrl.queue.keys``):
    keys.inflight(run, generator_id)   hash  prompt_id -> msgpack {"text", "metadata"}
    keys.engine_pids(run)              hash  generator_id -> msgpack {"host", "pids": [[pid, t0]], "segments",
                                                                   "started"}  (recovery.EngineRecord)
    keys.incarnation(run, generator_id) int  INCR'd once per start
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
import zlib

from asyncrl.config import Config
from asyncrl.data.images import ImageLimits
from asyncrl.queue.replay import RolloutQueue
from asyncrl.queue.runstate import RunState
from asyncrl.rollout import transfer
from asyncrl.rollout.affinity import pin_to_cores
from asyncrl.rollout.engine import RolloutEngine, WeightLoadError
from asyncrl.rollout.envs import allowed_token_ids
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.evaluation import EvalOutcome, HeldOut
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.heartbeat import Heartbeat
from asyncrl.rollout.production import Production
from asyncrl.rollout.prompts import open_prompts, prompt_encoder
from asyncrl.rollout.recovery import (
    ENGINE_OWNER_ENV,
    EngineRecord,
    count_if_restarted,
    engine_owner,
    mark_engine_owner,
    predecessor_prompts,
    reap_predecessor,
)
from asyncrl.rollout.sampling import transfer_backend
from asyncrl.rollout.stats import GeneratorStats, TokenRate
from asyncrl.rollout.vision_prompts import VisionModel, images_refused, prompt_images, with_images
from asyncrl.rollout.watcher import WeightWatcher
from asyncrl.seeding import rollout_seed
from asyncrl.sync.model_ship import local_model
from asyncrl.sync.weight_sync import lora_publish
from asyncrl.types import WeightLocation

log = logging.getLogger(__name__)

ADMISSION_WAIT_S = 0.2
"""A generator that would start before the trainer opened admission checks this often."""


class GeneratorFailed(RuntimeError):
    """The generation loop ended with an error instead of a stop."""


class GeneratorActor:
    """One engine, one environment, one prompt stream; produces RolloutGroups until stopped."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        generator_id: str,
        redis_url: str,
        run: str,
        password: str | None = None,
        autostart: bool = False,
        exit_on_failure: bool = False,
        model_package: dict | None = None,
    ):
        self.cfg, self.rollout, self.generator_id, self.run = cfg, cfg.rollout, generator_id, run
        self.exit_on_failure = exit_on_failure
        self.failure: BaseException | None = None  # what ended the generation loop, if not a stop
        self._main: asyncio.Task | None = None
        self._waiter: concurrent.futures.Future | None = None  # a start waiting for admission to open
        # Request ids of sample() calls, which Ray runs in several threads at once (next() on a
        # count is atomic; `+= 1` on an attribute is not).
        self._sample_ids = itertools.count(1)
        self._connect(redis_url, password)
        predecessor_was_generating = reap_predecessor(self.run_state, generator_id)
        count_if_restarted(self.run_state, generator_id)
        model_path = self._open_inputs(model_path, model_package)
        self._rate = TokenRate(started_at=time.time())
        self._start_loop()
        self._start_engine(model_path)
        # Until start(), a successor should do what our predecessor did (its prompts are still admitted).
        self.engine_record = EngineRecord(self.run_state, generator_id, self.engine, predecessor_was_generating)
        self._build_parts()
        self.engine_record.write()
        self._join_running_job()
        taken_over = self._take_over_predecessor()
        # A successor (Ray restart, or the same id started again) goes on where its predecessor
        # stopped: Ray re-runs __init__ with the original arguments, so autostart=False would leave
        # its admitted prompts idle for ever. Not before the trainer's prepare() opens admission,
        # though: a resumed trainer first retires its predecessor's weights and budget and publishes
        # its own, and re-issued prompts skip admission, so earlier they would run on the wrong weights.
        if autostart or predecessor_was_generating or taken_over:
            self.start(when_admitted=True)

    # ------------------------------------------------------------------ bring-up, in order

    def _connect(self, redis_url: str, password: str | None) -> None:
        q = self.cfg.queue
        self.queue = RolloutQueue.connect(
            redis_url,
            self.run,
            password=password,
            consumer=self.generator_id,
            maxlen=q.maxlen,
            ledger=q.ledger,
            claim_idle_s=q.claim_idle_s,
            retry_deadline_s=q.retry_deadline_s,
            outage_deadline_s=q.outage_deadline_s,
        )
        self.run_state = RunState.of(self.queue)

    def _open_inputs(self, model_path: str, model_package: dict | None) -> str:
        """The environment, the tokenizer, this incarnation's prompt stream and its encoding;
        returns where the model is on this node."""
        from transformers import AutoTokenizer  # heavy: imported when a generator is built, not with the module

        r = self.rollout
        self.env = make_rollout_env(r, self.run)
        model_path = local_model(model_path, model_package)  # another node: the shipped copy
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Incarnation 1 on a fresh run, so two runs of one config sample the same prompts with
        # the same seeds; a restart (actor crash, trainer resume) gets a new number, so prompt
        # and group ids never repeat within a run.
        self.incarnation = self.run_state.next_incarnation(self.generator_id)
        prefix = f"{self.generator_id}.{self.incarnation}"
        self.image_limits = ImageLimits.of(r.images)  # a prompt file's images and every drawn prompt's
        self.prompts = open_prompts(
            r.prompts,
            self.env,
            id_prefix=prefix,
            seed=rollout_seed(self.cfg) + zlib.crc32(prefix.encode()),
            split=r.prompt_split,
            prompt_field=r.prompt_field,
            answer_field=r.answer_field,
            image_limits=self.image_limits,
        )
        # One encoding for drawn, re-issued and warm-up prompts (the chat template, if any).
        # A vision-language model's prompts carry images: checked as each prompt is drawn.
        self.vision = VisionModel.of(model_path)
        refused = images_refused(r.env, self.env.multi_turn, r.teacher is not None)
        self.encode = with_images(
            prompt_encoder(self.tokenizer, r.chat_template), self.vision, self.image_limits, refused
        )
        return model_path

    def _start_loop(self) -> None:
        # Pin before the loop thread exists: it spawns the engine, whose processes inherit its cores.
        pin_to_cores(self.rollout.cpu_affinity)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.generator_id}-loop", daemon=True)
        self._thread.start()

    def _start_engine(self, model_path: str) -> None:
        sync = self.cfg.sync
        # Its processes carry the mark: a successor reaps them only if they do (rollout/recovery.py).
        mark_engine_owner(self.run, self.generator_id)
        self.engine: RolloutEngine = self._call(
            RolloutEngine.start(
                self.rollout,
                model_path,
                seed=rollout_seed(self.cfg),
                weight_transfer=transfer_backend(sync),
                learner_dtype=self.cfg.learner.dtype,
                lora=self.cfg.learner.lora if lora_publish(self.cfg.learner.lora, sync) == "adapter" else None,
                routing_replay=self.cfg.algo.routing_replay == "rollout",
            )
        )
        self.engine.allowed_token_ids = allowed_token_ids(self.rollout.env, self.tokenizer)
        # One name per generator, so a crashed predecessor's kept weights are replaced, not leaked.
        self.engine.keep_path = os.path.join(
            sync.shm_dir, f".asyncrl-{self.run}-{self.generator_id}-last-good.safetensors"
        )
        self.engine.drop_kept()

    def _build_parts(self) -> None:
        self.weights = WeightWatcher(self.engine, self.run_state, self.cfg, self.generator_id, self.run)
        self.groups = GroupMaker(
            self.cfg, self.env, self.tokenizer, self.engine, self.generator_id, self.vision, self.image_limits
        )
        self.held_out = HeldOut(self.cfg, self.env, self.tokenizer, self.engine, self.generator_id, self.encode)
        self.production = Production(
            self.cfg,
            self.queue,
            self.run_state,
            self.engine,
            self.weights,
            self.groups,
            self.prompts,
            self.encode,
            self.generator_id,
            self._fail,
        )

    def _join_running_job(self) -> None:
        """Joining (or restarting into) a running job: load its published weights, and warm the
        engine up before the first admission (see RolloutEngine.warm_up)."""
        location, version = self.run_state.weights()
        if location is None or version <= 0:
            return
        try:
            self.update_weights(location, version)
        except (WeightLoadError, OSError) as e:  # the heartbeat poll tries again later
            self.weights.note_failed(location, version)
            log.warning("%s: could not load published weights v%d: %s", self.generator_id, version, e)
        _, text, metadata = next(self.prompts)
        warm = self.encode(text, metadata)
        images = prompt_images(metadata, warm, self.vision, self.image_limits) or None  # checked by encode
        prefix = f"{self.generator_id}.{self.incarnation}:warmup"
        self._call(self.engine.warm_up(warm, self.rollout.max_inflight_groups, prefix, images))

    def _take_over_predecessor(self) -> int:
        """Queue the prompts a crashed predecessor admitted but never put; how many."""
        items = predecessor_prompts(self.run_state, self.generator_id, self.encode, self.image_limits)
        self.production.take_over(items)
        gid, n = self.generator_id, len(items)
        log.info("%s: incarnation %d, %d prompts re-issued from a predecessor", gid, self.incarnation, n)
        return n

    # ------------------------------------------------------------------ Ray

    @classmethod
    def remote_actor(cls, cfg: Config, **kwargs):
        """Start as a Ray actor that Ray restarts after a crash (it then resumes on its own)."""
        import ray

        actor = ray.remote(cls).options(
            num_cpus=cfg.rollout.cpus_per_generator,
            num_gpus=cfg.rollout.gpus_per_generator,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=8,
            resources=cfg.rollout.resources or None,
            # The worker is exec'd with the mark, so every process it starts carries it, spawned
            # or forked (a successor reaps only marked processes: rollout/recovery.py).
            runtime_env={"env_vars": {ENGINE_OWNER_ENV: engine_owner(kwargs["run"], kwargs["generator_id"])}},
        )
        return actor.remote(cfg, exit_on_failure=True, **kwargs)

    # ------------------------------------------------------------------ public, blocking

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, when_admitted: bool = False) -> None:
        """Begin generating in the background (idempotent). ``when_admitted``: only once the
        trainer has opened admission (returns at once; a waiter starts the loop then)."""

        async def begin():
            if self._main is None or self._main.done():
                self.production.stopping = False
                self.failure = None
                self._main = asyncio.ensure_future(_generate(self))
                self._main.add_done_callback(self._main_done)

        async def begin_when_admitted():
            while not await asyncio.to_thread(self.run_state.admission_open):
                await asyncio.sleep(ADMISSION_WAIT_S)
            await begin()
            await asyncio.to_thread(self.engine_record.write, True)

        if when_admitted and not self.run_state.admission_open():
            self._waiter = asyncio.run_coroutine_threadsafe(begin_when_admitted(), self._loop)
            return
        self._call(begin())
        self.engine_record.write(generating=True)

    def stop(self, drain_timeout_s: float = 30.0) -> dict:
        """Stop admitting, let in-flight groups finish (up to the timeout), leave the job cleanly."""
        self._call(_wind_down(self, drain_timeout_s))
        return self.stats()

    def update_weights(self, location: WeightLocation, version: int) -> dict:
        """Apply weights in flight: pause (keep requests), load, label ``version``, resume."""
        try:
            return self._call(self.weights.update(location, version))
        finally:
            self.engine_record.refresh()  # a failed load may have rebuilt the engine

    def version(self) -> int:
        return self.engine.version

    def sample(
        self,
        prompt_ids: list[int],
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        ignore_eos: bool = False,
    ) -> list[dict]:
        """Sample outside the loop (tests, benchmarks): [{"token_ids", "logprobs", "versions", "finish_reason"}]."""
        request_id = f"{self.generator_id}.{self.incarnation}:sample:{next(self._sample_ids)}"
        outs = self._call(
            self.engine.generate(
                list(prompt_ids), n, request_id, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
            )
        )
        return [vars(c) for c in outs]

    def evaluate(
        self,
        prompts: list[tuple[str, str, dict]],
        temperature: float,
        timeout_s: float | None = None,
        version: int | None = None,
        eval_id: str | None = None,
    ) -> EvalOutcome:
        """Held-out (prompt id, text, metadata), each rolled out once as training would, within
        ``timeout_s``, under weight ``version`` alone when one is named (rollout/evaluation.py)."""
        return self._call(self.held_out.run(prompts, temperature, timeout_s, version, eval_id))

    def cancel_evaluations(self, eval_id: str | None = None) -> int:
        """Stop evaluation ``eval_id`` (None: all) here, also if its call has not reached the
        loop yet (ray.cancel does not reach them); how many were running."""

        async def cancel() -> int:
            return self.held_out.cancel(eval_id)

        return self._call(cancel())

    def pid(self) -> int:
        return os.getpid()

    def engine_pids(self) -> list[list]:
        return list(self.engine.engine_pids)

    def snapshot(self) -> GeneratorStats:
        """Counts so far; raises GeneratorFailed if the generation loop died (not stopped)."""
        if self.failure is not None:
            raise GeneratorFailed(
                f"{self.generator_id}: generation loop died: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure
        return GeneratorStats.read(
            self.generator_id, self.engine, self.production, self.groups, self.weights, self._rate
        )

    def stats(self) -> dict:
        """snapshot() as a plain dict, for callers across Ray (tests, the elastic CLI)."""
        return self.snapshot().as_dict()

    def shutdown(self) -> None:
        """Stop without draining, abort requests, shut the engine down (its /dev/shm segments go too)."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(_wind_down(self, 0.0))
        self._call(self.engine.shutdown())
        self.weights.close()
        self.engine_record.remove()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self.queue.close()

    # ------------------------------------------------------------------ NCCL weight transfer (GPU)
    # sync/nccl.py calls these on the actor; the engine side is rollout/transfer.py.

    def transfer_world_size(self) -> int:
        return transfer.world_size(self.engine)

    def transfer_init(self, init_info: dict) -> None:
        self._call(transfer.init(self.engine, init_info))

    def transfer_begin(self) -> None:
        self._call(transfer.begin(self.engine, self.cfg.sync.inflight))

    def transfer_receive(self, update_info: dict) -> None:
        self._call(transfer.receive(self.engine, update_info))

    def transfer_finish(self, version: int, path: str | None = None) -> None:
        self._call(transfer.finish(self.engine, version, self.cfg.sync.inflight, path))
        self.weights.note_transferred()

    def transfer_abort(self, location: WeightLocation, version: int) -> dict:
        """A transfer failed part-way: make the engine whole and resume, then load ``location`` as
        ``version`` like a pushed file (on failure admission stays closed and this raises)."""
        self._call(transfer.abort(self.engine))
        self.engine_record.refresh()  # if the abort rebuilt the engine, its new processes must be reapable
        return self.update_weights(location, version)

    # ------------------------------------------------------------------ the loop

    def _main_done(self, task: asyncio.Task) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail("generation loop died", error)

    def _fail(self, what: str, error: BaseException) -> None:
        """The loop cannot go on: say why, then stop it (stats() raises) or, as a Ray actor, exit."""
        if self.failure is not None:
            return
        self.failure = error
        log.error("%s: %s", self.generator_id, what, exc_info=error)
        if self.exit_on_failure:
            # A Ray actor: exit so Ray restarts it and the successor re-issues the noted prompts,
            # rather than live on with a dead loop while the trainer waits for groups.
            logging.shutdown()
            os._exit(1)
        if self._main is not None and not self._main.done():
            self._main.cancel()


# The loop's coroutines are functions, not methods: one `async def` on GeneratorActor makes Ray
# run it as an asyncio actor, whose plain methods run one at a time on Ray's event loop, so an
# update_weights or stats() call would wait for every sample() before it (measured: a weight
# update landed only once 1.6 s of running requests had finished).


async def _generate(gen: GeneratorActor) -> None:
    heartbeat = Heartbeat(gen.run_state, gen.generator_id, gen.weights, gen.engine_record, gen.snapshot)
    beat = asyncio.ensure_future(heartbeat.run())
    try:
        await gen.production.run()
    finally:
        beat.cancel()


async def _wind_down(gen: GeneratorActor, drain_timeout_s: float) -> None:
    if gen._waiter is not None:
        gen._waiter.cancel()  # a stop before the trainer opened admission: never start
    gen.production.halt()
    if gen._main is not None:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(gen._main), timeout=2.0)
        if not gen._main.done():
            gen._main.cancel()
    await gen.production.drain(drain_timeout_s)
    # A clean stop hands back what it admitted but never produced; a crash leaves the
    # in-flight hash for the successor instead.
    await asyncio.to_thread(gen.run_state.release_inflight, gen.generator_id)
    # A successor must not auto-start.
    await asyncio.to_thread(gen.engine_record.write, False)
    await asyncio.to_thread(gen.run_state.remove_generator, gen.generator_id)
