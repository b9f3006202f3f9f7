"""Held-out prompts rolled out on a generator's engine the way its training prompts are.

    maker = GroupMaker(cfg, env, tokenizer, engine, "gen-0")    # evaluation's own: its own failure counts
    out = await evaluate_items(maker, items, temperature=0.0)   # EvalOutcome
    out.rewards, out.response_tokens, out.failures
    out = await held_out.run(prompts, 0.0, timeout_s, version=7)  # only samples made under v7

Each prompt is one ``GroupMaker.make`` group of one sample (or one trajectory): a single-turn
completion scored by the generator's RewardScorer, a multi-turn episode stepped through the
environment (rollout/envs/multiturn.py, or a library environment's own episode loop), so an
evaluation reward means what a training reward means for every environment. The trainer's
side is asyncrl/control/evaluate.py; generators run this through ``GeneratorActor.evaluate``.

An evaluation names the weight version it measures. A generator behind it waits for its engine
to load that version (within the evaluation's timeout); one past it, or still behind at the
timeout, takes no part. While its rollouts run it holds the engine's weight updates (a file
load waits, at most the timeout); a rollout any of whose tokens still came from another version
(an NCCL transfer, which cannot wait) is left out. Each is counted in ``off_version``: an
evaluation is never a mix of versions.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field

from asyncrl.config import Config
from asyncrl.rollout.engine import RolloutEngine
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.prompts import PromptItem
from asyncrl.rollout.vision_prompts import VisionModel
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

CANCELS_KEPT = 64
"""Cancelled evaluation ids a generator remembers (an evaluation's call may reach it after its
cancel); evaluations run one at a time, so a few would do."""


@dataclass
class EvalOutcome:
    """What a batch of held-out prompts gave: one entry per prompt that was rolled out, in order."""

    rewards: list[float] = field(default_factory=list)
    """The reward training would see (an episode's return); NaN where its scoring failed."""
    response_tokens: list[int] = field(default_factory=list)
    """Tokens the policy sampled: the completion, or every turn of the episode."""
    failures: int = 0
    """Rewards or episode scorings that failed or timed out (reward_on_failure ones included),
    and rollouts that raised (engine trouble), which training would have run again."""
    timeouts: int = 0
    """Prompts not rolled out within control.eval_timeout_s (abandoned, not in ``rewards``)."""
    not_run: int = 0
    """Prompts not rolled out at all: the engine holds no weights it can sample (a failed load
    it could not undo) and would wait for new ones."""
    version: int | None = None
    """The weight version asked for: every entry of ``rewards`` was produced under it alone.
    None: any version (a caller that names none)."""
    versions: list[int] = field(default_factory=list)
    """The version each entry of ``rewards`` was sampled under, when a version is named (empty
    otherwise): the trainer checks it is ``version`` throughout."""
    off_version: int = 0
    """Prompts left out because not produced under ``version``: the engine never reached it in
    time, had moved past it, or the weights changed while the rollout ran."""
    seconds: float = 0.0
    """Wall seconds this generator spent on the batch (waiting for the version included)."""


VERSION_POLL_S = 0.1
"""How often a generator behind the evaluated version looks at its engine's version again."""


def failed_so_far(maker: GroupMaker) -> int:
    return maker.scorer.errors + maker.scorer.timeouts


def reward_of(group: RolloutGroup) -> tuple[float, int]:
    """(reward, sampled tokens) of a one-sample group: step-wise samples of one trajectory all
    carry its return, an interleaved sample's observations have loss mask 0."""
    s = group.samples[0]
    reward = math.nan if any(x.error is not None for x in group.samples) else float(s.reward)
    return reward, sum(int(x.loss_mask.sum()) for x in group.samples)


def version_of(group: RolloutGroup) -> int | None:
    """The one weight version every token of the group was sampled under; None when they differ
    (or when a sample was submitted under an older version than its tokens say)."""
    seen: set[int] = set()
    for s in group.samples:
        seen.add(int(s.behavior_version))
        if s.token_versions is not None:
            seen.update(int(v) for v in s.token_versions.tolist())
    return seen.pop() if len(seen) == 1 else None


async def evaluate_items(
    maker: GroupMaker,
    items: list[PromptItem],
    temperature: float,
    timeout_s: float | None = None,
    version: int | None = None,
) -> EvalOutcome:
    """One rollout of each of ``items`` at ``temperature``, all at once on ``maker``'s engine;
    one not done in ``timeout_s`` is cancelled (its request aborted) and counted in ``timeouts``.
    With ``version``, a rollout not wholly sampled under it is counted in ``off_version`` instead
    of scored."""
    before = failed_so_far(maker)
    groups = await asyncio.gather(
        *(asyncio.wait_for(maker.make(item, n=1, temperature=temperature, teacher=False), timeout_s) for item in items),
        return_exceptions=True,
    )
    out = EvalOutcome(version=version)
    raised = 0
    for item, group in zip(items, groups, strict=True):
        if isinstance(group, asyncio.CancelledError):
            raise group
        if isinstance(group, asyncio.TimeoutError):  # builtins.TimeoutError on 3.11+, not on 3.10
            out.timeouts += 1
            log.warning(
                "evaluation prompt %s: not rolled out in %s s (control.eval_timeout_s)", item.prompt_id, timeout_s
            )
            continue
        if isinstance(group, BaseException):
            # Training would run the prompt again; a held-out set is scored once, so it counts as failed.
            raised += 1
            log.warning("evaluation prompt %s failed: %s: %s", item.prompt_id, type(group).__name__, group)
            continue
        if version is not None and version_of(group) != version:
            out.off_version += 1
            log.info("evaluation prompt %s: not sampled under v%d alone: left out", item.prompt_id, version)
            continue
        reward, tokens = reward_of(group)
        out.rewards.append(reward)
        out.response_tokens.append(tokens)
        if version is not None:
            out.versions.append(version)  # version_of(group) == version: checked above
    out.failures = failed_so_far(maker) - before + raised
    return out


class HeldOut:
    """A generator's evaluation side (``GeneratorActor.evaluate``): held-out prompts encoded as
    its training prompts are, rolled out by a GroupMaker of its own, built at the first call, so
    evaluation's failed rewards stay out of the training counts (rollout/reward_errors)."""

    def __init__(self, cfg: Config, env, tokenizer, engine: RolloutEngine, generator_id: str, encode):
        self.cfg, self.env, self.tokenizer, self.engine, self.generator_id = cfg, env, tokenizer, engine, generator_id
        self.encode = encode
        self.maker: GroupMaker | None = None
        self._running: dict[asyncio.Task, str | None] = {}
        self._cancelled: collections.deque[str] = collections.deque(maxlen=CANCELS_KEPT)

    def cancel(self, eval_id: str | None = None) -> int:
        """Cancel the evaluation ``eval_id`` (None: every one) running here: the trainer stops, no
        longer waits for it, and its hold on weight loads would hold the last publish. How many
        were running. Ray's cancel does not reach a coroutine on the generator's own loop: this
        does. The id is kept, so that an evaluation whose call had not yet reached the loop when
        its cancel came (both are calls on the actor's threads, in no set order) never starts."""
        if eval_id is not None:
            self._cancelled.append(eval_id)
        running = [t for t, i in self._running.items() if not t.done() and eval_id in (None, i)]
        for task in running:
            task.cancel()
        return len(running)

    async def run(
        self,
        prompts: list[tuple[str, str, dict]],
        temperature: float,
        timeout_s: float | None = None,
        version: int | None = None,
        eval_id: str | None = None,
    ) -> EvalOutcome:
        """(prompt id, text, metadata) -> one rollout each; the prompt id is its request id.
        An engine without weights it can sample (``closed``) would hold every request until new
        weights load: its prompts are reported as not run at once instead. With ``version``,
        only rollouts sampled under that weight version count (the module's docstring).
        ``eval_id`` names it for ``cancel``; one cancelled before it got here raises at once."""
        if eval_id is not None and eval_id in self._cancelled:
            raise asyncio.CancelledError(f"evaluation {eval_id} was cancelled before it started")
        t0 = time.monotonic()
        task = asyncio.current_task()
        if task is not None:
            self._running[task] = eval_id
        try:
            out = await self._run(prompts, temperature, timeout_s, version)
        finally:
            if task is not None:
                self._running.pop(task, None)
        out.seconds = time.monotonic() - t0
        return out

    async def _run(
        self, prompts: list[tuple[str, str, dict]], temperature: float, timeout_s: float | None, version: int | None
    ) -> EvalOutcome:
        if self.engine.closed is not None:
            log.warning("%s: %d evaluation prompts not run: %s", self.generator_id, len(prompts), self.engine.closed)
            return EvalOutcome(version=version, not_run=len(prompts))
        if self.maker is None:
            vision = VisionModel.of(self.engine.model_path)  # held-out prompts may carry images too
            self.maker = GroupMaker(self.cfg, self.env, self.tokenizer, self.engine, self.generator_id, vision)
        if version is None:
            return await evaluate_items(self.maker, self.items(prompts), temperature, timeout_s)
        waited = await self.reach(version, timeout_s)
        timeout_s = None if timeout_s is None else max(timeout_s - waited, VERSION_POLL_S)
        # A weight update that arrives meanwhile waits for the evaluation (at most its timeout):
        # otherwise one publish per step would supersede nearly every evaluation as it ran.
        async with self.engine.updates_held():
            if self.engine.closed is not None:  # a failed load while it waited
                gid, closed = self.generator_id, self.engine.closed
                log.warning("%s: %d evaluation prompts not run: %s", gid, len(prompts), closed)
                return EvalOutcome(version=version, not_run=len(prompts))
            if self.engine.version != version:
                log.warning(
                    "%s: %d evaluation prompts not run: the engine holds v%d, the evaluation measures v%d",
                    self.generator_id,
                    len(prompts),
                    self.engine.version,
                    version,
                )
                return EvalOutcome(version=version, off_version=len(prompts))
            return await evaluate_items(self.maker, self.items(prompts), temperature, timeout_s, version)

    async def reach(self, version: int, timeout_s: float | None) -> float:
        """Wait while the engine is behind ``version`` (within ``timeout_s``); seconds waited.
        An engine past it never comes back to it: no wait."""
        t0 = time.monotonic()
        while self.engine.version < version and self.engine.closed is None:
            if timeout_s is not None and time.monotonic() - t0 >= timeout_s:
                break
            await asyncio.sleep(VERSION_POLL_S)
        return time.monotonic() - t0

    def items(self, prompts: list[tuple[str, str, dict]]) -> list[PromptItem]:
        """The prompts encoded as the generator encodes its training prompts (rollout.chat_template)."""
        return [PromptItem(pid, text, meta, self.encode(text, meta)) for pid, text, meta in prompts]
