"""bench/simulate.py against closed-form cases: the synchronous cycle, generation-bound and
training-bound async, and the staleness bound under long tails with many generators.

    .venv/bin/python -m pytest tests/unit/test_simulate.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import bench.simulate as sim

# Every group takes exactly 1 s and a generator runs a whole batch at full speed.
BASE = sim.Scenario(
    generators=1,
    slots=8,
    parallel=8,
    gen_samples=[1.0],
    train_step=0.3,
    sync=0.05,
    sync_pause=0.1,
    groups_per_step=8,
    max_staleness=0,
    steps=60,
)


def test_synchronous_step_is_generate_then_train_then_publish_and_load():
    r = sim.simulate(BASE)
    assert r.steps_per_s == pytest.approx(1 / (1.0 + 0.3 + 0.05 + 0.1), rel=1e-6)
    assert r.staleness_max == 0 and r.dropped_stale == 0


@pytest.mark.parametrize("bound", [1, 2, 4])
def test_async_generation_bound_pays_only_the_engines_pause(bound):
    # The learner (0.35 s) hides behind generation: one batch per 1 s + the 0.1 s load pause.
    r = sim.simulate(replace(BASE, max_staleness=bound))
    assert r.steps_per_s == pytest.approx(1 / (1.0 + 0.1), rel=0.02)
    assert r.staleness_max <= bound


def test_async_training_bound_runs_at_the_learners_pace():
    r = sim.simulate(replace(BASE, max_staleness=2, train_step=3.0))
    assert r.steps_per_s == pytest.approx(1 / (3.0 + 0.05), rel=0.02)
    assert r.learner_busy_frac > 0.95


@pytest.mark.parametrize("seed", range(4))
def test_staleness_never_exceeds_the_bound_with_long_tails(seed):
    sc = sim.Scenario(
        generators=4,
        slots=6,
        parallel=3,
        gen_mean=1.0,
        gen_cv=2.0,
        gen_samples=[],
        train_step=0.2,
        sync=0.02,
        sync_pause=0.05,
        groups_per_step=8,
        max_staleness=1,
        steps=80,
        seed=seed,
    )
    r = sim.simulate(sc)
    assert r.staleness_max <= 1
    assert sum(r.staleness_hist.values()) == pytest.approx(1.0)
    slower = sim.simulate(replace(sc, max_staleness=0))
    assert r.steps_per_s > slower.steps_per_s  # async beats the synchronous trainer here


def peers_report(step: float, wait: float, sync: float, load: float) -> dict:
    """A bench/peers.py report's realistic workload, as much of it as from_peers reads."""
    sync_profile = {
        "time/step": {"mean": step},
        "time/wait_data": {"mean": wait},
        "time/sync": {"mean": sync},
        "sync/apply_s": {"mean": load},
    }
    trainers = {
        "asyncrl_sync": {
            "error": None,
            "profile": sync_profile,
            "steps_per_s": 1 / step,
            "useful_tokens_per_s": 150 / step,
            "runs": [{"error": None, "profile_steps": {"time/wait_data": [wait, wait]}}],
        },
        "asyncrl_async": {"error": None, "steps_per_s": 0.4, "useful_tokens_per_s": 40.0},
        "trl_hf": {"error": None, "useful_tokens_per_s": 60.0},
        "trl_vllm": {"error": "failed", "useful_tokens_per_s": None},
    }
    return {"workloads": {"realistic": {"spec": {"prompts_per_step": 4}, "trainers": trainers}}}


def test_from_peers_rebuilds_the_sync_step_and_overlaps_it_for_an_own_learner_device():
    # Sync's 3 s step = 1 s generation + 1.85 s learner + 0.15 s publish (0.05 of it the engines' load).
    r = sim.from_peers(peers_report(step=3.0, wait=1.0, sync=0.15, load=0.05), "realistic", steps=120)
    assert r["sync_simulated_steps_per_s"] == pytest.approx(1 / 3.0, rel=0.01)
    assert r["costs_s"] == pytest.approx({"generation": 1.0, "train": 1.85, "publish": 0.1, "load": 0.05})
    # Learner-bound once generation overlaps it: the learner's step plus its export.
    assert r["async_own_device_steps_per_s"] == pytest.approx(1 / 1.95, rel=0.02)
    assert r["best_trl"] == "trl_hf"  # the failed peer is left out
    assert r["useful_tokens_per_step_async"] == pytest.approx(100.0)
    assert r["ratio_vs_best_trl_at_async_lengths"] == pytest.approx(100 / 1.95 / 60, rel=0.02)
    assert r["ratio_vs_best_trl_at_sync_lengths"] == pytest.approx(150 / 1.95 / 60, rel=0.02)
