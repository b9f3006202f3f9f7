"""Token log-probs and entropy from logits, at a sampling temperature.

    logp = logprobs_from_logits(logits, targets, temperature=0.7)    # [..., V], [...] -> [...]
    ent = entropy_from_logits(logits, temperature=0.7)              # [..., V] -> [...]

logp = log_softmax(logits / T)[target]: what vLLM returns with
``logprobs_mode="processed_logprobs"`` (no top-k / top-p: with those on, the engine's
distribution is truncated and the learner's is not). The learner must compute the same
quantity the engine recorded, or every TIS ratio is off by the temperature.

Entropy H = lse(z) - sum_v p_v z_v with z = logits / T, p = softmax(z). It runs through a
custom autograd function that keeps only ``logits`` for backward and works in row chunks,
so besides the gradient itself it never holds more than one extra logits-sized tensor
(a naive softmax * log_softmax keeps three).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows (tokens) per chunk inside the entropy kernel: bounds the temporaries to
# chunk x vocab instead of tokens x vocab.
ENTROPY_CHUNK_ROWS = 1024


def logprobs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / T) gathered at ``targets``: [..., V], [...] (long) -> [...]."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not line up")
    z = _at_least_float32(logits)
    z = z / temperature if temperature != 1.0 else z
    picked = z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _at_least_float32(x: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast: a log-sum-exp over the vocab in bf16 is off by ~1e-2."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _entropy_rows(z: Tensor) -> tuple[Tensor, Tensor]:
    """Entropy and log-sum-exp of each row of z [R, V] (no grad; z is overwritten).

    Shifting by the row max first keeps lse - E[z] from cancelling catastrophically when
    the logits are large (float32 at |z| ~ 5e3 has a step of ~5e-4).
    """
    top = z.max(dim=-1, keepdim=True).values
    z.sub_(top)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    expected_z = torch.bmm(p.unsqueeze(1), z.unsqueeze(-1)).reshape(-1)  # sum_v p z without a p*z tensor
    return lse - expected_z, lse + top.squeeze(-1)


class _Entropy(torch.autograd.Function):
    """H(softmax(logits / T)) per row; backward recomputes p chunk by chunk.

    dH/dz_j = -p_j (z_j - lse + H) = -p_j (log p_j + H);  dH/dlogits = dH/dz / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk: int) -> Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        dtype = torch.promote_types(logits.dtype, torch.float32)
        ent = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(ent)
        for s in range(0, flat.shape[0], chunk):
            ent[s : s + chunk], lse[s : s + chunk] = _entropy_rows(flat[s : s + chunk].to(dtype) / temperature)
        ctx.save_for_backward(logits, ent, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return ent.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ent, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            log_p = flat[s : s + chunk].to(lse.dtype) / t - lse[s : s + chunk].unsqueeze(-1)
            grad[s : s + chunk] = (
                -torch.exp(log_p) * (log_p + ent[s : s + chunk].unsqueeze(-1)) * (g[s : s + chunk] / t).unsqueeze(-1)
            )
        return grad.reshape(logits.shape), None, None


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, *, chunk_rows: int = ENTROPY_CHUNK_ROWS) -> Tensor:
    """Entropy of softmax(logits / T) over the last dim: [..., V] -> [...], differentiable.

    The result is float32 (or float64 for float64 logits) whatever the logits' dtype.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r}: must be >= 1")
    return _Entropy.apply(logits, float(temperature), int(chunk_rows))
