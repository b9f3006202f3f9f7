"""The code sandbox against hostile programs: each is contained, scored a failure, and the host
(this test process, its files, its environment, its process table) is unaffected. Run as root
in CI, which is what these check (RLIMIT_NPROC does not bind root: the sandbox's own uid and
pid namespace must).

env PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_code_sandbox.py -q
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.rollout.envs import make_env
from asyncrl.rollout.envs.sandbox import SLOT_UID_BASE, Isolation, Sandbox, SandboxLimits, isolation
from asyncrl.rollout.envs.sandbox_host import pids_cgroup
from tests.support.orphans import adopting

LIMITS = SandboxLimits(timeout_s=10.0, memory_mb=128, max_output_bytes=64 << 10, max_file_bytes=64 << 10)
"""Programs that end on their own (a limit stops them): a generous timeout costs nothing and a
loaded CI box cannot turn a memory or output violation into a timeout."""
SHORT = dataclasses.replace(LIMITS, timeout_s=1.0)
"""Programs that run until killed: a short timeout keeps them cheap."""
ECHO_TESTS = {"tests": [{"input": "abc\n", "output": "abc\n"}, {"input": "xy\n", "output": "xy\n"}]}


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


@pytest.fixture(scope="module")
def env():
    return make_env("code", {"timeout_s": 10.0, "memory_mb": 128, "max_output_bytes": 65536, "max_file_bytes": 65536})


def _sandbox_processes() -> list[int]:
    """Processes running as any sandbox slot's uid (what a run left behind)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if SLOT_UID_BASE <= entry.stat().st_uid < SLOT_UID_BASE + 256:
                    found.append(int(entry.name))
            except FileNotFoundError:
                continue
    return found


def test_a_correct_program_passes_and_a_wrong_one_fails(env):
    right = "Here it is:\n```python\nprint(input())\n```\n"
    assert env.reward("p", right, ECHO_TESTS) == 1.0
    assert env.reward("p", "```python\nprint(input()[::-1])\n```", ECHO_TESTS) == 0.0
    half = "```python\ns = input()\nprint(s if s == 'abc' else 'no')\n```"
    assert env.reward("p", half, ECHO_TESTS) == 0.5
    assert env.check(half, ECHO_TESTS).verdicts == ["pass", "fail"]


def test_infinite_loop_is_killed_at_the_timeout():
    env = make_env("code", {"timeout_s": 1.0})
    result = env.check("while True:\n    pass\n", ECHO_TESTS)
    assert result.violation in ("timeout", "cpu_limit", "killed") and result.timeouts <= 1
    assert env.score_result(result) == 0.0
    assert result.verdicts == [result.violation]  # the remaining test was not run


def test_fork_bomb_is_bounded_and_leaves_nothing_behind(sandbox):
    if os.geteuid() == 0 and not isolation().own_uid:
        pytest.skip(f"as root without a uid of its own nothing bounds a fork bomb here: {isolation().describe()}")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    # What it left is what this process adopted (a subreaper): the box's process table, which
    # the suite's other lane fills and empties meanwhile, is not the measure.
    with adopting() as left:
        run = Sandbox(SHORT).run(bomb)
    assert run.violation is not None
    assert _sandbox_processes() == [] or not isolation().own_uid
    assert left == [], f"the fork bomb left {len(left)} processes running"


def test_root_without_namespaces_or_own_uid_still_bounds_processes():
    """The fallback where unshare is refused and the interpreter is out of another uid's
    reach: root runs it without capabilities in a pids cgroup (RLIMIT_NPROC never binds uid 0)."""
    if os.geteuid() != 0:
        pytest.skip("root's fallback (no namespaces, no own uid): this test runs as root only")
    probe = pids_cgroup("test", 1)
    if probe is None:
        pytest.skip("no writable pids cgroup on this host: root's fallback bounds nothing here")
    os.rmdir(probe)
    bare = Sandbox(
        dataclasses.replace(LIMITS, timeout_s=2.0), isolation=Isolation(False, False, False, False, pids_cgroup=True)
    )
    forks = "import os, time\nn = 0\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n"
    forks += "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n"
    run = bare.run(forks)
    assert run.stdout.strip().isdigit() and int(run.stdout) < LIMITS.max_processes, run


def test_setsid_daemon_does_not_outlive_its_run(sandbox):
    """A child that leaves the process group (setsid) is still killed: pid namespace or uid."""
    if not (isolation().pidns or isolation().own_uid):
        pytest.skip(f"neither a pid namespace nor an own uid here: {isolation().describe()}")
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('ok')\n"
    assert sandbox.run(daemon).stdout == "ok\n"
    assert _sandbox_processes() == []


def test_memory_hog_hits_its_limit(sandbox, env):
    run = sandbox.run("x = bytearray(1 << 30)\nprint('allocated')")
    assert run.violation == "memory_limit" and "allocated" not in run.stdout
    assert env.reward("p", "x = bytearray(1 << 30)\nprint(input())", ECHO_TESTS) == 0.0


