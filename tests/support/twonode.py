"""A real two-node Ray cluster on one machine, for the multi-node tests and the sync benchmark.

    with two_node_cluster(shared_dir) as c:     # ray.init'ed to it; c.node2_id, c.address ...
        ...

The head runs in the caller's namespace, with its own temp dir (so its `ray_current_cluster`
file is nobody else's business). The second node is `ray start --address=HEAD --block` run
inside its own mount namespace (`unshare --mount`, fresh tmpfs on /dev/shm and /tmp): it
shares the loopback network with the head, but no shared memory and no temp files, as a
second host would not. It carries the custom resource `node2`. Needs root for unshare
(``unshare_permitted()``). Only the processes started here are stopped on exit: `ray stop`
would stop every Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.queue.server import free_port

RAY = str(Path(sys.executable).with_name("ray"))


def unshare_permitted() -> bool:
    try:
        return subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def private_host_command(*argv: str, hide: tuple[str, ...] = ()) -> list[str]:
    """argv run as if on another host: its own empty /dev/shm and /tmp (and the `hide` paths)."""
    mounts = " && ".join(f"mount -t tmpfs tmpfs {p}" for p in ("/dev/shm", "/tmp", *hide))
    return ["unshare", "--mount", "sh", "-c", f'{mounts} && exec "$@"', "sh", *argv]


MARK = "ASYNCRL_TWONODE"
"""Environment variable every process of one cluster inherits (its value: the head's temp
dir), so the clean-up finds exactly those, Ray's renamed agents included."""


def cluster_env(pythonpath: str | None = None, mark: str = "") -> dict[str, str]:
    """Environment of the cluster's processes: no auth token, our package importable."""
    env = dict(os.environ, **{MARK: mark})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")]))
    env["RAY_AUTH_MODE"] = "disabled"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class TwoNodes:
    address: str  # HEAD_IP:PORT (GCS)
    client_address: str  # ray://127.0.0.1:PORT (Ray Client: a process with no raylet of its own)
    head_node_id: str
    node2_id: str
    node2: subprocess.Popen
    env: dict
    node2_argv: list[str]
    node2_log: Path
    temp_dir: str  # the head's Ray temp dir (its logs are under session_latest/logs)
    shared_dir: Path | None = None  # set by callers that keep one (the tests' checkpoint dir)

    def kill_node2_raylet(self) -> int:
        """SIGKILL the second node's raylet, as a host crash would take it; returns its pid.
        `ray start --block` then sees its node die and stops the node's other processes."""
        import psutil

        raylets = [p for p in psutil.Process(self.node2.pid).children(recursive=True) if p.name() == "raylet"]
        if not raylets:
            raise RuntimeError("the second node has no raylet process")
        raylets[0].kill()
        return raylets[0].pid

    def restart_node2(self, timeout_s: float = 120) -> str:
        """Stop what is left of the second node and start a fresh one (a new node id, the same
        resources, a new private namespace); returns its node id."""
        import ray

        _stop_group(self.node2)
        old = self.node2_id
        self.node2 = _start_node2(self.node2_argv, self.env, self.node2_log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fresh = [
                n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node2" in n["Resources"] and n["NodeID"] != old
            ]
            if fresh:
                self.node2_id = fresh[0]
                return self.node2_id
            time.sleep(1)
        raise TimeoutError(f"the restarted second node did not join in {timeout_s:.0f} s")


def _start_node2(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        private_host_command(*argv), env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop_group(proc: subprocess.Popen) -> None:
    """`ray start --block` stops its node on SIGTERM; SIGKILL the group if it does not."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_for_nodes(ray, count: int, timeout_s: float) -> list[dict]:
    deadline, alive = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= count:
            return alive
        time.sleep(1)
    raise TimeoutError(f"only {len(alive)} of {count} Ray nodes came up in {timeout_s:.0f} s")


@contextlib.contextmanager
def two_node_cluster(
    log_dir: Path,
    *,
    pythonpath: str | None = None,
    head_cpus: int = 8,
    node2_cpus: int = 6,
    object_store_bytes: int = 300_000_000,
):
    import ray

    head_tmp = tempfile.mkdtemp(prefix="rmn-", dir="/tmp")
    env = cluster_env(pythonpath, mark=head_tmp)
    port, client_port = free_port(""), free_port("")
    ip = ray.util.get_node_ip_address()
    node2 = cluster = None
    try:
        out = subprocess.run(
            [
                RAY,
                "start",
                "--head",
                f"--port={port}",
                f"--ray-client-server-port={client_port}",
                f"--num-cpus={head_cpus}",
                f"--object-store-memory={object_store_bytes}",
                "--include-dashboard=false",
                f"--temp-dir={head_tmp}",
                "--disable-usage-stats",
                '--resources={"node1": 1}',
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray start --head failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")
        node2_argv = [
            RAY,
            "start",
            f"--address={ip}:{port}",
            f"--num-cpus={node2_cpus}",
            f"--object-store-memory={object_store_bytes}",
            '--resources={"node2": 4}',
            "--disable-usage-stats",
            "--block",
        ]
        node2_log = Path(log_dir) / "node2.log"
        node2 = _start_node2(node2_argv, env, node2_log)
        if ray.is_initialized():  # e.g. the test session's local Ray: a driver talks to one cluster
            ray.shutdown()
        ray.init(
            address=f"{ip}:{port}",
            _temp_dir=head_tmp,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": env["PYTHONPATH"],
                    "VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"],
                    "TOKENIZERS_PARALLELISM": "false",
                    "VLLM_LOGGING_LEVEL": "WARNING",
                }
            },
        )
        nodes = _wait_for_nodes(ray, 2, 120)
        cluster = TwoNodes(
            f"{ip}:{port}",
            f"ray://127.0.0.1:{client_port}",
            next(n["NodeID"] for n in nodes if "node1" in n["Resources"]),
            next(n["NodeID"] for n in nodes if "node2" in n["Resources"]),
            node2,
            env,
            node2_argv,
            node2_log,
            head_tmp,
        )
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        node2 = cluster.node2 if cluster is not None else node2  # a test may have restarted it
        if node2 is not None:
            _stop_group(node2)
        stop_processes_mentioning(head_tmp)
        shutil.rmtree(head_tmp, ignore_errors=True)


def stop_processes_mentioning(marker: str) -> list[int]:
    """SIGTERM (then SIGKILL) every process of the cluster: ``MARK=marker`` in its environment,
    or ``marker`` (the head's temp dir) on its command line."""
    import psutil

    mine = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in p.info["cmdline"] or []) or p.environ().get(MARK) == marker:
                mine.append(p)
    for p in mine:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(mine, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in mine]


def client_server_logs(temp_dir: str, tail: int = 3000) -> str:
    """The ends of the head's Ray Client server logs (why a client was refused)."""
    logs = sorted(Path(temp_dir, "session_latest", "logs").glob("ray_client_server*"))
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in logs)
