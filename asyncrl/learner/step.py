"""One optimizer step over a rank's micro-batches, as plain functions over a model.

    add_prepass_logprobs(model, reference, microbatches, temperature=1.0, logprob_fn=token_logprobs)
    stats = train_step(model, optimizer, scheduler, microbatches, loss_fn, grad_clip=1.0)

`loss_fn(logits, mb) -> (loss, metrics)` (logits in the micro-batch's forward layout:
padded [B, L, V] or packed [1, T, V], see forward_logits) returns the micro-batch's share of
the mini-batch loss, sum_t w_t * term_t, with the reduction weights w computed over the whole mini-batch
(all ranks). Summed over micro-batches (gradient accumulation) and ranks, that is the
mini-batch loss, and FSDP sums the ranks' gradients (``fsdp.shard_model`` sets its divide
factor to 1; its default mean is what SkyRL PR #1296 had to compensate). Hence the gradient
does not depend on how the mini-batch is cut into ranks and micro-batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncrl.data import microbatch as mbatch
from asyncrl.data.microbatch import PADDING_KEY
from asyncrl.learner.context_parallel import ContextParallel
from asyncrl.learner.routing_replay import mismatch_metric, replay_scope
from asyncrl.learner.vision import image_inputs, shared_tiles
from asyncrl.types import MetricValue, merge_metrics

LossFn = Callable[[Any, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, MetricValue]]]
"""(logits, or a context-parallel forward's RowScores; micro-batch) -> (loss, metrics)."""
LogprobFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class StepStats:
    """What one rank reports for one optimizer step (metrics already floats)."""

    metrics: dict[str, MetricValue]
    grad_norm: float
    lr: float
    seconds_forward_backward: float
    seconds_optimizer: float


def tensors_on(mb: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensor fields of a micro-batch on `device` (flags such as is_padding dropped)."""
    return {k: v.to(device, non_blocking=True) for k, v in mb.items() if isinstance(v, torch.Tensor)}


MASKED_LOGIT = -1e4
"""What a token the engines may not sample gets as its logit. vLLM uses -inf; a finite value
(exp underflows to exactly 0 in float32 all the same) keeps p * log p = 0 in the entropy and
leaves a masked prompt token's logprob finite, where loss_mask * -inf would be NaN."""


def disallowed_mask(allowed: list[int] | None, vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """[V] bool, True where the engines may not sample (asyncrl.rollout.envs.allowed_token_ids); None: no mask."""
    if allowed is None:
        return None
    mask = torch.ones(vocab_size, dtype=torch.bool)
    mask[torch.tensor(allowed, dtype=torch.long)] = False
    return mask.to(device)


def policy_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    disallowed: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    images: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """[B, L, V] logits, float32 (float64 from a float64 model). No attention mask: padding
    is on the right and attention is causal, so real positions never see a pad (see
    asyncrl.data.microbatch); a packed row passes `position_ids` instead (forward_logits).
    Tokens the engines may not sample are masked as the engines mask them, so every logprob
    and the entropy are those of the policy that sampled. A vision-language model takes its
    pixel arguments in `images` (asyncrl.learner.vision.image_inputs)."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    logits = model(input_ids=input_ids, use_cache=False, **extra, **(images or {})).logits
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return logits if disallowed is None else logits.masked_fill(disallowed, MASKED_LOGIT)


def forward_logits(model: nn.Module, mb: dict[str, Any], disallowed: torch.Tensor | None = None) -> torch.Tensor:
    """Logits over the micro-batch's forward layout: its [B, L] rows, or its packed [1, T] row.

    The packed row carries only `position_ids`, restarting at 0 for each sequence; the
    model's attention implementation (asyncrl.learner.fsdp.attention_implementation) finds
    the sequence boundaries in them and runs each sequence alone: flash attention's varlen
    kernel on CUDA (cu_seqlens from the positions), asyncrl.learner.attention's per-sequence
    SDPA elsewhere; neither computes attention between sequences. Rotary (or learned)
    positions come from the same `position_ids`, so each sequence's logits are those of its
    own padded row. A vision-language model's images go with either layout (image_inputs).
    """
    images = image_inputs(model, mb, mbatch.forward_ids(mb).device)
    with shared_tiles(model, mb):  # a group's image encoded once, its features for each sample
        if mbatch.is_packed(mb):
            return policy_logits(
                model, mb[mbatch.PACKED_IDS], disallowed, position_ids=mb[mbatch.POSITION_IDS], images=images
            )
        return policy_logits(model, mb["input_ids"], disallowed, images=images)


def microbatch_logprobs(
    model: nn.Module,
    mb: dict[str, Any],
    *,
    temperature: float,
    logprob_fn: LogprobFn,
    device: torch.device,
    disallowed: torch.Tensor | None = None,
    cp: ContextParallel | None = None,
) -> torch.Tensor:
    """[B, L] token logprobs of the micro-batch's rows (position 0 is 0), packed or not; with
    `cp`, a packed row is split over the CP group (asyncrl.learner.context_parallel)."""
    fwd = {k: v.to(device) for k, v in mb.items() if k in ("input_ids", *mbatch.PACKING_FIELDS, *mbatch.IMAGE_FIELDS)}
    if cp is not None and mbatch.is_packed(fwd):
        cp = cp.at(temperature)
        with cp.scope(fwd) as layout:
            return cp.scores(model, fwd, layout, disallowed).logprobs
    with replay_scope(model, mb):  # routing replay: the engine's experts, when the micro-batch has them
        logits = forward_logits(model, fwd, disallowed)
    logp = logprob_fn(logits, mbatch.forward_ids(fwd), temperature)
    return mbatch.unpack(logp, fwd) if mbatch.is_packed(fwd) else logp


@torch.no_grad()
def add_prepass_logprobs(
    model: nn.Module | None,
    reference: nn.Module | None,
    microbatches: list[dict[str, Any]],
    *,
    temperature: float,
    logprob_fn: LogprobFn,
    device: torch.device,
    disallowed: torch.Tensor | None = None,
    cp: ContextParallel | None = None,
) -> None:
    """Fill mb['old_logprobs'] (the proximal policy: `model`'s current weights; skipped when
    `model` is None) and, with a reference model, mb['ref_logprobs'], in place. Runs on
    padding micro-batches too: every forward is an FSDP all-gather, so all ranks must run
    the same number."""
    for mb in microbatches:
        for key, net in (("old_logprobs", model), ("ref_logprobs", reference)):
            if net is not None:
                mb[key] = microbatch_logprobs(
                    net,
                    mb,
                    temperature=temperature,
                    logprob_fn=logprob_fn,
                    device=device,
                    disallowed=disallowed,
                    cp=cp,
                ).cpu()
    for net in (model, reference):
        if net is not None:
            reshard(net)


def _to_float(metrics: dict[str, MetricValue]) -> dict[str, MetricValue]:
    """One host sync per metric per step, not per micro-batch."""
    return {k: MetricValue(m.reduce, float(m.total), float(m.count)) for k, m in metrics.items()}


def _grad_norm(model: nn.Module, max_norm: float) -> float:
    """clip_grad_norm_ over FSDP2's DTensor grads; the norm is a replicated DTensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def reshard(model: Any) -> None:
    """Free every FSDP unit's gathered parameters; called after each no-grad pass. Such a
    pass (a later mini-batch's proximal log-probs, compute_logprobs) leaves the units that
    keep theirs after forward (the root, the last block) gathered, and the next training
    step's gradient of those units then came out wrong (the previous step's added in)."""
    from torch.distributed.fsdp import FSDPModule  # kept next to its only use

    # A LoRA run's reference is the model behind a wrapper (asyncrl.learner.lora.AdapterDisabled).
    net = model if isinstance(model, nn.Module) else getattr(model, "model", None)
    if not isinstance(net, nn.Module):
        return
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    microbatches: list[dict[str, Any]],
    loss_fn: LossFn,
    *,
    grad_clip: float,
    device: torch.device,
    disallowed: torch.Tensor | None = None,
    cp: ContextParallel | None = None,
) -> StepStats:
    """Accumulate gradients over `microbatches`, clip, take one AdamW step and one lr step.

    Per micro-batch: backward of loss_mb = loss_fn(logits, mb) = sum_t w_t * term_t. Padding
    micro-batches run the same forward/backward (collectives) and contribute exactly 0; their
    metrics are dropped.

    With `cp` every rank of the CP group holds the same micro-batches; a packed one is split
    over the group, each rank computes the whole micro-batch's loss from the gathered
    log-probs and backpropagates 1/cp.size of it (asyncrl.learner.context_parallel).
    """
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    parts = []
    for mb in microbatches:
        tensors = tensors_on(mb, device)
        if cp is not None and mbatch.is_packed(tensors):
            with cp.scope(tensors) as layout:  # the backward too: recomputed blocks gather again
                loss, metrics = loss_fn(cp.scores(model, tensors, layout, disallowed), tensors)
                (loss / cp.size).backward()
        else:
            with replay_scope(model, tensors):  # the backward too: recomputed blocks replay as well
                loss, metrics = loss_fn(forward_logits(model, tensors, disallowed), tensors)
                mismatch = mismatch_metric(model, tensors)
                (loss if cp is None else loss / cp.size).backward()
            if mismatch is not None:
                metrics = metrics | {"router/mismatch_frac": MetricValue("mean", *mismatch)}
        if not mb.get(PADDING_KEY, False):
            parts.append(metrics)
    t1 = time.perf_counter()
    grad_norm = _grad_norm(model, grad_clip)
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    scheduler.step()
    return StepStats(
        metrics=_to_float(merge_metrics(parts)),
        grad_norm=grad_norm,
        lr=lr,
        seconds_forward_backward=t1 - t0,
        seconds_optimizer=time.perf_counter() - t1,
    )


@torch.no_grad()
def sequence_logprobs(
    model: nn.Module,
    microbatches: list[dict[str, Any]],
    lengths: list[list[int]],
    *,
    temperature: float,
    logprob_fn: LogprobFn,
    device: torch.device,
    disallowed: torch.Tensor | None = None,
    cp: ContextParallel | None = None,
) -> list[list[Any]]:
    """Per micro-batch, per real row: token logprobs trimmed to the row's length (numpy)."""
    out = []
    for mb, lens in zip(microbatches, lengths, strict=True):
        logp = (
            microbatch_logprobs(
                model,
                mb,
                temperature=temperature,
                logprob_fn=logprob_fn,
                device=device,
                disallowed=disallowed,
                cp=cp,
            )
            .cpu()
            .numpy()
        )
        out.append([] if mb.get(PADDING_KEY, False) else [logp[k, :n].copy() for k, n in enumerate(lens)])
    reshard(model)
    return out
