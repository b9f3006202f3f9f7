"""bench/peers_time.py, the peers bench's headline: time to a reward threshold and reward at
equal wall-clock, per trainer over seeds, with bounds where a run never reached the threshold.

    .venv/bin/python -m pytest tests/unit/test_peers_time.py -q
"""

from __future__ import annotations

import math

import pytest

from bench import peers_time as pt
from bench.peers import add_time_headline
from bench.peers_report import summarize


def run(times: list[float], rewards: list[float], seed: int = 0) -> dict:
    """One run's summary as bench/peers.py makes it: per-step ends relative to launch at t0 = 100."""
    raw = raw_run(times, rewards, seed)
    return summarize({**raw, "wall_s": times[-1] if times else 0.0, "error": None}, threshold=0.0)


def raw_run(steps: list[float], rewards: list, seed: int = 0) -> dict:
    """A child's raw record, where the step ends and the rewards need not pair up (a TRL run that
    died after scoring a step's completions and before that step ended)."""
    return {
        "t0": 100.0,
        "seed": seed,
        "wall_s": 0.0,
        "error": "RuntimeError: died (log: x)",
        "log": "",
        "steps": [100.0 + t for t in steps],
        "rewards": rewards,
        "completions": [8] * len(steps),
        "tokens": [16] * len(steps),
        "useful_tokens": [16] * len(steps),
    }


def test_rolling_mean_covers_fewer_steps_at_the_start_and_skips_missing_rewards():
    assert pt.rolling([1.0, 3.0, math.nan, 5.0], n=2) == [1.0, 2.0, 3.0, 5.0]
    assert pt.rolling([math.nan]) == [None]


def test_crossing_needs_a_full_window_and_stops_at_the_horizon():
    times = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    # The first step alone is 1.0 >= 0.5, but the window of 5 is full only at step 5 (mean 0.6).
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert pt.crossing(times, rewards, 0.5, horizon=100) == 50.0
    assert pt.crossing(times, rewards, 0.5, horizon=45) is None  # crossed only after the horizon
    assert pt.crossing(times, rewards, 0.7, horizon=100) is None  # (0+1+0+1+1)/5 = 0.6 at step 6
    # A run shorter than the window (one that crashed after two lucky steps) never reaches it.
    assert pt.crossing([5.0, 6.0], [1.0, 1.0], 0.5, horizon=100) is None


def test_reward_at_t_is_the_rolling_reward_of_the_last_step_ended_by_t():
    times, rewards = [10.0, 20.0, 30.0], [0.0, 1.0, 2.0]
    assert pt.reward_at(times, rewards, 5.0) is None  # still starting up
    assert pt.reward_at(times, rewards, 10.0) == 0.0
    assert pt.reward_at(times, rewards, 29.9) == 0.5  # no interpolation towards step 3
    assert pt.reward_at(times, rewards, 1e9) == 1.0


def test_seeds_combine_and_a_never_reaching_seed_makes_the_time_a_lower_bound():
    fast = [run([10, 20, 30, 40, 50], [1] * 5, seed=0), run([10, 20, 30, 40, 60], [1] * 5, seed=1)]
    # A budgeted run ends at its first step past the budget (100 s here).
    half = [run([10, 20, 30, 40, 50], [1] * 5, seed=0), run([30, 60, 90, 120], [-1] * 4, seed=1)]
    fig = pt.time_figures({"asyncrl_async": fast, "trl_hf": half}, threshold=0.5, budget_s=100)
    ours, peer = fig["trainers"]["asyncrl_async"], fig["trainers"]["trl_hf"]
    assert ours["seeds"] == [0, 1]
    assert ours["time_to_threshold_s"] == 55.0 and not ours["lower_bound"] and ours["reached_runs"] == 2
    # Seed 1 never reached it: counted at the budget (100), so the mean (75) is only a lower bound.
    assert peer["time_to_threshold_s"] == 75.0 and peer["lower_bound"] and peer["time_to_threshold_runs"] == [50, None]
    assert fig["best_peer"] == "trl_hf"
    assert fig["ratio"] == pytest.approx(75 / 55) and fig["ratio_kind"] == "lower_bound"
    # Reward at equal wall-clock: fractions of the budget, mean and spread over the seeds.
    assert fig["times_s"] == [25.0, 50.0, 75.0, 100.0]
    at_end = peer["reward_at"]["100"]
    assert (at_end["mean"], at_end["min"], at_end["max"], at_end["n"]) == (0.0, -1.0, 1.0, 2)
    assert fig["reward_at_horizon"] == {"asyncrl_async": 1.0, "trl_hf": 0.0}


