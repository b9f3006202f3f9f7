"""Context parallelism: one packed row split across the ranks of a context-parallel group.

    cp = ContextParallel.build(rank=r, world_size=n, size=2, sampling=loss.Sampling.of(cfg.rollout))
    with cp.scope(mb) as layout:                          # mb: a packed micro-batch, the same on every CP rank
        scores = cp.scores(model, mb, layout)             # RowScores over the whole row, on every CP rank
        loss, metrics = microbatch_loss(scores, mb, ...)
        (loss / cp.size).backward()                       # inside the scope: recomputed blocks gather again

Every rank of a CP group holds the same micro-batch. Its packed row (padded at the end to a
multiple of 2 x size with one extra, separate sequence) is cut into 2 x size equal chunks;
rank r runs the model on chunks r and 2 x size - 1 - r (zigzag: under causal attention the
early chunks are cheap and the late ones dear, so every rank gets one of each and the same
work). Each token keeps its true position id, so rotary embeddings are those of the whole row.

Attention (`attend`, called by asyncrl.learner.attention's varlen SDPA while a layout is
active) all-gathers the keys and values of the row from the CP group and runs each local
query span against its own sequence's keys up to itself: a packed row's sequences stay apart
and a sequence that straddles a chunk boundary sees all its earlier tokens, wherever they
live. Everything else in a decoder block is per token, so the chunk's hidden states and
logits are exactly the full row's at those positions.

The per-token log-probs (and entropies) are taken where the logits are, each position
scoring its successor token, then all-gathered to the whole row, so every CP rank computes
the full micro-batch's loss: sequence-level terms see whole sequences. Each rank backpropagates
1/size of it; the all-gather's backward all-reduces the row's gradient and keeps its own
slice, so the gradient reaching each rank's chunk is exactly the whole loss's, and FSDP's sum
over all ranks (CP ranks included) is the CP=1 gradient. The design page is
docs/design/learner.md, "Context parallelism".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.algo.logprobs import entropy_from_logits, logprobs_from_logits
from asyncrl.data import microbatch as mbatch
from asyncrl.learner.loss import RowScores, Sampling

_ACTIVE: RowLayout | None = None
"""The layout the model's attention reads (set by ContextParallel.scope). A global, not a
context variable: activation checkpointing recomputes blocks inside backward, which must see it."""


def active() -> RowLayout | None:
    """The row layout of the forward (or recompute) in progress, None outside CP."""
    return _ACTIVE


def zigzag(rank: int, size: int, padded: int) -> list[tuple[int, int]]:
    """Rank `rank`'s two [start, end) chunks of a row of `padded` tokens (a multiple of 2 x size)."""
    c = padded // (2 * size)
    return [(rank * c, (rank + 1) * c), ((2 * size - 1 - rank) * c, (2 * size - rank) * c)]


def _positions(chunks: list[tuple[int, int]]) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in chunks])


@dataclass(frozen=True)
class RowLayout:
    """How one packed row of `length` tokens lies over the CP group."""

    cp: ContextParallel
    length: int
    padded: int
    chunks: list[tuple[int, int]]
    """This rank's [start, end) spans of the padded row, in the order its tokens run."""
    local: Tensor
    """[padded / size] the row positions this rank computes (its chunks, concatenated)."""
    order: Tensor
    """[padded] where row position p sits in the rank-major concatenation of every rank's tokens."""
    spans: list[tuple[int, int]]
    """The sequences of the padded row (the padding is one sequence of its own)."""
    position_ids: Tensor
    """[1, padded] the row's position ids, the padding's restarting at 0."""


def gather(x: Tensor, layout: RowLayout, dim: int) -> Tensor:
    """Every CP rank's `x` (this rank's tokens along `dim`) as the whole padded row, in row
    order. Differentiable: the backward sums the row's gradient over the group and keeps this
    rank's slice."""
    cat = _Gather.apply(x, dim, layout.cp.group, layout.cp.size, layout.cp.rank)
    return cat.index_select(dim, layout.order.to(x.device))


