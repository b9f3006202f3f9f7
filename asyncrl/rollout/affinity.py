"""Pinning a generator's engine to CPU cores (benchmarks keep generators and learners apart)."""

from __future__ import annotations

import contextlib
import os

from asyncrl.config import parse_cpu_list


def pin_to_cores(cpu_affinity: str) -> list[int]:
    """Pin every thread of this process to ``cpu_affinity`` ("0-1"); return the cores ([] = no pinning).

    Call it before spawning the engine: child processes inherit the affinity of the thread
    that starts them. vLLM's CPU worker then binds its OpenMP threads to
    VLLM_CPU_OMP_THREADS_BIND (one "0,1"-style list per local rank, '|'-separated; see
    vllm/utils/ompmultiprocessing.py), which would default to "auto" (cores of its own
    choosing), so set it to the same cores.
    """

    cores = parse_cpu_list(cpu_affinity)
    if not cores:
        return []
    absent = [c for c in cores if c >= (os.cpu_count() or 1)]
    if absent:
        raise ValueError(
            f"rollout.cpu_affinity={cpu_affinity!r}: this machine has no cores {absent} (it has {os.cpu_count()})"
        )
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that exited meanwhile
            os.sched_setaffinity(int(tid), cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    return cores
