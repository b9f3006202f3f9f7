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
    token_mean_per_microbatch  legacy: see per_microbatch_token_mean_weights

S is the number of sequences with at least one loss token (sequences excluded entirely,
e.g. a failed reward, do not dilute the others); len_i = sum_t m_i,t; C is a constant,
usually the max response length (Liu et al., "Understanding R1-Zero-Like Training", 2025).
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "token_mean_per_microbatch")


def reduction_weights(loss_mask: Tensor, reduction: str, *, constant: float | None = None) -> Tensor:
    """Per-token weights [N, T] for a whole mini-batch; zero wherever ``loss_mask`` is zero.

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
