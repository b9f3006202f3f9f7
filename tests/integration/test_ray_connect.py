"""`control.ray_address` unset is a private Ray instance even where a stale cluster file says
otherwise; a configured address that nobody answers is a clear error naming the field.

Runs in a private mount namespace (fresh tmpfs on /tmp) so the stale
/tmp/ray/ray_current_cluster it writes cannot touch anyone else's Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.makedirs("/tmp/ray", exist_ok=True)
    with open("/tmp/ray/ray_current_cluster", "w") as f:   # an old `ray start --head`, long gone
        f.write("127.0.0.1:1")
    import ray
    from asyncrl.config import ControlConfig
    from asyncrl.control.cluster import ClusterUnavailable, connect_ray

    connect_ray(ControlConfig(), env_vars={})
    assert ray.cluster_resources()["CPU"] >= 8, ray.cluster_resources()   # our private instance
    ray.shutdown()
    t0 = time.monotonic()
    try:
        connect_ray(ControlConfig(ray_address="127.0.0.1:1"), env_vars={})
    except ClusterUnavailable as e:
        print("ERROR:", e)
        print("SECONDS:", round(time.monotonic() - t0, 1))
    else:
        sys.exit("attached to a cluster that does not exist")
""")


def unshare_ok() -> bool:
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not unshare_ok(), reason="unshare --mount is not permitted here (needs root)")
def test_unset_address_starts_a_private_instance_and_a_dead_address_is_named(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    env.pop("RAY_ADDRESS", None)
    shell = f"mount -t tmpfs tmpfs /tmp && exec {sys.executable} {script}"
    # The script lives in tmp_path (under /tmp): copy it in before the tmpfs hides it.
    shell = f"cp {script} /dev/shm/.asyncrl-probe-{os.getpid()}.py && " + shell.replace(
        str(script), f"/dev/shm/.asyncrl-probe-{os.getpid()}.py"
    )
    try:
        out = subprocess.run(
            ["unshare", "--mount", "sh", "-c", shell], env=env, capture_output=True, text=True, timeout=200
        )
    finally:
        if os.path.exists(f"/dev/shm/.asyncrl-probe-{os.getpid()}.py"):
            os.unlink(f"/dev/shm/.asyncrl-probe-{os.getpid()}.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "control.ray_address='127.0.0.1:1'" in out.stdout, out.stdout
    assert "ray start --head" in out.stdout
