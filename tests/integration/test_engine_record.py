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


def _sleeper(env: dict[str, str] | None = None):
    import subprocess

    return subprocess.Popen(["sleep", "300"], env={**os.environ, **(env or {})})


def test_a_forged_record_kills_no_process_that_was_not_started_for_this_generator(redis_url, caplog):
    """Anyone who can write the run's Redis could name any process of this user in an engine
    record: only one whose environment says it was started for this generator is reaped, and a
    segment is deleted only if nobody maps it."""
    from multiprocessing import shared_memory

    import psutil

    from asyncrl.rollout.recovery import ENGINE_OWNER_ENV

    q = RolloutQueue.connect(redis_url, "forged")
    rs = RunState.of(q)
    unrelated = _sleeper()  # a live process of the same user, nothing to do with the run
    other_gen = _sleeper({ENGINE_OWNER_ENV: "forged/g1"})  # another generator's engine
    orphan = _sleeper({ENGINE_OWNER_ENV: "forged/g0"})  # g0's own, left by its predecessor
    in_use = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this live process
    leaked = "/dev/shm/psm_" + os.urandom(8).hex()  # mapped by nobody
    open(leaked, "wb").close()
    try:
        procs = [unrelated, other_gen, orphan]
        rs.set_engine_record(
            "g0",
            {
                "host": socket.gethostname(),
                "pids": [[p.pid, psutil.Process(p.pid).create_time()] for p in procs],
                "segments": [f"/dev/shm/{in_use.name.lstrip('/')}", leaked],
                "started": True,
            },
        )
        with caplog.at_level("WARNING"):
            assert reap_predecessor(rs, "g0") is True
        assert orphan.wait(timeout=30) is not None  # reaped: it carries g0's mark
        assert unrelated.poll() is None and other_gen.poll() is None
        assert "not reaping processes" in caplog.text and str(unrelated.pid) in caplog.text
        assert os.path.exists(f"/dev/shm/{in_use.name.lstrip('/')}") and not os.path.exists(leaked)

        # Malformed records: ignored with a reason, logged once each, never a crash.
        caplog.clear()
        bad = [
            "not a dict",
            {"host": socket.gethostname(), "pids": "1234", "segments": [], "started": True},
            {"host": socket.gethostname(), "pids": [[unrelated.pid, "soon"]], "segments": [], "started": True},
            {"host": socket.gethostname(), "pids": [[True, 1.0]], "segments": [], "started": True},
            {"host": socket.gethostname(), "pids": [[1, 1.0]] * 10_000, "segments": [], "started": True},
            {"host": socket.gethostname(), "pids": [], "segments": ["/etc/passwd"], "started": True},
            {"host": socket.gethostname(), "pids": [], "segments": [], "started": "yes"},
        ]
        for i, record in enumerate(bad):
            rs.set_engine_record(f"bad{i}", record)
            with caplog.at_level("WARNING"):
                assert reap_predecessor(rs, f"bad{i}") is False
                assert reap_predecessor(rs, f"bad{i}") is False
            assert caplog.text.count(f"bad{i}: ignoring its engine record") == 1, caplog.text
        assert unrelated.poll() is None and os.path.exists("/etc/passwd")
    finally:
        for p in (unrelated, other_gen, orphan):
            p.kill()
            p.wait()
        in_use.close()
        in_use.unlink()
        if os.path.exists(leaked):
            os.unlink(leaked)
        q.close()
