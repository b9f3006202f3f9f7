"""Rewards off the generator's event loop, each call under a timeout, failures counted.

    scorer = RewardScorer(env, RewardLimits(timeout_s=30.0, workers=8, on_failure=None))
    reward, error = await scorer.score(prompt, response, metadata)
    scorer.timeouts, scorer.errors, scorer.pool.hung    # counts so far
    scorer.close()

A reward is user code (a sandboxed code run, a remote verifier): run on the loop it would stop
every group of the generator while it runs, and a hung one would stop them for good. Here:

- A plain ``def`` reward runs on ``RewardPool``, a fixed number of daemon threads, so the loop
  keeps generating and the samples of a group (and of all groups in flight) score in parallel.
  Threads, not processes: reward functions are closures, bound methods and environment objects
  that need not pickle, and the common slow reward waits on I/O (a verifier, a subprocess
  sandbox) which releases the GIL. A CPU-bound pure-Python reward should do its work in a
  subprocess of its own (and can then kill it on its own deadline).
- An ``async def`` reward is awaited on the loop under ``asyncio.wait_for`` (one that blocks
  without awaiting still blocks the loop: that is the function's bug, not something a timeout
  can interrupt).
- The timeout counts from the moment the call starts, not from when it was queued. A thread
  cannot be killed: a call past its timeout is abandoned (its thread finishes it in the
  background, its result discarded) and a fresh thread takes its place, so hung calls never
  shrink the pool; ``RewardPool.hung`` counts the abandoned threads still running.
- A call that times out, raises or returns something other than a finite number fails its
  sample: ``(NaN, why)``, which the learner leaves out of the loss, or, with
  ``RewardLimits.on_failure`` set, ``(on_failure, None)`` and the sample is trained on with
  that reward (verl's and SkyRL's convention). Either way it is counted (``timeouts``,
  ``errors``) and logged once per distinct failure, never per sample. A multi-turn episode
  whose reward failed inside the environment (the tools env) comes through the same rules
  (``failed``).
- The share of the last ``FAILURE_WINDOW`` scorings that failed is ``failure_rate`` (with the
  reward the last failure named): the generator's heartbeat carries it, and the trainer's
  console and the dashboard raise an alert above monitor.alert_reward_failure_rate, since a
  reward outage otherwise looks like a task whose groups all tie.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rollout.envs.base import Environment, RewardError, check_reward_value
from asyncrl.rollout.envs.reward_fns import WeightedRewards

log = logging.getLogger(__name__)

MAX_LOGGED_KINDS = 256
"""Distinct failures logged in full; past this a flood of distinct messages is only counted."""
FAILURE_WINDOW = 100
"""The failure rate is over this many of the latest scorings."""
FAILURE_MIN_SCORED = 10
"""Fewer scorings than this give no failure rate (one early failure is not an outage)."""


class RewardTimeout(RewardError):
    """A reward call ran past its timeout."""


@dataclass(frozen=True)
class RewardLimits:
    timeout_s: float = 30.0
    """Seconds one reward call may run (per function of rollout.rewards, unless it sets its own)."""
    workers: int = 8
    """Threads running plain ``def`` rewards at once."""
    on_failure: float | None = None
    """None: a failed reward is NaN and its sample is left out of the loss; a number: its reward."""

    @classmethod
    def from_rollout(cls, rollout) -> RewardLimits:
        return cls(rollout.reward_timeout_s, rollout.reward_workers, rollout.reward_on_failure)


@dataclass(frozen=True)
class Score:
    """One sample's scoring: its reward, why it has none (NaN), and whether the reward failed
    (also true when rollout.reward_on_failure stood in for it: then ``error`` is None)."""

    reward: float
    error: str | None = None
    failed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    """What the reward counted doing it (``Environment.reward_with_counts``: tests run, timeouts...);
    the trainer sums them per step into rollout/<name> for the names its catalogue knows."""


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    started: asyncio.Future = field(init=False)
    done: asyncio.Future = field(init=False)
    cancelled: bool = False
    finished: bool = False
    abandoned: bool = False

    def __post_init__(self) -> None:
        self.started = self.loop.create_future()
        self.done = self.loop.create_future()

    def post(self, fut: asyncio.Future, value: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if fut.done():  # the caller gave up (timeout, cancel): nobody wants this any more
                return
            if exc is None:
                fut.set_result(value)
            else:
                fut.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # a closed loop (the generator stopped): nothing to tell
            self.loop.call_soon_threadsafe(settle)


class RewardPool:
    """``workers`` daemon threads running plain reward calls; a call past its timeout is
    abandoned to its thread and a new thread replaces it. Daemon threads: a hung reward must
    not keep the process from exiting either."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.workers = workers
        self.hung = 0
        """Threads still running a call that was abandoned past its timeout."""
        self.abandoned = 0
        """Calls abandoned so far (hung now or finished late)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="asyncrl-reward", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:
                continue
            job.post(job.started)
            try:
                job.post(job.done, job.fn(*job.args, **job.kwargs))
            except Exception as e:  # user code: whatever it raises goes to its caller
                job.post(job.done, exc=e)
            except BaseException as e:  # sys.exit() in a reward fails that sample, not the generator
                job.post(job.done, exc=RuntimeError(f"{type(e).__name__}: {e}"))
            with self._lock:
                job.finished = True
                if job.abandoned:  # a replacement already took this thread's place
                    self.hung -= 1
                    return

    async def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """``fn(*args, **kwargs)`` on a pool thread; RewardTimeout once it has run ``timeout_s``."""
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        job = _Job(fn, args, kwargs, asyncio.get_running_loop())
        self._jobs.put(job)
        try:
            await job.started
        except asyncio.CancelledError:
            job.cancelled = True  # still queued: the thread that picks it up skips it
            raise
        try:
            return await asyncio.wait_for(job.done, timeout_s)
        except TimeoutError:
            self._abandon(job)
            raise RewardTimeout(f"did not return within {timeout_s:g} s") from None
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    def _abandon(self, job: _Job) -> None:
        with self._lock:
            if job.finished:
                return
            job.abandoned = True
            self.hung += 1
            self.abandoned += 1
            hung = self.hung
        self._spawn()
        # Never returning costs a thread per call: say so loudly as the count doubles, rather
        # than cap the replacements and let queued samples wait behind hung threads for good.
        if hung >= self.workers and hung & (hung - 1) == 0:
            log.warning(
                "%d reward threads are hung (calls abandoned past their timeout, still running): "
                "a reward that never returns leaks one thread per call; fix it or give it its own deadline",
                hung,
            )

    def close(self) -> None:
        """Stop the idle threads; hung ones are daemons and end with the process."""
        self._closed = True
        for _ in range(self.workers):
            self._jobs.put(None)


class RewardScorer:
    """Scores samples for one generator: ``env``'s reward, or each function of
    ``rollout.rewards`` (WeightedRewards) as its own call with its own timeout."""

    def __init__(self, env: Environment, limits: RewardLimits):
        self.env, self.limits = env, limits
        self.pool = RewardPool(limits.workers)
        self.timeouts = 0
        self.errors = 0
        """Reward calls that raised or returned a non-number (timeouts not included)."""
        self._logged: set[tuple[str, str]] = set()
        self._recent: deque[bool] = deque(maxlen=FAILURE_WINDOW)
        self.last_failure = ""
        """The latest failure's message (it names the reward that failed), cut to 300 characters."""

    @property
    def failure_rate(self) -> float | None:
        """Failed share of the latest FAILURE_WINDOW scorings (None before FAILURE_MIN_SCORED)."""
        if len(self._recent) < FAILURE_MIN_SCORED:
            return None
        return sum(self._recent) / len(self._recent)

    async def score_completion(
        self, tokenizer: Any, prompt: str, token_ids: Sequence[int], metadata: dict[str, Any]
    ) -> Score:
        """A sampled completion decoded the way every reward reads it (special tokens dropped),
        then scored: training and evaluation both come through here, so they judge the same text."""
        return await self.judge(prompt, tokenizer.decode(token_ids, skip_special_tokens=True), metadata)

    async def score(self, prompt: str, response: str, metadata: dict[str, Any]) -> tuple[float, str | None]:
        """(reward, None), or for a failed call (on_failure or NaN, why) as the module says."""
        out = await self.judge(prompt, response, metadata)
        return out.reward, out.error

    async def judge(self, prompt: str, response: str, metadata: dict[str, Any]) -> Score:
        """``score``, telling a failure apart even when rollout.reward_on_failure stands in for it."""
        counts: dict[str, int] = {}
        try:
            if isinstance(self.env, WeightedRewards):
                value = await self._weighted(self.env, prompt, response, metadata)
            else:
                name = f"{type(self.env).__name__}.reward"
                counted = getattr(self.env, "reward_with_counts", None)
                # Positional, as the Environment contract calls it (subclasses name them freely).
                out = await self._call(name, counted or self.env.reward, (prompt, response, metadata), {})
                if counted is not None:
                    out, counts = _split_counts(name, out)
                value = check_reward_value(name, out)
        except RewardError as e:
            return self.failed(e)
        self.succeeded()
        return Score(value, counts=counts)

    def succeeded(self) -> None:
        """Note a scoring that worked (for the failure rate): an episode scored by its environment."""
        self._recent.append(False)

    async def _weighted(self, env: WeightedRewards, prompt: str, response: str, metadata: dict[str, Any]) -> float:
        kwargs = env.call_kwargs(prompt, response, metadata)
        calls = [self._call(f.path, f.fn, (), kwargs, f.timeout_s) for f in env.fns]
        outs = await asyncio.gather(*calls, return_exceptions=True)
        for out in outs:  # the first failure fails the sample; the others have been awaited
            if isinstance(out, BaseException):
                raise out
        try:
            return env.combine(outs)
        except ValueError as e:  # a function returned a non-number: its failure, named in e
            raise RewardError(str(e)) from e

    async def _call(
        self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], timeout_s: float | None = None
    ):
        timeout = timeout_s if timeout_s is not None else self.limits.timeout_s
        try:
            if inspect.iscoroutinefunction(fn):
                try:
                    return await asyncio.wait_for(fn(*args, **kwargs), timeout)
                except TimeoutError:
                    raise RewardTimeout(f"did not return within {timeout:g} s") from None
            out = await self.pool.call(fn, args, kwargs, timeout)
            if inspect.iscoroutine(out):  # an object whose __call__ is async: await it here
                try:
                    return await asyncio.wait_for(out, timeout)
                except TimeoutError:
                    raise RewardTimeout(f"did not return within {timeout:g} s") from None
            return out
        except RewardTimeout as e:
            raise RewardTimeout(f"{name} {e}") from None
        except RewardError:
            raise
        except Exception as e:  # user code: any exception is the reward's failure, not ours
            raise RewardError(f"{name} raised {type(e).__name__}: {e}") from e

    def failed(self, e: RewardError) -> Score:
        """The shared rules for a failed reward: counted, logged once per kind, and scored
        rollout.reward_on_failure or NaN with why."""
        self._recent.append(True)
        self.last_failure = str(e)[:300]
        timed_out = isinstance(e, RewardTimeout)
        if timed_out:
            self.timeouts += 1
        else:
            self.errors += 1
        # One line per kind of failure (which call, which exception), not per sample: a broken
        # reward fails every sample, and its message usually embeds the sample's text.
        kind = (str(e).partition(" ")[0], type(e.__cause__ or e).__name__)
        if kind not in self._logged and len(self._logged) < MAX_LOGGED_KINDS:
            self._logged.add(kind)
            log.warning(
                "reward failed (%s): %s; further failures like it are only counted (rollout/reward_%s)",
                "timeout" if timed_out else "error",
                e,
                "timeouts" if timed_out else "errors",
            )
        if self.limits.on_failure is not None:
            return Score(self.limits.on_failure, None, failed=True)
        return Score(math.nan, str(e), failed=True)

    def close(self) -> None:
        self.pool.close()


def _split_counts(name: str, out: Any) -> tuple[Any, dict[str, int]]:
    """``reward_with_counts``'s (reward, counts); a RewardError naming ``name`` when it is not that."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise RewardError(f"{name}_with_counts returned {out!r:.100}, expected (reward, {{name: count}})")
    counts = {k: v for k, v in out[1].items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
    return out[0], counts
