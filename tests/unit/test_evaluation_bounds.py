"""Evaluation is bounded (control.eval_timeout_s): a held-out rollout that never ends is
abandoned and counted, an engine that cannot sample reports its prompts at once, and the
rest are scored as before. An evaluation of a named weight version scores only rollouts
sampled under it alone, and the trainer checks every answer before it counts it. The
trainer's side (generators that hang or die) is
tests/integration/test_rollout_reproducible.py::test_an_evaluation_is_bounded_and_reports_what_it_lost.

.venv/bin/python -m pytest tests/unit/test_evaluation_bounds.py -q
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from asyncrl.config import Config
from asyncrl.control.evaluate import check_outcome
from asyncrl.rollout.evaluation import EvalOutcome, HeldOut, evaluate_items, version_of
from asyncrl.rollout.prompts import PromptItem


class Maker:
    """A GroupMaker's surface as evaluate_items uses it: one prompt's rollout never ends (an
    engine that holds its request), one raises, the others give a one-sample group."""

    def __init__(self) -> None:
        self.scorer = SimpleNamespace(errors=0, timeouts=0)
        self.episode_errors = 0
        self.cancelled: list[str] = []

    async def make(self, item: PromptItem, n: int, temperature: float, teacher: bool = True):
        if item.prompt_id == "hangs":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(item.prompt_id)
                raise
        if item.prompt_id == "raises":
            raise RuntimeError("engine trouble")
        sample = SimpleNamespace(reward=0.5, error=None, loss_mask=np.ones(3, np.int8))
        return SimpleNamespace(samples=[sample])


def items(*ids: str) -> list[PromptItem]:
    return [PromptItem(pid, "ab=", {}, [1, 2, 3]) for pid in ids]


def test_a_rollout_past_the_timeout_is_abandoned_and_counted():
    maker = Maker()
    out = asyncio.run(evaluate_items(maker, items("a", "hangs", "raises", "b"), 0.0, timeout_s=0.5))  # type: ignore[arg-type]
    assert out.rewards == [0.5, 0.5] and out.response_tokens == [3, 3]
    assert out.timeouts == 1 and out.failures == 1 and out.not_run == 0
    assert maker.cancelled == ["hangs"]  # its request is aborted, not left running on the engine


def test_an_engine_that_cannot_sample_reports_its_prompts_at_once():
    """After a failed load it could not undo, the engine takes no request until new weights
    load: evaluation does not wait for that."""
    engine = SimpleNamespace(closed="version 3's weights are gone; it holds version 0's")

    def encode(text, meta):
        raise AssertionError("nothing is encoded or run")

    held_out = HeldOut(Config(), None, None, engine, "gen-0", encode)  # type: ignore[arg-type]
    out = asyncio.run(held_out.run([("eval-0", "ab=", {}), ("eval-1", "ba=", {})], 0.0, timeout_s=600.0))
    assert out.not_run == 2 and out.rewards == [] and out.timeouts == 0


# ------------------------------------------------------------------ one named weight version


def group_under(*versions: int, behavior: int | None = None):
    """A one-sample group whose tokens were sampled under ``versions`` (submitted at ``behavior``)."""
    sample = SimpleNamespace(
        reward=1.0,
        error=None,
        loss_mask=np.ones(len(versions), np.int8),
        behavior_version=min(versions) if behavior is None else behavior,
        token_versions=np.asarray(versions, np.int32),
    )
    return SimpleNamespace(samples=[sample], behavior_version=sample.behavior_version)


class VersionedMaker(Maker):
    """Each prompt's rollout comes out under the versions its id names ("v3", "v3-4"); with an
    engine, under the engine's version once ``seconds`` have passed (a rollout that takes time)."""

    def __init__(self, engine=None, seconds: float = 0.0) -> None:
        super().__init__()
        self.engine, self.seconds = engine, seconds

    async def make(self, item: PromptItem, n: int, temperature: float, teacher: bool = True):
        if self.engine is not None:
            start = self.engine.version
            await asyncio.sleep(self.seconds)
            return group_under(start, self.engine.version)
        return group_under(*(int(v) for v in item.prompt_id[1:].split("-")))


def test_a_rollout_not_sampled_under_the_named_version_alone_is_left_out():
    """The weights changed while it ran (tokens of two versions), or it ran wholly on another:
    counted in off_version, never scored; without a named version all are scored."""
    out = asyncio.run(evaluate_items(VersionedMaker(), items("v3", "v3-4", "v4", "v3"), 0.0, version=3))  # type: ignore[arg-type]
    assert out.version == 3 and out.versions == [3, 3] and out.rewards == [1.0, 1.0] and out.off_version == 2
    anything = asyncio.run(evaluate_items(VersionedMaker(), items("v3", "v3-4"), 0.0))  # type: ignore[arg-type]
    assert anything.off_version == 0 and len(anything.rewards) == 2