def test_a_peer_that_never_reaches_it_gives_budget_over_ours_as_a_lower_bound():
    ours = [run([10, 20, 30, 40, 50], [1] * 5, seed=s) for s in (0, 1)]
    never = [run([30, 60, 90, 120], [-1] * 4, seed=s) for s in (0, 1)]
    fig = pt.time_figures({"trl_vllm": never, "asyncrl_async": ours}, threshold=0.5, budget_s=100)
    assert fig["ratio"] == pytest.approx(100 / 50) and fig["ratio_kind"] == "lower_bound"
    assert pt.fmt_ratio(fig["ratio"], fig["ratio_kind"]).startswith(">= 2.00x")
    # The other way round: only asyncrl never reached it, an upper bound; neither: no ratio at all.
    swapped = pt.time_figures({"trl_vllm": ours, "asyncrl_async": never}, threshold=0.5, budget_s=100)
    assert swapped["ratio"] == pytest.approx(50 / 100) and swapped["ratio_kind"] == "upper_bound"
    both = pt.time_figures({"trl_vllm": never, "asyncrl_async": never}, threshold=0.5, budget_s=100)
    assert both["ratio"] is None and both["ratio_kind"] == "neither_reached"
    vs = pt.time_figures({"asyncrl_sync": never, "asyncrl_async": ours}, threshold=0.5, budget_s=100)["vs_sync"]
    assert vs["ratio"] == pytest.approx(2.0) and vs["kind"] == "lower_bound"


def test_best_peer_is_the_fastest_and_ties_of_bounds_go_to_the_higher_reward():
    ours = [run([10, 20, 30, 40, 50], [1] * 5)]
    low, lower = [run([10, 20, 30, 40, 50], [-1] * 5)], [run([10, 20, 30, 40, 50], [-0.5] * 5)]
    fig = pt.time_figures({"asyncrl_async": ours, "trl_hf": low, "trl_vllm": lower}, threshold=0.5, budget_s=100)
    assert fig["best_peer"] == "trl_vllm"
    quick = [run([5, 6, 7, 8, 9], [1] * 5)]
    fig = pt.time_figures({"asyncrl_async": ours, "trl_hf": quick, "trl_vllm": lower}, threshold=0.5, budget_s=100)
    assert fig["best_peer"] == "trl_hf" and fig["ratio"] == pytest.approx(9 / 50) and fig["ratio_kind"] == "exact"


def test_without_a_budget_the_horizon_is_the_last_runs_end_and_failed_runs_are_left_out():
    failed = run([], [])
    fig = pt.time_figures(
        {"asyncrl_async": [run([10, 20, 30], [0, 0, 1]), failed], "trl_hf": [run([10, 40], [0, 0])]},
        threshold=0.5,
        budget_s=None,
    )
    assert fig["horizon_s"] == 40.0 and fig["budget_s"] is None
    ours = fig["trainers"]["asyncrl_async"]
    assert ours["runs"] == 1 and ours["time_to_threshold_runs"] == [None]  # 1/3 < 0.5
    # Censored at its own end (30 s), not at the horizon: it is not known to miss it past 30 s.
    assert ours["time_to_threshold_s"] == 30.0 and ours["lower_bound"]
    # A run that ended before t keeps its last rolling reward.
    assert ours["reward_at"]["40"]["mean"] == pytest.approx(1 / 3)
    assert fig["trainers"]["trl_hf"]["reward_at"]["40"]["mean"] == 0.0


