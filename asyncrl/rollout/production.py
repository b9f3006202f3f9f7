"""A generator's production line: draw a prompt, wait for admission, roll it out, put the group.

    line = Production(cfg, queue, run_state, engine, weights, groups, prompts, encode, "gen-0", on_fail)
    line.take_over(items)       # a crashed predecessor's admitted prompts, run first
    await line.run()            # on the generator's event loop, until line.halt()
    await line.drain(30.0)      # after halt(): let in-flight groups finish, cancel the rest
    line.counts.groups          # what it did so far (ProductionCounts)

Admission and the in-flight note in Redis are one atomic step (run_state.admit_prompt), and so
are the put and the note's removal. Up to rollout.max_inflight_groups groups generate at
once; a finished group is held through a full queue (put's timeout is logged, never a reason
to drop it) and, while held, keeps its task counted so no more prompts are drawn. A rollout
that fails (engine trouble) is re-issued under the same id; a put that fails for good is
handed to ``on_fail``, since a line that went on without it would leave the trainer one group
short for good. A request aborted under a group (an engine rebuild) fails the whole group
(RequestAborted, counted in ``counts.aborted``): torn samples are never scored or put. Re-issued
prompts wait, like new ones, while the announced weights cannot be loaded.

With rollout.drop_uniform_groups (DAPO's dynamic sampling), a finished group whose rewards all
tie (``GroupMaker.uniform``) is not put: its note is deleted, its admission handed back and
``dropped_uniform`` counted in one script (run_state.drop_admitted), and the line draws the
next prompt. The prompt is consumed, not retried: it comes back only when the prompt source
does (its next epoch). A dropped group never reaches the stream, so the ledger (produced =
trained + dropped-stale + dead-lettered + queued) is untouched by it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from asyncrl.config import Config
from asyncrl.queue.replay import QueueFull, RolloutQueue
from asyncrl.queue.runstate import RunState
from asyncrl.rollout.engine import PromptRefused, RequestAborted, RolloutEngine
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.prompts import PromptItem
from asyncrl.rollout.vision_prompts import PromptImageError
from asyncrl.rollout.watcher import WeightWatcher
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

ADMISSION_POLL_S = 0.05
BLOCKED_POLL_S = 1.0
"""While announced weights cannot be loaded, admission is retried this often (the weight
poll retries the load meanwhile)."""


@dataclass
class ProductionCounts:
    """What one production line did so far (GeneratorStats documents each count)."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    prompts_skipped: int = 0
    group_errors: int = 0
    aborted: int = 0
    reissued: int = 0
    dropped_uniform: int = 0
    admission_calls: int = 0
    admission_s: float = 0.0


