"""Attaching to a Ray cluster without token authentication is warned about, once; the private
Ray a run starts itself never is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from asyncrl.control import cluster
from asyncrl.control.cluster import open_cluster_warning, warn_if_open_cluster


def test_the_decision():
    assert open_cluster_warning(None, True) is None  # the run's own private instance, with its token
    assert open_cluster_warning("local", True) is None
    for private in (None, "local"):  # ... started with RAY_AUTH_MODE=disabled: open to every local user
        msg = open_cluster_warning(private, False)
        assert msg is not None and "RAY_AUTH_MODE=disabled" in msg and "without token authentication" in msg
    assert open_cluster_warning("10.0.0.1:6379", True) is None  # a token is sent (GCS not asked)
    assert open_cluster_warning("10.0.0.1:6379", True, False) is None  # the GCS refused a token-less call
    assert open_cluster_warning("10.0.0.1:6379", True, True) is not None  # ... or answered it: open
    for address in ("auto", "10.0.0.1:6379", "ray://head:10001"):
        msg = open_cluster_warning(address, False)
        assert msg is not None and f"control.ray_address={address!r}" in msg and "RAY_AUTH_MODE=token" in msg
    assert "--ray-address='auto'" in str(open_cluster_warning("auto", False, key="--ray-address"))


def test_warns_once_per_address_and_for_the_private_instance_only_without_its_token(caplog, monkeypatch):
    monkeypatch.setattr(cluster, "_warned_open", set())
    with caplog.at_level(logging.WARNING, logger=cluster.__name__):
        warn_if_open_cluster(None, token_sent=True)
        assert caplog.records == []
        warn_if_open_cluster("local", token_sent=True)
        warn_if_open_cluster("10.0.0.1:6379", token_sent=True, tokenless_accepted=False)
        assert caplog.records == []
        for _ in range(3):
            warn_if_open_cluster("10.0.0.1:6379", token_sent=False)
        warn_if_open_cluster("ray://10.0.0.1:10001", key="--ray-address", token_sent=False)
    first, second = (r.getMessage() for r in caplog.records)  # exactly two
    assert first.startswith("control.ray_address='10.0.0.1:6379'")
    assert second.startswith("--ray-address='ray://10.0.0.1:10001'")


def test_token_mode_is_read_from_the_installed_ray():
    # In fresh processes: Ray caches its config, and this one's must not change under other tests.
    code = "from asyncrl.control.cluster import token_auth_enabled as t; print(t())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    results = {}
    for mode in ("token", "disabled"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, "RAY_AUTH_MODE": mode},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        results[mode] = out.stdout.strip()
    assert results == {"token": "True", "disabled": "False"}


SECRET = "s3cret-Ray-pw"


def test_a_password_in_the_ray_address_is_in_no_message(caplog, monkeypatch):
    """A Ray Client URL or a proxy may carry credentials: the unreachable-cluster error, the
    "attached to" line and the open-cluster warning show the address without them."""
    import pytest

    from asyncrl.config import load_config
    from asyncrl.control.cluster import ClusterUnavailable, connect_ray, shown_address

    for address in (f"ray://alice:{SECRET}@127.0.0.1:1", f"alice:{SECRET}@127.0.0.1:1"):
        cfg = load_config(None, [f"control.ray_address={address}"])
        with pytest.raises(ClusterUnavailable) as bad:
            connect_ray(cfg.control, {})  # nobody listens on port 1: refused before ray.init
        assert SECRET not in str(bad.value) and "127.0.0.1:1" in str(bad.value)
        assert SECRET not in str(shown_address(address)) and "127.0.0.1:1" in str(shown_address(address))
        msg = open_cluster_warning(address, False)
        assert msg is not None and SECRET not in msg and "127.0.0.1:1" in msg
    monkeypatch.setattr(cluster, "_warned_open", set())
    with caplog.at_level(logging.WARNING, logger=cluster.__name__):
        warn_if_open_cluster(f"ray://:{SECRET}@head:10001", token_sent=False)
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)
