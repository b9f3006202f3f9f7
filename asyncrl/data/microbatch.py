"""Deal a mini-batch to DP ranks, cut each rank's share into micro-batches, pad or pack, collate.

    shares = deal_to_ranks([s.num_tokens for s in minibatch], num_ranks=2)       # rank -> indices
    plans = [split_by_token_budget([lengths[i] for i in share], budget=4096) for share in shares]
    count = max(len(p) for p in plans)                                            # same on all ranks
    mb = collate([seq_fields(s) for s in seqs], pad_token_id=0)                   # dict of [B, L]
    mb = collate_packed([seq_fields(s) for s in seqs], pad_token_id=0)            # the same + one packed [1, T] row
    pad = padding_microbatch(field_dtypes(mb), pad_token_id=0)                    # zero loss mask

Two layouts of one micro-batch; the per-token fields (loss mask, rollout logprobs,
advantages, reduction weights ...) are [B, L] right-padded rows in both, so the loss code
is the same for both:

- *padded*: the model runs on the [B, L] rows. Right padding plus causal attention means
  real positions never attend to a pad, so no attention mask is needed and logits at real
  positions do not depend on the padding. The planner picks the cut into micro-batches with
  the least padded compute, each micro-batch charged a fixed cost (`split_by_token_budget`);
  what padding is left is reported as `learner/padding_frac`.
- *packed* (``learner.packing``, the default): the model runs on one row holding the
  sequences back to back (PACKED_IDS, [1, T]) with POSITION_IDS restarting at 0 for each
  sequence, from which the attention keeps every token inside its own sequence and computes
  nothing between sequences (asyncrl.learner.step.forward_logits, asyncrl.learner.attention).
  No pad is computed; the budget bounds the real tokens (`pack_by_token_budget`). Anything
  computed per position on that row (log-probs, entropy) comes back to the [B, L] layout
  through UNPACK_INDEX (`unpack`), with 0 at each sequence's position 0 and on padding, as
  the padded path has at position 0; the loss never reads padding positions.

All ranks run the same number of micro-batches, because every FSDP forward/backward is a
collective. A rank with less data runs *padding micro-batches*: one pad-token row that
carries every per-token field of the real ones (rollout logprobs, versions, advantages ...)
with loss_mask = reduction_weights = 0. Dropping an optional field there is what made the
loss raise inside the collective in SkyRL (PR #1811); `padding_microbatch`
builds it from the real micro-batches' field list, so it cannot drift from them. It is never
packed (one token: nothing to gain).

Images (a vision-language model's prompts, TrainSequence.pixel_values): a micro-batch carries
its distinct tiles under PIXEL_VALUES [1, distinct, 3, S, S] and PIXEL_MASK [1, distinct, S, S]
(a group's samples share theirs) and TILE_INDEX, its sequences' tiles in row order as rows of
those, in both layouts. The model places the tiles' features at the image tokens in reading
order, row after row of the padded layout, sequence after sequence of the packed row: the
same order, so both layouts are exact. A padding micro-batch has no
images; the learner's forward gives any micro-batch without images a stand-in one
(asyncrl.learner.vision.image_inputs), because every rank must run the vision tower's FSDP
collectives in every micro-batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncrl.types import TrainSequence

# Per-token fields a TrainSequence carries into the learner (all aligned to input_ids).
SEQUENCE_FIELDS = ("input_ids", "loss_mask", "rollout_logprobs", "advantages", "reduction_weights", "token_versions")
INTEGER_FIELDS = ("input_ids", "token_versions")
CRITIC_FIELDS = ("token_rewards",)
"""Carried as well when the run trains a critic (TrainSequence.token_rewards)."""
PADDING_KEY = "is_padding"
ROUTED_EXPERTS = "routed_experts"
"""A sequence's engine routing (TrainSequence.routed_experts, uint8 [L - 1, layers, k]): not a
per-token [L] field. A micro-batch carries its sequences' routings as a list under this key (None
for a sequence without one) when any of them has one (the learner lays them out for its forward,
or refuses a micro-batch with an unrouted sequence with the reason: asyncrl.learner.
routing_replay.attach_replay); a dense model's sequences have none and nothing changes."""
# The packed layout's extra fields (module docstring): the forward's input row, its
# per-sequence positions, and where each [B, L] slot's value sits in that row (-1: none).
PACKED_IDS = "packed_input_ids"
POSITION_IDS = "position_ids"
UNPACK_INDEX = "unpack_index"
PACKING_FIELDS = (PACKED_IDS, POSITION_IDS, UNPACK_INDEX)
PIXEL_VALUES = "pixel_values"
PIXEL_MASK = "pixel_attention_mask"
TILE_INDEX = "tile_index"
IMAGE_FIELDS = (PIXEL_VALUES, PIXEL_MASK, TILE_INDEX)
"""A sequence's images (TrainSequence.pixel_values / pixel_attention_mask): per tile, not per
token. A micro-batch holds each distinct tile once, and TILE_INDEX [tiles], for each tile of
its sequences in row order, which of them it is (module docstring)."""


