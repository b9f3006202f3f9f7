"""Verified math answers: read a response's final answer and compare it with the reference
using math-verify (LaTeX, fractions, percentages, units, sets and intervals, boxed answers).

    scorer = MathScorer(timeout_s=5)
    scorer.check("Natalia sold ... #### 72", "... so she sold \\boxed{72} clips")   # Verdict(found=True, correct=True)

What is compared:
- the response's answer: the text after its last GSM8K marker "####" when it has one, else
  what math-verify extracts (LatexExtractionConfig, ExprExtractionConfig): a \\boxed{} answer
  first, then "the final answer is ...", LaTeX between $...$, then the last number;
- the reference's: the text after its last "####" (GSM8K's worked solutions), the last \\boxed{}
  of a worked solution (MATH's), or the whole reference read as if it were boxed (a bare answer
  such as "\\frac{1}{2}", "(1,2)" or "1,000"), as verl's math-verify reward does.
math_verify.verify then decides: 0.5 = \\frac{1}{2} = 1/2, \\sqrt{4} = 2, x=2 matches 2, 1,000 =
1000, 50\\% matches both 0.5 and 50 (its percent rule), "5 dollars" and \\$5 match 5; 1/3 and
0.33 differ (it rounds to 6 decimals).

Why a worker process: sympy can spend minutes in one C call that holds the GIL (an answer of
\\boxed{10^{10^{10}}} is enough), which freezes every thread of the process, so no thread-pool
or asyncio timeout can stop it; and math-verify's own timeout is a SIGALRM that works only in a
process's main thread (generators score from their event-loop thread). So the comparison runs in
child processes (``python -m asyncrl.rollout.envs.math_scorer``): a call takes an idle child or
starts one, so calls made at once (the reward threads') compare at once and a pathological
answer holds up no other. A child is killed when its call exceeds ``timeout_s`` (counted from
when the comparison is sent); the call then raises TimeoutError, which the reward reports as a
failed sample, and a later call starts a new child.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GSM8K_MARKER = "####"
STARTUP_TIMEOUT_S = 120.0
"""For the worker to import sympy and math-verify and warm them up (~1 s; more on a loaded box):
not counted in a call's timeout_s."""
SPAWN_AFTER_S = 0.05
"""A call that finds every child busy waits this long for one to free up before starting its
own: a comparison takes 0.25-12 ms, so a child still busy after it is stuck on a slow answer."""
MAX_STARTING = 2
"""Children starting at once (each imports sympy and math-verify: ~0.5 s of CPU), so a burst of
calls on a small machine starts a few children, not one per call."""
MAX_CHARS = 100_000
"""Longer texts are cut to their last MAX_CHARS characters (where final answers are)."""


@dataclass(frozen=True)
class Verdict:
    found: bool
    """An answer could be read from the response at all."""
    correct: bool
    """It equals the reference's answer."""


def reference_text(gold: str) -> str:
    """The part of a reference answer that math-verify should read (see the module docstring)."""
    if GSM8K_MARKER in gold:
        return "\\boxed{" + gold.rsplit(GSM8K_MARKER, 1)[1].strip() + "}"
    if "\\boxed" in gold or "\\fbox" in gold:
        return gold
    return "\\boxed{" + gold.strip() + "}"


