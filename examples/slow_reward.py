"""Slow rewards that cannot stall generation: an ``async def`` remote verifier and a blocking
check, each under a timeout (configs/slow_rewards.yaml).

    PYTHONPATH=. asyncrl train configs/slow_rewards.yaml

Generators run a plain ``def`` reward on their reward threads and await an ``async def`` one
on their event loop, every sample of every group in flight at once; a call past its timeout
(rollout.reward_timeout_s, or the entry's own timeout_s) scores its sample as failed
(rollout.reward_on_failure) and counts in rollout/reward_timeouts on the dashboard.
"""

from __future__ import annotations

import asyncio
import time
import zlib

VERIFIER_LATENCY_S = 0.05
STUCK_S = 60.0
"""How long the stand-in verifier takes on an answer it chokes on: far past any timeout."""


def chokes_on(answer: str) -> bool:
    """About one answer in ten, fixed by the answer's text (e.g. "cbb"; "bab" passes)."""
    return zlib.crc32(answer.encode()) % 10 == 0


async def remote_verifier(prompts, completions, target, **_):
    """Stands in for an HTTP call to a verifier service (await it with your client of choice,
    e.g. httpx.AsyncClient): it answers in 50 ms, but never in time for the answers it chokes
    on, which then time out instead of holding up the generator."""
    await asyncio.sleep(STUCK_S if any(chokes_on(c) for c in completions) else VERIFIER_LATENCY_S)
    return [1.0 if c.strip() == t else 0.0 for c, t in zip(completions, target, strict=True)]


def blocking_check(prompts, completions, **_):
    """Stands in for a blocking call (a sandboxed subprocess, a synchronous HTTP client): it
    runs on a reward thread, so its sleep blocks that thread only, never the event loop."""
    time.sleep(0.01)
    return [None if not c.strip() else float(len(c.strip()) <= 3) for c in completions]
