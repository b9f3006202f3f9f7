"""The dict a generator's stats() returns across Ray is read by name (the elastic CLI, tests,
bench/generate.py): its keys, and the heartbeat's, are a contract."""

from __future__ import annotations

from asyncrl.control.step_metrics import reward_failures
from asyncrl.queue.readback import parse_heartbeat
from asyncrl.rollout.stats import GeneratorStats

STATS_KEYS = {
    "groups",
    "samples",
    "tokens",
    "prompts_skipped",
    "reward_errors",
    "reward_timeouts",
    "reward_threads_hung",
    "reward_failure_rate",
    "reward_last_failure",
    "group_errors",
    "aborted",
    "reissued",
    "dropped_uniform",
    "weight_updates",
    "weight_update_errors",
    "admission_calls",
    "admission_s",
    "version",
    "inflight",
    "tokens_per_s",
    "generator_id",
    "weights_blocked",
}


def test_stats_dict_and_heartbeat_keep_their_keys():
    values = {k: i for i, k in enumerate(sorted(STATS_KEYS))}
    snap = GeneratorStats(**{**values, "generator_id": "g0", "weights_blocked": "cannot load v3"})
    d = snap.as_dict()
    assert set(d) == STATS_KEYS and d["groups"] == values["groups"] and d["generator_id"] == "g0"
    assert snap.heartbeat() == {
        "version": values["version"],
        "groups": values["groups"],
        "tokens_per_s": values["tokens_per_s"],
        "inflight": values["inflight"],
        "blocked": "cannot load v3",  # the trainer's console shows why a generator admits nothing
        "reward_errors": values["reward_errors"],  # summed into rollout/reward_errors by the trainer
        "reward_timeouts": values["reward_timeouts"],
        # the console and dashboard alert on it, naming the reward through the last failure
        "reward_failure_rate": values["reward_failure_rate"],
        "reward_last_failure": values["reward_last_failure"],
    }


def test_the_trainer_sums_the_generators_reward_failures_from_their_heartbeats():
    values = {k: 0 for k in STATS_KEYS} | {
        "weights_blocked": None,
        "tokens_per_s": 0.0,
        "reward_failure_rate": None,
        "reward_last_failure": "",
    }
    g0 = GeneratorStats(**{**values, "generator_id": "g0", "reward_errors": 3, "reward_timeouts": 1})
    g1 = GeneratorStats(**{**values, "generator_id": "g1", "reward_errors": 2, "reward_timeouts": 5})
    older = {"version": 0, "groups": 1}  # a heartbeat without the counts (a generator of an older release)
    # As the trainer reads them: checked (asyncrl.queue.readback), so what a generator writes must pass.
    beats = {"g0": g0.heartbeat(), "g1": g1.heartbeat(), "g2": older}
    gens = {gid: parse_heartbeat({**beat, "heartbeat": 1.0}) for gid, beat in beats.items()}
    assert reward_failures(gens) == {"rollout/reward_errors": 5.0, "rollout/reward_timeouts": 6.0}
