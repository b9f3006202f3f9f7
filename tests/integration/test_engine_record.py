"""A generator's crash record in Redis stays current: a rebuilt engine's new processes are
written again (a successor must reap the engine that is running, not the one that was), and
the started flag a successor resumes by follows start and stop."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from asyncrl.queue import RolloutQueue, RunState
from asyncrl.rollout.recovery import EngineRecord, reap_predecessor


@dataclass
class EngineProcs:
    """What the record reads of an engine (recovery.EngineProcesses): our pid with a create time
    that is not ours, and no segments, so a reap of the record touches nothing."""

    engine_pids: list[list] = field(default_factory=lambda: [[os.getpid(), 1.0]])
    shm_segments: list[str] = field(default_factory=list)


def test_the_record_follows_a_rebuilt_engine_and_the_started_flag(redis_url):
    q = RolloutQueue.connect(redis_url, "record")
    rs = RunState.of(q)
    engine = EngineProcs()
    record = EngineRecord(rs, "g0", engine, generating=False)
    assert record.outdated()  # never written
    record.write()
    assert rs.engine_record("g0") == {
        "host": socket.gethostname(),
        "pids": [[os.getpid(), 1.0]],
        "segments": [],
        "started": False,
    }
    assert not record.outdated()
    record.refresh()  # nothing changed: nothing to write
    record.write(generating=True)
    assert rs.engine_record("g0")["started"] is True
    assert reap_predecessor(rs, "g0") is True  # a successor would go on generating

    # A rebuild replaces the pid list (RolloutEngine.rebuild): the record is outdated until written.
    engine.engine_pids = [[os.getpid(), 2.0]]
    assert record.outdated()
    record.refresh()
    assert not record.outdated()
    assert rs.engine_record("g0")["pids"] == [[os.getpid(), 2.0]]
    assert rs.engine_record("g0")["started"] is True  # a refresh keeps the flag

    record.write(generating=False)
    assert reap_predecessor(rs, "g0") is False
    record.remove()
    assert rs.engine_record("g0") is None and reap_predecessor(rs, "g0") is False
    q.close()
