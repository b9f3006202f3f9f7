"""The demo task across two "hosts" (see conftest.py): every generator and learner rank 1 on
the second node, the trainer, Redis and rank 0 on the head, nothing shared but the loopback
network and the checkpoint dir (a shared disk in the first test, an S3 bucket on loopback in
the second); and an elastic generator from a third private namespace that sees neither the
run dir nor the model.

One run serves both checks (the elastic generator joins it mid-run): each run's start-up
(two vLLM engines and two FSDP ranks) is most of a minute on a 2-core box."""

from __future__ import annotations

import logging
import statistics
import subprocess
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.ledger import audit, trained_ids
from asyncrl.control.train import latest_checkpoint, train
from tests.support.job import elastic_generator_argv
from tests.support.twonode import client_server_logs, private_host_command

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(900)


def test_demo_learns_with_generators_and_a_learner_rank_on_another_host(two_nodes, tiny_model_dir):
    import ray

    from asyncrl.sync.objstore import ObjectStoreWeightSync

    run_dir = two_nodes.shared_dir / "mn"
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            "control.run_name=mn",
            f"control.run_dir={run_dir}",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
            "control.total_steps=3000",
            "control.max_staleness=2",
            "control.checkpoint_every=20",
            # A path in the head's private /tmp: the second node and the elastic generator get the
            # model through Ray, as weights version 0.
            f"rollout.model={tiny_model_dir}",
            "rollout.resources={node2: 1}",
            "learner.num_ranks=2",
            "learner.placement=STRICT_SPREAD",
            "learner.collective_timeout_s=120",
        ],
    )
    rewards: list[float] = []
    seen: dict = {"elastic": None, "left_at": None}
    log_path = two_nodes.shared_dir / "elastic.log"

    trained = []  # every trained group, as the loop saw it (it keeps only the last step's)

    def on_step(loop, metrics):
        holder["loop"] = loop
        trained.extend(loop.last_trained)
        rewards.append(metrics["reward/mean"])
        step = loop.state.step
        if step == 1:
            seen["ranks"] = [info["node_id"] for info in loop.rt.learner.rank_info]
            seen["generators"] = ray.get(
                [
                    g.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                    for g in loop.rt.generators
                ]
            )
        if step == 1:  # a third host: its own /dev/shm and /tmp, and the run dir hidden too
            seen["elastic"] = subprocess.Popen(
                private_host_command(
                    *elastic_generator_argv(
                        loop.rt.redis_url,
                        cfg.control.run_name,
                        "elastic-3",
                        "--max-groups",
                        "4",
                        "--ray-address",
                        two_nodes.client_address,
                    ),
                    hide=(str(two_nodes.shared_dir),),
                ),
                stdout=log_path.open("w"),
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=two_nodes.env,
            )
        proc = seen["elastic"]
        if proc is not None and seen["left_at"] is None and proc.poll() is not None:
            seen["left_at"] = step
        learned = len(rewards) >= 40 and statistics.fmean(rewards[-10:]) > statistics.fmean(rewards[:10]) + 0.25
        if learned and seen["left_at"] is not None and step >= seen["left_at"] + 3:
            loop.stop.event.set()

    holder: dict = {}
    try:
        state = train(cfg, on_step=on_step)
    finally:
        if seen["elastic"] is not None and seen["elastic"].poll() is None:
            seen["elastic"].terminate()  # it leaves cleanly on SIGTERM
    loop = holder["loop"]
    proc = seen["elastic"]
    assert proc is not None and proc.wait(timeout=120) == 0, log_path.read_text()[-3000:] + client_server_logs(
        two_nodes.temp_dir
    )

    assert isinstance(loop.rt.weight_sync, ObjectStoreWeightSync)  # sync.backend=auto on two nodes
    assert seen["ranks"] == [two_nodes.head_node_id, two_nodes.node2_id]
    assert seen["generators"] and set(seen["generators"]) == {two_nodes.node2_id}
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert last > first + 0.25, f"reward did not improve: {first:.3f} -> {last:.3f} over {len(rewards)} steps"
    assert len(trained) == state.trained_count
    assert all(0 <= g.staleness <= cfg.control.max_staleness for g in trained)
    assert any(g.generator_id == "elastic-3" for g in trained)
    elastic_log = log_path.read_text()
    assert "unpacked from the object store" in elastic_log, elastic_log[-3000:]

    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.queue.server import EmbeddedRedis

    with EmbeddedRedis(run_dir / "redis", aof=True) as server:  # the run stopped its own; AOF brings it back
        q = RolloutQueue.connect(server.url, cfg.control.run_name, ledger=True)
        ledger = audit(q, trained_ids(run_dir, upto_step=state.step)).check()
        assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0, ledger.summary
        assert RunState.of(q).state()["status"] == "stopped"
        q.close()
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))  # both ranks' shards landed


