"""The PPO critic of one learner rank: a value model sharded like the policy, with its own
optimizer and schedule (algo.critic; formulas and staleness: docs/design/critic.md).

    critic = Critic.load(cfg, policy_path, mesh, device=device)   # in LearnerActor.setup
    values = critic.values(mbs)                  # [B, L] per micro-batch, before any update
    metrics = critic.prepare(mbs, values)        # GAE -> mb["advantages"], mb["returns"], mb["old_values"]
    ...  the policy's step reads mb["advantages"]  ...
    metrics |= critic.train(mbs)                 # one optimizer step on the clipped value loss

The model is the policy's architecture as ``AutoModelForTokenClassification`` with one label:
the same trunk, a scalar head (``score``) in place of the LM head. Started from a causal LM's
checkpoint (the default: the policy's own) its head is fresh and zero, so the first values are
0 and the first advantages are the discounted returns. It is a separate module, sharded on the
policy's mesh with the same FSDP2 wrapping, so the policy's weights, log-probs and publishes
are exactly what they are without it.

Position t of a [B, L] field holds the quantities of the action input_ids[t]; its state is the
prefix input_ids[:t], whose last hidden state is at t - 1: V_t = head(h_{t-1}), the same shift
as the log-probs (position 0 is 0 and never a policy token).

Every method that runs the model is a collective (FSDP all-gathers, and prepare all-reduces
the batch statistics): all ranks call it with the same number of micro-batches, padding ones
included (their loss mask is 0, so they add nothing).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.algo.advantages import AdvantageParams, gae
from asyncrl.algo.reduction import per_microbatch_token_mean_weights
from asyncrl.algo.value import clipped_value_loss, explained_variance, gae_returns, moments, whiten
from asyncrl.config import Config
from asyncrl.config.critic import check_value_model_family
from asyncrl.data import microbatch as mbatch
from asyncrl.learner import checkpoint, fsdp, optim
from asyncrl.learner.step import tensors_on
from asyncrl.types import MetricValue

CRITIC_DIR = "critic"
"""A checkpoint's critic: its own DCP shards and rank files under <checkpoint>/critic."""


def load_value_model(
    model_path: str, mesh: Any, *, device: torch.device, dtype: str, activation_checkpointing: bool = False
) -> nn.Module:
    """The value model from `model_path` (a causal LM: trunk + fresh zero head; or a saved critic),
    float32 master weights, sharded with FSDP2 over `mesh` as the policy is (and its blocks
    checkpointed as the policy's are, with learner.activation_checkpointing)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    check_value_model_family(model_path)
    config = AutoConfig.from_pretrained(model_path)
    fresh = not any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
    config.num_labels = 1
    attn = fsdp.attention_implementation(device, dtype, config)
    # From a causal LM, transformers reports the LM head unused and the value head new, at
    # warning level: expected here, so its report is kept to errors.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            model_path, config=config, dtype=torch.float32, attn_implementation=attn
        )
    finally:
        hf_logging.set_verbosity(level)
    model.config.use_cache = False
    if fresh:
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
        if not isinstance(head, nn.Module):
            raise ValueError(f"{type(model).__name__}: no value head (score / classifier) to initialise")
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()
    model.train(False)  # no dropout (the classifier's included), as the policy
    return fsdp.shard_model(
        model, mesh, fsdp.mixed_precision(dtype, device), activation_checkpointing=activation_checkpointing
    )


def token_values(model: nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    """[B, L] V_t = head(h_{t-1}) over the micro-batch's rows (packed or not); 0 at position 0."""
    packed = mbatch.is_packed(mb)
    ids = mb[mbatch.PACKED_IDS] if packed else mb["input_ids"]
    extra = {"position_ids": mb[mbatch.POSITION_IDS]} if packed else {}
    out = model(input_ids=ids, **extra).logits[..., 0].float()
    shifted = torch.nn.functional.pad(out[:, :-1], (1, 0), value=0.0)
    return mbatch.unpack(shifted, mb) if packed else shifted