def test_the_headline_names_the_ratio_its_kind_and_each_trainers_reward_at_the_budget():
    ours = [run([10, 20, 30, 40, 50], [1] * 5)]
    never = [run([30, 60, 90, 120], [-1] * 4)]
    report = {
        "workloads": {
            "realistic": {"time": pt.time_figures({"asyncrl_async": ours, "trl_hf": never}, 0.5, budget_s=100)}
        },
        "headline": {"realistic_completions_per_s_ratio": 2.0},
    }
    add_time_headline(report)
    h = report["headline"]
    assert h["realistic_time_to_threshold_ratio"] == pytest.approx(2.0)
    assert h["realistic_time_to_threshold_ratio_kind"] == "lower_bound"
    assert h["realistic_reward_at_budget"] == {"asyncrl_async": 1.0, "trl_hf": -1.0}
    assert h["realistic_time_to_threshold_s"]["trl_hf"] == {"mean": 100.0, "lower_bound": True, "runs": [None]}
    assert h["realistic_completions_per_s_ratio"] == 2.0  # the throughput ratios stay, after it


def test_the_reward_at_the_budget_says_how_many_seeds_it_is_over():
    ours = [run([10, 20, 30, 40, 50], [1] * 5, seed=s) for s in (0, 1)]
    # Seed 0 still starting up at the budget (its first step past it), seed 1 with three steps.
    slow = [run([130], [-1.0], seed=0), run([40, 60, 90, 120], [-0.5] * 4, seed=1)]
    report = {
        "workloads": {"realistic": {"time": pt.time_figures({"asyncrl_async": ours, "trl_vllm": slow}, 0.5, 100)}},
        "headline": {},
    }
    add_time_headline(report)
    h = report["headline"]
    assert h["realistic_reward_at_budget"] == {"asyncrl_async": 1.0, "trl_vllm": -0.5}
    assert h["realistic_reward_at_budget_seeds"] == {"asyncrl_async": 2, "trl_vllm": 1}
    log = "\n".join(pt.lines("realistic", report["workloads"]["realistic"]["time"]))
    assert "@100s -0.500 [1 of 2]" in log and "@100s 1.000  " in log


def test_a_reward_whose_step_never_ended_is_left_out_not_a_crash_at_the_end():
    # Three steps ended; a fourth step's completions were scored, then the run died.
    died = summarize(raw_run([10, 20, 30], [0.0, 0.0, 0.0, 1.0]), threshold=0.5)
    fine = run([10, 20, 30, 40, 50], [1] * 5)
    fig = pt.time_figures({"asyncrl_async": [fine], "trl_hf": [died]}, threshold=0.5, budget_s=100)
    peer = fig["trainers"]["trl_hf"]
    # Paired up to the last step that ended: never reached, censored at its own end (30 s).
    assert peer["time_to_threshold_runs"] == [None] and peer["time_to_threshold_s"] == 30.0
    assert peer["reward_at"]["100"]["mean"] == 0.0
    assert died["time_to_threshold_s"] is None
    # A step's end without its reward (the other way round) pairs up the same way.
    fig = pt.time_figures({"asyncrl_async": [summarize(raw_run([10, 20], [1.0]), 0.5)]}, threshold=0.5, budget_s=None)
    ours = fig["trainers"]["asyncrl_async"]
    assert fig["horizon_s"] == 10.0 and ours["reward_at"]["10"]["mean"] == 1.0 and ours["time_to_threshold_s"] == 10.0


def test_rewards_that_are_not_finite_numbers_are_missing_not_a_crash():
    assert pt.rolling([None, 1.0, math.inf, "x", 3.0], n=5) == [None, 1.0, 1.0, 1.0, 2.0]


def test_a_mean_reward_of_zero_wins_a_tie_of_bounds_over_a_negative_one():
    ours = [run([10, 20, 30, 40, 50], [1] * 5)]
    zero, negative = [run([10, 20, 30, 40, 50], [0.0] * 5)], [run([10, 20, 30, 40, 50], [-0.5] * 5)]
    fig = pt.time_figures({"asyncrl_async": ours, "trl_hf": zero, "trl_vllm": negative}, threshold=0.5, budget_s=100)
    assert fig["trainers"]["trl_hf"]["reward_at"]["100"]["mean"] == 0.0
    assert fig["best_peer"] == "trl_hf"


