"""After a crash: find a dead generator's engine processes and /dev/shm segments, reap them,
and pick up the prompts it had admitted but never put.

    was_generating = reap_predecessor(run_state, "gen-0")         # at start, before our engine exists
    record = EngineRecord(run_state, "gen-0", engine, generating=was_generating)
    record.write()                    # now, and record.write(generating=True/False) at a start/stop
    record.refresh()                  # after anything that may rebuild the engine: write if outdated()
    retry = predecessor_prompts(run_state, "gen-0", encode)    # [PromptItem] to run again, not re-admitted

If the process owning a vLLM engine is SIGKILLed, its EngineCore/worker processes survive,
holding ~420 MB of /dev/shm. Each generator records its engine's [pid, create_time] pairs and
segments in Redis (``keys.engine_pids``), so its successor (Ray restart, or the same id started
again on this host) can reap them; the create time guards against a recycled pid.

Redis is not proof: anyone who can write the run's keys (every generator host holds the
password) could name any process of this user there. A successor reaps a process only if its
own environment, as it was exec'd (``/proc/PID/environ``), says it was started for this
generator of this run (``ENGINE_OWNER_ENV``: a generator actor's worker is exec'd with it, so
whatever it forks or spawns carries it). A process that does not is
left alone and named in a warning. A segment is deleted only if a reaped process mapped it or
no process of this user maps it. The record itself is checked field by field; a malformed one
is logged once and ignored. An engine forked rather than spawned (``asyncrl generate``) does
not show the marker: it is stopped by its own generator, or by that process's lifeline
(asyncrl.lifeline) when the generator dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Protocol

from asyncrl.data.images import ImageLimits
from asyncrl.infra import shm_segments_of, stop_processes
from asyncrl.queue.readback import SHM_SEGMENT, parse_note
from asyncrl.queue.records import unpack_note
from asyncrl.queue.runstate import RunState
from asyncrl.rollout.prompts import PromptItem

log = logging.getLogger(__name__)


def live_processes(records: list[list]) -> list:
    """psutil.Process of each [pid, create_time] still running; the create time guards
    against a recycled pid (another process that got the number since)."""
    import psutil

    alive = []
    for pid, created in records:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(created)) < 1e-3:
                alive.append(p)
    return alive


def reap_processes(records: list[list], timeout_s: float = 10.0) -> list[int]:
    """SIGTERM (then SIGKILL) each still-living [pid, create_time]; return the pids reaped
    (infra.stop_processes)."""
    alive = live_processes(records)
    stop_processes(alive, timeout_s)
    return [p.pid for p in alive]


def is_resource_tracker(proc) -> bool:
    """multiprocessing's resource tracker, which vLLM's start-up spawns for *our* process: it
    lives until we exit, so counting it as an engine process made every shutdown wait it out
    (10 s) and then kill it."""
    import psutil

    try:
        return any("multiprocessing.resource_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def unlink_segments(paths: list[str]) -> list[str]:
    """Delete these /dev/shm/psm_* segments of a dead engine; return the ones that existed.

    Its processes unlink them on a clean shutdown, but not when the process that owned the
    engine was SIGKILLed: reaping the orphans with SIGTERM leaves them behind (~420 MB).
    """
    bad = [p for p in paths if not SHM_SEGMENT.fullmatch(p)]
    if bad:
        raise ValueError(f"refusing to unlink {bad}: not /dev/shm/psm_<hex> segments")
    removed = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


ENGINE_OWNER_ENV = "ASYNCRL_ENGINE_OWNER"
"""Set in a generator's environment before its engine starts: ``<run>/<generator id>``."""

_warned: set[tuple[str, str]] = set()


def _warn_once(generator_id: str, what: str, *args: object) -> None:
    if (generator_id, what) not in _warned:
        _warned.add((generator_id, what))
        log.warning(f"%s: {what}", generator_id, *args)


RESTARTS_COUNTER = "generator_restarts"
"""The run counter of generator processes Ray restarted after they died (the dashboard marks
each rise on its charts, as generators/restarts)."""


def count_if_restarted(run_state: RunState, generator_id: str) -> bool:
    """Count this start in RESTARTS_COUNTER when it is Ray restarting the actor after its process
    died (not a first start, and not a resumed trainer's fresh actor); whether it was."""
    try:
        import ray

        restarted = ray.is_initialized() and bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in a Ray actor (an in-process generator): not a Ray restart
        restarted = False
    if restarted:
        run_state.incr(RESTARTS_COUNTER)
        log.warning("%s: restarted by Ray after its process died (%s)", generator_id, RESTARTS_COUNTER)
    return restarted


def engine_owner(run: str, generator_id: str) -> str:
    """The ENGINE_OWNER_ENV value of a generator's engine processes."""
    return f"{run}/{generator_id}"


