"""Varlen attention on CPU: causal SDPA run per sequence of a packed row, for Hugging Face models.

    from asyncrl.learner import attention
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention.VARLEN_SDPA)
    logits = model(input_ids=packed_row, position_ids=positions).logits   # [1, T] each

A packed row holds several sequences back to back, its ``position_ids`` restarting at 0 for
each (asyncrl.data.microbatch.collate_packed). Flash attention's varlen kernel (CUDA) keeps
each token's attention inside its own sequence and computes nothing else. Transformers' SDPA
on a packed row builds a dense [T, T] block-diagonal mask and computes every block of it, the
attention between sequences too, before the mask drops it: on a row of k sequences of n
tokens that is k times the attention work. This implementation is the CPU counterpart of the
varlen kernel: it cuts the row at each restart of ``position_ids`` and runs causal
``scaled_dot_product_attention`` on each sequence alone, so no token attends across a boundary
and nothing between sequences (or on padding) is computed. Rows without a restart (the padded
layout, whose positions the model makes itself) go to one causal SDPA call, as under SDPA.

Registered (`register`) under VARLEN_SDPA in transformers' AttentionInterface, and not in its
mask interface: transformers then builds no mask for the model at all (masking_utils skips an
implementation it has no mask function for), so a rule the model would express only through
its mask would be lost. The rules that reach the attention call are honoured (causal, a
sliding window, GQA, dropout, the scale, and attention-logit soft-capping as Gemma 2 applies
it: ``softcap * tanh(scores / softcap)`` before the mask); a model whose mask carries others
(chunked attention, a non-causal config) is refused: asyncrl.config.attention_rules says which
at load time, and the forward raises on the arguments it cannot honour (attention sinks, position biases).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.learner import context_parallel

VARLEN_SDPA = "asyncrl_sdpa_varlen"
"""The attention implementation's name (it contains "sdpa": transformers then checks that the
model supports SDPA before loading it with this)."""


def segments(position_ids: torch.Tensor, batch: int) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) token spans of its sequences: a position that is not its
    predecessor + 1 starts one (as transformers' find_packed_sequence_indices and flash
    attention's cu_seqlens read packed rows)."""
    pos = position_ids.expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    width = pos.shape[1]
    out = []
    for row in starts.cpu().tolist():
        cuts = [t for t, s in enumerate(row) if s] + [width]
        out.append(list(itertools.pairwise(cuts)))
    return out


def _causal_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
    gqa: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence (or of rows that each hold one), [B, H, n, D]."""
    n = query.shape[2]
    mask = None
    if sliding_window is not None and n > sliding_window:
        # transformers' sliding_window_overlay on top of causal: q - window < kv <= q.
        i = torch.arange(n, device=query.device)
        gap = i.view(-1, 1) - i.view(1, -1)
        mask = (gap >= 0) & (gap < sliding_window)
    if softcap is not None:
        return _softcapped(query, key, value, mask=mask, dropout=dropout, scaling=scaling, softcap=softcap)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=mask is None and n > 1,
        enable_gqa=gqa,
    )


def _softcapped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Causal attention with the scores soft-capped (``softcap * tanh(s / softcap)``, then the
    mask, then softmax in float32), as transformers' eager Gemma-2 attention and the engines'
    kernels compute it; SDPA has no such step."""
    n = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value)


def varlen_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key/value [B, Hkv, T, D]
    -> ([B, T, H, D], no weights). Each sequence of each row (`segments` of the
    ``position_ids`` the decoder layer passes on) attends causally to itself alone."""
    refused = [k for k in ("s_aux", "position_bias") if kwargs.get(k) is not None]
    if attention_mask is not None or refused:
        what = refused or ["an attention mask"]
        raise NotImplementedError(f"{VARLEN_SDPA} ({type(module).__name__}): cannot honour {what}")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise NotImplementedError(f"{VARLEN_SDPA} ({type(module).__name__}): non-causal attention")
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            f"{VARLEN_SDPA}: {type(module).__name__} passes no position_ids to its attention, so the "
            "sequences of a packed row cannot be told apart; load this model with attn_implementation='sdpa'"
        )
    layout = context_parallel.active()
    if layout is not None:  # this rank holds chunks of a row split over its CP group
        out = context_parallel.attend(
            query,
            key,
            value,
            layout,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            gqa=getattr(module, "num_key_value_groups", 1) > 1,
            softcap=kwargs.get("softcap"),
        )
        return out.transpose(1, 2).contiguous(), None
    attend = functools.partial(
        _causal_sdpa,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        gqa=getattr(module, "num_key_value_groups", 1) > 1,
        softcap=kwargs.get("softcap"),
    )
    spans = segments(position_ids, query.shape[0])
    if all(len(row) == 1 for row in spans):
        out = attend(query, key, value)
    else:
        rows = []
        for b, row in enumerate(spans):
            q, k, v = query[b : b + 1], key[b : b + 1], value[b : b + 1]
            rows.append(torch.cat([attend(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in row], 2))
        out = torch.cat(rows, 0)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make VARLEN_SDPA a valid ``attn_implementation`` in this process (idempotent)."""
    from transformers import AttentionInterface  # transformers: heavy at import

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
