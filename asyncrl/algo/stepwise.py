"""Step-wise (multi-turn) trajectories: one sequence per step, one advantage per trajectory.

    adv = broadcast_trajectory_advantages(traj_adv, step_to_traj, step_masks)   # [S, T]
    merged, sources = merge_prefix_steps(steps)        # steps: list of {field: 1-D tensor}

Broadcast: each trajectory's scalar advantage goes to every one of its steps, on *that
step's own* response mask. Copying the last step's already-masked row instead puts the
value at the last step's token positions, which (prompts and responses differ in length
from turn to turn) rarely overlap an earlier step's own tokens, so earlier steps silently
train with advantage 0 (SkyRL issue #1492, fixed in PR #1507). Only outcome estimators make
sense here (one scalar per trajectory); the config rejects gae and reinforce_pp.

Merge: when step k+1's sequence starts with step k's whole sequence (prompt + response, as
happens when each turn re-sends the conversation so far), the two are one sequence: the
positions of step k keep step k's fields (its loss mask covers only its generated tokens)
and the rest come from step k+1 (observation tokens have loss mask 0). Training cost goes
from O(turns^2) to O(turns) tokens (SkyRL PR #1479).
"""

from __future__ import annotations

import torch
from torch import Tensor


def broadcast_trajectory_advantages(traj_advantages: Tensor, step_to_traj: Tensor, step_masks: Tensor) -> Tensor:
    """A[s, t] = traj_advantages[step_to_traj[s]] * step_masks[s, t].

    Args:
        traj_advantages: [K] one scalar advantage per trajectory.
        step_to_traj: [S] long, the trajectory of each step.
        step_masks: [S, T] each step's own response/loss mask (right-aligned or not).
    """
    if step_to_traj.dim() != 1 or step_masks.dim() != 2 or step_masks.shape[0] != step_to_traj.shape[0]:
        raise ValueError(
            "step_to_traj [S] and step_masks [S, T] do not line up: "
            f"{tuple(step_to_traj.shape)}, {tuple(step_masks.shape)}"
        )
    if step_to_traj.numel() and (step_to_traj.min() < 0 or step_to_traj.max() >= traj_advantages.shape[0]):
        raise ValueError(f"step_to_traj indexes outside the {traj_advantages.shape[0]} trajectories")
    mask = (step_masks > 0).to(traj_advantages.dtype if traj_advantages.is_floating_point() else torch.float32)
    return traj_advantages[step_to_traj].to(mask.dtype).unsqueeze(1) * mask


def _extends(prefix: Tensor, seq: Tensor) -> bool:
    return seq.shape[0] >= prefix.shape[0] and bool(torch.equal(seq[: prefix.shape[0]], prefix))


def merge_prefix_steps(steps: list[dict[str, Tensor]]) -> tuple[list[dict[str, Tensor]], list[list[int]]]:
    """Merge consecutive steps of ONE trajectory whose sequences extend each other.

    Args:
        steps: in step order; each a dict of 1-D tensors of equal length aligned to
            ``input_ids`` (e.g. input_ids, loss_mask, rollout_logprobs, advantages,
            token_versions). All steps must carry the same fields.

    Returns:
        (merged sequences, for each the indices of the steps it came from).
    """
    merged: list[dict[str, Tensor]] = []
    sources: list[list[int]] = []
    for i, step in enumerate(steps):
        if "input_ids" not in step:
            raise ValueError(f"step {i} has no 'input_ids'")
        n = step["input_ids"].shape[0]
        for name, value in step.items():
            if value.dim() != 1 or value.shape[0] != n:
                raise ValueError(f"step {i}: field {name!r} has shape {tuple(value.shape)}, expected [{n}]")
        if merged and set(step) != set(merged[-1]):
            raise ValueError(f"step {i} has fields {sorted(step)}, the previous step {sorted(merged[-1])}")
        if merged and _extends(merged[-1]["input_ids"], step["input_ids"]):
            prev = merged[-1]
            k = prev["input_ids"].shape[0]
            merged[-1] = {name: torch.cat([prev[name], step[name][k:].to(prev[name].dtype)]) for name in step}
            sources[-1].append(i)
        else:
            merged.append(dict(step))
            sources.append([i])
    return merged, sources