def response_text(response: str) -> str:
    """The part of a response that math-verify should read: after its last "####" when it has one."""
    if GSM8K_MARKER in response:
        tail = response.rsplit(GSM8K_MARKER, 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    return response


def judge(gold: str, response: str) -> Verdict:
    """Compare in this process, with no time limit: the worker's side (``MathScorer`` bounds it)."""
    # sympy and math-verify take ~0.3 s to import: loaded only where answers are compared.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold, response = gold[-MAX_CHARS:], response[-MAX_CHARS:]
    reference = parse(reference_text(gold), config, parsing_timeout=None) or parse(gold, config, parsing_timeout=None)
    if not reference:
        raise ValueError(f"cannot read an answer from the reference {gold[:200]!r}")
    text = response_text(response)
    answer = parse(text, config, parsing_timeout=None) if text.strip() else []
    if not answer:
        return Verdict(found=False, correct=False)
    return Verdict(found=True, correct=bool(verify(reference, answer, timeout_seconds=None)))


class _Worker:
    """One child process comparing answers, and the unread part of its replies."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # The child imports this module by name: make the copy of asyncrl the parent runs importable.
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.rollout.envs.math_scorer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.buffer = b""
        weakref.finalize(self, _kill_process, self.proc)
        try:
            self.read_line(STARTUP_TIMEOUT_S)  # its "ready" line
        except (TimeoutError, OSError) as e:
            self.kill()
            raise RuntimeError(f"the math-verify worker process did not start: {e}") from e

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        return self.read_line(timeout_s)

    def read_line(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError(f"no reply within {timeout_s:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise OSError(f"it exited with status {self.proc.wait()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        _kill_process(self.proc)


class MathScorer:
    """Compares answers in child processes, each call killed after ``timeout_s`` seconds.

    Thread-safe, and concurrent: each call takes an idle child, or, when every child is busy
    for SPAWN_AFTER_S, starts one (MAX_STARTING at a time), so a slow comparison never holds up
    another, and there are never more children than comparisons running at once (the reward
    threads calling: rollout.reward_workers at most). A call's clock starts when its comparison
    is sent, after any wait and start-up. Children start on demand (building an environment, as
    ``asyncrl train --check`` does, starts nothing), are kept for the next calls, and exit with
    their parent (they read requests from a pipe and stop at end of file)."""

    def __init__(self, timeout_s: float = 5.0):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be a number of seconds > 0")
        if importlib.util.find_spec("math_verify") is None:
            raise ValueError("math-verify is not installed: pip install 'math-verify[antlr4_13_2]==0.9.0'")
        self.timeout_s = float(timeout_s)
        self._lock = threading.Condition()  # guards the fields below, never held during a comparison
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._starting = 0
        self.started = 0
        """Children started so far (one per comparison running at once, and one per kill)."""

    @property
    def processes(self) -> int:
        """Children alive now, idle or comparing."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def check(self, gold: str, response: str) -> Verdict:
        """The verdict on ``response`` against the reference ``gold``. Raises TimeoutError when
        the comparison takes over timeout_s, ValueError when the reference has no readable answer."""
        request = json.dumps({"gold": str(gold), "response": str(response)}).encode() + b"\n"
        worker = self._take()
        try:
            reply = worker.ask(request, self.timeout_s)
        except TimeoutError:
            self._drop(worker)
            raise TimeoutError(f"math-verify took over {self.timeout_s:g} s to compare the answers") from None
        except OSError as e:  # the child died (killed from outside, out of memory)
            self._drop(worker)
            raise RuntimeError(f"the math-verify worker process died: {e}") from e
        except BaseException:
            self._drop(worker)
            raise
        self._give_back(worker)
        if "error" in reply:
            raise ValueError(reply["error"])
        return Verdict(found=bool(reply["found"]), correct=bool(reply["correct"]))

    def close(self) -> None:
        """Kill every child (a comparison running now fails as a dead worker's would)."""
        with self._lock:
            workers = [*self._idle, *self._busy]
            self._idle, self._busy = [], set()
        for w in workers:
            w.kill()

    def _take(self) -> _Worker:
        spawn_at = time.monotonic() + SPAWN_AFTER_S
        with self._lock:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        self._busy.add(worker)
                        return worker
                    worker.kill()  # died while idle: reap it
                now = time.monotonic()
                if self._starting < MAX_STARTING and (now >= spawn_at or not (self._busy or self._starting)):
                    break
                self._lock.wait(max(spawn_at - now, 0.01))
            self._starting += 1
            self.started += 1
        try:
            worker = _Worker()  # started outside the lock: other calls go on meanwhile
        finally:
            with self._lock:
                self._starting -= 1
                self._lock.notify_all()
        with self._lock:
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._busy:  # not if close() took it meanwhile
                self._busy.discard(worker)
                self._idle.append(worker)
                self._lock.notify_all()
                return
        worker.kill()

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()


def _kill_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


def serve() -> None:
    """The worker: one JSON request a line on stdin, one JSON verdict a line on stdout."""
    import logging

    # Replies go to the original stdout; anything else printing to stdout lands on stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # It warns that its (signal) timeout is off: the parent enforces the limit instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    judge("\\frac{1}{2}", "$0.5$")  # the first comparison loads the LaTeX grammar (~0.5 s): before "ready"
    out.write(b'{"ready": true}\n')
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            verdict = judge(request["gold"], request["response"])
            reply: dict[str, Any] = {"found": verdict.found, "correct": verdict.correct}
        except Exception as e:  # a bad reference or a math-verify bug: the caller's error, not the worker's death
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    serve()
