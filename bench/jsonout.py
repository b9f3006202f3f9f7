"""The benches' stdout contract: the last line a bench writes to stdout is its JSON.

Ray (log_to_driver, its atexit hooks), vLLM and their child processes write to file
descriptor 1 whenever they like, also after the bench printed its result. So for the whole
run fd 1 points at stderr (children inherit that), and only the bench's own lines go to the
real stdout, through a duplicate of the original descriptor; fd 1 is never pointed back.

    with JsonStdout() as out:
        out.line("human-readable summary")   # optional, to stdout
        out.result = {...}                   # written last, as one JSON line, on exit
"""

from __future__ import annotations

import json
import os
import sys


def _plain(obj):
    """numpy scalars (a figure or a comparison of figures) as the Python value they hold."""
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"{type(obj).__name__} in a bench's result is not JSON")


class JsonStdout:
    def __init__(self) -> None:
        self.result: dict | None = None
        self._fd = -1

    def __enter__(self) -> JsonStdout:
        sys.stdout.flush()
        self._fd = os.dup(1)
        os.dup2(2, 1)
        return self

    def line(self, text: str) -> None:
        """One line to the real stdout (and nothing else there: others' output is on stderr)."""
        sys.stdout.flush()
        os.write(self._fd, (text + "\n").encode())

    def __exit__(self, *exc) -> None:
        # Written even when the bench failed after its figures were in: a partial result is
        # still the last line, and the exception (on stderr) says what went wrong.
        if self.result is not None:
            self.line(json.dumps(self.result, default=_plain))
        os.close(self._fd)
