"""The parity gate stops a run whose learner and engine disagree before a single update.

Real job (`asyncrl train`: trainer, learner, a vLLM-CPU generator). The engine is given a
model config the learner never reads (`rollout.engine_kwargs.hf_overrides`, a setting users
copy from their serving configs): the same weights then compute another function on the
engine's side, exactly what an attention rule the learner ignores does. At staleness 0 the
learner's log-probs must equal the engine's; the gate sees they do not, names the size and
the setting, and the run ends with no step trained and no checkpoint written."""

from __future__ import annotations

import json
import re

import pytest

from asyncrl.monitor.dashboard.rundir import RunDirSource
from asyncrl.rundir import latest_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_learner_that_disagrees_with_its_engine_is_stopped_before_any_update(train_job):
    job = train_job(
        "gate",
        "control.total_steps=5",
        "rollout.engine_kwargs={hf_overrides: {rms_norm_eps: 0.5}}",
    )
    job.start()
    code = job.wait(600)
    log = job.log_tail(300_000)
    assert code == 2, log[-4000:]
    found = re.search(
        r"parity gate FAILED at v0: learner vs engine log-probs on (\d+) tokens of (\d+) samples: "
        r"max \|diff\| (\S+) \(mean (\S+); tolerance 0\.001, float32\)",
        log,
    )
    assert found, log[-4000:]
    worst = float(found.group(3))
    print(f"gate: max |diff| {worst} (mean {found.group(4)}) on {found.group(1)} tokens of {found.group(2)} samples")
    assert worst > 1e-2 and int(found.group(1)) > 0
    # The cause named, and what to do; said in the CLI's one line, no traceback.
    last = log.strip().splitlines()[-1]
    assert last.startswith("asyncrl train: parity gate FAILED at v0"), last
    assert "rollout.engine_kwargs.hf_overrides={'rms_norm_eps': 0.5} changes the engine's model config" in last
    assert "Stopped before any update (control.parity_gate=stop" in last
    assert "Traceback" not in log.split("===== ")[-1]
    # Before any update: no step logged, no checkpoint, the learner still at version 0.
    run_dir = job.run_dir
    assert (run_dir / "metrics.jsonl").read_text().strip() == ""
    assert latest_checkpoint(run_dir) is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["step"] == 0 and summary["policy_version"] == 0
    gate = summary["parity_gate"]
    assert gate["passed"] is False and gate["mode"] == "stop" and gate["version"] == 0
    assert gate["max_abs_diff"] == pytest.approx(worst, rel=1e-2) and gate["tolerance"] == 1e-3
    assert "rms_norm_eps" in summary["error"]
    # The dashboard of the finished run shows it as an alert with the figure.
    alerts = RunDirSource(run_dir).snapshot("gate")["alerts"]
    assert [a["kind"] for a in alerts] == ["parity_gate"], alerts
    assert alerts[0]["value"] == pytest.approx(worst, rel=1e-2) and "stopped before any update" in alerts[0]["message"]