def test_a_request_submitted_under_an_older_version_is_not_of_the_newer():
    """sync.inflight=keep: tokens all of v4, but the request was submitted (and its prompt
    prefilled) under v3."""
    assert version_of(group_under(4, 4, behavior=3)) is None  # type: ignore[arg-type]
    assert version_of(group_under(4, 4)) == 4  # type: ignore[arg-type]


class Engine:
    """The engine's surface HeldOut reads: its version (raised by ``load_after``) and ``closed``."""

    def __init__(self, version: int):
        self.version, self.closed = version, None
        self.lock = asyncio.Lock()

    def updates_held(self) -> asyncio.Lock:
        return self.lock

    async def load_after(self, seconds: float, version: int) -> None:
        await asyncio.sleep(seconds)
        async with self.lock:  # as RolloutEngine.load_weights
            self.version = version


def held_out(engine: Engine, seconds: float = 0.0) -> HeldOut:
    h = HeldOut(Config(), None, None, engine, "gen-0", lambda text, meta: [1, 2])  # type: ignore[arg-type]
    h.maker = VersionedMaker(engine, seconds)  # type: ignore[assignment]
    return h


PROMPTS = [("v5", "ab=", {}), ("v5", "ba=", {})]


def test_a_generator_behind_the_version_waits_for_it_then_evaluates():
    engine = Engine(4)

    async def main():
        loading = asyncio.ensure_future(engine.load_after(0.3, 5))
        out = await held_out(engine).run(PROMPTS, 0.0, timeout_s=600.0, version=5)
        await loading
        return out

    out = asyncio.run(main())
    assert out.versions == [5, 5] and out.off_version == 0 and out.seconds > 0


def test_a_generator_past_the_version_or_never_reaching_it_takes_no_part():
    """Past it: no wait (an engine never goes back). Behind it until the timeout: left out."""
    past = asyncio.run(held_out(Engine(6)).run(PROMPTS, 0.0, timeout_s=600.0, version=5))
    assert past.off_version == 2 and past.rewards == [] and past.seconds < 600
    behind = asyncio.run(held_out(Engine(4)).run(PROMPTS, 0.0, timeout_s=0.3, version=5))
    assert behind.off_version == 2 and behind.rewards == [] and behind.version == 5


def test_an_answer_is_checked_before_it_is_counted():
    """A generator's answer crosses a process boundary: each way it can be wrong is refused with
    a reason, and a well-formed one passes."""
    good = EvalOutcome(rewards=[1.0, math.nan], response_tokens=[2, 3], version=5, versions=[5, 5], seconds=0.5)
    assert check_outcome(good, 3, 5) is None
    bad = {
        "not an outcome": ({"rewards": [1.0]}, "not an evaluation outcome"),
        "another version": (replace(good, version=4), "measured v4"),
        "a reward of another version": (replace(good, versions=[5, 4]), "other than v5"),
        "a reward that is not a float": (replace(good, rewards=["1", 1.0]), "finite floats"),
        "an infinite reward": (replace(good, rewards=[math.inf, 1.0]), "finite floats"),
        "lengths that do not pair": (replace(good, response_tokens=[2]), "do not pair"),
        "a negative length": (replace(good, response_tokens=[2, -1]), "not a count"),
        "a negative count": (replace(good, off_version=-1), "not counts"),
        "more prompts than given": (replace(good, off_version=2), "more prompts than the 3"),
        "a NaN duration": (replace(good, seconds=math.nan), "not a duration"),
    }
    for what, (answer, reason) in bad.items():
        problem = check_outcome(answer, 3, 5)
        assert problem is not None and reason in problem, (what, problem)


def test_an_update_that_arrives_during_the_evaluation_waits_for_it():
    """The next version is published while the rollouts run: its load waits for them, so they
    are all of the named version, and it lands after."""
    engine = Engine(5)

    async def main():
        loading = asyncio.ensure_future(engine.load_after(0.05, 6))
        out = await held_out(engine, seconds=0.3).run(PROMPTS, 0.0, timeout_s=600.0, version=5)
        await loading
        return out

    out = asyncio.run(main())
    assert out.versions == [5, 5] and out.off_version == 0 and engine.version == 6


class DeadLLM:
    """vLLM's AsyncLLM after its EngineCore died: every request fails and ``errored`` is set."""

    errored = True

    async def generate(self, prompt, params, request_id, lora_request=None):
        raise RuntimeError("EngineCore died")
        yield  # an async generator, as AsyncLLM.generate


