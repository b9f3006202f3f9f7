"""GeneratorActor: keeps a vLLM engine busy sampling rollout groups into the Redis queue.

    gen = GeneratorActor.remote_actor(cfg, model_path=d, generator_id="gen-0",
                                      redis_url=url, run="demo")          # Ray actor, restarts on crash
    gen.start.remote()
    ray.get(gen.update_weights.remote(WeightsFile("/dev/shm/asyncrl-demo-v1.safetensors"), 1))
    ray.get(gen.stats.remote());  ray.get(gen.shutdown.remote())

    # in-process (the elastic `asyncrl generate` CLI): the same class, called directly
    gen = GeneratorActor(cfg, d, "host-123", url, "demo"); gen.start(); ...; gen.shutdown()

The engine and the generation loop live on an asyncio loop in a thread of their own, so
every public method is a plain blocking call, safe from any thread (Ray runs the actor
with max_concurrency > 1, so stats() answers while update_weights() runs).

The parts, one module each: rollout/production.py (admission, the in-flight slots, put),
rollout/groups.py (a prompt -> a scored group, single- or multi-turn), rollout/watcher.py
(loading published weights, pushed or polled), rollout/recovery.py (a crashed predecessor's
processes, segments and admitted prompts), rollout/engine.py (vLLM). This class ties them to
one engine, an asyncio loop and Ray. If the loop or a put fails (Redis gone past
queue.outage_deadline_s, or refusing the write), stats() raises GeneratorFailed, and a Ray
actor exits so that Ray restarts it; the successor reaps its predecessor's engine, re-issues
its in-flight prompts without a second admission, and goes on generating if it was. Every
second it heartbeats {version, groups, tokens_per_s, inflight, blocked}; every
WEIGHTS_POLL_S it loads newer published weights by itself if nobody pushed them.

Reproducible, never repeating: each start takes an incarnation number from Redis (INCR, so
1 on a fresh run). Prompt ids are "{generator_id}.{incarnation}:..." and double as group ids
and request ids, and request ids fix the sampling seeds: two fresh runs of one config sample
the same prompts with the same seeds, while a restarted actor or a resumed trainer never
reuses an id. No uuid or clock goes into a seed.

Redis keys written for it (through RunState, self.run_state; names from ``asyncrl.queue.keys``):
    keys.inflight(run, generator_id)   hash  prompt_id -> msgpack {"text", "metadata"}
    keys.engine_pids(run)              hash  generator_id -> msgpack {"host", "pids": [[pid, t0]], "segments",
                                                                   "started"}
    keys.incarnation(run, generator_id) int  INCR'd once per start
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
import zlib
from collections import deque

from asyncrl.config import Config
from asyncrl.rollout import recovery, transfer
from asyncrl.rollout.affinity import pin_to_cores
from asyncrl.rollout.engine import RolloutEngine, WeightLoadError
from asyncrl.rollout.envs import allowed_token_ids
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.production import Production
from asyncrl.rollout.prompts import encode_prompt, open_prompts
from asyncrl.rollout.sampling import transfer_backend
from asyncrl.rollout.watcher import WeightWatcher
from asyncrl.seeding import rollout_seed
from asyncrl.types import WeightLocation

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
WEIGHTS_POLL_S = 0.1
"""An elastic generator (nobody pushes it weights) checks for a newer version this often: a
trainer doing several steps a second outruns a once-a-second poll by more than the
staleness bound, and every group the generator made would be dropped as stale."""
ADMISSION_WAIT_S = 0.2
"""A generator that would start before the trainer opened admission checks this often."""
RATE_WINDOW_S = 10.0
"""tokens_per_s in stats() and the heartbeat is the rate over about this long."""


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
        from transformers import AutoTokenizer

        from asyncrl.queue.replay import RolloutQueue
        from asyncrl.queue.runstate import RunState
        from asyncrl.sync.model_ship import local_model

        self.cfg, self.rollout, self.generator_id, self.run = cfg, cfg.rollout, generator_id, run
        self.queue = RolloutQueue.connect(
            redis_url,
            run,
            password=password,
            consumer=generator_id,
            maxlen=cfg.queue.maxlen,
            ledger=cfg.queue.ledger,
            claim_idle_s=cfg.queue.claim_idle_s,
            retry_deadline_s=cfg.queue.retry_deadline_s,
            outage_deadline_s=cfg.queue.outage_deadline_s,
        )
        self.run_state = RunState.of(self.queue)
        self.exit_on_failure = exit_on_failure
        self.failure: BaseException | None = None  # what ended the generation loop, if not a stop
        predecessor_was_generating = recovery.reap_predecessor(self.run_state, generator_id)
        self.env = make_rollout_env(self.rollout)
        model_path = local_model(model_path, model_package)  # another node: the shipped copy
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Incarnation 1 on a fresh run, so two runs of one config sample the same prompts with
        # the same seeds; a restart (actor crash, trainer resume) gets a new number, so prompt
        # and group ids never repeat within a run.
        incarnation = self.incarnation = self.run_state.next_incarnation(generator_id)
        prefix = f"{generator_id}.{incarnation}"
        r = self.rollout
        self.prompts = open_prompts(
            r.prompts,
            self.env,
            id_prefix=prefix,
            seed=rollout_seed(cfg) + zlib.crc32(prefix.encode()),
            split=r.prompt_split,
            prompt_field=r.prompt_field,
            answer_field=r.answer_field,
        )
        # One encoding for drawn, re-issued and warm-up prompts (the chat template, if any).
        self.encode = functools.partial(encode_prompt, self.tokenizer, chat_template=r.chat_template)
        self.counts = {
            "groups": 0,
            "samples": 0,
            "tokens": 0,
            "prompts_skipped": 0,
            "reward_errors": 0,
            "group_errors": 0,
            "aborted": 0,
            "reissued": 0,
            "weight_updates": 0,
            "weight_update_errors": 0,
            "admission_calls": 0,
            "admission_s": 0.0,
        }
        self._started_at = time.time()
        self._rate_samples: deque = deque()  # (time, tokens so far), for the recent rate
        self._samples_drawn = 0  # request ids of sample() calls
        self._main: asyncio.Task | None = None
        self._waiter = None  # a start waiting for the trainer to open admission (start(when_admitted=True))
        # Pin before the loop thread exists: it spawns the engine, whose processes inherit its cores.
        pin_to_cores(self.rollout.cpu_affinity)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{generator_id}-loop", daemon=True)
        self._thread.start()
        self.engine: RolloutEngine = self._call(
            RolloutEngine.start(
                self.rollout, model_path, seed=rollout_seed(cfg), weight_transfer=transfer_backend(cfg.sync)
            )
        )
        self.engine.allowed_token_ids = allowed_token_ids(self.rollout.env, self.tokenizer)
        # One name per generator, so a crashed predecessor's kept weights are replaced, not leaked.
        self.engine.keep_path = os.path.join(cfg.sync.shm_dir, f".asyncrl-{run}-{generator_id}-last-good.safetensors")
        self.engine.drop_kept()
        self.weights = WeightWatcher(
            self.engine, self.run_state, cfg, generator_id, run, self.counts, self._record_engine
        )
        groups = GroupMaker(cfg, self.env, self.tokenizer, self.engine, generator_id, self.counts)
        self.production = Production(
            cfg,
            self.queue,
            self.run_state,
            self.engine,
            self.weights,
            groups,
            self.prompts,
            self.encode,
            generator_id,
            self.counts,
            self._fail,
        )
        # Until start(), a successor should do what our predecessor did (its prompts are still admitted).
        self._generating = predecessor_was_generating
        self._record_engine()
        location, version = self.run_state.weights()
        if location is not None and version > 0:
            try:  # joining (or restarting into) a running job
                self.update_weights(location, version)
            except (WeightLoadError, OSError) as e:  # the heartbeat poll tries again later
                self.weights.note_failed(location, version)
                log.warning("%s: could not load published weights v%d: %s", generator_id, version, e)
            # Joining a running job: warm up before the first admission (see RolloutEngine.warm_up).
            warm = self.encode(next(self.prompts)[1])
            self._call(self.engine.warm_up(warm, self.rollout.max_inflight_groups, f"{prefix}:warmup"))
        retry = self.production.retry
        retry.extend(recovery.predecessor_prompts(self.run_state, generator_id, self.encode))
        self.counts["reissued"] += len(retry)
        log.info("%s: incarnation %d, %d prompts re-issued from a predecessor", generator_id, incarnation, len(retry))
        # A crashed generator's successor (Ray restart, or the same id started again) goes on
        # where it stopped without waiting for start(): Ray re-runs __init__ with the original
        # arguments, so an actor created with autostart=False would otherwise sit idle forever
        # on its predecessor's admitted prompts.
        # Not before the trainer's prepare() has opened admission, though: a resumed trainer
        # first retires its predecessor's weights and budget and publishes its own, and re-issued
        # prompts skip admission, so starting earlier would run them on the wrong weights.
        if autostart or predecessor_was_generating or retry:
            self.start(when_admitted=True)

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
                self._main = asyncio.ensure_future(self._run())
                self._main.add_done_callback(self._main_done)

        async def begin_when_admitted():
            while not await asyncio.to_thread(self.run_state.admission_open):
                await asyncio.sleep(ADMISSION_WAIT_S)
            await begin()
            self._generating = True
            await asyncio.to_thread(self._record_engine)

        if when_admitted and not self.run_state.admission_open():
            self._waiter = asyncio.run_coroutine_threadsafe(begin_when_admitted(), self._loop)
            return
        self._call(begin())
        self._generating = True
        self._record_engine()

    def stop(self, drain_timeout_s: float = 30.0) -> dict:
        """Stop admitting, let in-flight groups finish (up to the timeout), leave the job cleanly."""
        self._call(self._stop(drain_timeout_s))
        return self.stats()

    def update_weights(self, location: WeightLocation, version: int) -> dict:
        """Apply weights in flight: pause (keep requests), load, label ``version``, resume."""
        return self._call(self.weights.update(location, version))

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
        self._samples_drawn += 1
        request_id = f"{self.generator_id}.{self.incarnation}:sample:{self._samples_drawn}"
        outs = self._call(
            self.engine.generate(
                list(prompt_ids), n, request_id, max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos
            )
        )
        return [vars(c) for c in outs]

    def pid(self) -> int:
        return os.getpid()

    def engine_pids(self) -> list[list]:
        return list(self.engine.engine_pids)

    def stats(self) -> dict:
        """Counts so far; raises GeneratorFailed if the generation loop died (not stopped)."""
        if self.failure is not None:
            raise GeneratorFailed(
                f"{self.generator_id}: generation loop died: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure
        return {
            **self.counts,
            "version": self.engine.version,
            "inflight": len(self.production.tasks),
            "tokens_per_s": self._recent_tokens_per_s(),
            "generator_id": self.generator_id,
            "weights_blocked": self.weights.blocked,
        }

    def _recent_tokens_per_s(self) -> float:
        """Tokens/s over the last RATE_WINDOW_S (an average since start would climb for minutes
        after start-up and hide a slowdown); since start until a window has passed."""
        now, tokens = time.time(), self.counts["tokens"]
        samples = self._rate_samples
        samples.append((now, tokens))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, k0 = samples[0] if now - samples[0][0] >= 1.0 else (self._started_at, 0)
        return (tokens - k0) / max(now - t0, 1e-9)

    def shutdown(self) -> None:
        """Stop without draining, abort requests, shut the engine down (its /dev/shm segments go too)."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop(0.0))
        self._call(self.engine.shutdown())
        self.run_state.set_engine_record(self.generator_id, None)
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
        self.counts["weight_updates"] += 1
        self.weights.blocked = None

    def transfer_abort(self, location: WeightLocation, version: int) -> dict:
        """A transfer failed part-way: make the engine whole and resume, then load ``location`` as
        ``version`` like a pushed file (on failure admission stays closed and this raises)."""
        pids = self.engine.engine_pids
        self._call(transfer.abort(self.engine))
        if self.engine.engine_pids is not pids:  # rebuilt: its new processes must be reapable
            self._record_engine()
        return self.update_weights(location, version)

    # ------------------------------------------------------------------ crash recovery

    def _record_engine(self) -> None:
        recovery.record_engine(self.run_state, self.generator_id, self.engine, self._generating)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        beat = asyncio.ensure_future(self._heartbeat_loop())
        try:
            await self.production.run()
        finally:
            beat.cancel()

    def _main_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail("generation loop died", task.exception())

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

    async def _heartbeat_loop(self) -> None:
        last_beat = 0.0
        while True:
            try:
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    last_beat = time.monotonic()
                    s = self.stats()
                    await asyncio.to_thread(
                        self.run_state.heartbeat,
                        self.generator_id,
                        {
                            "version": s["version"],
                            "groups": s["groups"],
                            "tokens_per_s": s["tokens_per_s"],
                            "inflight": s["inflight"],
                            # why it admits nothing, if so: the trainer shows it on its console
                            "blocked": s["weights_blocked"],
                        },
                    )
                await self.weights.poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a missed beat or a failed self-update is retried next second
                log.warning("%s: heartbeat/weights poll failed: %s", self.generator_id, e)
            await asyncio.sleep(WEIGHTS_POLL_S)

    async def _stop(self, drain_timeout_s: float) -> None:
        if self._waiter is not None:
            self._waiter.cancel()  # a stop before the trainer opened admission: never start
        self.production.halt()
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._main), timeout=2.0)
            if not self._main.done():
                self._main.cancel()
        await self.production.drain(drain_timeout_s)
        # A clean stop hands back what it admitted but never produced; a crash leaves the
        # in-flight hash for the successor instead.
        await asyncio.to_thread(self.run_state.release_inflight, self.generator_id)
        self._generating = False
        await asyncio.to_thread(self._record_engine)  # a successor must not auto-start
        await asyncio.to_thread(self.run_state.remove_generator, self.generator_id)
