"""Shared fixtures: each starts a real component and cleans up exactly what it started."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama + char tokenizer written to a temp dir (nothing is downloaded)."""
    from asyncrl.rollout.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free 127.0.0.1 port, stopped by its PID at the end."""
    from asyncrl.queue.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server, flushed so every test starts from an empty database."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray for the whole session (logical CPUs > cores so actors can co-exist)."""
    import ray

    ray.init(
        address="local",  # never a cluster a stale /tmp/ray/ray_current_cluster names
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=512 * 1024 * 1024,
        ignore_reinit_error=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    yield ray
    ray.shutdown()
