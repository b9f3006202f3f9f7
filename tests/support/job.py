"""Supervise one `asyncrl train` job in a subprocess: start, watch, hurt, resume, audit.

    job = TrainJob("configs/demo.yaml", ["control.total_steps=12"], run_dir="/tmp/r", run_name="r")
    job.start()                          # its own process group; output to run_dir/job.log
    job.wait_for_step(3, timeout=300)    # polls the run's state hash in Redis
    job.drop_connections(pause_s=3)      # CLIENT KILL TYPE normal + CLIENT PAUSE
    job.restart_redis(down_s=2)          # SIGKILL redis-server, start it again on its AOF
    job.kill_redis(); ...; job.start_redis()   # the same, with the outage as long as you like
    job.signal(signal.SIGKILL)           # the whole process group (trainer + Ray + engines)
    job.wait(30); job.resume(); job.wait(600)
    ledger = job.audit().check()         # produced = trained + dropped + dead-lettered + queued
    job.cleanup()                        # SIGKILL, by PID, whatever it started that is still alive

Used by tests/faults, bench/soak.py and the trainer's e2e tests. The job always runs with
`queue.ledger=true`, so every produced group id is recorded and the audit can balance.

Finding the job's Redis: the embedded server writes its config to run_dir/redis/redis.conf
(mode 0600) and keeps its port across restarts and resumes (EmbeddedRedis takes over the
port of a predecessor), so the `port` and `requirepass` lines there are the address. With
an external server (queue.redis_url set) the URL comes from the job's run_dir/config.yaml.
Nothing has to be printed and parsed from the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import msgpack
import psutil
import redis

ROOT = Path(__file__).resolve().parents[2]


class JobDied(RuntimeError):
    """The job exited while we were waiting for it to make progress."""


def pid_running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_process_tree(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60.0) -> int | None:
    """Send `sig` to `proc` and wait up to `timeout` for it to exit; if it does not, SIGKILL it
    and every descendant it has (a killed `asyncrl generate` would orphan its vLLM EngineCore,
    ~2 GB, for good). Returns its exit status, None if it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = {p.pid: p for p in [*tree, *psutil.Process(proc.pid).children(recursive=True)]}.values()
    proc.kill()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait(timeout=30)
    psutil.wait_procs(list(tree), timeout=30)
    return None


def elastic_generator_argv(redis_url: str, run: str, generator_id: str, *options: str) -> list[str]:
    """`asyncrl generate`: a generator joining a running job from its own process, knowing only
    Redis (`options`: e.g. "--max-groups", "3")."""
    cli = [sys.executable, "-m", "asyncrl.cli", "generate"]
    return [*cli, "--redis", redis_url, "--run", run, "--id", generator_id, *options]


