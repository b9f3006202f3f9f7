"""What a stalled or dead `asyncrl train` job looks like from outside: its Redis state and log.

    print(diagnosis(job))     # job: an tests.support.job.TrainJob

TrainJob.wait_for_step puts it in the error when a job stalls or dies under a test.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time

import redis

_RETRY_LINE = re.compile(r"Redis at \S+: \w+: .*; retry \d+ in ")


def diagnosis(job, n_lines: int = 60) -> str:
    """A stalled or dead job as Redis and its log show it: state, counters, stream depth
    and pending, each generator's heartbeat age and in-flight prompts, then the log's last
    lines with runs of Redis-retry warnings folded (they would push out the lines that
    explain the stall)."""
    from asyncrl.queue import keys
    from asyncrl.queue.runstate import unpack_small

    parts = []
    try:
        with contextlib.closing(job.client()) as r:
            stream = keys.rollouts(job.run_name)
            parts.append(f"state: {job.state()}\ncounters: {job.counters()}")
            pending = r.xpending(stream, keys.CONSUMER_GROUP)["pending"] if r.exists(stream) else 0
            parts.append(f"stream length {r.xlen(stream)}, pending {pending}")
            for gen, raw in r.hgetall(keys.generators(job.run_name)).items():
                beat, gen = unpack_small(raw), gen.decode()
                noted = r.hlen(keys.inflight(job.run_name, gen))
                parts.append(
                    f"generator {gen}: heartbeat {time.time() - beat.get('heartbeat', 0):.1f}s "
                    f"ago, version {beat.get('version')}, groups {beat.get('groups')}, "
                    f"{noted} prompts noted in flight"
                )
    except (redis.RedisError, RuntimeError, ValueError) as e:  # a diagnosis must not raise
        parts.append(f"(Redis state unreadable: {e})")
    lines = []
    for is_retry, run in itertools.groupby(
        job.log_tail(400_000).splitlines(), key=lambda line: bool(_RETRY_LINE.search(line))
    ):
        if is_retry:
            lines.append(f"... {sum(1 for _ in run)} Redis retry warnings ...")
        else:
            lines.extend(run)
    parts.append("log tail:\n" + "\n".join(lines[-n_lines:]))
    return "\n".join(parts)
