"""The private Ray a run starts (no control.ray_address), as connect_ray starts it: its session
directory is its user's only, and started with RAY_AUTH_MODE=disabled it is warned about as an
open cluster is.

    .venv/bin/python -m pytest tests/integration/test_private_ray.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

# In a fresh process: Ray reads its token mode once, and ray.init may run once per process.
CODE = """
import json, logging, os, stat
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
import ray
from asyncrl.config import load_config
from asyncrl.control.cluster import connect_ray

cfg = load_config(None, ["control.ray_object_store_mb=128"])
connect_ray(cfg.control, {}, verbose=False)
session = ray._private.worker._global_node.get_session_dir_path()
print(json.dumps({"session_mode": stat.S_IMODE(os.stat(session).st_mode)}))
ray.shutdown()
"""


def test_private_ray_session_dir_is_private_and_a_tokenless_one_is_warned_about():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        env={**env, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["session_mode"] == 0o700, oct(result["session_mode"])
    warnings = [line for line in out.stderr.splitlines() if "without token authentication" in line]
    assert len(warnings) == 1 and "RAY_AUTH_MODE=disabled" in warnings[0], out.stderr[-3000:]