def model_pad_token_id(config: Any) -> int:
    """The id a model's micro-batches are padded with, from its Hugging Face config: its
    ``pad_token_id`` if that is an id of its vocabulary, else its text config's, else 0. A
    vision-language config without a pad id of its own gets its class's default, which need not
    be in the vocabulary (Idefics3's is 128002, past SmolVLM's 49,280 ids): every embedding
    lookup of a padded micro-batch would then fail."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    for candidate in (getattr(config, "pad_token_id", None), getattr(text, "pad_token_id", None)):
        if not isinstance(candidate, int) or isinstance(candidate, bool):
            continue
        if candidate >= 0 and (not isinstance(vocab, int) or candidate < vocab):
            return candidate
    return 0


def seq_fields(seq: TrainSequence) -> dict[str, np.ndarray]:
    """The per-token arrays of one TrainSequence, as int64 / float32 numpy (msgpack/Ray friendly)."""
    out = {}
    for name in SEQUENCE_FIELDS:
        value = np.asarray(getattr(seq, name))
        out[name] = value.astype(np.int64 if name in INTEGER_FIELDS else np.float32, copy=False)
    if seq.token_rewards is not None:
        out["token_rewards"] = np.asarray(seq.token_rewards).astype(np.float32, copy=False)
    if seq.routed_experts is not None:
        out[ROUTED_EXPERTS] = np.asarray(seq.routed_experts, dtype=np.uint8)
    return out | image_fields(seq)


def forward_fields(seq: TrainSequence) -> dict[str, np.ndarray]:
    """What a forward-only pass (the learner's log-probs, the parity gate) needs of a sequence:
    its ids, and its images if it has any."""
    return {"input_ids": np.asarray(seq.input_ids, dtype=np.int64)} | image_fields(seq)


def image_fields(seq: TrainSequence) -> dict[str, np.ndarray]:
    """A sequence's images as IMAGE_FIELDS arrays; {} without."""
    if seq.pixel_values is None:
        return {}
    return {
        PIXEL_VALUES: np.asarray(seq.pixel_values, dtype=np.float32),
        PIXEL_MASK: np.asarray(seq.pixel_attention_mask, dtype=bool),
    }


def _collate_images(seqs: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """The sequences' distinct tiles as [1, distinct, ...] tensors and TILE_INDEX; {} without any.

    A group's samples carry the same array (one per group, asyncrl.data.batch; Ray's pickling
    of a rank's plan keeps one object one object), so tiles are shared by array identity: the
    vision tower then encodes a group's images once per micro-batch, not once per sample.
    Equal arrays that are different objects are encoded twice, which is only slower."""
    first: dict[int, int] = {}  # id(a sequence's tile array) -> its first row among the distinct tiles
    values: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    index: list[int] = []
    rows = 0
    for s in seqs:
        tiles = s.get(PIXEL_VALUES)
        if tiles is None or not len(tiles):
            continue
        if id(tiles) not in first:  # every array is alive in `seqs` meanwhile: ids are not reused
            first[id(tiles)] = rows
            values.append(tiles)
            masks.append(s[PIXEL_MASK])
            rows += len(tiles)
        index.extend(range(first[id(tiles)], first[id(tiles)] + len(tiles)))
    if not values:
        return {}
    shapes = {v.shape[1:] for v in values}
    if len(shapes) > 1:
        raise ValueError(f"collate: tiles of different shapes {sorted(shapes)} in one micro-batch")
    return {
        PIXEL_VALUES: torch.from_numpy(np.concatenate(values)).unsqueeze(0),
        PIXEL_MASK: torch.from_numpy(np.concatenate(masks)).unsqueeze(0),
        TILE_INDEX: torch.tensor(index, dtype=torch.long),
    }


def deal_to_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Assign sequence indices to ranks so token counts are balanced (longest first, greedy).

    LPT scheduling: take sequences from longest to shortest and give each to the rank with
    the fewest tokens so far (ties: lowest rank). Deterministic, so the driver and any
    re-run produce the same dealing. Each rank's indices come back in ascending order.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}: must be >= 1")
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shares]


MICROBATCH_COST_TOKENS = 64
"""What one more micro-batch costs, in padded tokens: its forward/backward launch, FSDP
all-gather and Python. The planner splits a batch further only where that saves more padding."""


def split_by_token_budget(lengths: list[int], budget: int, overhead: int = MICROBATCH_COST_TOKENS) -> list[list[int]]:
    """Cut sequences into micro-batches whose padded size (rows x longest) fits `budget` tokens,
    with the least padded compute: minimise  sum over micro-batches of (rows x longest + overhead).

    Sequences are sorted longest first; some optimal plan then cuts that order into contiguous
    runs (for fixed run sizes, giving the longest sequences to the same runs never raises a
    run's longest), so a dynamic programme over cut points finds it: best[j] = min over runs
    (i, j] that fit the budget of best[i] + (j - i) * sorted_len[i] + overhead. A greedy fill (add while it fits)
    pads a whole micro-batch to one long straggler: on a long-tailed batch that was 15-45% of
    the learner's tokens (bench/peers.py, realistic workload). A sequence longer than the
    budget is never split: it gets a micro-batch of its own. Deterministic (ties: the fewest
    rows in the last run); returns lists of indices into `lengths`, longest micro-batch first.
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget={budget}: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    if n == 0:
        return []
    heads = np.array([lengths[i] for i in order], dtype=np.int64)
    best = np.zeros(n + 1, dtype=np.int64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # A run (i, j] fits when (j - i) * heads[i] <= budget; heads[i] >= heads[j - 1] bounds
        # its rows, and one sequence alone always goes.
        starts = np.arange(max(0, j - max(1, budget // int(heads[j - 1]))), j)
        fits = (j - starts) * heads[starts] <= budget
        fits[-1] = True
        starts = starts[fits]
        costs = best[starts] + (j - starts) * heads[starts] + overhead
        k = len(starts) - 1 - int(np.argmin(costs[::-1]))  # ties: the latest start, i.e. the fewest rows
        best[j], cut[j] = costs[k], starts[k]
    runs, j = [], n
    while j > 0:
        i = int(cut[j])
        runs.append([order[t] for t in range(i, j)])
        j = i
    return runs[::-1]


def pack_by_token_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Cut sequences into packed micro-batches of at most `budget` tokens in all, as few as fit.

    Packed, a micro-batch costs its real tokens whatever its mix of lengths, so only the
    count of micro-batches (each a fixed cost, MICROBATCH_COST_TOKENS) is left to minimise:
    first-fit decreasing (longest first, each into the first micro-batch it fits), within
    11/9 of the fewest plus one. A sequence longer than the budget is never split: it gets a
    micro-batch of its own. Deterministic; returns lists of indices into `lengths`, the
    micro-batch holding the longest sequence first.
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget={budget}: must be >= 1")
    runs: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, load in enumerate(loads) if load + lengths[i] <= budget), len(runs))
        if k == len(runs):
            runs.append([])
            loads.append(0)
        runs[k].append(i)
        loads[k] += lengths[i]
    return runs


def collate(seqs: list[dict[str, np.ndarray]], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad per-token arrays to the longest sequence and stack them into [B, L] tensors.

    input_ids pad with `pad_token_id`, every other field with 0 (so loss_mask and
    reduction_weights are 0 on padding). All sequences must carry the same fields.
    """
    if not seqs:
        raise ValueError("collate: a micro-batch needs at least one sequence (use padding_microbatch)")
    routings = [s.get(ROUTED_EXPERTS) for s in seqs]
    images = _collate_images(seqs)
    seqs = [{n: a for n, a in s.items() if n != ROUTED_EXPERTS and n not in IMAGE_FIELDS} for s in seqs]
    names = list(seqs[0])
    for k, s in enumerate(seqs):
        if list(s) != names:
            raise ValueError(f"collate: sequence {k} has fields {sorted(s)}, sequence 0 has {sorted(names)}")
    width = max(len(s["input_ids"]) for s in seqs)
    out = {}
    for name in names:
        first = np.asarray(seqs[0][name])
        fill = pad_token_id if name == "input_ids" else 0
        rows = np.full((len(seqs), width), fill, dtype=first.dtype)
        for k, s in enumerate(seqs):
            arr = np.asarray(s[name])
            if arr.shape != (len(s["input_ids"]),):
                raise ValueError(
                    f"collate: field {name!r} of sequence {k} has shape {arr.shape}, "
                    f"input_ids has ({len(s['input_ids'])},)"
                )
            rows[k, : len(arr)] = arr
        out[name] = torch.from_numpy(rows)
    if any(r is not None for r in routings):  # a list (not a tensor): the learner lays it out
        out[ROUTED_EXPERTS] = routings  # type: ignore[assignment]
    return out | images


def collate_packed(seqs: list[dict[str, np.ndarray]], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """`collate`'s [B, L] fields plus the packed row the model runs on (module docstring):
    PACKED_IDS and POSITION_IDS [1, T] (the sequences back to back in their order, T their
    total length) and UNPACK_INDEX [B, L], the position in that row of each slot's value, -1
    at each sequence's position 0 (it has no predecessor) and on padding.
    """
    out: dict[str, Any] = collate(seqs, pad_token_id=pad_token_id)
    lengths = [len(s["input_ids"]) for s in seqs]
    ids = np.empty(sum(lengths), dtype=np.int64)
    positions = np.empty(sum(lengths), dtype=np.int64)
    index = np.full(tuple(out["input_ids"].shape), -1, dtype=np.int64)
    start = 0
    for k, n in enumerate(lengths):
        ids[start : start + n] = seqs[k]["input_ids"]
        positions[start : start + n] = np.arange(n)
        index[k, 1:n] = np.arange(start + 1, start + n)
        start += n
    out[PACKED_IDS] = torch.from_numpy(ids).to(out["input_ids"].dtype).unsqueeze(0)
    out[POSITION_IDS] = torch.from_numpy(positions).unsqueeze(0)
    out[UNPACK_INDEX] = torch.from_numpy(index)
    return out


def is_packed(mb: dict[str, Any]) -> bool:
    """Whether the model runs on this micro-batch's packed row rather than its [B, L] rows."""
    return PACKED_IDS in mb


def forward_ids(mb: dict[str, Any]) -> torch.Tensor:
    """The token ids the model runs on: the packed row, or the [B, L] rows."""
    return mb[PACKED_IDS] if is_packed(mb) else mb["input_ids"]


def unpack(values: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """Per-position values over a packed micro-batch's row ([1, T]) in the [B, L] layout of its
    other fields: 0 at each sequence's position 0 and on padding. Differentiable."""
    index = mb[UNPACK_INDEX].to(values.device)
    picked = values.reshape(-1)[index.clamp(min=0)]
    return torch.where(index >= 0, picked, torch.zeros_like(picked))


def computed_tokens(mb: dict[str, Any]) -> int:
    """Token slots the model computes for this micro-batch, padding included."""
    return int(mb[PACKED_IDS].numel() if is_packed(mb) else mb["input_ids"].numel())


def field_dtypes(mb: dict[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """The field list of a collated micro-batch, which a padding micro-batch must reproduce."""
    return {name: t.dtype for name, t in mb.items() if isinstance(t, torch.Tensor) and name not in IMAGE_FIELDS}


def padding_microbatch(fields: dict[str, torch.dtype], *, pad_token_id: int, length: int = 1) -> dict[str, Any]:
    """A [1, length] micro-batch that carries every field in `fields` and trains on nothing.

    input_ids are pad tokens; every other field is 0, so loss_mask and reduction_weights are
    0 and each loss term contributes exactly 0 while the forward/backward collectives still
    run. Flagged with PADDING_KEY so its metrics are not counted. A forward-only field list
    (the learner's log-probs: input_ids alone) pads with input_ids alone.
    """
    loss_fields = ("loss_mask", "reduction_weights")
    required = ("input_ids", *loss_fields) if any(f in fields for f in loss_fields) else ("input_ids",)
    for name in required:
        if name not in fields:
            raise ValueError(f"padding_microbatch: the field list lacks {name!r}; got {sorted(fields)}")
    out: dict[str, Any] = {}
    for name, dtype in fields.items():
        fill = pad_token_id if name == "input_ids" else 0
        out[name] = torch.full((1, length), fill, dtype=dtype)
    out[PADDING_KEY] = True
    return out


def plan_microbatches(
    lengths_per_rank: list[list[int]], budget: int, *, packing: bool = False
) -> tuple[list[list[list[int]]], int]:
    """Split every rank's share by the budget (packed or padded); return the plans and the
    common micro-batch count."""
    split = pack_by_token_budget if packing else split_by_token_budget
    plans = [split(lengths, budget) for lengths in lengths_per_rank]
    return plans, max(1, max((len(p) for p in plans), default=0))


def build_rank_microbatches(
    seqs: list[dict[str, np.ndarray]],
    plan: list[list[int]],
    count: int,
    fields: dict[str, torch.dtype],
    *,
    pad_token_id: int,
    packing: bool = False,
) -> list[dict[str, Any]]:
    """Collate (packing: `collate_packed`) one rank's micro-batches per `plan`, then add
    padding ones up to `count`."""
    if len(plan) > count:
        raise ValueError(f"plan has {len(plan)} micro-batches, more than the common count {count}")
    mbs: list[dict[str, Any]] = []
    for idx in plan:
        members = [seqs[i] for i in idx]
        mb: dict[str, Any] = (
            collate_packed(members, pad_token_id=pad_token_id)
            if packing
            else collate(members, pad_token_id=pad_token_id)
        )
        if set(mb) - {*PACKING_FIELDS, *IMAGE_FIELDS, ROUTED_EXPERTS} != set(fields):
            raise ValueError(f"micro-batch fields {sorted(mb)} differ from the mini-batch's {sorted(fields)}")
        mb[PADDING_KEY] = False
        mbs.append(mb)
    while len(mbs) < count:
        mbs.append(padding_microbatch(fields, pad_token_id=pad_token_id))
    return mbs
