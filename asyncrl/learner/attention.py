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
sliding window, GQA, dropout, the scale); a model whose mask carries others (chunked
attention, logit soft-capping, attention sinks, position biases) is refused: `supports`
says which at load time, and the forward raises on the arguments it cannot honour.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VARLEN_SDPA = "asyncrl_sdpa_varlen"
"""The attention implementation's name (it contains "sdpa": transformers then checks that the
model supports SDPA before loading it with this)."""

# Config fields whose attention rule lives in the mask or in arguments this function refuses.
_UNSUPPORTED_CONFIG = ("attention_chunk_size", "attn_logit_softcapping")


def supports(config: Any) -> bool:
    """Whether a model with this Hugging Face config can run VARLEN_SDPA: a causal decoder
    whose attention rules all reach the attention call (module docstring)."""
    if not getattr(config, "is_causal", True):
        return False
    return all(getattr(config, name, None) is None for name in _UNSUPPORTED_CONFIG)


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
) -> torch.Tensor:
    """Causal attention of one sequence (or of rows that each hold one), [B, H, n, D]."""
    n = query.shape[2]
    mask = None
    if sliding_window is not None and n > sliding_window:
        # transformers' sliding_window_overlay on top of causal: q - window < kv <= q.
        i = torch.arange(n, device=query.device)
        gap = i.view(-1, 1) - i.view(1, -1)
        mask = (gap >= 0) & (gap < sliding_window)
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
    refused = [k for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None]
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
    attend = functools.partial(
        _causal_sdpa,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        gqa=getattr(module, "num_key_value_groups", 1) > 1,
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