class Production:
    """Admission, the slots of max_inflight_groups, rollout and put, for one generator."""

    def __init__(
        self,
        cfg: Config,
        queue: RolloutQueue,
        run_state: RunState,
        engine: RolloutEngine,
        weights: WeightWatcher,
        groups: GroupMaker,
        prompts: Iterator[tuple[str, str, dict[str, Any]]],  # (prompt_id, text, metadata)
        encode: Callable[[str, dict[str, Any]], list[int]],
        generator_id: str,
        on_fail: Callable[[str, BaseException], None],
    ):
        self.cfg, self.rollout, self.queue, self.engine = cfg, cfg.rollout, queue, engine
        self.run_state = run_state
        self.weights, self.groups, self.prompts, self.encode = weights, groups, prompts, encode
        self.generator_id = generator_id
        self.on_fail = on_fail
        """Told when a finished group cannot be put: the line cannot go on without it."""
        self.counts = ProductionCounts()
        self.retry: deque[PromptItem] = deque()  # admitted prompts to run again (predecessor's, or failed here)
        self.tasks: set[asyncio.Task] = set()  # groups generating or being put
        self.slots_taken = 0  # of those, still generating (the slots of max_inflight_groups)
        self.stopping = False
        self._slot_freed = asyncio.Event()

    def take_over(self, items: list[PromptItem]) -> None:
        """Run these admitted prompts (a predecessor's) first, without a second admission."""
        self.retry.extend(items)
        self.counts.reissued += len(items)

    async def run(self) -> None:
        while not self.stopping:
            # The next prompt is admitted (and noted) while every slot is still busy, so a
            # freed slot is refilled at once instead of idling the engine for two Redis
            # round trips. If we stop first, the stop releases it with the other noted ones.
            item = await self._reissue_next() if self.retry else await self._admit_next()
            if item is None:
                continue
            while self._busy() and not self.stopping:
                self._slot_freed.clear()
                await self._slot_freed.wait()
            if self.stopping:
                break
            self._spawn(item)

    def halt(self) -> None:
        """Stop admitting; a loop waiting for a free slot sees it at once."""
        self.stopping = True
        self._slot_freed.set()

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for in-flight groups, then cancel the rest and abort their requests."""
        if self.tasks and timeout_s > 0:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
        unfinished = list(self.tasks)
        for t in unfinished:
            t.cancel()
        await self.engine.abort_all()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
        self.retry.clear()

    def _busy(self) -> bool:
        """All generation slots taken, or too many finished groups still waiting to be put
        (a full queue), which must stop us drawing more rather than pile them up in memory."""
        return (
            self.slots_taken >= self.rollout.max_inflight_groups
            or len(self.tasks) >= 2 * self.rollout.max_inflight_groups
        )

    async def _reissue_next(self) -> PromptItem | None:
        """The next admitted prompt to run again, once the engine runs weights it may generate
        with (admitted already, so no second admission; but a prompt run while the announced
        weights cannot load would only make a group dropped as stale). None if stopping."""
        while self.weights.blocked is not None and not self.stopping:
            await asyncio.sleep(BLOCKED_POLL_S)
        return None if self.stopping else self.retry.popleft()

    async def _admit_next(self) -> PromptItem | None:
        """Draw a prompt and wait until admission lets it start; None if skipped or stopping."""
        item = self._next_prompt()
        if item is None:
            return None
        note = msgpack.packb({"text": item.text, "metadata": item.metadata}, use_bin_type=True)
        while not self.stopping:
            if self.weights.blocked is not None:
                await asyncio.sleep(BLOCKED_POLL_S)
                continue
            t0 = time.perf_counter()
            admitted = await asyncio.to_thread(
                self.run_state.admit_prompt, self.generator_id, item.prompt_id, note, self.engine.version
            )
            self.counts.admission_calls += 1
            self.counts.admission_s += time.perf_counter() - t0
            if admitted:
                return item
            await asyncio.sleep(ADMISSION_POLL_S)
        return None

    def _next_prompt(self) -> PromptItem | None:
        # A prompt whose group the trainer dropped as stale comes first (asyncrl.queue.reissue).
        reissued = self.run_state.pop_reissued(self.groups.image_limits)
        if reissued is not None:
            prompt_id, text, metadata = reissued.prompt_id, reissued.text, reissued.metadata
            try:
                ids = self.encode(text, metadata)
            except Exception as e:  # read back from Redis: untrusted (its images, its conversation), skipped
                log.warning("%s: re-issued prompt %r skipped: %s", self.generator_id, prompt_id[:200], e)
                self.counts.prompts_skipped += 1
                self.run_state.incr("prompts_skipped")
                return None
        else:
            prompt_id, text, metadata = next(self.prompts)
            ids = self.encode(text, metadata)  # a bad image from the environment stops the generator
        if self.groups.prompt_length(ids, metadata) > self.rollout.max_prompt_tokens:  # images expanded
            self.counts.prompts_skipped += 1
            self.run_state.incr("prompts_skipped")
            return None
        return PromptItem(prompt_id, text, metadata, ids)

    def _spawn(self, item: PromptItem) -> None:
        self.slots_taken += 1
        task = asyncio.ensure_future(self._produce(item))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self._slot_freed.set()
        error = None if task.cancelled() else task.exception()
        if error is None:
            return
        if self.stopping:  # a stop releases the prompt (run_state.release_inflight): nothing is lost
            log.warning("%s: a group was not put before the stop: %s", self.generator_id, error)
        else:
            # Only the put raises here (a failed rollout is re-issued in _produce). The prompt
            # stays noted in Redis, so the group is not lost if a successor takes over.
            self.on_fail("a finished group could not be put", error)

    async def _produce(self, item: PromptItem) -> None:
        try:
            group = await self.groups.make(item)
        except asyncio.CancelledError:
            raise
        except PromptImageError as e:
            # Checked as drawn, so what is left is the engine's expansion disagreeing with the
            # model's image tokens: every prompt would fail alike. Stop, with the reason.
            self.on_fail(f"prompt {item.prompt_id}: its images cannot be sampled", e)
            return
        except PromptRefused as e:
            # Refused as it is (e.g. too long once its images are expanded): run again, it would
            # be refused again, forever. Skipped with the reason; its admission goes back.
            log.warning("%s: prompt %s skipped: %s", self.generator_id, item.prompt_id[:200], e)
            self.counts.prompts_skipped += 1
            await asyncio.to_thread(self.run_state.drop_admitted, self.generator_id, item.prompt_id, "prompts_skipped")
            return
        except Exception as e:  # engine trouble (e.g. rebuilt mid-request): run the prompt again
            self.counts.group_errors += 1
            if isinstance(e, RequestAborted):  # its partial tokens were never scored nor put
                self.counts.aborted += 1
            log.warning(
                "%s: prompt %s failed (%s: %s); re-issuing it", self.generator_id, item.prompt_id, type(e).__name__, e
            )
            if not self.stopping:
                self.retry.append(item)
            return
        finally:  # the slot frees before the put: the next group generates while this one is sent
            self.slots_taken -= 1
            self._slot_freed.set()
        if self.rollout.drop_uniform_groups and self.groups.uniform(group):
            # Dropped, not put: the slot is already free and the admission goes back, so the
            # loop admits a fresh prompt in its place and the learner is not starved.
            if await asyncio.to_thread(self.run_state.drop_admitted, self.generator_id, item.prompt_id):
                self.counts.dropped_uniform += 1
            return
        while True:
            try:
                return await asyncio.to_thread(self._put, group)
            except QueueFull as e:
                if self.stopping:
                    raise
                # The trainer is behind (or acks only at its checkpoints): keep the group. No
                # more are drawn meanwhile, since a waiting put keeps its task in _busy().
                log.warning("%s: still holding group %s: %s", self.generator_id, group.group_id, e)

    def _put(self, group: RolloutGroup) -> None:
        self.queue.put(group, timeout=self.cfg.queue.put_timeout_s, inflight_of=self.generator_id)
        self.counts.groups += 1
        self.counts.samples += len(group.samples)
        self.counts.tokens += group.num_tokens
