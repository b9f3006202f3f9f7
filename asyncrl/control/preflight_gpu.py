"""`asyncrl train --check` on devices: whether the GPUs a config asks for, and their memory,
fit this host, and whether a GPU shared by the learner and an engine is set up to be shared.

    lines = gpu_fit(cfg, backend="shm", devices=cuda_devices())   # ConfigError when it cannot run

A fractional ``learner.gpus_per_rank`` or ``rollout.gpus_per_generator`` lets Ray place the
learner and an engine on one device. Two things then fail at start-up, after minutes, that
are plain from the config: NCCL cannot join two processes on one device (the weight sync
must go through shared memory: ``sync.backend: shm``), and vLLM takes
``gpu_memory_utilization`` (0.9 by default) of the whole device for itself, leaving the
learner nothing, so the share must be set in ``rollout.engine_kwargs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncrl.config import Config, ConfigError
from asyncrl.config.reward_model import RewardModelConfig

VLLM_DEFAULT_MEMORY_SHARE = 0.9
"""vLLM's gpu_memory_utilization when rollout.engine_kwargs does not set it."""


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float


def cuda_devices() -> list[Device]:
    """The CUDA devices torch sees on this host (none on a CPU box)."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(Device(props.name, props.total_memory / 2**30))
    return out


def _requests(cfg: Config) -> list[tuple[str, int, float]]:
    """(what, processes, GPUs each) for every part of the run that asks for GPUs."""
    r, learner = cfg.rollout, cfg.learner
    parts = [
        ("learner", learner.num_ranks, learner.gpus_per_rank),
        ("generators", r.num_generators, r.gpus_per_generator),
    ]
    parts += [
        (f"rollout.rewards[{i}] (reward model)", 1, spec.num_gpus)
        for i, spec in enumerate(r.rewards)
        if isinstance(spec, RewardModelConfig)
    ]
    return [(what, n, each) for what, n, each in parts if n and each > 0]


def gpu_fit(cfg: Config, backend: str, devices: list[Device]) -> list[str]:
    """--check's lines on GPUs; ConfigError for a shared GPU set up to fail, or a request this
    host cannot hold when the run would start here (no control.ray_address)."""
    requests = _requests(cfg)
    if not requests:
        return []
    r, learner = cfg.rollout, cfg.learner
    shared = any(0 < each < 1 for what, _, each in requests if what in ("learner", "generators"))
    share = r.engine_kwargs.get("gpu_memory_utilization")
    if share is not None and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1):
        raise ConfigError(f"rollout.engine_kwargs.gpu_memory_utilization={share!r}: expected a number in (0, 1]")
    if shared and backend == "nccl":
        raise ConfigError(
            f"sync.backend resolves to nccl, but learner.gpus_per_rank={learner.gpus_per_rank:g} / "
            f"rollout.gpus_per_generator={r.gpus_per_generator:g} put the learner and an engine on one GPU, where "
            "NCCL cannot connect them: set sync.backend=shm (weights go through shared memory)"
        )
    if shared and r.num_generators and r.gpus_per_generator > 0 and share is None:
        raise ConfigError(
            f"rollout.gpus_per_generator={r.gpus_per_generator:g} shares a GPU (with the learner or another engine), "
            f"but vLLM takes "
            f"{VLLM_DEFAULT_MEMORY_SHARE:g} of the device's memory by default: set "
            "rollout.engine_kwargs.gpu_memory_utilization (e.g. 0.3) so the learner keeps the rest"
        )
    total = sum(n * each for _, n, each in requests)
    asked = ", ".join(f"{what} {n} x {each:g}" for what, n, each in requests)
    needed = math.ceil(total - 1e-9)
    head = f"GPUs: the config asks for {total:g} ({asked}): {needed} device(s)"
    if not devices:
        if cfg.control.ray_address is not None:
            return [f"{head}; this host has NO GPU: the cluster (control.ray_address) must hold them"]
        return [
            f"{head}; this host has NO GPU (torch sees no CUDA device): the run cannot start here, checked up to here"
        ]
    memory = min(d.memory_gib for d in devices)
    lines = [f"{head}; this host has {len(devices)}: {', '.join(f'{d.name} {d.memory_gib:.0f} GiB' for d in devices)}"]
    if len(devices) < needed:
        if cfg.control.ray_address is None:
            raise ConfigError(
                f"{head}, and this host has {len(devices)}: lower num_ranks/num_generators or the GPUs each takes "
                "(fractions share a device), or run on a cluster (control.ray_address)"
            )
        lines.append("  fewer than asked on this host: the cluster (control.ray_address) must hold the rest")
    if r.num_generators and r.gpus_per_generator > 0:
        engine_share = float(share) if share is not None else VLLM_DEFAULT_MEMORY_SHARE
        where = " (the rest of that GPU is the learner's)" if shared else ""
        lines.append(
            f"engine memory: gpu_memory_utilization {engine_share:g} of {memory:.0f} GiB = "
            f"{engine_share * memory:.1f} GiB per engine{where}"
        )
    return lines


def cannot_start_here(cfg: Config, devices: list[Device]) -> str | None:
    """Why the run cannot start from this host, or None: it asks for GPUs, this host has none,
    and no cluster (control.ray_address) could hold them. `--check` prints every line first,
    then exits 2 with this reason (a refusal, as for a config it rejects)."""
    requests = _requests(cfg)
    if not requests or devices or cfg.control.ray_address is not None:
        return None
    total = sum(n * each for _, n, each in requests)
    return (
        f"the config asks for {total:g} GPU(s) and this host has none (torch sees no CUDA device); "
        "run it on a GPU host, or on a cluster (control.ray_address)"
    )
