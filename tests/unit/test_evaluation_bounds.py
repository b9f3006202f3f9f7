"""Evaluation is bounded (control.eval_timeout_s): a held-out rollout that never ends is
abandoned and counted, an engine that cannot sample reports its prompts at once, and the
rest are scored as before. The trainer's side (generators that hang or die) is
tests/integration/test_rollout_reproducible.py::test_an_evaluation_is_bounded_and_reports_what_it_lost.

.venv/bin/python -m pytest tests/unit/test_evaluation_bounds.py -q
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from asyncrl.config import Config
from asyncrl.rollout.evaluation import HeldOut, evaluate_items
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
