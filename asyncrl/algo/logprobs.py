"""Token log-probs and entropy from logits, at a sampling temperature with top-k / top-p.

    logp = logprobs_from_logits(logits, targets, temperature=0.7, top_k=50, top_p=0.9)  # [..., V], [...] -> [...]
    ent = entropy_from_logits(logits, temperature=0.7, top_k=50, top_p=0.9)             # [..., V] -> [...]

The quantity is the one vLLM returns with ``logprobs_mode="processed_logprobs"`` (its
``Sampler``: allowed-token mask, then temperature, then top-k, then top-p, then
``log_softmax``; vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py,
``apply_top_k_top_p_pytorch``). Per row, with z = logits / T (logits already masked where the
engines may not sample):

    top-k:  drop v if z_v < z_(k), the k-th largest value (ties with it are all kept)
    top-p:  sort the survivors ascending, q = their softmax, c = cumsum(q);
            drop the tokens with c <= 1 - p; the largest always stays. The token whose
            cumulative mass first exceeds 1 - p (the one that crosses the threshold) is kept.
    logp_v = z_v - logsumexp_{u kept} z_u   (v kept),   -inf (v dropped)

Both cuts keep every token whose z is >= one per-row threshold t (:func:`kept_threshold`),
so the kept set is stored as one number per row. vLLM's top-p cuts by sorted position: of
several tokens tied exactly at the cut it keeps an arbitrary subset; here all of them are
kept (a superset, so a token the engine sampled is never dropped for a tie). Without ties,
the sets are identical.

A target outside the kept set gets -inf (probability 0): a learner whose weights differ
from the sampling engine's (stale data, or the last float bits at the cut) can rank a
sampled token outside its own cut. The learner's loss masks such tokens and counts them
(asyncrl.learner.loss); the gradient through a -inf entry is defined as 0, never NaN.

Entropy H = lse(z) - sum_v p_v z_v over the kept set, p = softmax of the kept z. It runs
through a custom autograd function that keeps only ``logits`` (and two numbers per row) for
backward and works in row chunks, so besides the gradient itself it never holds more than
one extra logits-sized tensor (a naive softmax * log_softmax keeps three). The truncated
log-prob runs through the same kind of function; untruncated, it is plain autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows (tokens) per chunk inside the kernels: bounds the temporaries to chunk x vocab
# instead of tokens x vocab.
ENTROPY_CHUNK_ROWS = 1024


def _check(temperature: float, top_k: int, top_p: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k={top_k!r}: must be -1 (off) or >= 1")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1]")


def truncates(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether top-k / top-p cut anything (vLLM treats top_k >= V like -1, top_p = 1 as off)."""
    return 0 < top_k < vocab_size or top_p < 1.0