def _all_sum(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        x = x.to(device)
        dist.all_reduce(x)
    return x.cpu()


class Critic:
    """One rank's value model, optimizer and schedule (see the module docstring)."""

    def __init__(self, cfg: Config, model: nn.Module, *, device: torch.device) -> None:
        self.cfg, self.spec, self.model, self.device = cfg, cfg.algo.critic, model, device
        lc = cfg.learner.model_copy(update={"lr": self.spec.lr})
        self.grad_clip = cfg.learner.grad_clip
        self.optimizer = optim.build_optimizer(model.parameters(), lc)
        total = cfg.control.total_steps * cfg.learner.mini_batches_per_step
        self.scheduler = optim.build_scheduler(self.optimizer, lc, total_steps=total)
        self.params = AdvantageParams(gamma=cfg.algo.gamma, lam=cfg.algo.lam)

    @classmethod
    def load(cls, cfg: Config, policy_path: str, mesh: Any, *, device: torch.device) -> Critic:
        path = cfg.algo.critic.model or policy_path
        lc = cfg.learner
        model = load_value_model(
            path, mesh, device=device, dtype=lc.dtype, activation_checkpointing=lc.activation_checkpointing
        )
        return cls(cfg, model, device=device)

    @torch.no_grad()
    def values(self, microbatches: list[dict[str, Any]]) -> list[torch.Tensor]:
        """The current critic's [B, L] values per micro-batch (on CPU): the "old" values."""
        return [token_values(self.model, tensors_on(mb, self.device)).cpu() for mb in microbatches]

    def prepare(self, microbatches: list[dict[str, Any]], values: list[torch.Tensor]) -> dict[str, MetricValue]:
        """GAE from `values` and each micro-batch's token_rewards over its loss mask; sets
        mb["advantages"] (whitened over the whole mini-batch, all ranks, if configured),
        mb["returns"] (A + V, unwhitened) and mb["old_values"]. Collective (one all-reduce)."""
        advs = []
        stats = torch.zeros(4, 3, dtype=torch.float64)
        for mb, v in zip(microbatches, values, strict=True):
            mask = mb["loss_mask"]
            n = mask.shape[0]
            adv = gae(
                torch.zeros(n, dtype=torch.float64),
                torch.arange(n),
                mask,
                params=self.params,
                token_rewards=mb["token_rewards"],
                values=v,
            )
            ret = gae_returns(adv, v, mask)
            mb["old_values"], mb["returns"] = v.float(), ret.float()
            advs.append(adv)
            stats += torch.stack([moments(adv, mask), moments(ret, mask), moments(ret - v, mask), moments(v, mask)])
        stats = _all_sum(stats, self.device)
        if not torch.isfinite(stats).all():
            # Summed over every rank, so all of them stop here together (no rank is left in a
            # collective); the policy's step never sees NaN advantages.
            raise FloatingPointError(
                "the critic diverged: its values on this mini-batch's policy tokens are NaN/inf, so GAE's "
                "advantages would be too and the policy's step would take them in; lower algo.critic.lr, "
                "or resume from a checkpoint before the divergence"
            )
        for mb, adv in zip(microbatches, advs, strict=True):
            mask = mb["loss_mask"]
            mb["advantages"] = (whiten(adv, mask, stats[0]) if self.spec.whiten_advantages else adv).float()
        tokens = float(stats[0, 2])
        if tokens == 0:
            return {}
        one = 1.0  # every rank reports the same global value: a mean over ranks leaves it as is
        return {
            "critic/value_mean": MetricValue("mean", float(stats[3, 0]) / tokens, one),
            "critic/return_mean": MetricValue("mean", float(stats[1, 0]) / tokens, one),
            "critic/advantage_mean": MetricValue("mean", float(stats[0, 0]) / tokens, one),
            "critic/explained_variance": MetricValue("mean", explained_variance(stats[1], stats[2]), one),
        }

    def train(self, microbatches: list[dict[str, Any]]) -> dict[str, MetricValue]:
        """One optimizer step on value_loss_coef * sum_t w_t * clipped value loss_t (w: the
        mini-batch's reduction weights, as the policy's terms), after prepare."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        clipped_sum = tokens = 0.0
        for mb in microbatches:
            t = tensors_on(mb, self.device)
            mask = t["loss_mask"]
            per_token, clipped = clipped_value_loss(
                token_values(self.model, t), t["old_values"], t["returns"], mask, clip=self.spec.value_clip
            )
            weighted = (self._weights(t, len(microbatches)) * per_token).sum()
            (self.spec.value_loss_coef * weighted).backward()
            if not mb.get(mbatch.PADDING_KEY, False):
                loss_sum += weighted.detach().double().cpu()
                clipped_sum += float(clipped.sum())
                tokens += float((mask > 0).sum())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):  # the same global norm on every rank: all of them stop
            raise FloatingPointError(
                f"the critic's gradient norm is {grad_norm}: its step would write NaN/inf into its weights "
                "(and the next mini-batch's advantages); lower algo.critic.lr or algo.critic.value_loss_coef"
            )
        self.optimizer.step()
        self.scheduler.step()
        return {
            "critic/value_loss": MetricValue("sum", float(loss_sum)),
            "critic/clip_frac": MetricValue("mean", clipped_sum, tokens),
            "critic/grad_norm": MetricValue("mean", grad_norm, 1.0),
            "time/learner_critic": MetricValue("max", time.perf_counter() - t0, 1.0),
        }

    def _weights(self, mb: dict[str, torch.Tensor], count: int) -> torch.Tensor:
        """The policy terms' own reduction weights (the legacy per-micro-batch mean computed
        here, as the policy's loss computes it)."""
        mask = mb["loss_mask"]
        if self.cfg.algo.loss_reduction == "token_mean_per_microbatch":
            world = dist.get_world_size() if dist.is_initialized() else 1
            return per_microbatch_token_mean_weights(mask, count * world)
        return mb["reduction_weights"] * (mask > 0)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path, *, rank: int, step: int, version: int, storage_options=None) -> None:
        """Collective: the critic's shards, optimizer and schedule under <directory>/critic."""
        checkpoint.save_rank_state(
            cast(Any, checkpoint.run_path(directory, storage_options) / CRITIC_DIR),  # a RunPath: run_path takes it
            self.model,
            self.optimizer,
            self.scheduler,
            rank=rank,
            step=step,
            version=version,
            storage_options=storage_options,
        )

    def load_state(self, directory: str | Path, *, rank: int, storage_options=None) -> None:
        """Collective: restore what save wrote (a checkpoint of a run without a critic has none:
        ValueError naming it, rather than a fresh critic silently replacing a trained one)."""
        root = checkpoint.run_path(directory, storage_options) / CRITIC_DIR
        if not (root / "dcp").exists():
            raise ValueError(
                f"checkpoint {directory} holds no critic ({CRITIC_DIR}/): it was saved by a run without "
                "algo.critic; resume it without the critic, or start a new run"
            )
        checkpoint.load_rank_state(
            cast(Any, root), self.model, self.optimizer, self.scheduler, rank=rank, storage_options=storage_options
        )
