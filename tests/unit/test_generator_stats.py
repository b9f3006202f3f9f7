"""The dict a generator's stats() returns across Ray is read by name (the elastic CLI, tests,
bench/generate.py): its keys, and the heartbeat's, are a contract."""

from __future__ import annotations

from asyncrl.rollout.stats import GeneratorStats

STATS_KEYS = {
    "groups",
    "samples",
    "tokens",
    "prompts_skipped",
    "reward_errors",
    "reward_timeouts",
    "reward_threads_hung",
    "group_errors",
    "aborted",
    "reissued",
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
    }
