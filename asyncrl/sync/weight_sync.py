"""Pick the weight-sync backend for this machine.

    sync = build_weight_sync(cfg.sync, queue=queue, run=cfg.control.run_name)

"auto" is NCCL (vLLM's weight-transfer API, learner rank 0 -> engine workers) when CUDA
is available, else shared memory (/dev/shm safetensors). Both expose register(handle),
path_for(version), publish(state_dict, version), publish_file(path, version), close().
"""

from __future__ import annotations

from asyncrl.config import SyncConfig


def resolve_backend(backend: str) -> str:
    match backend:
        case "auto":
            import torch

            return "nccl" if torch.cuda.is_available() else "shm"
        case "shm" | "nccl":
            return backend
        case _:
            raise ValueError(f"sync.backend={backend!r}: must be one of 'auto', 'shm', 'nccl'")


def build_weight_sync(cfg: SyncConfig, *, queue=None, run: str, engines: list | None = None):
    match resolve_backend(cfg.backend):
        case "shm":
            from asyncrl.sync.shm import ShmWeightSync

            return ShmWeightSync(cfg, queue=queue, run=run, engines=engines)
        case "nccl":
            from asyncrl.sync.nccl import NcclWeightSync

            return NcclWeightSync(cfg, queue=queue, run=run, engines=engines)
