"""Stand-ins for a generator's ``evaluate`` as the trainer's Evaluator calls it through Ray:
one that answers, one that never does, one whose process dies, one whose answer cannot be
counted, one that answers once a file exists. Run as Ray actors, so they live in an importable
module (a test module is not importable by Ray's workers)."""

from __future__ import annotations

import os
import time


class Up:
    def ready(self) -> bool:
        return True


class Answers(Up):
    """A generator's evaluate as the trainer calls it, answering for every prompt."""

    def evaluate(self, prompts, temperature, timeout_s=None, version=None, eval_id=None):
        from asyncrl.rollout.evaluation import EvalOutcome

        n = len(prompts)
        versions = [] if version is None else [version] * n
        return EvalOutcome(rewards=[1.0] * n, response_tokens=[2] * n, version=version, versions=versions)


class Hangs(Up):
    """A generator whose evaluate never answers (an engine holding its requests)."""

    def evaluate(self, prompts, temperature, timeout_s=None, version=None, eval_id=None):
        time.sleep(3600)


class Dies(Up):
    """A generator whose process dies mid-evaluation."""

    def evaluate(self, prompts, temperature, timeout_s=None, version=None, eval_id=None):
        os._exit(1)


class Lies(Up):
    """A generator whose answer claims rewards it was never given prompts for."""

    def evaluate(self, prompts, temperature, timeout_s=None, version=None, eval_id=None):
        from asyncrl.rollout.evaluation import EvalOutcome

        n = len(prompts) + 5
        return EvalOutcome(rewards=[9.0] * n, response_tokens=[2] * n, version=version, versions=[version] * n)


class AnswersOnceFileExists(Answers):
    """Answers once ``path`` exists: an evaluation that is still running until the test says."""

    def __init__(self, path: str):
        self.path = path

    def evaluate(self, prompts, temperature, timeout_s=None, version=None, eval_id=None):
        while not os.path.exists(self.path):
            time.sleep(0.05)
        return super().evaluate(prompts, temperature, timeout_s, version)