def test_the_reward_at_the_horizon_includes_the_step_that_ends_it():
    # No budget: the horizon is the last step's end, 40.04 s; its label rounds to 40.
    fig = pt.time_figures({"asyncrl_async": [run([10, 20, 40.04], [0.0, 0.0, 3.0])]}, threshold=5.0, budget_s=None)
    assert fig["times_s"][-1] == 40.0
    assert fig["reward_at_horizon"]["asyncrl_async"] == pytest.approx(1.0)  # (0 + 0 + 3) / 3


def test_no_ratio_from_a_time_of_zero_and_the_same_keys_when_no_run_had_a_step():
    zero = {"runs": 1, "time_to_threshold_s": 0.0, "lower_bound": False}
    assert pt.ratio(zero, {"runs": 1, "time_to_threshold_s": 10.0, "lower_bound": False}) == (None, None)
    fig = pt.time_figures({"asyncrl_async": [run([], [])]}, threshold=0.5, budget_s=None)
    assert fig["horizon_s"] is None and fig["ratio"] is None
    assert fig["vs_sync"] == {"ratio": None, "kind": None} and fig["reward_at_horizon"] == {}
    report = {"workloads": {"realistic": {"time": fig}}, "headline": {}}
    add_time_headline(report)
    assert report["headline"]["realistic_time_to_threshold_ratio"] is None


def test_the_per_run_time_to_threshold_stops_at_the_budget_and_a_trainer_mean_is_not_survivors_only():
    from bench.peers_report import combine

    # Reached only at the step past the budget (100 s): not within it.
    late = summarize(raw_run([30, 60, 90, 120, 130], [1] * 5) | {"error": None}, threshold=0.5, budget_s=100)
    assert late["time_to_threshold_s"] is None
    early = summarize(raw_run([10, 20, 30, 40, 50, 110], [1] * 6) | {"error": None}, threshold=0.5, budget_s=100)
    assert early["time_to_threshold_s"] == 50.0
    # One seed reached it, one did not: the trainer's time is not the reaching seed's alone.
    assert combine([early, late])["time_to_threshold_s"] is None
    assert combine([early, early])["time_to_threshold_s"] == 50.0


def test_the_plot_draws_a_run_whose_record_does_not_pair_up(tmp_path):
    from bench.peers_report import combine, plot

    died = summarize(raw_run([10, 20, 30], [math.nan, 0.0, 0.0, 1.0]), threshold=0.5)
    runs = {"trl_hf": [died], "asyncrl_async": [run([10, 20], [0.0, 1.0])]}
    report = {
        "machine": "test",
        "workloads": {
            "realistic": {
                "spec": {"threshold": 0.5},
                "trainers": {tr: combine(rs) for tr, rs in runs.items()},
                "time": pt.time_figures(runs, 0.5, budget_s=100),
            }
        },
    }
    plot(report, [tmp_path / "peers.png"])
    assert (tmp_path / "peers.png").stat().st_size > 0


def test_a_budgeted_run_that_crashed_is_reported_with_its_own_error_and_one_that_stopped_early_is_flagged(tmp_path):
    from bench.peers_run import read_result, run_error

    spec = {"budget_s": 150.0, "steps": 5000, "t0": 100.0}
    # The child's own error, not "no step within the budget", when it crashed before a step.
    assert run_error({"error": "OSError: no such model", "steps": []}, 1, spec) == "OSError: no such model"
    assert run_error({"steps": []}, 0, spec) == "no step within the budget"
    # Ended at its first step past the budget: no error. Ended cleanly before it: it had less time.
    assert run_error({"steps": [200.0, 251.0]}, 0, spec) is None
    assert "before the 150 s budget" in run_error({"steps": [200.0, 230.0]}, 0, spec)
    assert run_error({"steps": [101.0] * 3}, 0, {**spec, "steps": 3}) is None  # the step cap
    assert run_error({"steps": [1.0, 2.0]}, 0, {"budget_s": None, "steps": 3, "t0": 0.0}) == "2 of 3 steps"
    assert run_error({}, 0, spec, "timed out after 750 s") == "timed out after 750 s"
    # A result file cut short by a kill reads as no result, not a crash of the bench.
    (tmp_path / "cut.json").write_text('{"steps": [1.0, 2')
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_result(tmp_path / "cut.json") == {} == read_result(tmp_path / "list.json")
    assert read_result(tmp_path / "missing.json") == {}


