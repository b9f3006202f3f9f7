"""DAPO's overlong handling and the tie test of its dynamic sampling: plain numpy, no torch.

    soft_overlong_penalty([10, 14, 16, 20], max_new_tokens=16, buffer=4)   # [0, -0.5, -1, -1]
    rewards_tie([1.0, 1.0, 1.0])                                           # True

Soft overlong punishment (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. (13)), with L_max the
most new tokens a response may have and L_cache = ``buffer``:

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                = -1                                  L_max < |y|

scaled by ``coef`` and added to the task reward before advantages, so the group baseline
sees it. A response can only reach L_max by being cut there, so the penalty runs from 0 at
L_max - L_cache down to -1 at the cut.

Overlong filtering (DAPO section 3.4) drops a truncated sample (its engine finish reason is
"length") from the loss: ``is_truncated``.

Dynamic sampling (DAPO section 3.2): a group whose rewards are all equal gets advantage 0 on
every sample under a group baseline (grpo, dr_grpo, rloo, maxrl), so it only dilutes the
batch; ``rewards_tie`` is the test, on exactly the rewards the estimator would see.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncrl.types import RolloutGroup

TRUNCATED = "length"
"""The finish reason of a response cut at its token budget (vLLM's, kept in Sample.stop_reason)."""


def soft_overlong_penalty(
    lengths: Sequence[int] | np.ndarray, max_new_tokens: int, buffer: int, coef: float = 1.0
) -> np.ndarray:
    """coef * R_length(|y|) per response length (float64 [N]); see the module docstring.

    A budget smaller than ``buffer`` (a prompt's own, shorter, max_tokens) uses the whole
    budget as the buffer (L_cache = L_max), so the penalty still ends at -1 at the cut."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be >= 1")
    if buffer < 1:
        raise ValueError(f"buffer={buffer!r}: must be >= 1")
    if not coef >= 0:
        raise ValueError(f"coef={coef!r}: must be >= 0")
    cache = min(buffer, max_new_tokens)
    y = np.asarray(lengths, dtype=np.float64)
    start = max_new_tokens - cache
    penalty = np.where(y <= start, 0.0, (start - y) / cache)
    return coef * np.maximum(penalty, -1.0)


def is_truncated(stop_reason: str) -> bool:
    """Whether a sample was cut at its token budget (finish reason 'length')."""
    return stop_reason == TRUNCATED


def rewards_tie(rewards: Sequence[float] | np.ndarray) -> bool:
    """True iff there is at least one reward and all are exactly equal (then every group-
    baseline advantage is exactly 0). No rewards (every one failed) is not a tie: a failure
    is reported, not hidden as an uninformative group."""
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size > 0 and np.all(r == r[0]))


MAX_NEW_TOKENS_KEY = "max_new_tokens"
"""Group metadata: the token budget its responses were sampled with (a prompt's own max_tokens
can differ from rollout.max_tokens); the generator writes it when the soft penalty is on."""


def token_budget(group: RolloutGroup, default: int | None) -> int:
    """L_max of ``group``: the budget its generator recorded, else ``default`` (rollout.max_tokens)."""
    recorded = group.metadata.get(MAX_NEW_TOKENS_KEY)
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
        return recorded
    if default is None:
        raise ValueError(f"group {group.group_id!r}: no token budget recorded and no default max_new_tokens given")
    return default


def penalised_rewards(
    group: RolloutGroup, buffer: int | None, coef: float = 1.0, default_max_new_tokens: int | None = None
) -> np.ndarray:
    """Each sample's reward plus coef * R_length(its response length) (float64 [n]); the plain
    rewards when ``buffer`` is None (no soft penalty). A failed reward (NaN) stays NaN."""
    rewards = np.array([s.reward for s in group.samples], dtype=np.float64)
    if buffer is None:
        return rewards
    budget = token_budget(group, default_max_new_tokens)
    return rewards + soft_overlong_penalty([s.num_tokens for s in group.samples], budget, buffer, coef)
