"""Routing replay: a mixture-of-experts learner routes each token to the experts the engine chose.

    install_routing_replay(model)            # once, before FSDP wrapping (idempotent)
    with replayed_routing(model, experts):   # experts: [tokens, layers, k] int, the forward's layout
        loss = loss_fn(model(input_ids=...).logits, ...)
        loss.backward()                      # inside: recomputed (checkpointed) blocks replay too

An off-policy learner scores tokens that an older policy sampled; in an MoE model a small change
of the router's logits flips a token's top-k experts, and the learner's log-prob then comes from
different experts than the engine's (the train/inference mismatch grows with staleness). Replay
takes the experts from the engine and keeps the learner's own router for their weights:

- which experts: the given indices, not the learner's top-k;
- their weights: the learner router's softmax over all experts, gathered at the given indices
  (renormalised over them when the model's ``norm_topk_prob`` is set), so the router's logits
  still receive the policy gradient through the weights;
- the router logits the model reports (``output_router_logits``) are the learner's own, whole:
  a load-balancing (aux) loss computed from them is unchanged by replay. asyncrl's policy loss
  does not add that aux loss (the model's ``router_aux_loss_coef`` only enters transformers'
  own ``labels`` loss, which the learner never passes), so with or without replay the router
  learns from the policy gradient alone.

The patch replaces the forward of each transformers ``Qwen3MoeTopKRouter`` (the block's
``gate``); the experts and the sparse block are untouched. Outside a ``replayed_routing`` block
the patched router computes exactly what the original does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_LOG = logging.getLogger(__name__)

PATCHED = "_asyncrl_routing_replay"
"""The attribute a patched router carries: its layer index among the model's MoE layers."""


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, E] logits of N tokens' hidden states [N, H] under a router weight [E, H]."""
    return F.linear(hidden, weight)


def own_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] the router's own choice: the k experts of highest probability (transformers' order)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    return torch.topk(probs, k, dim=-1).indices