class TrainJob:
    """One run directory, trained by one `asyncrl train` subprocess at a time."""

    def __init__(
        self,
        config_path: str | Path,
        overrides: list[str] | tuple[str, ...] = (),
        *,
        run_dir: str | Path,
        run_name: str,
        env: dict[str, str] | None = None,
    ):
        self.config_path = Path(config_path)
        self.overrides = list(overrides)
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.env = {**os.environ, **(env or {})}
        self.log_path = self.run_dir / "job.log"
        self.proc: subprocess.Popen | None = None
        self._redis_procs: list[subprocess.Popen] = []  # servers restart_redis() started
        self._seen: dict[int, float] = {}  # pid -> create_time of every process the job started

    # ------------------------------------------------------------------ lifecycle

    def _spawn(self, args: list[str]) -> TrainJob:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"job {self.run_name!r} is already running (pid {self.proc.pid})")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"\n===== {' '.join(args)}\n")
        # Its own session: signals go to the job's process group, never to the caller's.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "train", *args],
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=self.log_path.open("a"),
            stderr=subprocess.STDOUT,
        )
        self._seen[self.proc.pid] = psutil.Process(self.proc.pid).create_time()
        return self

    def start(self) -> TrainJob:
        """A fresh run (ledger on, dashboard off unless an override turns it on)."""
        return self._spawn(
            [
                str(self.config_path),
                f"control.run_dir={self.run_dir}",
                f"control.run_name={self.run_name}",
                "queue.ledger=true",
                "monitor.dashboard=false",
                "monitor.console=false",
                *self.overrides,
            ]
        )

    def resume(self, *overrides: str) -> TrainJob:
        """`asyncrl train --resume run_dir` (the run's saved config, plus `overrides`)."""
        return self._spawn(["--resume", str(self.run_dir), *overrides])

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("job not started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the job's whole process group (trainer, Ray, engine processes)."""
        self.processes()  # remember who was there, for cleanup
        os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int:
        """The job's exit status; subprocess.TimeoutExpired if it is still running after `timeout`."""
        return self.proc.wait(timeout=timeout)

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:] if self.log_path.exists() else "(no log)"

    def diagnosis(self, n_lines: int = 60) -> str:
        """A stalled or dead job as Redis and its log show it (tests.support.diagnose)."""
        from tests.support.diagnose import diagnosis

        return diagnosis(self, n_lines)

    # ------------------------------------------------------------------ Redis

    def redis_url(self) -> str | None:
        """The job's Redis URL, or None before its embedded server wrote its config."""
        cfg_file = self.run_dir / "config.yaml"
        if cfg_file.exists():
            import yaml

            queue = (yaml.safe_load(cfg_file.read_text()) or {}).get("queue", {})
            if queue.get("redis_url"):
                return queue["redis_url"]
        conf = self.run_dir / "redis" / "redis.conf"
        if not conf.exists():
            return None
        port, password = None, None
        for line in conf.read_text().splitlines():
            if line.startswith("port "):
                port = int(line.split()[1])
            elif line.startswith("requirepass "):
                password = line.split(None, 1)[1].strip().strip('"')
        auth = f":{quote(password, safe='')}@" if password else ""
        return f"redis://{auth}127.0.0.1:{port}/0" if port else None

    def client(self) -> redis.Redis:
        url = self.redis_url()
        if url is None:
            raise RuntimeError(f"job {self.run_name!r} has no Redis yet")
        return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)

    def _hash(self, name: str) -> dict[str, str]:
        try:
            with contextlib.closing(self.client()) as r:
                return {k.decode(): v.decode() for k, v in r.hgetall(f"asyncrl:{self.run_name}:{name}").items()}
        except (redis.RedisError, RuntimeError):
            return {}

    def state(self) -> dict[str, str]:
        """The run's state hash (policy_version, status, ...); {} while Redis is unreachable."""
        return self._hash("state")

    def counters(self) -> dict[str, int]:
        """The run's counters (groups_trained, dead_lettered, prompts_skipped, ...); {} if unreachable."""
        return {k: int(v) for k, v in self._hash("counters").items()}

    def _state_int(self, name: str) -> int:
        """A state field as an int; 0 while absent or not a number (a test's hostile client
        may have overwritten it; the trainer writes it again)."""
        try:
            return int(self.state().get(name, 0))
        except ValueError:
            return 0

    def policy_version(self) -> int:
        """The version generators are admitted against (trails the trainer while a publish is in flight)."""
        return self._state_int("policy_version")

    def trainer_step(self) -> int:
        """The last step the trainer has trained (written right after the optimizer step)."""
        return self._state_int("trainer_step")

    def checkpoint_step(self) -> int:
        """The step of the last checkpoint the trainer wrote and acked."""
        return self._state_int("checkpoint_step")

    def wait_for_step(self, n: int, timeout: float) -> int:
        """Block until the trainer has trained step n; returns its step then. JobDied if the
        process exits first, TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self.processes()
            step = self.trainer_step()
            if step >= n:
                return step
            if not self.running():
                raise JobDied(
                    f"job {self.run_name!r} exited ({self.proc.returncode}) at step {step} "
                    f"before step {n}:\n{self.diagnosis()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.run_name!r} at step {step}, not {n}, after {timeout}s:\n{self.diagnosis()}"
                )
            time.sleep(0.25)

    # ------------------------------------------------------------------ Redis faults

    def drop_connections(self, pause_s: float = 3.0) -> int:
        """Kill every normal client connection (the trainer's, the generators'), then pause
        all clients for `pause_s` (CLIENT PAUSE ALL): they must back off and carry on.
        Returns how many connections were killed."""
        with self.client() as r:
            killed = int(r.client_kill_filter(_type="normal"))
            if pause_s > 0:
                r.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        return killed

    def restart_redis(self, down_s: float = 1.0, timeout: float = 20.0) -> int:
        """SIGKILL the job's redis-server (a crash: no shutdown, no final AOF flush beyond
        `appendfsync always`) and start a new one on the same redis.conf: same port, same
        AOF. Returns the new server's PID; a resume stops it like any orphaned server, and
        cleanup() kills it if it is still running."""
        self.kill_redis()
        time.sleep(down_s)
        return self.start_redis(timeout=timeout)

    def kill_redis(self) -> None:
        """SIGKILL the job's redis-server and wait until it is gone."""
        old = int((self.run_dir / "redis" / "redis.pid").read_text())
        self.processes()
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_running(old) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self._redis_procs:
            proc.poll()  # reap an earlier restart's server if that was the one killed

    def start_redis(self, timeout: float = 20.0) -> int:
        """Start redis-server on the job's redis.conf (same port, same AOF) after kill_redis();
        returns its PID once it has loaded its data."""
        from asyncrl.queue.server import find_redis_server

        redis_dir = self.run_dir / "redis"
        proc = subprocess.Popen(
            [find_redis_server(), str(redis_dir / "redis.conf")],
            cwd=redis_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._redis_procs.append(proc)
        self._seen[proc.pid] = psutil.Process(proc.pid).create_time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, RuntimeError), self.client() as r:
                if r.info("server")["process_id"] == proc.pid and r.info("persistence")["loading"] == 0:
                    return proc.pid
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"restarted redis-server (pid {proc.pid}) did not come up; see {redis_dir / 'redis.log'}")

    def queue(self, **kwargs):
        """A RolloutQueue on the job's run, ledger on (close it when done)."""
        from asyncrl.queue import RolloutQueue

        kwargs.setdefault("consumer", "job-observer")
        return RolloutQueue.connect(self.redis_url(), self.run_name, ledger=True, **kwargs)

    # ------------------------------------------------------------------ checkpoints and ledger

    def final_extra(self) -> dict:
        """The `extra` of the last complete checkpoint (step, version, trained_count, ...)."""
        from asyncrl.control.train import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.run_dir / 'checkpoints'}")
        return msgpack.unpackb((ckpt / "extra.msgpack").read_bytes(), raw=False)

    def final_trained_ids(self) -> list[str]:
        """Every group id trained into the last complete checkpoint's weights, from the run's
        trained-ids audit (asyncrl.control.ledger; the job runs with queue.ledger on)."""
        from asyncrl.control.ledger import trained_ids

        return trained_ids(self.run_dir, upto_step=int(self.final_extra()["step"]))

    def audit(self):
        """The run's ledger (not yet checked: call .check()). Works on a stopped job too: the
        embedded server is then started on its data dir (AOF) for the audit and stopped again."""
        from asyncrl.control.ledger import audit

        trained = self.final_trained_ids()
        with self.observe() as q:
            return audit(q, trained)

    @contextlib.contextmanager
    def observe(self):
        """A RolloutQueue (ledger on) on the run's Redis, running or not: for a stopped job the
        embedded server is started on its data dir (AOF) while the block runs."""
        if self.running():
            q = self.queue()
            try:
                yield q
            finally:
                q.close()
            return
        from asyncrl.queue import RolloutQueue
        from asyncrl.queue.server import EmbeddedRedis

        password = None
        url = self.redis_url()
        if url and "@" in url:
            from urllib.parse import unquote, urlsplit

            password = unquote(urlsplit(url).password or "") or None
        with EmbeddedRedis(self.run_dir / "redis", aof=True, password=password) as server:
            q = RolloutQueue.connect(server.url, self.run_name, ledger=True, consumer="job-observer")
            try:
                yield q
            finally:
                q.close()

    # ------------------------------------------------------------------ processes

    def processes(self) -> dict[int, str]:
        """PID -> command of every live process the job started: the trainer and its
        descendants (Ray, learner ranks, generators, vLLM engine processes) and the embedded
        redis-server (its own session, found by its pidfile). Also remembered for cleanup()."""
        found: dict[int, str] = {}
        roots = [self.proc.pid] if self.running() else []
        pidfile = self.run_dir / "redis" / "redis.pid"
        with contextlib.suppress(OSError, ValueError):
            roots.append(int(pidfile.read_text().strip()))
        for pid in roots:
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    if p.status() == psutil.STATUS_ZOMBIE:
                        continue
                    found[p.pid] = " ".join(p.cmdline()[:3]) or p.name()
                    self._seen.setdefault(p.pid, p.create_time())
        return found

    def pids_named(self, fragment: str) -> list[int]:
        """Live job processes whose command contains `fragment` (Ray titles its actors
        'ray::GeneratorActor...', 'ray::LearnerActor...')."""
        return sorted(pid for pid, cmd in self.processes().items() if fragment in cmd)

    def restarted_redis_pids(self) -> set[int]:
        """The redis-servers start_redis() started in the job's place: the job's own exit does
        not stop them (it did not start them); a resume stops them as a predecessor's."""
        return {proc.pid for proc in self._redis_procs}

    def leftovers(self) -> dict[int, str]:
        """Processes the job started (seen by processes()) that are still alive."""
        out = {}
        for pid, t0 in self._seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == t0 and p.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = " ".join(p.cmdline()[:3]) or p.name()
        return out

    def cleanup(self) -> None:
        """SIGKILL, by PID, every process this job started that is still alive."""
        if self.running():
            self.processes()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in [self.proc, *self._redis_procs]:
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
