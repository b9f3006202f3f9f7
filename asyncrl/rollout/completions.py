"""A finished vLLM request as the generator uses it: one Completion per sample, with the
behaviour logprob and the weight version of every token.

    outs = completions(final, version=engine.version, submitted=3)   # final: vLLM's last RequestOutput
    outs[0].token_ids, outs[0].logprobs, outs[0].versions

Logprobs are vLLM's ``processed_logprobs`` of the sampled token (rollout/sampling.py asks for
them); per-token versions come from vLLM's ``weight_versions`` spans (rollout/engine.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.data.routing import routed_rows

_LOG = logging.getLogger(__name__)


@dataclass
class Completion:
    """One sampled response: tokens, their behaviour logprobs and the version of each token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_cache_hit_tokens: int = 0
    submitted_version: int | None = None
    """The engine's version when the request was submitted, which salts its prefix-cache lookups.
    A token labelled later ran after an update: in "keep" mode it may attend to the older
    weights' KV (a request queued at the update may even have had its whole prompt from the cache)."""
    prompt_ids: list[int] | None = None
    """The prompt ids the engine ran (vLLM's ``prompt_token_ids``): for a prompt with images,
    its placeholders expanded to the image tokens (asyncrl.rollout.vision_prompts)."""
    routed_experts: np.ndarray | None = None
    """uint8 [prompt + response - 1, layers, k]: the experts the engine routed each forwarded
    position to, from an engine started with enable_return_routed_experts (algo.routing_replay);
    None otherwise."""


def token_versions(spans, num_tokens: int, fallback: int) -> list[int]:
    """Expand vLLM's [(version, start, end)] spans into one int per output token."""
    out = [fallback] * num_tokens
    for span in spans or ():
        for i in range(span.start, min(span.end, num_tokens)):
            out[i] = int(span.version)
    return out


def completions(final: Any, version: int, submitted: int) -> list[Completion]:
    """vLLM's last output of a finished request, in sample order; ``version`` labels tokens
    without a span, ``submitted`` is the version the request was submitted at."""
    cached = final.num_cached_tokens or 0
    ran = None if final.prompt_token_ids is None else list(final.prompt_token_ids)  # one list, shared
    out = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        if c.logprobs is not None:
            logps = [
                next(iter(step.values())).logprob if len(step) == 1 else step[t].logprob
                for t, step in zip(ids, c.logprobs, strict=True)
            ]
        else:
            logps = [0.0] * len(ids)
        routed = getattr(c, "routed_experts", None)  # set only by an engine asked for it
        rows = None if ran is None else routed_rows(len(ran), len(ids))
        out.append(
            Completion(
                ids,
                logps,
                token_versions(c.weight_versions, len(ids), version),
                c.finish_reason,
                cached,
                submitted,
                prompt_ids=ran,
                routed_experts=engine_routing(routed, rows),
            )
        )
    return out


_ROUTING_REFUSED: list[bool] = []  # the warning is given once per process


def engine_routing(routed: Any, rows: int | None = None) -> np.ndarray | None:
    """An engine's routed experts as the sample carries them (asyncrl.data.routing: uint8, one
    byte per index, rows = prompt + response - 1), or None for one the record cannot carry as
    is: an index a byte cannot hold (negative, as a fill value, or past 255), which a plain cast
    would wrap into another expert (-1 -> 255) that the learner would replay; or, given
    ``rows``, another layout (a vLLM whose row count differs), which the record's decoder would
    dead-letter with the whole group. The sample keeps its tokens and trains with the learner's
    own routing; said once."""
    if routed is None:
        return None
    a = np.asarray(routed)
    if a.size and (not np.issubdtype(a.dtype, np.integer) or int(a.min()) < 0 or int(a.max()) > 255):
        why = f"of dtype {a.dtype} in [{a.min()}, {a.max()}] does not fit one byte per expert"
    elif rows is not None and (a.ndim != 3 or a.shape[0] != rows):
        why = f"{a.shape} does not hold one row for each of {rows} positions"
    else:
        return a.astype(np.uint8)
    if not _ROUTING_REFUSED:
        _ROUTING_REFUSED.append(True)
        _LOG.warning("routing replay: engine routing %s; dropped", why)
    return None