def replay_weights(logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """[N, k] routing weights of the given experts [N, k]: the softmax over all E experts taken at
    those indices, renormalised over them with ``norm_topk_prob`` (as the router normalises its
    own top-k). Differentiable in ``logits``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def differing(engine: torch.Tensor, learner: torch.Tensor) -> torch.Tensor:
    """[..., layers] bool: whether two routings [..., layers, k] name different top-k expert SETS
    (order within the top-k ignored)."""
    return (engine.sort(dim=-1).values != learner.sort(dim=-1).values).any(dim=-1)


def mismatch_fraction(engine: torch.Tensor, learner: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of (token, layer) pairs whose top-k expert SETS differ between two routings
    [..., layers, k] (order within the top-k ignored); ``valid`` [...] selects the tokens
    counted (e.g. the response tokens). 0 when no token is counted."""
    differ = differing(engine, learner).to(torch.float64)
    if valid is not None:
        differ = differ[valid.to(torch.bool)]
    return differ.mean() if differ.numel() else torch.zeros((), dtype=torch.float64)


def forward_routing(
    routings: list[torch.Tensor], lengths: list[int], *, packed: bool, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of a micro-batch's forward, [N, layers, k], and which of its N positions the
    engine routed ([N] bool), from each sequence's engine routing ([n_i - 1, layers, k]: every
    position but its last, asyncrl.data.routing) and its length n_i.

    ``packed``: the sequences back to back (N = sum n_i, the packed row); else right-padded
    rows of ``width`` (N = B * width). A position the engine did not route (a sequence's last
    token, padding) gets experts 0..k-1: under causal attention no scored log-prob reads its
    output (the last token predicts nothing, padding is on the right)."""
    if not routings or len(routings) != len(lengths):
        raise ValueError(f"forward_routing: {len(routings)} routings for {len(lengths)} sequences")
    _, layers, k = routings[0].shape
    for i, (r, n) in enumerate(zip(routings, lengths, strict=True)):
        if r.shape != (max(n - 1, 0), layers, k):
            raise ValueError(f"forward_routing: sequence {i} of {n} tokens has routing {tuple(r.shape)}")
    row = sum(lengths) if packed else (width if width is not None else max(lengths))
    starts = [sum(lengths[:i]) for i in range(len(lengths))] if packed else [i * row for i in range(len(lengths))]
    total = row if packed else row * len(lengths)
    experts = torch.arange(k, dtype=torch.long).expand(total, layers, k).clone()
    routed = torch.zeros(total, dtype=torch.bool)
    for r, start in zip(routings, starts, strict=True):
        experts[start : start + r.shape[0]] = r.to(torch.long)
        routed[start : start + r.shape[0]] = True
    return experts, routed


class _Replay:
    """The routing of the forward in progress, shared by the model's patched routers."""

    def __init__(self) -> None:
        self.experts: torch.Tensor | None = None  # [N, layers, k], N = the forward's tokens
        self.seen: list[torch.Tensor | None] = []  # per layer: the learner's own top-k, last forward


def _patched_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    logits = router_logits(hidden, self.weight)
    layer: int = getattr(self, PATCHED)
    replay: _Replay = self._asyncrl_replay
    own = own_topk(logits, self.top_k)
    replay.seen[layer] = own.detach()
    chosen = own
    if replay.experts is not None:
        if replay.experts.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"routing replay: {replay.experts.shape[0]} tokens of replayed experts "
                f"for a forward of {hidden.shape[0]}"
            )
        chosen = replay.experts[:, layer, :].to(device=logits.device, dtype=torch.long)
    weights = replay_weights(logits, chosen, self.norm_topk_prob)
    return logits, weights, chosen


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (transformers' Qwen3-MoE ``gate`` modules)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Qwen3MoeTopKRouter")]


def install_routing_replay(model: nn.Module) -> int:
    """Patch every Qwen3-MoE router of ``model`` for replay; returns how many layers. Idempotent.
    A model without such routers is refused: replay on a dense model (or an MoE family whose
    router this module does not know) would silently do nothing."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            "algo.routing_replay: the model has no Qwen3-MoE router (Qwen3MoeTopKRouter); "
            "routing replay supports the Qwen3-MoE family only"
        )
    replay = getattr(model, "_asyncrl_replay", None) or _Replay()
    replay.seen = [None] * len(routers)
    object.__setattr__(model, "_asyncrl_replay", replay)
    for layer, router in enumerate(routers):
        object.__setattr__(router, PATCHED, layer)
        object.__setattr__(router, "_asyncrl_replay", replay)
        router.forward = _patched_forward.__get__(router)
    return len(routers)


def _state(model: nn.Module) -> _Replay:
    replay = getattr(model, "_asyncrl_replay", None)
    if replay is None:
        raise RuntimeError("routing replay: install_routing_replay(model) was not called")
    return replay


@contextlib.contextmanager
def replayed_routing(model: nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block every forward of ``model`` (and every activation-checkpoint
    recomputation in a backward run inside it) routes token n of layer l to ``experts[n, l]``.
    ``experts`` is [N, layers, k] over the forward's flattened tokens (rows x length, or the
    packed row); None: the model routes itself."""
    replay = _state(model)
    if experts is not None and (experts.dim() != 3 or experts.shape[1] != len(replay.seen)):
        raise ValueError(
            f"routing replay: experts of shape {tuple(experts.shape)}, want [tokens, {len(replay.seen)}, k]"
        )
    before = replay.experts
    replay.experts = experts
    try:
        yield
    finally:
        replay.experts = before


def learner_routing(model: nn.Module) -> torch.Tensor:
    """[N, layers, k] the top-k the learner's own routers chose in the last forward (replayed or
    not): what the mismatch metric compares with the engine's."""
    seen = _state(model).seen
    if any(s is None for s in seen):
        raise RuntimeError("routing replay: no forward has run since install")
    return torch.stack([s for s in seen if s is not None], dim=1)


REPLAY_EXPERTS = "replay_experts"
"""A micro-batch's forward routing, [N, layers, k] uint8 (``attach_replay``): held for every
micro-batch of a rank's step (and moved to its device with them), it stays one byte per index
(int64 would be 8x: 400 MB for 16 rows of 8192 tokens of a 48-layer top-8 model); each router
takes its layer's column as long when it runs."""


def model_routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """(experts, MoE layers, top-k) of a model whose routers are patched."""
    cfg: Any = getattr(model, "config", None)
    return int(cfg.num_experts), len(_state(model).seen), int(cfg.num_experts_per_tok)


def setup_replay(model: nn.Module, *, context_parallel: int) -> None:
    """algo.routing_replay='rollout' on a learner rank, at start-up: patch the policy's routers,
    or refuse a model (or a layout) replay cannot serve."""
    from asyncrl.data.routing import check_expert_count, check_replay_model

    check_replay_model("the policy", None, context_parallel)  # the layout: the model is checked below
    install_routing_replay(model)
    check_expert_count(model_routing_shape(model)[0])


def attach_replay(model: nn.Module, mbs: list[dict[str, Any]], *, logged: set[str] | None = None) -> list[str]:
    """Lay out each micro-batch's sequence routings (asyncrl.data.microbatch.ROUTED_EXPERTS) as its
    forward's experts (REPLAY_EXPERTS), in place; returns the reasons of the routings refused.

    The routing came from Redis: ``check_expert_range`` (layer and top-k counts, expert index) runs
    here, where the model is known. A refused routing drops the replay of its micro-batch (it routes
    itself, the way a sample without routing does) and loses no data; its reason is logged once
    (``logged``: the reason words already logged, updated). A non-padding micro-batch without
    routings is refused as ``unrouted_sequence`` too: replay that never happens is said.
    Dropping it changes no collective: the forward's shape is the same either way."""
    from asyncrl.data.microbatch import PACKED_IDS, PADDING_KEY, ROUTED_EXPERTS
    from asyncrl.data.routing import RoutingError, check_expert_range

    num_experts, layers, k = model_routing_shape(model)
    refused = []
    for j, mb in enumerate(mbs):
        routings = mb.pop(ROUTED_EXPERTS, None)
        if mb.get(PADDING_KEY, False):
            continue  # a padding micro-batch: nothing to replay, nothing to say
        packed = PACKED_IDS in mb
        try:
            if routings is None:  # records without routing (an engine that returned none, multi-turn)
                raise RoutingError("unrouted_sequence", f"micro-batch {j}: none of its sequences carries a routing")
            # A forward replays or routes itself as a whole: one sequence without a routing (its
            # sample's engine routing was dropped) makes the micro-batch route itself, said once.
            missing = [i for i, r in enumerate(routings) if r is None]
            if missing:
                raise RoutingError(
                    "unrouted_sequence",
                    f"micro-batch {j}: {len(missing)} of its {len(routings)} sequences carry no routing",
                )
            # A routing covers its sequence but the last token (rows n - 1: asyncrl.data.batch).
            lengths = [int(r.shape[0]) + 1 if r.ndim == 3 else 0 for r in routings]
            for i, r in enumerate(routings):
                if r.ndim != 3:
                    raise RoutingError("bad_shape", f"micro-batch {j} sequence {i}: routing of shape {r.shape}")
                check_expert_range(r, num_experts, layers, k, where=f"micro-batch {j} sequence {i}")
            width = int(mb["input_ids"].shape[1])
            tokens = int(mb[PACKED_IDS].shape[1]) if packed else width
            if (sum(lengths) if packed else max(lengths)) != tokens:
                raise RoutingError(
                    "length_mismatch", f"micro-batch {j}: routings for {lengths} tokens, forward of {tokens}"
                )
            experts, _ = forward_routing(
                [torch.from_numpy(r) for r in routings],
                lengths,
                packed=packed,
                width=width,
            )
        except (RoutingError, ValueError) as err:
            refused.append(str(err))
            # Once per reason word, not per message: a stream of bad routings (each naming its
            # micro-batch, sequence and expert) must not log a line per micro-batch per step.
            reason = err.reason if isinstance(err, RoutingError) else "bad_layout"
            if logged is not None and reason not in logged:
                logged.add(reason)
                _LOG.warning("routing replay: routing refused, the micro-batch routes itself: %s", err)
            continue
        mb[REPLAY_EXPERTS] = experts.to(torch.uint8)  # the wire's range: checked above
    return refused


def replay_scope(model: Any, mb: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """``replayed_routing`` over the micro-batch's REPLAY_EXPERTS when it has them and ``model`` is
    the patched policy; otherwise nothing (a dense model, a reference model, a padding micro-batch)."""
    experts = mb.get(REPLAY_EXPERTS)
    if experts is None or getattr(model, "_asyncrl_replay", None) is None:
        return contextlib.nullcontext()
    return replayed_routing(model, experts)


def scored_positions(mb: dict[str, Any]) -> torch.Tensor:
    """[N] bool over the forward's positions: those whose output scores a loss token (position t's
    log-prob is read from the forward at t - 1; packed: through the unpack index)."""
    from asyncrl.data.microbatch import PACKED_IDS, UNPACK_INDEX

    live = mb["loss_mask"] > 0
    if PACKED_IDS in mb:
        out = torch.zeros(mb[PACKED_IDS].shape[1], dtype=torch.bool, device=live.device)
        index = mb[UNPACK_INDEX].to(live.device)
        out[index[live & (index > 0)] - 1] = True
        return out
    out = torch.zeros_like(live)
    out[:, :-1] = live[:, 1:]
    return out.reshape(-1)


def mismatch_metric(model: nn.Module, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(differing (token, layer) pairs, pairs counted) between the learner's own top-k of the
    forward just run and the replayed experts, over the positions that score loss tokens; None
    without replay."""
    experts = mb.get(REPLAY_EXPERTS)
    if experts is None or getattr(model, "_asyncrl_replay", None) is None:
        return None
    own = learner_routing(model).to(experts.device)
    valid = scored_positions(mb).to(experts.device)
    differ = differing(experts, own)[valid]  # [n, layers]
    return differ.sum().to(torch.float64), torch.tensor(float(differ.numel()), dtype=torch.float64)
