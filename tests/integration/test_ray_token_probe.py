"""The open-cluster check against a real GCS: the session's local Ray. This Ray turns token
authentication on for a new local instance unless RAY_AUTH_MODE says otherwise, so the
expected answer follows this process's mode either way."""

from __future__ import annotations

import logging

from asyncrl.control import cluster


def test_gcs_probe_and_warning_follow_the_clusters_token_mode(ray_session, caplog, monkeypatch):
    gcs = ray_session.get_runtime_context().gcs_address
    token = cluster.token_auth_enabled()
    assert cluster.gcs_accepts_tokenless(gcs) is (not token)
    assert cluster.gcs_accepts_tokenless("127.0.0.1:1", timeout_s=1.0) is None  # nobody there: unknown
    monkeypatch.setattr(cluster, "_warned_open", set())
    with caplog.at_level(logging.WARNING, logger=cluster.__name__):
        cluster.warn_if_open_cluster(gcs)  # as if attached to it by address
        cluster.warn_if_open_cluster(None)  # the private instance: only without its token
    assert len(caplog.records) == (0 if token else 2)