def test_huge_output_is_cut_and_killed(sandbox):
    run = sandbox.run("while True:\n    print('x' * 10000)\n")
    assert run.violation == "output_limit"
    assert len(run.stdout.encode()) <= LIMITS.max_output_bytes


def test_huge_file_is_stopped_at_the_size_limit(sandbox):
    program = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)\n"
    run = sandbox.run(program)
    assert run.violation == "file_size_limit", run
    # its directory is gone afterwards
    assert not [d for d in os.listdir("/tmp") if d.startswith("asyncrl-sandbox-") and _stale(d)]


def _stale(name: str) -> bool:
    return os.path.exists(os.path.join("/tmp", name, "big"))


def test_a_secret_file_outside_its_directory_is_unreadable(sandbox, tmp_path):
    if not isolation().own_uid:
        pytest.skip(f"the program runs as this uid, so it reads what this uid reads: {isolation().describe()}")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    run = sandbox.run(f"print(open({str(secret)!r}).read())")
    assert "hunter2" not in run.stdout and run.exit_code != 0
    assert "PermissionError" in run.stderr or "FileNotFoundError" in run.stderr


def test_the_callers_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "s3cr3t-value")
    run = sandbox.run("import os\nprint(sorted(os.environ))\nprint(open('/proc/self/environ').read())")
    assert "s3cr3t" not in run.stdout and "ASYNCRL_TEST_SECRET" not in run.stdout
    assert "PYTHONPATH" not in run.stdout  # nor asyncrl's import path


def test_it_runs_in_an_empty_home_that_is_removed_afterwards(sandbox):
    run = sandbox.run("import os, sys\nprint(os.getcwd() == os.environ['HOME'], os.listdir('.'), sys.flags.isolated)")
    assert run.stdout == "True ['main.py'] 1\n"
    where = sandbox.run("import os\nprint(os.getcwd())").stdout.strip()
    assert where.startswith("/") and not os.path.exists(where)


def test_no_network_to_a_local_listener(sandbox):
    if not isolation().netns:
        pytest.skip(
            f"no network namespace on this host, so the program can reach the network: {isolation().describe()}"
        )
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    run = sandbox.run(program)
    server.setblocking(False)  # a connection it made would be waiting in the backlog now
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert "connected" not in run.stdout
    assert "unreachable" in run.stderr or "refused" in run.stderr


def test_killing_its_parent_does_not_kill_the_caller(sandbox, env):
    run = sandbox.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(0, signal.SIGKILL)")
    assert run.stdout == ""
    # and this process (the reward worker's) still runs: a reward after it works
    assert env.reward("p", "print(input())", ECHO_TESTS) == 1.0


def test_it_sees_only_its_own_processes(sandbox):
    """Its pid namespace with its own /proc: no other process's command line or environment."""
    if not (isolation().pidns and isolation().own_uid):
        pytest.skip(f"no pid namespace with its own /proc here: {isolation().describe()}")
    run = sandbox.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert run.stdout == "[1]\n"


