"""Weights from the learners to the engines, at most one publish in flight.

    pub = Publisher(rt.learner, rt.weight_sync, rt.run_state, state)
    seconds = pub.publish(version, overlap=True)   # export now; the engines load meanwhile
    pub.finish()                                   # wait for the one in flight, raise its error here

The policy version in Redis is raised only after every engine applied the weights, so
admission never lets a generator start work counted against weights it lacks. With
`overlap` the engines' part runs in a background thread while the loop trains the next
step (docs/design.md, "The async learner does not wait for the engines to load").
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.control.state import LoopState
    from asyncrl.learner import LearnerGroup
    from asyncrl.queue import RunState


class Publisher:
    def __init__(self, learner: LearnerGroup, weight_sync: Any, run_state: RunState, state: LoopState):
        self.learner = learner
        self.weight_sync = weight_sync
        self.run_state = run_state
        self.state = state
        self.last_apply_s = 0.0
        """How long the engines took to apply the last publish (pause, load, resume)."""
        self._inflight: threading.Thread | None = None
        self._error: BaseException | None = None

    def publish(self, version: int, overlap: bool) -> float:
        """Export the weights as `version`, have the engines apply them, then raise the policy
        version in Redis; with `overlap` the engines' part runs while the caller goes on.
        Returns the seconds the caller spent."""
        t0 = time.perf_counter()
        self.finish()
        path = self.weight_sync.path_for(version)
        self.learner.export_to_file(path)
        self.state.published_version = version
        if overlap:
            self._inflight = threading.Thread(
                target=self._apply_and_announce, args=(path, version), name=f"publish-v{version}", daemon=True
            )
            self._inflight.start()
        else:
            self._apply_and_announce(path, version)
            self._raise_error()
        return time.perf_counter() - t0

    def _apply_and_announce(self, path: str, version: int) -> None:
        try:
            self.last_apply_s = self.weight_sync.publish_file(path, version)["apply_s"]
            self.run_state.set_policy_version(version)
        except BaseException as e:  # handed to the loop's thread by finish()
            self._error = e

    def finish(self) -> None:
        """Wait for the publish in flight (if any); its failure is raised here, in the caller."""
        self.join()
        self._raise_error()

    def join(self) -> None:
        """Wait for the publish in flight without raising (tear-down: engines must not go mid-load)."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
