"""Per-token reduction weights: how much each token counts in one mini-batch's loss.

    w = reduction_weights(loss_mask, "token_mean")        # [N, T] over the WHOLE mini-batch
    loss = (w * per_token_loss).sum()                      # per micro-batch, then summed

The driver computes the weights over the whole mini-batch (all DP ranks together), and
every loss term is ``sum_t w_t * term_t``. A sum splits over micro-batches and ranks
exactly, so the gradient cannot depend on how the mini-batch is cut. (The idea of moving
the normaliser out of the loss and into per-token weights is SkyRL PR #1296, which in turn
follows Tinker's "sum the token losses, scale the advantages" convention.)

    token_mean               w = m / sum(m)                      every token counts equally
    sequence_mean            w = m / (S * len_i)                  every sequence counts equally
    seq_mean_token_sum_norm  w = m / (S * C)                      Dr. GRPO: no length bias
    prompt_mean              w = m / (G * sum_{j in g} len_j)      every prompt counts equally
    token_mean_per_microbatch  legacy: see per_microbatch_token_mean_weights

S is the number of sequences with at least one loss token (sequences excluded entirely,
e.g. a failed reward, do not dilute the others); len_i = sum_t m_i,t; C is a constant,
usually the max response length (Liu et al., "Understanding R1-Zero-Like Training", 2025).
prompt_mean is the mean over prompts of each prompt's token mean: g is sequence i's group
(its prompt), G the number of groups with at least one loss token, so all samples of one
prompt share one unit of weight however many samples or tokens it has (SkyRL's
``prompt_mean``). It needs the group ids, which only the driver has.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_per_microbatch")


def reduction_weights(
    loss_mask: Tensor, reduction: str, *, constant: float | None = None, group_ids: Tensor | None = None
) -> Tensor:
    """Per-token weights [N, T] for a whole mini-batch; zero wherever ``loss_mask`` is zero.

    ``group_ids`` [N] (any integers; equal for samples of one prompt) is needed by
    ``prompt_mean`` only.

    ``token_mean_per_microbatch`` cannot be computed here (it depends on the micro-batch a
    token lands in): it returns ``loss_mask`` itself, and the loss turns it into weights with
    :func:`per_microbatch_token_mean_weights` once the micro-batch is known.
    """
    mask = loss_mask.to(torch.float64) if not loss_mask.is_floating_point() else loss_mask
    if mask.dim() != 2:
        raise ValueError(f"loss_mask must be [N, T], got shape {tuple(mask.shape)}")
    if reduction == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    if reduction == "token_mean_per_microbatch":
        return mask.clone()
    lengths = mask.sum(dim=1, keepdim=True)
    num_seqs = (lengths > 0).sum().clamp(min=1).to(mask.dtype)
    if reduction == "sequence_mean":
        return mask / (num_seqs * lengths.clamp(min=1.0))
    if reduction == "seq_mean_token_sum_norm":
        if constant is None or not constant > 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a constant > 0, got {constant!r}")
        return mask / (num_seqs * constant)
    if reduction == "prompt_mean":
        return _prompt_mean_weights(mask, lengths.squeeze(1), group_ids)
    raise ValueError(f"unknown loss reduction {reduction!r}: must be one of {', '.join(LOSS_REDUCTIONS)}")


def per_microbatch_token_mean_weights(loss_mask: Tensor, num_microbatches: int) -> Tensor:
    """Legacy ``token_mean_per_microbatch``: w = m / (sum(m over this micro-batch) * K).

    K is the number of micro-batches the mini-batch was cut into, counted over all DP ranks
    (``world_size * micro-batches per rank``): the result is the mean, over micro-batches, of
    each micro-batch's token mean, which is what trainers did before the weights moved to the
    driver. Its gradient DOES depend on the micro-batching (with micro-batches of one sequence
    it is sequence_mean); it exists only to reproduce older runs.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: must be >= 1")
    mask = loss_mask if loss_mask.is_floating_point() else loss_mask.to(torch.float32)
    return mask / (mask.sum().clamp(min=1.0) * num_microbatches)


def _prompt_mean_weights(mask: Tensor, lengths: Tensor, group_ids: Tensor | None) -> Tensor:
    if group_ids is None:
        raise ValueError("prompt_mean needs group_ids (one per sequence; equal for samples of one prompt)")
    group_ids = torch.as_tensor(group_ids, device=mask.device)
    if group_ids.shape != lengths.shape:
        raise ValueError(f"group_ids must be [N] = {tuple(lengths.shape)}, got {tuple(group_ids.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    group_tokens = torch.zeros(
        int(inverse.max()) + 1 if inverse.numel() else 0, dtype=mask.dtype, device=mask.device
    ).index_add_(0, inverse, lengths)
    num_groups = (group_tokens > 0).sum().clamp(min=1).to(mask.dtype)
    return mask / (num_groups * group_tokens[inverse].clamp(min=1.0)).unsqueeze(1)
