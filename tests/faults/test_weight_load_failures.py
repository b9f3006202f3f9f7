"""Weights that no generator can load end the run at the deadline, with the cause and the
resume command, instead of a trainer that waits without a word.

Real job (`asyncrl train`: trainer, learner, a vLLM-CPU generator). The run trains LoRA
adapters of rank 16 and publishes each adapter alone, while the user's engine settings cap
the engine's adapters at rank 8 (`rollout.engine_kwargs.max_lora_rank`, a vLLM serving
setting): vLLM refuses every adapter the learner publishes. With the staleness bound at 0 the
first step's groups are the last anything can make: the trainer says every 30 s what fails,
the dashboard alerts and counts the failed loads, and at `sync.load_failure_deadline_s` the
run checkpoints and ends in one line naming the cause and the resume command."""

from __future__ import annotations

import json
import re
import time

import pytest

from asyncrl.monitor.dashboard.data import run_snapshot
from asyncrl.rundir import latest_checkpoint
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
DEADLINE_S = 15


def test_weights_no_generator_can_load_end_the_run_at_the_deadline_with_the_cause(train_job):
    job = train_job(
        "unloadable",
        "control.total_steps=50",
        "control.max_staleness=0",
        "learner.lora={r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, v_proj], publish: adapter}",
        "rollout.engine_kwargs={max_lora_rank: 8}",
        f"sync.load_failure_deadline_s={DEADLINE_S}",
        "sync.max_load_failures=5",
    )
    job.start()
    # The first publish (v1, after step 1) fails on the only generator: the trainer says so.
    wait_for(
        lambda: not job.running() or "no generator can load the weights" in job.log_tail(300_000),
        400,
        "the trainer saying no generator can load the weights",
        interval=0.5,
    )
    assert job.running(), job.log_tail()
    t0 = time.monotonic()
    # While it lasts the dashboard alerts with the cause, and counts the failed load.
    snap = run_snapshot(job.client(), "unloadable")
    unloadable = [a for a in snap["alerts"] if a["kind"] == "weights_unloadable"]
    assert unloadable and "LoRA rank 16 is greater than max_lora_rank 8" in unloadable[0]["message"], snap["alerts"]
    assert snap["summary"]["counters"]["weight_load_failures"] >= 1

    code = job.wait(DEADLINE_S + 120)
    ended_after = time.monotonic() - t0
    log = job.log_tail(300_000)
    assert code != 0, log[-4000:]
    print(f"the job ended {ended_after:.0f} s after the trainer first said the weights cannot load")
    # Said while waiting: the version, how many publishes, the cause and when the run ends.
    assert re.search(
        r"no generator can load the weights \(v1: 1 of 1 failed; 1 publish\(es\) in a row over \d+ s\): .*LoRA rank 16 "
        r"is greater than max_lora_rank 8.*; nothing new can be generated or trained until one loads them \(each "
        r"generator retries\)\. The run checkpoints and ends after 4 more failed publish\(es\) or \d+ s\.",
        log,
    ), log[-4000:]
    # Ended at the deadline (not by the batch timeout, nor by its generator dying), checkpointed.
    found = re.search(
        r"no generator can load the weights \(v1: 1 of 1 failed; 1 publish\(es\) in a row over (\d+) s\): .*LoRA rank "
        rf"16 is greater than max_lora_rank 8.* \(reached sync\.load_failure_deadline_s={DEADLINE_S}\); checkpointed "
        r"step (\d+)\. Resume once the engines can load the weights: asyncrl train --resume (\S+)",
        log,
    )
    assert found, log[-4000:]
    assert DEADLINE_S <= int(found.group(1)) <= DEADLINE_S + 15
    assert found.group(3) == str(job.run_dir)
    step = int(found.group(2))
    assert step == 1
    ckpt = latest_checkpoint(job.run_dir)
    assert ckpt is not None and ckpt.name == f"step_{step:06d}"
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["counters"]["weight_load_failures"] >= 1
    assert "reached sync.load_failure_deadline_s" in summary["error"]
    assert summary["parity_gate"]["passed"] is True  # the base model (v0) matched before the step
