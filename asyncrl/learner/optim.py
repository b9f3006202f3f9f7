"""AdamW and the learning-rate schedule: linear warm-up, then constant, cosine or linear decay.

    optimizer = build_optimizer(model.parameters(), cfg.learner)
    scheduler = build_scheduler(optimizer, cfg.learner, total_steps=cfg.control.total_steps)
    ... optimizer.step(); scheduler.step()      # once per mini-batch (= one policy version)

The schedule is a pure function of the optimizer step (`lr_factor`), so a checkpoint only
needs the step count to restore it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from asyncrl.config import LearnerConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based: the step about to be taken).

    warm-up (step < W):  (step + 1) / W          -- the first step already moves the weights
    after, with progress p = (step - W) / max(1, total - W) clipped to [0, 1]:
        constant: 1;   linear: 1 - p;   cosine: (1 + cos(pi p)) / 2
    (Loshchilov & Hutter, "SGDR", 2017, for the cosine shape; Goyal et al. 2017 for warm-up.)
    """
    if step < 0:
        raise ValueError(f"step={step}: must be >= 0")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"learner.lr_schedule={schedule!r}: must be one of 'constant', 'cosine', 'linear'")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: LearnerConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (the frozen reference model has none)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    # foreach: one multi-tensor kernel per op instead of a Python loop over (DTensor) shards.
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), weight_decay=cfg.weight_decay, foreach=True
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LearnerConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `lr_factor`; `total_steps` counts optimizer steps (policy versions)."""
    lr_factor(0, warmup_steps=cfg.warmup_steps, total_steps=total_steps, schedule=cfg.lr_schedule)  # name errors now

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=cfg.warmup_steps, total_steps=total_steps, schedule=cfg.lr_schedule)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
