"""GeneratorActor: keeps a vLLM engine busy sampling rollout groups into the Redis queue.

    gen = GeneratorActor.remote_actor(cfg, model_path=d, generator_id="gen-0",
                                      redis_url=url, run="demo")          # Ray actor, restarts on crash
    gen.start.remote()
    ray.get(gen.update_weights.remote("/dev/shm/asyncrl-demo-v1.safetensors", 1))
    ray.get(gen.stats.remote());  ray.get(gen.shutdown.remote())

    # in-process (the elastic `asyncrl generate` CLI): the same class, called directly
    gen = GeneratorActor(cfg, d, "host-123", url, "demo"); gen.start(); ...; gen.shutdown()

The engine and the generation loop live on an asyncio loop in a thread of their own, so
every public method is a plain blocking call, safe from any thread (Ray runs the actor
with max_concurrency > 1, so stats() answers while update_weights() runs).

Loop: draw a prompt (skip and count those over rollout.max_prompt_tokens), wait for
admission and note the prompt in the generator's in-flight hash in Redis (one atomic step,
RunState.admit_prompt), sample n completions, score them with the environment, put one
RolloutGroup and delete the in-flight note (again one step). Up to
rollout.max_inflight_groups groups run at once. A finished group is held through a full
queue (put's timeout is logged, never a reason to drop it). Every Redis call retries through
a restart of the server (queue.connection.Retrier) and waits out a longer outage; if the loop
or a put fails anyway (Redis gone past queue.outage_deadline_s, or refusing the write), stats() raises GeneratorFailed,
and a Ray actor exits so that Ray restarts it. A restarted actor
(Ray max_restarts) first reaps its predecessor's orphaned engine processes and deletes their
leaked /dev/shm/psm_* segments, then re-issues the predecessor's in-flight prompts without a
second admission, and goes on generating if the predecessor was. Every second it
heartbeats {version, groups, tokens_per_s} and loads newer published weights by itself if
nobody pushed them (elastic generators).

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
import logging
import os
import socket
import threading
import time
import zlib
from collections import deque

import msgpack
import numpy as np

from asyncrl.config import Config
from asyncrl.queue.replay import QueueFull
from asyncrl.queue.runstate import unpack_small
from asyncrl.rollout.affinity import pin_to_cores
from asyncrl.rollout.engine import RolloutEngine, WeightLoadError, reap_processes, unlink_segments
from asyncrl.rollout.envs import make_env, score_completion
from asyncrl.rollout.envs.multiturn import Turn, run_trajectory, to_interleaved_sample, to_step_samples
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.prompts import open_prompts
from asyncrl.sync import objstore
from asyncrl.types import RolloutGroup, Sample

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
WEIGHTS_POLL_S = 0.1
"""An elastic generator (nobody pushes it weights) checks for a newer version this often: a
trainer doing several steps a second outruns a once-a-second poll by more than the
staleness bound, and every group the generator made would be dropped as stale."""
ADMISSION_POLL_S = 0.05
RATE_WINDOW_S = 10.0
"""tokens_per_s in stats() and the heartbeat is the rate over about this long."""


WEIGHTS_RETRY_S = 30.0
"""A published version that failed to load is tried again after this long (not every beat)."""


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
        predecessor_was_generating = self._reap_predecessor()
        self.env = make_rollout_env(self.rollout)
        model_path = local_model(model_path, model_package)  # another node: the shipped copy
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Incarnation 1 on a fresh run, so two runs of one config sample the same prompts with
        # the same seeds; a restart (actor crash, trainer resume) gets a new number, so prompt
        # and group ids never repeat within a run.
        incarnation = self.incarnation = self.run_state.next_incarnation(generator_id)
        prefix = f"{generator_id}.{incarnation}"
        self.prompts = open_prompts(
            self.rollout.prompts, self.env, id_prefix=prefix, seed=self.rollout.seed + zlib.crc32(prefix.encode())
        )
        self.counts = {
            "groups": 0,
            "samples": 0,
            "tokens": 0,
            "prompts_skipped": 0,
            "reward_errors": 0,
            "group_errors": 0,
            "reissued": 0,
            "weight_updates": 0,
            "weight_update_errors": 0,
            "admission_calls": 0,
            "admission_s": 0.0,
        }
        self._started_at = time.time()
        self._rate_samples: deque = deque()  # (time, tokens so far), for the recent rate
        self._retry: deque = deque()  # admitted prompts to run again (predecessor's, or failed here)
        self._samples_drawn = 0  # request ids of sample() calls
        self._weights_failed: tuple[str, int, float] | None = None  # (location, version, when)
        self._weights_blocked: str | None = None  # why admission is closed: announced weights failed to load
        self._tasks: set[asyncio.Task] = set()  # groups generating or being put
        self._slots_taken = 0  # of those, still generating (the slots of max_inflight_groups)
        self._slot_freed = asyncio.Event()
        self._main: asyncio.Task | None = None
        self._stopping = False
        # Pin before the loop thread exists: it spawns the engine, whose processes inherit its cores.
        pin_to_cores(self.rollout.cpu_affinity)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{generator_id}-loop", daemon=True)
        self._thread.start()
        self.engine: RolloutEngine = self._call(RolloutEngine.start(self.rollout, model_path))
        # One name per generator, so a crashed predecessor's kept weights are replaced, not leaked.
        self.engine.keep_path = os.path.join(cfg.sync.shm_dir, f".asyncrl-{run}-{generator_id}-last-good.safetensors")
        self.engine.drop_kept()
        # Until start(), a successor should do what our predecessor did (its prompts are still admitted).
        self._generating = predecessor_was_generating
        self._record_engine()
        location, version = self.run_state.weights()
        if location is not None and version > 0:
            try:  # joining (or restarting into) a running job
                self.update_weights(location, version)
            except (WeightLoadError, OSError) as e:  # the heartbeat poll tries again later
                self._weights_failed = (location, version, time.monotonic())
                log.warning("%s: could not load published weights v%d: %s", generator_id, version, e)
            self._call(self._warm_up())
        self._load_predecessor_inflight()
        log.info(
            "%s: incarnation %d, %d prompts re-issued from a predecessor", generator_id, incarnation, len(self._retry)
        )
        # A crashed generator's successor (Ray restart, or the same id started again) goes on
        # where it stopped without waiting for start(): Ray re-runs __init__ with the original
        # arguments, so an actor created with autostart=False would otherwise sit idle forever
        # on its predecessor's admitted prompts.
        if autostart or predecessor_was_generating or self._retry:
            self.start()

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

    def start(self) -> None:
        """Begin generating in the background (idempotent)."""

        async def begin():
            if self._main is None or self._main.done():
                self._stopping = False
                self.failure = None
                self._main = asyncio.ensure_future(self._run())
                self._main.add_done_callback(self._main_done)

        self._call(begin())
        self._generating = True
        self._record_engine()

    def stop(self, drain_timeout_s: float = 30.0) -> dict:
        """Stop admitting, let in-flight groups finish (up to the timeout), leave the job cleanly."""
        self._call(self._stop(drain_timeout_s))
        return self.stats()

    def update_weights(self, location: str, version: int) -> dict:
        """Apply weights in flight: pause (keep requests), load, label ``version``, resume."""
        return self._call(self._update(location, version))

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
            "inflight": len(self._tasks),
            "tokens_per_s": self._recent_tokens_per_s(),
            "generator_id": self.generator_id,
            "weights_blocked": self._weights_blocked,
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

    def transfer_world_size(self) -> int:
        return self.engine.llm.vllm_config.parallel_config.world_size

    def transfer_init(self, init_info: dict) -> None:
        self._call(self.engine.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info}))

    def transfer_begin(self) -> None:
        async def begin():
            await self.engine.pause(clear_cache=self.cfg.sync.inflight == "recompute")
            await self.engine.llm.start_weight_update()

        self._call(begin())

    def transfer_receive(self, update_info: dict) -> None:
        self._call(self.engine.llm.collective_rpc("update_weights", kwargs={"update_info": update_info}))

    def transfer_finish(self, version: int) -> None:
        async def finish():
            await self.engine.llm.finish_weight_update()
            await self.engine.set_version(version)
            if self.cfg.sync.inflight == "recompute":
                await self.engine.llm.reset_prefix_cache(reset_running_requests=True)
            await self.engine.llm.resume_generation()
            self.counts["weight_updates"] += 1

        self._call(finish())

    # ------------------------------------------------------------------ crash recovery

    def _reap_predecessor(self) -> bool:
        """Kill a crashed predecessor's orphaned engine processes; return whether it was generating."""
        record = self.run_state.engine_record(self.generator_id)
        if record is None:
            return False
        if record.get("host") == socket.gethostname():
            reaped = reap_processes(record.get("pids", []))
            if reaped:
                log.warning("%s: reaped %d orphaned engine processes %s", self.generator_id, len(reaped), reaped)
            removed = unlink_segments(record.get("segments", []))  # after the reap: nobody maps them
            if removed:
                log.warning("%s: deleted %d leaked shared-memory segments %s", self.generator_id, len(removed), removed)
        return bool(record.get("started", False))

    def _record_engine(self) -> None:
        """What a successor needs after a crash: our engine's PIDs, and whether we were generating."""
        self.run_state.set_engine_record(
            self.generator_id,
            {
                "host": socket.gethostname(),
                "pids": self.engine.engine_pids,
                "segments": self.engine.shm_segments,
                "started": self._generating,
            },
        )

    def _load_predecessor_inflight(self) -> None:
        for prompt_id, raw in self.run_state.inflight_prompts(self.generator_id).items():
            note = unpack_small(raw)
            ids = self.tokenizer.encode(note["text"])
            self._retry.append((prompt_id, note["text"], note["metadata"], ids))
            self.counts["reissued"] += 1

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        beat = asyncio.ensure_future(self._heartbeat_loop())
        try:
            while not self._stopping:
                # The next prompt is admitted (and noted) while every slot is still busy, so a
                # freed slot is refilled at once instead of idling the engine for two Redis
                # round trips. If we stop first, _stop releases it with the other noted ones.
                item = self._retry.popleft() if self._retry else await self._admit_next()
                if item is None:
                    continue
                while self._busy() and not self._stopping:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                if self._stopping:
                    break
                self._spawn(item)
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

    def _busy(self) -> bool:
        """All generation slots taken, or too many finished groups still waiting to be put
        (a full queue), which must stop us drawing more rather than pile them up in memory."""
        return (
            self._slots_taken >= self.rollout.max_inflight_groups
            or len(self._tasks) >= 2 * self.rollout.max_inflight_groups
        )

    async def _admit_next(self):
        """Draw a prompt and wait until admission lets it start; None if skipped or stopping."""
        item = self._next_prompt()
        if item is None:
            return None
        note = msgpack.packb({"text": item[1], "metadata": item[2]}, use_bin_type=True)
        while not self._stopping:
            if self._weights_blocked is not None:  # the heartbeat retries the load meanwhile
                await asyncio.sleep(HEARTBEAT_S)
                continue
            t0 = time.perf_counter()
            admitted = await asyncio.to_thread(
                self.run_state.admit_prompt, self.generator_id, item[0], note, self.engine.version
            )
            self.counts["admission_calls"] += 1
            self.counts["admission_s"] += time.perf_counter() - t0
            if admitted:
                return item
            await asyncio.sleep(ADMISSION_POLL_S)
        return None

    def _next_prompt(self):
        prompt_id, text, metadata = next(self.prompts)
        ids = self.tokenizer.encode(text)
        if len(ids) > self.rollout.max_prompt_tokens:
            self.counts["prompts_skipped"] += 1
            self.run_state.incr("prompts_skipped")
            return None
        return prompt_id, text, metadata, ids

    def _spawn(self, item) -> None:
        self._slots_taken += 1
        task = asyncio.ensure_future(self._produce(item))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._slot_freed.set()
        if task.cancelled() or task.exception() is None:
            return
        if self._stopping:  # a stop releases the prompt (queue.release_inflight): nothing is lost
            log.warning("%s: a group was not put before the stop: %s", self.generator_id, task.exception())
        else:
            # Only the put raises here (a failed rollout is re-issued in _produce). The prompt
            # stays noted in Redis, so the group is not lost if a successor takes over; a loop
            # that went on without it would leave the trainer one group short for good.
            self._fail("a finished group could not be put", task.exception())

    async def _produce(self, item) -> None:
        prompt_id = item[0]
        try:
            group = await self._rollout_group(*item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # engine trouble (e.g. rebuilt mid-request): run the prompt again
            self.counts["group_errors"] += 1
            log.warning(
                "%s: prompt %s failed (%s: %s); re-issuing it", self.generator_id, prompt_id, type(e).__name__, e
            )
            if not self._stopping:
                self._retry.append(item)
            return
        finally:  # the slot frees before the put: the next group generates while this one is sent
            self._slots_taken -= 1
            self._slot_freed.set()
        while True:
            try:
                return await asyncio.to_thread(self._put, group)
            except QueueFull as e:
                if self._stopping:
                    raise
                # The trainer is behind (or acks only at its checkpoints): keep the group. No
                # more are drawn meanwhile, since a waiting put keeps its task in _busy().
                log.warning("%s: still holding group %s: %s", self.generator_id, group.group_id, e)

    def _put(self, group: RolloutGroup) -> None:
        self.queue.put(group, timeout=self.cfg.queue.put_timeout_s, inflight_of=self.generator_id)
        self.counts["groups"] += 1
        self.counts["samples"] += len(group.samples)
        self.counts["tokens"] += group.num_tokens

    async def _rollout_group(self, prompt_id: str, text: str, metadata: dict, ids: list[int]) -> RolloutGroup:
        t0 = time.time()
        if self.env.multi_turn:
            samples = await self._multi_turn_samples(prompt_id, text, metadata, ids)
        else:
            # The prompt id is the request id: unique in the run, and it fixes the sampling seed.
            max_tokens = metadata.get("max_tokens")  # per-prompt budget (long-tailed workloads)
            if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
                max_tokens = max(1, min(max_tokens, self.rollout.engine_max_model_len - len(ids)))
            else:
                max_tokens = None
            completions = await self.engine.generate(ids, self.rollout.n_samples, prompt_id, max_tokens=max_tokens)
            samples = [self._sample(text, metadata, c, t0) for c in completions]
        # How in-flight requests met a weight update; "keep" means later tokens may have attended
        # to KV computed by older weights (a correction the learner may want to know about).
        meta = dict(metadata, inflight=self.cfg.sync.inflight)
        if self.cfg.sync.inflight == "keep" and any(
            s.token_versions is not None and len(set(s.token_versions.tolist())) > 1 for s in samples
        ):
            meta["stale_kv"] = True  # tokens after a mid-request update attended to older weights' KV
        # One group per prompt: a prompt re-issued after a crash that had in fact been put
        # carries the same id, so the queue drops the duplicate instead of training it twice.
        return RolloutGroup(
            group_id=prompt_id,
            prompt_id=prompt_id,
            prompt_ids=np.asarray(ids, np.int32),
            samples=samples,
            env=self.rollout.env,
            metadata=meta,
        )

    def _sample(self, prompt: str, metadata: dict, c, t0: float) -> Sample:
        reward, error = score_completion(self.env, self.tokenizer, prompt, c.token_ids, metadata)
        if error is not None:
            self.counts["reward_errors"] += 1
        n = len(c.token_ids)
        return Sample(
            response_ids=np.asarray(c.token_ids, np.int32),
            rollout_logprobs=np.asarray(c.logprobs, np.float32),
            loss_mask=np.ones(n, np.uint8),
            reward=reward,
            behavior_version=min(c.versions) if c.versions else self.engine.version,
            stop_reason=c.finish_reason,
            token_versions=np.asarray(c.versions, np.int32),
            generator_id=self.generator_id,
            timings={"generate_s": time.time() - t0, "finished_at": time.time()},
            error=error,
        )

    async def _multi_turn_samples(self, prompt_id: str, text: str, metadata: dict, ids: list[int]) -> list[Sample]:
        budget = self.rollout.engine_max_model_len - self.rollout.max_tokens

        async def one(k: int):
            turns = 0

            async def policy(context: list[int]) -> Turn:
                nonlocal turns
                turns += 1  # request id (and so seed) per trajectory and turn: reproducible
                c = (await self.engine.generate(context, 1, f"{prompt_id}/t{k}/{turns}"))[0]
                return Turn(c.token_ids, c.logprobs, c.versions, c.finish_reason)

            env = make_env(self.rollout.env, self.rollout.env_kwargs)  # episode state is per trajectory
            return await run_trajectory(
                env,
                text,
                metadata,
                policy,
                self.tokenizer.encode,
                lambda t: self.tokenizer.decode(t, skip_special_tokens=True),
                budget,
            )

        trajectories = await asyncio.gather(*(one(k) for k in range(self.rollout.n_samples)))
        if self.cfg.algo.stepwise:
            return [s for k, t in enumerate(trajectories) for s in to_step_samples(t, k, self.generator_id)]
        return [to_interleaved_sample(t, self.generator_id) for t in trajectories]

    async def _warm_up(self) -> None:
        """One full window of throw-away requests before the first admission. A cold vLLM-CPU
        engine takes seconds over its first batch (measured: 2.6 s for 16 groups of the demo,
        then 0.2 s): a generator joining a running job would spend them on admitted groups,
        which a trainer doing several steps a second has then moved past the staleness bound."""
        t0 = time.perf_counter()
        prompt = self.tokenizer.encode(next(self.prompts)[1])
        await asyncio.gather(
            *(
                self.engine.generate(
                    prompt,
                    self.rollout.n_samples,
                    f"{self.generator_id}.{self.incarnation}:warmup:{k}",
                    max_tokens=self.rollout.max_tokens,
                    ignore_eos=True,
                )
                for k in range(self.rollout.max_inflight_groups)
            )
        )
        log.info("%s: engine warmed up in %.1f s", self.generator_id, time.perf_counter() - t0)

    async def _update(self, location: str, version: int) -> dict:
        if version <= self.engine.version:
            return {"version": self.engine.version, "skipped": True}
        pids, path, t0 = self.engine.engine_pids, location, time.perf_counter()
        try:  # a ray-object:// location is fetched to a local file first (sync/objstore.py)
            path = await asyncio.to_thread(
                objstore.fetch, location, version, self.cfg.sync.shm_dir, f"{self.run}-{self.generator_id}"
            )
            fetch_s = time.perf_counter() - t0
            info = await self.engine.load_weights(path, version, inflight=self.cfg.sync.inflight)
        except (WeightLoadError, OSError) as e:
            self.counts["weight_update_errors"] += 1
            # Generating on the old weights would only make groups that are dropped as stale.
            if self._weights_blocked is None:
                log.error(
                    "%s: stopped admitting work: cannot load the announced weights v%d (%s): %s",
                    self.generator_id,
                    version,
                    location,
                    e,
                )
            self._weights_blocked = f"cannot load the announced weights v{version} ({location}): {e}"
            raise
        finally:
            objstore.discard(path, location)
            if self.engine.engine_pids is not pids:  # the engine was rebuilt: new processes to reap
                await asyncio.to_thread(self._record_engine)
        if self._weights_blocked is not None:
            log.warning("%s: weights v%d loaded; admitting work again", self.generator_id, version)
        self._weights_blocked = None
        if not info.get("skipped"):
            self.counts["weight_updates"] += 1
        return dict(info, fetch_s=fetch_s)

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
                location, version = await asyncio.to_thread(self.run_state.weights)
                if location is not None and version > self.engine.version and self._may_try(location, version):
                    try:
                        await self._update(location, version)
                    except (WeightLoadError, OSError):
                        self._weights_failed = (location, version, time.monotonic())
                        raise
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a missed beat or a failed self-update is retried next second
                log.warning("%s: heartbeat/weights poll failed: %s", self.generator_id, e)
            await asyncio.sleep(WEIGHTS_POLL_S)

    def _may_try(self, location: str, version: int) -> bool:
        """Not the weights that just failed to load: each failed attempt pauses the engine."""
        failed = self._weights_failed
        return failed is None or failed[:2] != (location, version) or time.monotonic() - failed[2] > WEIGHTS_RETRY_S

    async def _stop(self, drain_timeout_s: float) -> None:
        self._stopping = True
        self._slot_freed.set()
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._main), timeout=2.0)
            if not self._main.done():
                self._main.cancel()
        if self._tasks and drain_timeout_s > 0:
            await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
        unfinished = list(self._tasks)
        for t in unfinished:
            t.cancel()
        await self.engine.abort_all()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
        # A clean stop hands back what it admitted but never produced; a crash leaves the
        # in-flight hash for the successor instead.
        await asyncio.to_thread(self.run_state.release_inflight, self.generator_id)
        self._retry.clear()
        self._generating = False
        await asyncio.to_thread(self._record_engine)  # a successor must not auto-start
        await asyncio.to_thread(self.run_state.remove_generator, self.generator_id)