def test_a_restrictive_umask_and_a_private_tmpdir_as_in_ray_workers(sandbox, monkeypatch, tmp_path):
    """Ray's workers run with umask 077 (and a run's TMPDIR may lie in a private directory):
    the interpreter must still be reachable by the sandbox's own uid."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    old = os.umask(0o077)
    try:
        run = sandbox.run("print(6 * 7)")
    finally:
        os.umask(old)
    assert run.stdout == "42\n" and run.violation is None


def test_isolation_is_stated(caplog):
    described = isolation().describe()
    assert "network namespace" in described and "pid namespace" in described


def _needs_mountns() -> None:
    if not isolation().mountns:
        pytest.skip(f"no mount namespace of its own here: {isolation().describe()}")


def test_world_writable_places_are_private_and_gone_afterwards(sandbox, tmp_path):
    """/tmp, /dev/shm and a world-writable directory without the sticky bit (Ray's session
    directory is one): nothing it writes or deletes there reaches the host."""
    _needs_mountns()
    shared = Path("/tmp") / f"asyncrl-test-shared-{os.getpid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    mark = f"asyncrl-test-left-{os.getpid()}"
    try:
        (shared / "victim").write_text("x")
        program = (
            f"import os\nos.unlink({str(shared / 'victim')!r})\n"
            f"open('/dev/shm/{mark}', 'w').write('x')\nopen('/tmp/{mark}', 'w').write('x')\nprint('ok')"
        )
        run = sandbox.run(program)
        assert (shared / "victim").exists(), run
        assert not Path("/dev/shm", mark).exists() and not Path("/tmp", mark).exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        for left in (Path("/dev/shm", mark), Path("/tmp", mark)):  # what a failure left
            with contextlib.suppress(OSError):
                left.unlink()


def test_filling_its_disk_stops_at_the_limit(tmp_path):
    """Many files each under max_file_bytes: the total is bounded too (a private tmpfs)."""
    _needs_mountns()
    small = Sandbox(dataclasses.replace(LIMITS, max_disk_bytes=1 << 20))
    program = "i = 0\nwhile True:\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * 60000)\n    i += 1\n"
    assert small.run(program).violation == "disk_limit"


def test_system_v_shared_memory_does_not_outlive_the_run(sandbox):
    """A segment it makes would hold host memory until removed: its own IPC namespace."""
    if not isolation().netns:
        pytest.skip(f"no namespaces here: {isolation().describe()}")
    key = 0x41530000 + os.getpid() % 0xFFFF
    program = f"import ctypes\nprint(ctypes.CDLL(None).shmget({key}, 1 << 20, 0o1000 | 0o666) >= 0)"
    assert sandbox.run(program).stdout == "True\n"
    libc = ctypes.CDLL(None)
    assert libc.shmget(key, 0, 0) == -1  # not on the host


def test_no_new_privileges_for_its_own_uid(sandbox):
    run = sandbox.run("print([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('NoNewPrivs')])")
    assert run.stdout == "['1']\n", run


def test_a_crashed_reward_worker_leaves_no_program_running():
    """The worker (here a subprocess) is SIGKILLed mid-run: its sleeping program dies with it."""
    if not (isolation().pidns and isolation().own_uid):
        pytest.skip(f"checked by its own uid in a pid namespace: {isolation().describe()}")
    mark = f"crashed-worker-{os.getpid()}"
    code = (
        "from asyncrl.rollout.envs.sandbox import Sandbox, SandboxLimits\n"
        f"Sandbox(SandboxLimits(timeout_s=300)).run('import time  # {mark}\\ntime.sleep(300)')"
    )
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 180  # until its program runs (the worker imports first: slow on a loaded box)
        while not _sandbox_processes() and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.01)
        assert _sandbox_processes()
    finally:
        worker.kill()
        worker.wait()
    for _ in range(500):
        if not _sandbox_processes():
            break
        time.sleep(0.01)
    left = _sandbox_processes()
    for pid in left:  # do not leave it to the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == []
    for main in Path("/tmp").glob("asyncrl-sandbox-*/main.py"):  # its directory stays (documented)
        with contextlib.suppress(OSError):
            if mark in main.read_text():
                shutil.rmtree(main.parent)


def test_two_processes_with_different_tmpdirs_never_share_a_slot(sandbox, monkeypatch, tmp_path):
    """The slots' uids are the host's: a lock directory under TMPDIR let two generators with
    different TMPDIRs run as one uid (and kill each other's programs)."""
    if not isolation().own_uid:
        pytest.skip(f"no uid of its own here: {isolation().describe()}")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    other = Sandbox(LIMITS)
    monkeypatch.setattr("tempfile.tempdir", None)
    held = threading.Event()
    results = []

    def slow() -> None:
        results.append(other.run("import os, sys, time\nprint(os.getuid(), flush=True)\ntime.sleep(1)"))

    t = threading.Thread(target=slow)
    t.start()
    for _ in range(3000):
        if _sandbox_processes():
            held.set()
            break
        time.sleep(0.01)
    mine = sandbox.run("import os\nprint(os.getuid())")
    t.join()
    assert held.is_set() and results[0].violation is None
    assert mine.stdout != results[0].stdout, (mine, results[0])


def test_unusual_text_is_the_programs_failure_not_the_sandboxs(sandbox):
    assert sandbox.run("print('\\u00e9\\U0001f600')").stdout == "\u00e9\U0001f600\n"
    run = sandbox.run("print(1)  # \ud800", stdin="\ud800")
    assert run.violation is None and run.exit_code != 0  # its SyntaxError: never a sandbox error


def test_a_program_cannot_pass_for_the_sandboxs_failure(env):
    """A sandbox failure fails the sample (not scored); the program's exit code and stderr
    must not be able to say so: it scores 0 like any failing program."""
    forged = "import os, sys\nsys.stderr.write('asyncrl sandbox: OSError: it was not me\\n')\nos._exit(125)"
    result = env.check(forged, ECHO_TESTS)
    assert result.verdicts == ["error", "error"] and env.score_result(result) == 0.0
    with pytest.raises(RuntimeError, match="could not start the program: ValueError"):
        Sandbox(dataclasses.replace(LIMITS, max_open_files=1 << 30)).run("print(1)")  # a real one


def test_the_problems_file_can_be_hidden_from_its_programs():
    """A world-readable problems file holds the expected outputs: a program that finds it
    prints the answer it looks up. ``hide`` covers its directory."""
    _needs_mountns()
    problems = Path(__file__).resolve().parents[2] / "examples" / "code" / "problems.jsonl"
    cheat = f"print(len(open({str(problems)!r}).read()) > 0)"
    limits = {"timeout_s": 10.0, "memory_mb": 128}
    if make_env("code", limits).sandbox.run(cheat).stdout != "True\n":
        pytest.skip("this checkout is not readable to the sandbox's uid anyway")
    hidden = make_env("code", {**limits, "hide": [str(problems.parent)]})
    run = hidden.sandbox.run(cheat)
    assert run.stdout == "" and "FileNotFoundError" in run.stderr, run
    assert problems.exists()  # for everyone else it is where it was