@torch.no_grad()
def _row_thresholds(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """t [R] for z [R, V]: row r keeps exactly the tokens with z >= t_r."""
    vocab = z.shape[-1]
    use_k = 0 < top_k < vocab
    if top_p >= 1.0:
        if not use_k:
            return torch.full(z.shape[:-1], -torch.inf, dtype=z.dtype, device=z.device)
        return z.topk(top_k, dim=-1).values[:, -1]  # vLLM's apply_top_k_only: no full sort
    s = z.sort(dim=-1).values  # ascending, as vLLM sorts
    if use_k:
        s.masked_fill_(s < s[:, vocab - top_k].unsqueeze(-1), -torch.inf)
    cum = s.softmax(dim=-1).cumsum_(dim=-1)
    # vLLM holds p as float32 and compares cumsum <= 1 - p; the largest token always stays.
    one_minus_p = 1 - torch.tensor(top_p, dtype=torch.float32)
    dropped = (cum <= one_minus_p.to(cum.dtype)).sum(dim=-1).clamp_(max=vocab - 1)
    return s.gather(-1, dropped.unsqueeze(-1)).squeeze(-1)


def kept_threshold(z: Tensor, top_k: int = -1, top_p: float = 1.0, *, chunk_rows: int = ENTROPY_CHUNK_ROWS) -> Tensor:
    """Per row of z = logits / T [..., V], the t with kept set {v : z_v >= t} (-inf: all kept).

    Chunked over rows, so the sort's temporaries stay chunk x V.
    """
    flat = z.detach().reshape(-1, z.shape[-1])
    out = torch.empty(flat.shape[0], dtype=flat.dtype, device=flat.device)
    for s in range(0, flat.shape[0], chunk_rows):
        out[s : s + chunk_rows] = _row_thresholds(flat[s : s + chunk_rows], top_k, top_p)
    return out.reshape(z.shape[:-1])


def _scaled(x: Tensor, temperature: float, dtype: torch.dtype) -> Tensor:
    """z = logits / T, computed the same way wherever a kept set is compared against it."""
    return x.to(dtype) / temperature


class _TruncatedLogprob(torch.autograd.Function):
    """z_y - lse_{kept} z at the target y; -inf where y is not kept.

    d/dz_j = [j = y] - p_j (p over the kept set, 0 elsewhere); d/dlogits = d/dz / T.
    A target outside the kept set gets a zero gradient on its row.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, top_k: int, top_p: float, chunk: int):
        flat = logits.reshape(-1, logits.shape[-1])
        tgt = targets.reshape(-1, 1).long()
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(out)
        thr = torch.empty_like(out)
        for s in range(0, flat.shape[0], chunk):
            z = _scaled(flat[s : s + chunk], temperature, dtype)
            t = _row_thresholds(z, top_k, top_p)
            picked = z.gather(-1, tgt[s : s + chunk]).squeeze(-1)
            z.masked_fill_(z < t.unsqueeze(-1), -torch.inf)
            lse[s : s + chunk] = torch.logsumexp(z, dim=-1)
            thr[s : s + chunk] = t
            out[s : s + chunk] = torch.where(picked >= t, picked - lse[s : s + chunk], -torch.inf)
        ctx.save_for_backward(logits, tgt, lse, thr, torch.isfinite(out))
        ctx.temperature, ctx.chunk = temperature, chunk
        return out.reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tgt, lse, thr, inside = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        g = torch.where(inside, grad_out.reshape(-1).to(lse.dtype), 0.0) / t
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            z = _scaled(flat[s : s + chunk], t, lse.dtype)
            p = torch.exp(z - lse[s : s + chunk].unsqueeze(-1)).masked_fill_(z < thr[s : s + chunk].unsqueeze(-1), 0.0)
            p.mul_(-g[s : s + chunk].unsqueeze(-1))
            p.scatter_add_(-1, tgt[s : s + chunk], g[s : s + chunk].unsqueeze(-1))
            grad[s : s + chunk] = p
        return grad.reshape(logits.shape), None, None, None, None, None


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = -1,
    top_p: float = 1.0,
    chunk_rows: int = ENTROPY_CHUNK_ROWS,
) -> Tensor:
    """log p(target) under the engine's sampling distribution: [..., V], [...] (long) -> [...].

    No top-k / top-p: log_softmax(logits / T)[target]. With them: the truncated, renormalised
    log-prob of the module docstring, -inf for a target outside the kept set.
    """
    _check(temperature, top_k, top_p)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not line up")
    if truncates(top_k, top_p, logits.shape[-1]):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows={chunk_rows!r}: must be >= 1")
        return _TruncatedLogprob.apply(logits, targets, float(temperature), int(top_k), float(top_p), int(chunk_rows))
    z = _at_least_float32(logits)
    z = z / temperature if temperature != 1.0 else z
    picked = z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _at_least_float32(x: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast: a log-sum-exp over the vocab in bf16 is off by ~1e-2."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _entropy_rows(z: Tensor, thr: Tensor) -> tuple[Tensor, Tensor]:
    """Entropy and log-sum-exp over the kept set {z >= thr} of each row of z [R, V] (no grad;
    z is overwritten).

    Shifting by the row max first keeps lse - E[z] from cancelling catastrophically when
    the logits are large (float32 at |z| ~ 5e3 has a step of ~5e-4).
    """
    dropped = z < thr.unsqueeze(-1)
    top = z.max(dim=-1, keepdim=True).values  # the largest token is always kept
    z.sub_(top)
    z.masked_fill_(dropped, -torch.inf)
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    z.masked_fill_(dropped, 0.0)  # p = 0 there; 0 * -inf would be NaN in the product below
    expected_z = torch.bmm(p.unsqueeze(1), z.unsqueeze(-1)).reshape(-1)  # sum_v p z without a p*z tensor
    return lse - expected_z, lse + top.squeeze(-1)


class _Entropy(torch.autograd.Function):
    """H(softmax of the kept logits / T) per row; backward recomputes p chunk by chunk.

    dH/dz_j = -p_j (z_j - lse + H) = -p_j (log p_j + H) on the kept set, 0 off it (the kept
    set is piecewise constant in z);  dH/dlogits = dH/dz / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, top_k: int, top_p: float, chunk: int) -> Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        dtype = torch.promote_types(logits.dtype, torch.float32)
        ent = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        lse = torch.empty_like(ent)
        thr = torch.empty_like(ent)
        for s in range(0, flat.shape[0], chunk):
            z = _scaled(flat[s : s + chunk], temperature, dtype)
            thr[s : s + chunk] = _row_thresholds(z, top_k, top_p)
            ent[s : s + chunk], lse[s : s + chunk] = _entropy_rows(z, thr[s : s + chunk])
        ctx.save_for_backward(logits, ent, lse, thr)
        ctx.temperature, ctx.chunk = temperature, chunk
        return ent.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ent, lse, thr = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad_out.reshape(-1)
        grad = torch.empty_like(flat)
        for s in range(0, flat.shape[0], chunk):
            z = _scaled(flat[s : s + chunk], t, lse.dtype)
            log_p = z - lse[s : s + chunk].unsqueeze(-1)
            p = torch.exp(log_p).masked_fill_(z < thr[s : s + chunk].unsqueeze(-1), 0.0)
            grad[s : s + chunk] = -p * (log_p + ent[s : s + chunk].unsqueeze(-1)) * (g[s : s + chunk] / t).unsqueeze(-1)
        return grad.reshape(logits.shape), None, None, None, None


def entropy_from_logits(
    logits: Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = -1,
    top_p: float = 1.0,
    chunk_rows: int = ENTROPY_CHUNK_ROWS,
) -> Tensor:
    """Entropy of the engine's sampling distribution (softmax(logits / T), cut by top-k /
    top-p and renormalised) over the last dim: [..., V] -> [...], differentiable.

    The result is float32 (or float64 for float64 logits) whatever the logits' dtype.
    """
    _check(temperature, top_k, top_p)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r}: must be >= 1")
    return _Entropy.apply(logits, float(temperature), int(top_k), float(top_p), int(chunk_rows))