@pytest.mark.parametrize("budget", ["-5", "0", "nan", "inf"])
def test_a_budget_that_is_not_seconds_above_zero_is_refused_before_anything_runs(tmp_path, budget, capsys):
    from bench.peers import run as bench

    with pytest.raises(SystemExit):
        bench(["--budget-s", budget, "--out", str(tmp_path / "out")])
    assert "--budget-s" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_run_that_crashed_after_a_few_lucky_steps_has_not_reached_the_threshold():
    ours = [run([10, 20, 30, 40, 50], [1] * 5)]
    crashed = [summarize(raw_run([20, 25], [1.0, 1.0]), threshold=0.5, budget_s=100)]
    assert crashed[0]["time_to_threshold_s"] is None
    fig = pt.time_figures({"asyncrl_async": ours, "trl_hf": crashed}, threshold=0.5, budget_s=100)
    peer = fig["trainers"]["trl_hf"]
    # Censored at its own end: a bound, not a time of 25 s that would make it 2x faster than ours.
    assert peer["time_to_threshold_runs"] == [None] and peer["lower_bound"] and peer["time_to_threshold_s"] == 25.0
    assert fig["ratio_kind"] == "lower_bound"


def test_a_bench_that_dies_in_a_later_workload_leaves_the_headline_and_a_failed_plot_loses_nothing(
    tmp_path, monkeypatch
):
    """bench/peers.py's own loop on canned trainer records (no trainer starts): peers.json is
    written after each workload, and a plot that fails at the end still gives the summary."""
    import json

    import bench.peers as peers

    def prepare(name, wl, tmp):
        return {"threshold": 0.5, "budget_s": wl.get("budget_s"), "seed": 0, "steps": 5, "workdir": str(tmp)}

    def run_trainer(tr, spec, out, limit, rep):
        if spec["budget_s"] is None:  # the second workload: the bench is killed here
            raise KeyboardInterrupt
        times = [10.0, 20.0, 30.0, 40.0, 50.0, 160.0]
        return raw_run(times, [1.0] * 6, seed=spec["seed"] + rep) | {"error": None, "profile": []}

    monkeypatch.setattr(peers, "prepare", prepare)
    monkeypatch.setattr(peers, "run_trainer", run_trainer)
    argv = ["--quick", "--trainers", "asyncrl_async", "asyncrl_sync", "--out", str(tmp_path), "--plot", ""]
    with pytest.raises(KeyboardInterrupt):
        peers.run([*argv, "--workloads", "realistic", "demo"])
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert saved["partial"] and list(saved["workloads"]) == ["realistic", "demo"][: len(saved["workloads"])]
    assert saved["headline"]["realistic_time_to_threshold_s"]["asyncrl_async"]["mean"] == 50.0
    assert saved["headline"]["realistic_budget_s"] == 150.0

    def broken_plot(report, paths):
        raise RuntimeError("no display")

    monkeypatch.setattr(peers, "plot", broken_plot)
    summary = peers.run([*argv, "--workloads", "realistic"])
    assert summary["realistic_time_to_threshold_s"]["asyncrl_sync"]["runs"] == [50.0, 50.0]
    assert not json.loads((tmp_path / "peers.json").read_text())["partial"]


def test_a_trl_run_stopped_by_the_parents_timeout_keeps_the_steps_it_made(tmp_path):
    """bench/peers_trl.py's main, with its run (TRL itself is not in this venv) replaced by one
    that made a step and hangs: SIGTERM, the parent's timeout, still leaves the record."""
    import json
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, time\n"
        "import bench.peers_trl as m\n"
        "def run(spec, result):\n"
        "    result['steps'].append(1.0); result['rewards'].append(0.5)\n"
        "    print('stepped', flush=True); time.sleep(60)\n"
        "m.run = run\n"
        "m.main(sys.argv[1], sys.argv[2])\n"
    )
    (tmp_path / "spec.json").write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "spec.json"), str(tmp_path / "result.json")],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "stepped"
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    result = json.loads((tmp_path / "result.json").read_text())
    assert rc != 0 and result["steps"] == [1.0] and result["rewards"] == [0.5]
    assert result["error"].startswith("SystemExit")
