"""The staleness study's command line and report (bench/staleness.py, bench/staleness_report.py)
without training: bad arguments refused before anything is overwritten, --report-only on a
partial or damaged cells.jsonl, one failed cell not losing the others, the modeled step time
made of the measured phases, and the guide's description of the corrections matching the
configs the cells build."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest

from bench import staleness
from bench.staleness import SYNC, Cell, config, drain
from bench.staleness_report import PUBLISH_S, modeled_step_s

ROOT = Path(__file__).resolve().parents[2]


def _cell(k: int, correction: str, seed: int = 0, steps: int = 3) -> Cell:
    return Cell(
        "reverse",
        k,
        correction,
        seed,
        samples=[0, steps * 16],
        eval_reward=[-0.2, 0.1],
        train_reward=[0.0] * steps,
        abs_logp_diff=[0.0 if k == 0 else 0.1] * steps,
        rollout_kl=[0.0] * steps,
        masked_frac=[0.0] * steps,
        gen_s=[0.2] * steps,
        train_s=[0.3] * steps,
        final_reward=0.1,
        wall_s=1.0,
        ring_checked=True,
    )


def test_rollout_is_band_in_the_guide_is_the_one_the_cells_train_with():
    cfg = config("reverse", "rollout_is", steps=3, staleness=2, model_dir="m", seed=0, groups=2)
    pl = cfg.algo.policy_loss
    band = f"({1 - pl.eps_clip_low:g}, {1 + pl.eps_clip_high:g})"
    guide = (ROOT / "docs/guide/staleness.md").read_text().splitlines()
    row = next(line for line in guide if "| `rollout_is` |" in line)
    assert re.search(r"\(0\.\d+, 1\.\d+\)", row).group(0) == band
    assert band in (ROOT / "bench/staleness.py").read_text()


@pytest.mark.parametrize("correction", ["tis", "tis_geo", SYNC])
def test_ppo_cells_keep_the_clip_the_guide_states(correction):
    cfg = config("reverse", correction, steps=3, staleness=2, model_dir="m", seed=0, groups=2)
    assert (cfg.algo.policy_loss.eps_clip_low, cfg.algo.policy_loss.eps_clip_high) == (0.2, 0.28)
    assert cfg.algo.correction.params().tis == "token"
    assert cfg.algo.correction.params().geo_mask is (correction == "tis_geo")


def test_modeled_step_is_the_measured_phases_and_the_publish():
    # The measured generation time is already a whole step's: the model adds no spread on top.
    gen, train = 0.27, 0.33
    assert modeled_step_s(gen, train, 0, 16) == pytest.approx(gen + train + 2 * PUBLISH_S, rel=1e-6)
    assert modeled_step_s(gen, train, 1, 16) == pytest.approx(train + PUBLISH_S, rel=0.01)  # the first step waits


@pytest.mark.parametrize("flag", ["--jobs", "--seeds", "--steps", "--threads"])
def test_a_count_below_one_is_refused_before_cells_jsonl_is_touched(tmp_path, capsys, flag):
    (tmp_path / "cells.jsonl").write_text("an earlier run's cells\n")
    with pytest.raises(SystemExit) as e:
        staleness.main(["--smoke", flag, "0", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert f"argument {flag}: 0: must be at least 1" in capsys.readouterr().err
    assert (tmp_path / "cells.jsonl").read_text() == "an earlier run's cells\n"


def test_report_only_without_cells_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        staleness.main(["--smoke", "--report-only", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "cells.jsonl does not exist" in capsys.readouterr().err


def test_report_only_skips_a_damaged_line_and_reports_the_rest(tmp_path, capsys):
    whole = [_cell(0, SYNC), _cell(2, "rollout_is"), _cell(2, "tis_geo")]
    lines = [json.dumps(asdict(c)) for c in whole]
    lines.insert(1, json.dumps(asdict(_cell(2, "tis_geo")))[:80])  # a run killed mid-write
    lines.append(json.dumps({"task": "reverse"}))  # not a cell
    (tmp_path / "cells.jsonl").write_text("\n".join(lines) + "\n")
    result = staleness.main(["--smoke", "--report-only", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "cells.jsonl:2: skipped" in err and "cells.jsonl:5: skipped" in err
    assert result["runs"] == 3
    assert (tmp_path / "staleness.md").exists() and (tmp_path / "staleness.png").exists()


def test_report_only_takes_the_steps_from_the_cells_not_the_mode_flag(tmp_path):
    cells = [_cell(0, SYNC, steps=5), _cell(2, "tis", steps=5)]
    (tmp_path / "cells.jsonl").write_text("".join(json.dumps(asdict(c)) + "\n" for c in cells))
    result = staleness.main(["--report-only", "--out", str(tmp_path)])  # no mode flag: the full grid's 100
    assert result["mode"]["steps"] == 5
    row = result["summary"]["reverse"]["corrections"]["tis"]
    assert row["2"]["modeled_wall_s"] == pytest.approx(result["summary"]["reverse"]["modeled_step_s"]["2"] * 5)


def test_one_failed_cell_does_not_lose_the_others(capsys):
    def work(i: int) -> int:
        if i == 1:
            raise RuntimeError("worker died")
        return i

    reported: list[int] = []
    with ThreadPoolExecutor(2) as pool:
        failures = drain([pool.submit(work, i) for i in range(4)], reported.append)
    assert sorted(reported) == [0, 2, 3]
    assert [str(f) for f in failures] == ["worker died"]
    assert "a cell failed: RuntimeError: worker died" in capsys.readouterr().err
