"""Evaluation every `control.eval_every` steps: a fixed held-out prompt set, rolled out by the
run's own generators (greedy by default) exactly as they roll out training prompts, logged as `eval/*`.

    ev = Evaluator(cfg)                        # draws the held-out prompts once
    metrics = ev.run(rt.generators)            # {"eval/reward_mean": ..., ...}

The set is `control.eval_size` prompts from `control.eval_prompts` (any prompt source
rollout.prompts takes, its `control.eval_split`; rollout.prompt_field / answer_field /
chat_template apply as in training), or, without one, from the environment with a seed of
its own, so it is the same set at every evaluation and across a resume. The prompts go to the
generators in round-robin batches through `GeneratorActor.evaluate` (asyncrl.rollout.evaluation),
next to their training work: each is one group of one sample through the generator's own
GroupMaker, so a single-turn completion is scored by the same RewardScorer and a multi-turn
episode is stepped through the environment as in training, and an eval reward means what a
training reward means. Nothing is admitted, queued or trained; the trainer waits for the answers.
A prompt's id is its request id, so at one set of weights every evaluation samples with the same seeds.
An evaluation is bounded by control.eval_timeout_s: what is not rolled out by then, or comes
from a generator that died, is reported (eval/timeouts, eval/failed) and the run goes on.

An evaluation measures one named weight version: the one the trainer last published when it
is due (eval/version, and eval/step the step it was due at). A generator behind that version
waits for it, one past it (or never reaching it) takes no part, and a rollout whose weights
changed under it is left out (eval/off_version): never a mix of versions. It does not pause
training: the loop's EvalSchedule starts it and goes on; its row lands in the metrics of the
step at which the last answer is in (at the latest the run's last step, which waits for it),
with its cost (eval/wall_s, and eval/generator_s the generators' seconds on it). While one runs,
a due evaluation is skipped (eval/skipped counts them). A generator's answer is checked before
it is counted: one that is not a well-formed outcome for this version counts as failed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.config import Config
from asyncrl.data.images import ImageLimits
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.evaluation import EvalOutcome
from asyncrl.rollout.prompts import open_prompts
from asyncrl.seeding import rollout_seed

log = logging.getLogger(__name__)

EVAL_GRACE_S = 30.0
"""The trainer waits control.eval_timeout_s plus this (at most the timeout again) for answers."""

STOP_POLL_S = 0.5
"""How often a wait for the last step's evaluation looks at the stop flag."""

EVAL_SEED_OFFSET = 1_000_003
"""Env-made eval prompts use seed + this: a stream of their own, not the generators'."""


class Evaluator:
    def __init__(self, cfg: Config):
        c, r = cfg.control, cfg.rollout
        self.temperature = c.eval_temperature
        self.timeout_s = c.eval_timeout_s
        self.grace_s = min(EVAL_GRACE_S, c.eval_timeout_s)
        """Past the generators' own timeout, for their answer to come back."""
        stream = open_prompts(
            c.eval_prompts,
            make_env(r.env, r.env_kwargs),  # for its prompts only: the generators score
            seed=rollout_seed(cfg) + EVAL_SEED_OFFSET,
            id_prefix="eval",
            split=c.eval_split,
            prompt_field=r.prompt_field,
            answer_field=r.answer_field,
            where="control.eval_prompts",
            image_limits=ImageLimits.of(r.images),
        )
        self.prompts: list[tuple[str, str, dict]] = list(itertools.islice(stream, c.eval_size))

    def run(self, generators: list, step: int | None = None, version: int | None = None) -> dict[str, float]:
        """eval/* metrics over the held-out prompts; logged as the evaluation at ``step``, of
        weight ``version`` (None: whatever each generator holds). Waits for the answers.

        Bounded: each generator rolls its prompts out within control.eval_timeout_s, and the
        trainer waits that long (plus a grace for the answer to travel) for the generators. A
        prompt not rolled out in time is one of eval/timeouts; a generator that died or whose
        call raised, or whose engine could not sample, makes its prompts eval/failed. The run
        goes on either way: an evaluation is a measurement, not a step."""
        return self.start(generators, step, version).collect()

    def start(self, generators: list, step: int | None = None, version: int | None = None) -> PendingEval:
        """Hand each generator its share of the prompts and return at once."""
        shares = [(gen, self.prompts[i :: len(generators)]) for i, gen in enumerate(generators)] if generators else []
        eval_id = uuid.uuid4().hex
        calls = {
            gen.evaluate.remote(batch, self.temperature, self.timeout_s, version, eval_id): len(batch)
            for gen, batch in shares
            if batch
        }
        return PendingEval(
            generators=[gen for gen, batch in shares if batch],
            step=step,
            version=version,
            prompts=len(self.prompts),
            calls=calls,
            eval_id=eval_id,
            deadline_s=self.timeout_s + self.grace_s,
            timeout_s=self.timeout_s,
        )