def test_losing_the_second_host_names_what_was_lost_and_the_resumed_run_balances_its_ledger(
    two_nodes, tiny_model_dir, caplog, s3_server
):
    """The second node's raylet is SIGKILLed mid-run (a host crash): the run fails with an error
    naming learner rank 1, reports each actor the node took and what Ray does about it (the
    generator restarts once a node with its resources exists; a rank does not); a fresh second
    host joins, `train(resume_dir=...)` resumes from the last checkpoint, and every group
    produced is trained exactly once, dropped, or still queued.

    The run dir is on S3 (moto on loopback), not on the shared disk: both ranks write their
    checkpoint shards there, and the resume reads them back from there."""
    from asyncrl.learner.group import LearnerError
    from asyncrl.queue import RolloutQueue
    from asyncrl.queue.server import EmbeddedRedis
    from asyncrl.rundir.store import run_path

    run_dir = run_path(f"s3://{s3_server.bucket()}/runs/crash", s3_server.storage_options)
    local_dir = two_nodes.shared_dir / "crash-local"  # the trainer's own (Redis AOF); no rank reads it

    def config(total_steps: int):
        return load_config(
            ROOT / "configs" / "demo.yaml",
            [
                "control.run_name=crash",
                f"control.run_dir={run_dir.url}",
                f"control.local_dir={local_dir}",
                *s3_server.overrides(),
                "monitor.console=false",
                "monitor.dashboard=false",
                "queue.ledger=true",
                f"control.total_steps={total_steps}",
                "control.checkpoint_every=5",
                f"rollout.model={tiny_model_dir}",
                "rollout.resources={node2: 1}",
                "learner.num_ranks=2",
                "learner.placement=STRICT_SPREAD",
                "learner.collective_timeout_s=60",
            ],
        )

    killed: dict = {}

    def on_step(loop, metrics):
        if loop.state.step == 12 and not killed:
            killed["raylet"] = two_nodes.kill_node2_raylet()

    caplog.set_level(logging.ERROR, logger="asyncrl.control.runtime")
    with pytest.raises(LearnerError, match="learner rank 1 died"):
        train(config(200), on_step=on_step)
    assert killed
    lost = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost actor:")]
    node2 = two_nodes.node2_id[:12]
    assert any(f"learner rank 1 on node {node2} (dead): lost" in line for line in lost), lost
    assert any(f"gen-0 on node {node2} (dead): restarting" in line for line in lost), lost
    assert not any("learner rank 0" in line for line in lost), lost

    two_nodes.restart_node2()
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_000010", ckpt
    state = train(config(16), resume_dir=run_dir.url)
    assert state.step == 16
    assert (run_dir / "hf" / "final" / "model.safetensors").is_file()  # the end-of-run export, uploaded
    assert (run_dir / "summary.json").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert sorted(p.name for p in local_dir.iterdir()) == ["metrics.jsonl", "redis"]

    with EmbeddedRedis(local_dir / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, "crash", ledger=True)
        ids = trained_ids(run_dir, upto_step=state.step)
        ledger = audit(q, ids).check()
        assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0, ledger.summary
        assert len(ids) == state.trained_count == 16 * 16
        q.close()
