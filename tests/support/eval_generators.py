"""Stand-ins for a generator's ``evaluate`` as the trainer's Evaluator calls it through Ray:
one that answers, one that never does, one whose process dies. Run as Ray actors, so they
live in an importable module (a test module is not importable by Ray's workers)."""

from __future__ import annotations

import os
import time


class Up:
    def ready(self) -> bool:
        return True


class Answers(Up):
    """A generator's evaluate as the trainer calls it, answering for every prompt."""

    def evaluate(self, prompts, temperature, timeout_s=None):
        from asyncrl.rollout.evaluation import EvalOutcome

        return EvalOutcome(rewards=[1.0] * len(prompts), response_tokens=[2] * len(prompts))


class Hangs(Up):
    """A generator whose evaluate never answers (an engine holding its requests)."""

    def evaluate(self, prompts, temperature, timeout_s=None):
        time.sleep(3600)


class Dies(Up):
    """A generator whose process dies mid-evaluation."""

    def evaluate(self, prompts, temperature, timeout_s=None):
        os._exit(1)
