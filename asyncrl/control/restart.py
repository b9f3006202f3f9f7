"""What a (re)starting trainer does to the run's Redis before any generator may work.

    top = run_state.retire_weights()             # Runtime, before generators exist
    state.continue_past(top, max_staleness)      # train(), after the checkpoint loads
    restart_admission(cfg, run_state, state, queued_skips=k, max_staleness=ms)   # prepare()

A crashed trainer leaves its announced weights, its admission budget and its generators'
in-flight notes in Redis (AOF). The new trainer retires the weights and closes admission
first, so neither its own generators nor an elastic one that outlived the crash load the
discarded weights or are admitted against the old budget; its prepare() publishes the
resumed weights under a version no earlier weights used and then reopens admission with a
count that includes every prompt that will be re-issued without a new admission.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from asyncrl.control.staleness import admission_budget

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.control.state import LoopState
    from asyncrl.queue import RunState

log = logging.getLogger(__name__)


def own_generator_ids(cfg: Config) -> list[str]:
    """The ids of the generators the trainer's runtime creates (each re-issues its predecessor's notes)."""
    return [f"gen-{i}" for i in range(cfg.rollout.num_generators)]


def restart_admission(
    cfg: Config, run_state: RunState, state: LoopState, *, queued_skips: int, max_staleness: int
) -> int:
    """Set groups_started so the budget left is what a run that never stopped would have.

    Counted: the groups trained into the restored weights, every entry still in the stream
    (less ``queued_skips``, the checkpoint's own groups, which are skipped, not released), and
    the prompts noted for generators that will re-issue them: ours (their successors do at
    start) and elastic ones whose heartbeat is recent. Notes of any other generator are
    deleted: nobody will run them, and counted they would hold budget for good. When the
    resume renumbered the weights (LoopState.continue_past), the budget at the new version
    is larger by the versions skipped, and so is the count.
    """
    c, m = cfg.control, cfg.learner.mini_batches_per_step
    skipped = admission_budget(state.version, max_staleness, c.groups_per_step, m) - admission_budget(
        state.version - state.version_offset, max_staleness, c.groups_per_step, m
    )
    ours = set(own_generator_ids(cfg))
    now = time.time()
    live = {
        gid for gid, beat in run_state.generators().items() if now - beat.heartbeat < cfg.rollout.heartbeat_timeout_s
    }
    noted = run_state.inflight_generators()
    reissued = [g for g in noted if g in ours or g in live]
    orphaned = [g for g in noted if g not in ours and g not in live]
    if orphaned:
        log.warning("deleting the admitted prompts of generators that will not come back: %s", ", ".join(orphaned))
    return run_state.restart_admission(state.trained_count - queued_skips + skipped, reissued, orphaned)