class _Gather(torch.autograd.Function):
    """all_gather along a dim; backward: all_reduce, then this rank's slice (gloo has no
    reduce_scatter; the row is small next to the activations it lets a rank drop)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, size: int, rank: int) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        ctx.dim, ctx.group, ctx.rank, ctx.n = dim, group, rank, x.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group: `size` consecutive ranks hold the same micro-batches."""

    group: Any
    rank: int
    size: int
    sampling: Sampling

    @classmethod
    def build(cls, *, rank: int, world_size: int, size: int, sampling: Sampling) -> ContextParallel:
        """Collective over the world: one process group per run of `size` consecutive ranks."""
        if size < 2 or world_size % size:
            raise ValueError(f"context_parallel={size} must be >= 2 and divide the {world_size} learner ranks")
        mine = None
        for start in range(0, world_size, size):
            group = dist.new_group(list(range(start, start + size)))  # every rank makes every group
            if start <= rank < start + size:
                mine = group
        return cls(group=mine, rank=rank % size, size=size, sampling=sampling)

    def at(self, temperature: float) -> ContextParallel:
        """The same group scoring at another temperature (the learner's compute_logprobs)."""
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, temperature=temperature))

    def layout(self, position_ids: Tensor) -> RowLayout:
        length = int(position_ids.shape[-1])
        padded = -(-length // (2 * self.size)) * (2 * self.size)
        pos = position_ids.reshape(1, -1).cpu()
        pos = torch.cat([pos, torch.arange(padded - length).unsqueeze(0)], 1)
        restart = torch.ones(padded, dtype=torch.bool)
        restart[1:] = pos[0, 1:] != pos[0, :-1] + 1
        cuts = [*torch.nonzero(restart).flatten().tolist(), padded]
        every = torch.cat([_positions(zigzag(r, self.size, padded)) for r in range(self.size)])
        return RowLayout(
            cp=self,
            length=length,
            padded=padded,
            chunks=zigzag(self.rank, self.size, padded),
            local=_positions(zigzag(self.rank, self.size, padded)),
            order=torch.argsort(every),
            spans=list(itertools.pairwise(cuts)),
            position_ids=pos,
        )

    @contextlib.contextmanager
    def scope(self, mb: dict[str, Any]) -> Iterator[RowLayout]:
        """The packed micro-batch's layout, active for the attention until the block exits:
        keep the backward inside it (activation checkpointing recomputes blocks there)."""
        global _ACTIVE
        layout = self.layout(mb[mbatch.POSITION_IDS])
        before, _ACTIVE = _ACTIVE, layout
        try:
            yield layout
        finally:
            _ACTIVE = before

    def scores(
        self, model: nn.Module, mb: dict[str, Any], layout: RowLayout, disallowed: Tensor | None = None
    ) -> RowScores:
        """The micro-batch's token log-probs and entropies over its [B, L] layout (the whole
        row: every CP rank gets the same), computed from this rank's chunks alone."""
        from asyncrl.learner.step import policy_logits  # step imports this module

        ids = mb[mbatch.PACKED_IDS]
        pad = layout.padded - layout.length
        ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
        # Row position p's logits score the token at p + 1 (its value lands in slot p + 1).
        targets = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1)
        local = layout.local.to(ids.device)
        logits = policy_logits(
            model, ids[:, local], disallowed, position_ids=layout.position_ids.to(ids.device)[:, local]
        )
        s = self.sampling
        logp = logprobs_from_logits(logits, targets[:, local], s.temperature, top_k=s.top_k, top_p=s.top_p)

        def to_rows(values: Tensor) -> Tensor:
            row = gather(values, layout, 1)[:, : layout.length - 1]
            return mbatch.unpack(F.pad(row, (1, 0), value=0.0), mb)

        def entropy(grad: bool) -> Tensor:
            src = logits if grad else logits.detach()
            return to_rows(entropy_from_logits(src, s.temperature, top_k=s.top_k, top_p=s.top_p))

        return RowScores(logprobs=to_rows(logp), entropy=entropy, vocab_size=int(logits.shape[-1]))


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    layout: RowLayout,
    *,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    gqa: bool,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of this rank's query chunks ([1, H, n, D]) over the whole row's keys
    and values (all-gathered), each query inside its own sequence; [1, H, n, D] out. With
    `softcap`, the scores are soft-capped as the one-rank attention does (Gemma 2)."""
    kw = {"dropout": dropout, "scaling": scaling, "sliding_window": sliding_window, "gqa": gqa, "softcap": softcap}
    keys, values = gather(key, layout, 2), gather(value, layout, 2)
    out, offset = [], 0
    for a, b in layout.chunks:
        for s, e in layout.spans:
            for lo in range(max(a, s), min(b, e), QUERY_BLOCK):
                hi = min(lo + QUERY_BLOCK, b, e)
                out.append(_span(query[:, :, offset + lo - a : offset + hi - a], keys, values, s, lo, hi, **kw))
        offset += b - a
    return torch.cat(out, 2)


QUERY_BLOCK = 512
"""Queries per SDPA call: a query span that starts after its sequence does needs an explicit
mask (SDPA's is_causal aligns the diagonal top-left), which CPU SDPA turns into a float
[queries, keys] tensor; blocks of this many queries bound it."""


def _span(q: Tensor, keys: Tensor, values: Tensor, s: int, lo: int, hi: int, **kw: Any) -> Tensor:
    """Row positions [lo, hi) of the sequence starting at s, attending to its keys [s, hi)."""
    k, v = keys[:, :, s:hi], values[:, :, s:hi]
    qi = torch.arange(lo, hi, device=q.device).view(-1, 1)
    kj = torch.arange(s, hi, device=q.device).view(1, -1)
    mask: Tensor | None = kj <= qi
    window = kw["sliding_window"]
    if window is not None:
        mask = (kj <= qi) & (qi - kj < window)
    elif lo == s:  # the sequence's first queries: square, plain causal, no mask to build
        mask = None
    if kw["softcap"] is not None:
        from asyncrl.learner.attention import _softcapped  # attention imports this module

        return _softcapped(q, k, v, mask=mask, dropout=kw["dropout"], scaling=kw["scaling"], softcap=kw["softcap"])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=kw["dropout"],
        scale=kw["scaling"],
        is_causal=mask is None and hi - lo > 1,
        enable_gqa=kw["gqa"],
    )