def test_an_engine_that_dies_during_an_evaluation_is_rebuilt_under_its_hold():
    """The evaluation holds weight updates and waits for its own requests; those requests find
    the engine dead and rebuild it. Taking the update lock for that rebuild would wait for the
    evaluation, which waits for them: the generator would stall to control.eval_timeout_s."""
    from asyncrl.rollout.engine import RequestAborted, RolloutEngine

    engine = RolloutEngine(DeadLLM(), Config().rollout, "unused", [], seed=0)
    rebuilt: list[int] = []

    async def rebuild() -> None:  # stands in for starting a fresh vLLM engine
        rebuilt.append(1)
        engine.llm = object()

    engine.rebuild = rebuild  # type: ignore[method-assign]

    async def main() -> BaseException:
        async with engine.updates_held():
            try:
                await asyncio.wait_for(engine.generate([1, 2], 1, "eval-0"), 10.0)
            except BaseException as e:
                return e
        raise AssertionError("a request on a dead engine succeeded")

    error = asyncio.run(main())
    assert isinstance(error, RequestAborted), error  # not a TimeoutError: no deadlock
    assert rebuilt == [1] and not engine._update_lock.locked()


def test_a_cancelled_evaluation_lets_go_of_weight_loads_at_once():
    """A trainer that stops cancels its evaluation (ray.cancel does not reach a coroutine on the
    generator's loop): the rollouts stop and the hold on weight loads is let go, so the run's
    last publish, which waits for the load, is not held to control.eval_timeout_s."""
    engine = Engine(5)

    async def main():
        h = held_out(engine, seconds=3600.0)
        running = asyncio.ensure_future(h.run(PROMPTS, 0.0, timeout_s=600.0, version=5))
        while not engine.lock.locked():  # its rollouts run, holding the loads
            await asyncio.sleep(0.01)
        assert h.cancel() == 1
        try:
            await running
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the evaluation ran on")
        await asyncio.wait_for(engine.load_after(0.0, 6), 5.0)  # the load is not held
        return h

    h = asyncio.run(main())
    assert engine.version == 6 and h.cancel() == 0


def test_a_cancel_that_arrives_before_its_evaluation_stops_that_one_and_no_other():
    """The trainer's evaluate call and its cancel are calls on the generator's threads, in no
    set order: a cancel that reaches the loop first must still stop that evaluation (else it
    holds weight loads to control.eval_timeout_s), and must not stop a later evaluation."""
    engine = Engine(5)

    async def main():
        h = held_out(engine, seconds=3600.0)
        assert h.cancel("first") == 0  # nothing running yet: remembered
        try:
            await asyncio.wait_for(h.run(PROMPTS, 0.0, timeout_s=600.0, version=5, eval_id="first"), 5.0)
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("a cancelled evaluation ran")
        assert not engine.lock.locked()  # it never held the loads
        later = asyncio.ensure_future(h.run(PROMPTS, 0.0, timeout_s=600.0, version=5, eval_id="second"))
        while not engine.lock.locked():
            await asyncio.sleep(0.01)
        assert h.cancel("first") == 0 and not later.done()  # another's cancel leaves it running
        assert h.cancel("second") == 1
        try:
            await later
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the evaluation ran on")

    asyncio.run(main())


def test_an_evaluation_due_with_no_generator_is_skipped_and_counted_in_that_steps_row(caplog):
    """No generator running when one is due (all restarting, or none joined yet): nothing is
    handed out, and the skip is counted in that step's row, not silently dropped."""
    from asyncrl.control.evaluate import EvalSchedule

    cfg = Config()
    cfg.control.eval_every = 2
    schedule = EvalSchedule(cfg)
    assert schedule.on_step(1, 1, [], last=False) == {}
    with caplog.at_level("WARNING"):
        assert schedule.on_step(2, 2, [], last=False) == {"eval/skipped": 1.0}
    assert schedule.pending is None and "no generator is running" in caplog.text
    assert schedule.on_step(3, 3, [], last=False) == {}  # reported once, when it changes
    assert schedule.on_step(4, 4, [], last=True) == {"eval/skipped": 2.0}


def test_eval_every_past_the_last_step_is_warned_about(caplog):
    from asyncrl.config.tree import validate

    cfg = Config()
    cfg.control.total_steps, cfg.control.eval_every = 10, 20
    with caplog.at_level("WARNING"):
        validate(cfg)
    assert "control.eval_every=20" in caplog.text and "no evaluation" in caplog.text
