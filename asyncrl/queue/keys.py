"""Redis key layout of one run. Every component names keys through this module only.

asyncrl:runs                      set    names of runs this Redis holds
asyncrl:{run}:rollouts            stream rollout groups, field b"d" = msgpack record, b"n" = the
                                         prompt's in-flight note (generators' puts; re-issue)
asyncrl:{run}:deadletter          stream malformed records: b"reason", b"d" (raw bytes), b"source_id"
asyncrl:{run}:metrics             stream field b"d" = msgpack {"step", "time", "source", "metrics": {name: float}}
asyncrl:{run}:state               hash   policy_version, weights_version, weights_location,
                                         trainer_step, checkpoint_step, max_staleness,
                                         groups_per_step, status, ...
asyncrl:{run}:counters            hash   groups_started, groups_produced, dropped_stale,
                                         dead_lettered, duplicates, groups_trained,
                                         dropped_uniform (generator-dropped tie groups), ...
asyncrl:{run}:dropped             set    group ids dropped as too stale
asyncrl:{run}:produced            set    every group id put (only with queue.ledger on)
asyncrl:{run}:inflight:{gen}      hash   a generator's admitted, unfinished prompts (re-issued on restart)
asyncrl:{run}:reissue             list   msgpack {"prompt_id", "text", "metadata"}: prompts of groups
                                         dropped as stale, to run again (asyncrl.queue.reissue)
asyncrl:{run}:engine_pids         hash   generator id -> msgpack {"host", "pids", "segments", "started"}
                                         (its predecessor's processes, reaped on restart)
asyncrl:{run}:incarnation:{gen}   int    how many times this generator id has started in the run
asyncrl:{run}:generators          hash   generator id -> msgpack {"version", "heartbeat", ...}
"""

from __future__ import annotations

PREFIX = "asyncrl"
RUNS = f"{PREFIX}:runs"
CONSUMER_GROUP = "learners"
RECORD_FIELD = b"d"
NOTE_FIELD = b"n"


def _key(run: str, name: str) -> str:
    if not run or ":" in run:
        raise ValueError(f"run name {run!r}: must be non-empty and contain no ':'")
    return f"{PREFIX}:{run}:{name}"


def rollouts(run: str) -> str:
    return _key(run, "rollouts")


def deadletter(run: str) -> str:
    return _key(run, "deadletter")


def metrics(run: str) -> str:
    return _key(run, "metrics")


def state(run: str) -> str:
    return _key(run, "state")


def counters(run: str) -> str:
    return _key(run, "counters")


def dropped(run: str) -> str:
    return _key(run, "dropped")


def produced(run: str) -> str:
    return _key(run, "produced")


def generators(run: str) -> str:
    return _key(run, "generators")


def incarnation(run: str, generator_id: str) -> str:
    return _key(run, f"incarnation:{generator_id}")


def inflight(run: str, generator_id: str) -> str:
    return _key(run, f"inflight:{generator_id}")


def engine_pids(run: str) -> str:
    return _key(run, "engine_pids")


def reissue(run: str) -> str:
    return _key(run, "reissue")
