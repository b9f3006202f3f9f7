"""Pick the weight-sync backend for this run.

    sync = build_weight_sync(cfg.sync, run_state=run_state, run=cfg.control.run_name, learner=group)

"auto" is NCCL (vLLM's weight-transfer API, learner rank 0 -> engine workers) when CUDA
is available; on CPU it is shared memory (/dev/shm safetensors, the fastest on one host)
when the Ray cluster is this one machine, and Ray's object store when it has other nodes
(any generator, elastic ones included, may sit there, and no filesystem is shared). All
expose register(handle), path_for(version), publish(state_dict, version),
publish_file(path, version), close().
"""

from __future__ import annotations

from asyncrl.config import SyncConfig

BACKENDS = ("auto", "shm", "nccl", "object_store")


def cluster_is_multinode() -> bool:
    import ray

    return ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def resolve_backend(backend: str, multinode: bool = False) -> str:
    match backend:
        case "auto":
            import torch

            if torch.cuda.is_available():
                return "nccl"
            return "object_store" if multinode else "shm"
        case "shm" | "nccl" | "object_store":
            return backend
        case _:
            raise ValueError(f"sync.backend={backend!r}: must be one of {', '.join(map(repr, BACKENDS))}")


def build_weight_sync(
    cfg: SyncConfig,
    *,
    run_state=None,
    run: str,
    engines: list | None = None,
    learner=None,
    model_package: dict | None = None,
):
    match resolve_backend(cfg.backend, multinode=cfg.backend == "auto" and cluster_is_multinode()):
        case "shm":
            from asyncrl.sync.shm import ShmWeightSync

            return ShmWeightSync(cfg, run_state=run_state, run=run, engines=engines)
        case "nccl":
            from asyncrl.sync.nccl import NcclWeightSync

            return NcclWeightSync(cfg, run_state=run_state, run=run, engines=engines)
        case "object_store":
            from asyncrl.sync.objstore import ObjectStoreWeightSync

            return ObjectStoreWeightSync(
                cfg, run_state=run_state, run=run, engines=engines, learner=learner, model_package=model_package
            )
