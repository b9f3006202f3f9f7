"""The two-node Ray cluster the tests of this directory share (tests.support.twonode).

The second node runs in its own mount namespace (fresh /dev/shm and /tmp), so it shares no
shared memory and no temp files with the head, as a second host would not; it carries the
custom resource `node2`. Shared between the two "hosts", as on a real cluster, is only a
checkpoint directory (under /var/tmp here, which the namespaces do not hide). Needs root for
unshare (CI runs as root); elsewhere the tests skip with that reason.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.twonode import two_node_cluster, unshare_permitted

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def two_nodes():
    if not unshare_permitted():
        pytest.skip("unshare --mount is not permitted here (needs root): cannot simulate a second host")
    shared = Path(tempfile.mkdtemp(prefix="asyncrl-multinode-", dir="/var/tmp"))
    try:
        with two_node_cluster(shared, pythonpath=str(ROOT)) as cluster:
            cluster.shared_dir = shared
            yield cluster
    finally:
        shutil.rmtree(shared, ignore_errors=True)
