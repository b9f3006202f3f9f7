"""Shared fixtures: each starts a real component and cleans up exactly what it started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.sigint import AT_IMPORT, sigint_state  # read before any test module is imported

pytest_plugins = ["tests.support.durations"]  # per-file seconds, when ASYNCRL_FILE_DURATIONS asks

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama + char tokenizer written to a temp dir (nothing is downloaded)."""
    from asyncrl.rollout.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture), its processor files and chat template,
    written once for the session (asyncrl.rollout.tiny_vl; nothing is downloaded). Read-only:
    a test that changes one copies it first."""
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    return write_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "model")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free 127.0.0.1 port, stopped by its PID at the end. Its
    administrative commands stay on: tests read its CONFIG and script refusals with ACL
    SETUSER (a run's server has them off: test_redis_lockdown.py)."""
    from asyncrl.queue.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False, admin_commands=True)
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
def s3_server():
    """moto's S3 server on a free 127.0.0.1 port (tests.support.s3), stopped by its PID at the end."""
    from tests.support.s3 import s3_server as start

    with start() as server:
        yield server


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


@pytest.fixture
def finished_run_dir(tmp_path):
    """A finished run's directory, written the way a run writes it: config.yaml (the resolved
    config tree), metrics.jsonl through the real JsonlSink, and summary.json through the real
    writer. The run logged steps 1-20, was resumed from its step-15 checkpoint and logged 16-30
    (rewards 0.25 higher, so the resumed rows are told apart); eval/* every 5 steps; at step 30
    drift/rollout_kl is above the 0.05 alert and drift/tis_ratio_max is NaN (logged as null).
    Returns (run_dir, reward_of_step) where reward_of_step holds the values that count."""
    import math
    from pathlib import Path

    import yaml

    from asyncrl.config import load_config
    from asyncrl.control.summary import write_summary_file
    from asyncrl.monitor.metrics import staleness_summary
    from asyncrl.monitor.sinks import JsonlSink

    run_dir = tmp_path / "fin"
    run_dir.mkdir()
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(
        root / "configs" / "demo.yaml",
        ["control.run_name=fin", f"control.run_dir={run_dir}", "control.max_staleness=2", "control.eval_every=5"],
    )
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    reward_of_step: dict[int, float] = {}

    def step_metrics(step: int, bonus: float) -> dict[str, float]:
        reward_of_step[step] = round(step / 40 + bonus, 4)
        m = {
            **staleness_summary([0, 1, 1, 2] if step % 2 else [0, 0, 1, 1], max_staleness=2),
            "reward/mean": reward_of_step[step],
            "reward/std": 0.25,
            "response/length_mean": 6.0 + step / 10,
            "drift/rollout_kl": 0.0625 if step == 30 else 0.004,
            "drift/masked_frac": 0.02,
            "drift/tis_ratio_max": math.nan if step == 30 else 1.5 + step / 100,
            "throughput/gen_tokens_per_s": 2000.0 + step,
            "throughput/train_tokens_per_s": 1000.0 + step,
            "time/wait_data": 0.1,
            "time/train": 0.05,
            "time/sync": 0.01,
            "queue/depth": 4.0,
            "learner/version": float(step),
            # Logged, but never a number: the dashboard has nothing to draw for the critic.
            "critic/value_loss": math.nan,
        }
        if step % 5 == 0:
            m.update(
                {
                    "eval/reward_mean": step / 50 + bonus,
                    "eval/reward_std": 0.125,
                    "eval/response_length_mean": 3.0 + step / 10,
                    "eval/reward_errors": 0.0,
                    "eval/prompts": 8.0,
                }
            )
        return m

    first = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(1, 21):
        first.log(step, step_metrics(step, 0.0))
    first.close()
    resumed = JsonlSink(run_dir / "metrics.jsonl")
    for step in range(16, 31):
        resumed.log(step, step_metrics(step, 0.25))
    resumed.close()
    write_summary_file(
        run_dir,
        {
            "run": "fin",
            "status": "finished",
            "step": 30,
            "first_step": 15,
            "policy_version": 30,
            "max_staleness": 2,
            "startup_s": 22.7,
            "wall_s": 56.0,
            "started_at": 1_790_000_000.0,
            "ended_at": 1_790_000_056.0,
            "counters": {
                "groups_started": 260,
                "groups_produced": 250,
                "groups_trained": 240,
                "dropped_stale": 4,
                "dead_lettered": 1,
            },
        },
    )
    return run_dir, reward_of_step


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo process group and its FSDP2 device mesh, for one module's tests (a
    FSDP2 learner built in this process, without Ray)."""
    import torch
    import torch.distributed as dist

    from asyncrl.learner import fsdp

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield fsdp.build_mesh(torch.device("cpu"), 1)
    finally:
        dist.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """Say so when the suite did not start with Python's own SIGINT handler (a run started in
    the background by a non-interactive shell inherits SIGINT ignored): a Ctrl-C check that
    does not set the handler first would then test the launch, not the code."""
    if AT_IMPORT != ("python", False):
        terminalreporter.write_line(f"SIGINT when the suite started: {AT_IMPORT.describe()}")


@pytest.fixture(autouse=True)
def _sigint_handler_restored(request):
    """A test that leaves SIGINT changed would change what Ctrl-C does in every later test (and
    whether the tests of the trainer's own handler mean anything), and a user's process after
    the same calls. Checked at both levels: the handler Python reports, and below it the
    C-level disposition and the main thread's signal mask, which a C extension can change
    while signal.getsignal() still names Python's handler. Whatever changed is put back and the
    test named, as a warning in the summary."""
    import signal
    import warnings

    before, below = signal.getsignal(signal.SIGINT), sigint_state()
    yield
    after, now = signal.getsignal(signal.SIGINT), sigint_state()
    left = []
    if after is not before:
        left.append(f"handled by {after!r}")
    elif now.disposition != below.disposition:
        left.append(f"with the C-level handler {now.disposition} (was {below.disposition})")
    if left and before is not None:
        signal.signal(signal.SIGINT, before)  # also re-installs Python's view at C level
    if now.blocked and not below.blocked:
        left.append("blocked in the main thread")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    if left:
        warnings.warn(f"{request.node.nodeid} left SIGINT {', '.join(left)}; restored", stacklevel=1)