def mark_engine_owner(run: str, generator_id: str) -> None:
    """Call before the engine starts: its processes inherit the mark (asyncrl.rollout.engine)."""
    os.environ[ENGINE_OWNER_ENV] = engine_owner(run, generator_id)


def _owned_by(pid: int, owner: str) -> bool:
    entry = f"{ENGINE_OWNER_ENV}={owner}".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def _zombie(proc) -> bool:
    """Exited, waiting to be reaped by its parent: nothing to stop (and its environ reads empty)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _mapped_segments() -> set[str]:
    """Every /dev/shm/psm_* segment some process of this user maps."""
    uid = os.getuid()
    pids = []
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if d.isdigit() and os.stat(f"/proc/{d}").st_uid == uid:
                pids.append(int(d))
    return shm_segments_of(pids)


def reap_predecessor(run_state: RunState, generator_id: str) -> bool:
    """Kill a crashed predecessor's orphaned engine processes and delete its leaked segments
    (on this host only: elsewhere the pids mean nothing); return whether it was generating.
    Only processes whose environment names this generator of this run are touched."""
    record = run_state.engine_pids(generator_id)  # checked (readback.parse_engine_pids); None if bad
    if record is None:
        return False
    if record.host == socket.gethostname():
        owner = engine_owner(run_state.run, generator_id)
        alive = [p for p in live_processes(record.pids) if not _zombie(p)]
        ours = [p for p in alive if _owned_by(p.pid, owner)]
        foreign = sorted(p.pid for p in alive if p not in ours)
        if foreign:
            _warn_once(
                generator_id,
                "not reaping processes %s named by its engine record: their environment does not say "
                "they were started for it (a record in Redis alone proves nothing)",
                foreign,
            )
        theirs = shm_segments_of([p.pid for p in ours])
        reaped = reap_processes([[p.pid, p.create_time()] for p in ours])
        if reaped:
            log.warning("%s: reaped %d orphaned engine processes %s", generator_id, len(reaped), reaped)
        # After the reap: a segment one of them mapped, or that nobody maps any more.
        mapped = _mapped_segments()
        removed = unlink_segments([s for s in record.segments if s in theirs or s not in mapped])
        if removed:
            log.warning("%s: deleted %d leaked shared-memory segments %s", generator_id, len(removed), removed)
    return record.started


class EngineProcesses(Protocol):
    """What a crash record needs of an engine (rollout/engine.py: RolloutEngine)."""

    engine_pids: list[list]
    shm_segments: list[str]


class EngineRecord:
    """Our entry in ``keys.engine_pids``: what a successor needs after a crash (our engine's
    PIDs and segments, to reap them, and whether we were generating, to go on if so)."""

    def __init__(self, run_state: RunState, generator_id: str, engine: EngineProcesses, generating: bool):
        self.run_state, self.generator_id, self.engine = run_state, generator_id, engine
        self.generating = generating
        self._written: list[list] | None = None  # the engine_pids list last written

    def write(self, generating: bool | None = None) -> None:
        """Write the record now (``generating``: a start or a stop changes it)."""
        if generating is not None:
            self.generating = generating
        self._written = self.engine.engine_pids
        self.run_state.set_engine_record(
            self.generator_id,
            {
                "host": socket.gethostname(),
                "pids": self.engine.engine_pids,
                "segments": self.engine.shm_segments,
                "started": self.generating,
            },
        )

    def outdated(self) -> bool:
        """The engine was rebuilt since the last write (a failed weight load or transfer, or a
        dead engine, rebuilds it): a successor could not reap its new processes."""
        return self.engine.engine_pids is not self._written

    def refresh(self) -> None:
        """Write the record again if it is outdated."""
        if self.outdated():
            self.write()

    def remove(self) -> None:
        """After our engine shut down cleanly: nothing left to reap, nothing to resume."""
        self.run_state.set_engine_record(self.generator_id, None)


def predecessor_prompts(
    run_state: RunState,
    generator_id: str,
    encode: Callable[[str, dict], list[int]],
    limits: ImageLimits | None = None,
) -> list[PromptItem]:
    """The prompts a predecessor admitted (noted in its in-flight hash) but never put: they are
    run again under their own ids, without a second admission. ``limits``: the run's
    rollout.images, which bound a note's size."""
    items = []
    for prompt_id, raw in run_state.inflight_prompts(generator_id).items():
        try:
            note = parse_note(unpack_note(raw, limits))
            # A note's images are read back from Redis: checked (asyncrl.rollout.vision_prompts) as any.
            ids = encode(note.text, note.metadata)
        except Exception as e:
            # Not a note a generator wrote: nothing to run. Its admission was counted for a
            # successor to use; give it back (and count it) so the budget stays balanced.
            log.warning("%s: in-flight note %r unreadable (%s); dropped", generator_id, prompt_id[:200], e)
            run_state.drop_admitted(generator_id, prompt_id, counter="notes_unreadable")
            continue
        items.append(PromptItem(prompt_id, note.text, note.metadata, ids))
    return items