@dataclass
class PendingEval:
    """An evaluation handed to the generators: poll ``ready()``, then ``collect()`` its metrics."""

    generators: list
    """The generators it was handed to (``cancel`` stops their rollouts)."""
    step: int | None
    version: int | None
    prompts: int
    calls: dict
    """Ray call -> how many prompts it carries."""
    eval_id: str
    """Names it on the generators, for ``cancel``."""
    deadline_s: float
    timeout_s: float
    t0: float = field(default_factory=time.perf_counter)

    def ready(self) -> bool:
        """Every generator answered, or the trainer has waited long enough."""
        import ray

        if time.perf_counter() - self.t0 >= self.deadline_s or not self.calls:
            return True
        _, pending = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        return not pending

    def collect(self, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """eval/* metrics, waiting (to the deadline at most) for the generators still running;
        a ``stop`` that turns true (SIGTERM: preemption has a grace to keep) ends the wait, and
        what is not in by then counts as timed out."""
        import ray

        calls = self.calls
        failed = self.prompts - sum(calls.values())  # no generator to run them
        ready: list = []
        pending = list(calls)
        stopped = False
        while pending:
            left = self.deadline_s - (time.perf_counter() - self.t0)
            stopped = stop is not None and stop()
            wait = 0.0 if left <= 0 or stopped else min(left, STOP_POLL_S)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
            ready += done  # those in by now count, whatever ends the wait
            if wait == 0.0:
                break
        outs: list[EvalOutcome] = []
        for ref in ready:
            try:
                answer = ray.get(ref)
            except Exception as e:  # the generator died (RayActorError) or its call raised
                failed += calls[ref]
                log.warning("evaluation: %d prompts failed: %s: %s", calls[ref], type(e).__name__, str(e)[:300])
                continue
            problem = check_outcome(answer, calls[ref], self.version)
            if problem is not None:  # a generator's answer is untrusted input, like Redis's
                failed += calls[ref]
                log.warning("evaluation: an answer for %d prompts ignored: %s", calls[ref], problem)
                continue
            outs.append(answer)
        timeouts = sum(calls[ref] for ref in pending)
        for ref in pending:  # best effort: the generator abandons its own rollouts at its timeout
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        if pending and stopped:
            log.warning("evaluation: the run stops; %d prompts not waited for", timeouts)
        elif pending:
            log.warning(
                "evaluation: %d generator(s) did not answer within %.0f s (control.eval_timeout_s): %d prompts",
                len(pending),
                self.timeout_s,
                timeouts,
            )
        return self._metrics(outs, failed, timeouts)

    def cancel(self) -> None:
        """Abandon it: ray.cancel does not reach a coroutine on a generator's loop, which would
        go on holding its weight loads (and the trainer's last publish) to eval_timeout_s."""
        import ray

        for ref in self.calls:
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        for gen in self.generators:
            with contextlib.suppress(Exception):  # a stand-in or a dead actor: nothing to stop
                gen.cancel_evaluations.remote(self.eval_id)

    def _metrics(self, outs: list[EvalOutcome], failed: int, timeouts: int) -> dict[str, float]:
        rewards = [x for o in outs for x in o.rewards if not math.isnan(x)]
        lengths = [n for o in outs for n in o.response_tokens]
        wall_s = time.perf_counter() - self.t0
        out = {
            "eval/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "eval/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "eval/response_length_mean": statistics.fmean(lengths) if lengths else math.nan,
            "eval/reward_errors": float(sum(o.failures for o in outs)),
            "eval/timeouts": float(timeouts + sum(o.timeouts for o in outs)),
            "eval/failed": float(failed + sum(o.not_run for o in outs)),
            "eval/prompts": float(self.prompts),
            "eval/measured": float(sum(len(o.rewards) for o in outs)),
            "eval/off_version": float(sum(o.off_version for o in outs)),
            "eval/wall_s": wall_s,
            "eval/generator_s": float(sum(o.seconds for o in outs)),
        }
        if self.version is not None:
            out["eval/version"] = float(self.version)
        if self.step is not None:
            out["eval/step"] = float(self.step)
        log.info(
            "eval due at step %s, of v%s: reward %.3f over %d of %d prompts (%d off version, %.1f s)",
            self.step,
            self.version,
            out["eval/reward_mean"],
            int(out["eval/measured"]),
            self.prompts,
            int(out["eval/off_version"]),
            wall_s,
        )
        return out


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


def check_outcome(answer: object, prompts: int, version: int | None) -> str | None:
    """Why a generator's answer to ``prompts`` prompts of weight ``version`` cannot be counted
    (None: it can). Nothing in it is trusted: its type, its lists and its counts are checked."""
    if not isinstance(answer, EvalOutcome):
        return f"not an evaluation outcome but {type(answer).__name__}"
    if answer.version != version:
        return f"it measured v{answer.version!r}, the evaluation measures v{version}"
    if not isinstance(answer.rewards, list) or not all(type(r) is float and not math.isinf(r) for r in answer.rewards):
        return "its rewards are not a list of finite floats (NaN for a failed scoring)"
    n = len(answer.rewards)
    if not isinstance(answer.response_tokens, list) or len(answer.response_tokens) != n:
        return f"its response lengths do not pair with its {n} rewards"
    if not all(_count(t) for t in answer.response_tokens):
        return "a response length that is not a count"
    if version is not None and (not isinstance(answer.versions, list) or answer.versions != [version] * n):
        return f"a reward it sampled under a version other than v{version}"
    counts = (answer.failures, answer.timeouts, answer.not_run, answer.off_version)
    if not all(_count(c) for c in counts):
        return f"counts that are not counts: {counts!r}"
    if n + answer.timeouts + answer.not_run + answer.off_version > prompts:
        return f"it accounts for more prompts than the {prompts} it was given"
    if not isinstance(answer.seconds, float) or not math.isfinite(answer.seconds) or answer.seconds < 0:
        return f"seconds {answer.seconds!r} is not a duration"
    return None


class EvalSchedule:
    """The loop's evaluations (control.eval_every): at most one in flight; it never holds a step
    but the run's last, which waits for it so that no evaluation is lost."""

    def __init__(self, cfg: Config, stop: Callable[[], bool] | None = None):
        self.cfg = cfg
        self.stop = stop
        """True once the run is asked to stop: the last step's wait for an evaluation ends."""
        self.evaluator: Evaluator | None = None
        self.pending: PendingEval | None = None
        self.skipped = 0

    def on_step(self, step: int, version: int, generators: list, last: bool) -> dict[str, float]:
        """eval/* metrics for this step's row: those of an evaluation whose answers are in."""
        every = self.cfg.control.eval_every
        out: dict[str, float] = {}
        if self.pending is not None and (last or self.pending.ready()):
            out = self.pending.collect(self.stop)
            self.pending = None
        skipped = self.skipped
        if every and step % every == 0 and not generators:
            self.skipped += 1
            log.warning("evaluation due at step %d skipped: no generator is running", step)
        elif every and step % every == 0:
            if self.pending is not None:
                self.skipped += 1
                log.warning(
                    "evaluation due at step %d skipped: the one due at step %s still runs", step, self.pending.step
                )
            else:
                if self.evaluator is None:
                    self.evaluator = Evaluator(self.cfg)
                self.pending = self.evaluator.start(generators, step=step, version=version)
                if last:
                    out = self.pending.collect(self.stop)
                    self.pending = None
        if out or self.skipped != skipped:
            out["eval/skipped"] = float(self.skipped)
        return out

    def close(self) -> None:
        """A run that stops early abandons the evaluation in flight."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None
