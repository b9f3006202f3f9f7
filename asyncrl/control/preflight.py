"""`asyncrl train --check`: what can be checked before anything starts, on any host.

    lines = preflight(cfg)      # [str] to print; ConfigError when something would fail at start-up

Past the config schema (asyncrl.config), the run's pieces are resolved the way the runtime
resolves them, without a model download, Redis, Ray or a device: the weight-sync backend
(``auto`` as this host would run it), the vLLM engine arguments a generator builds (unknown
``rollout.engine_kwargs`` are rejected here, and a nccl sync needs engines built with vLLM's
nccl weight transfer), the sync directory. What needs CUDA is listed, and whether this host
has it: a GPU config checked on a CPU box passes up to that point and says so.
"""

from __future__ import annotations

import os

from asyncrl.config import Config, ConfigError
from asyncrl.rollout.sampling import engine_args, transfer_backend
from asyncrl.seeding import rollout_seed
from asyncrl.sync.nccl import NcclWeightSync
from asyncrl.sync.objstore import ObjectStoreWeightSync
from asyncrl.sync.shm import ShmWeightSync
from asyncrl.sync.weight_sync import WeightSync, resolve_backend


def preflight(cfg: Config) -> list[str]:
    import torch

    s, r, learner = cfg.sync, cfg.rollout, cfg.learner
    lines = []
    backend = resolve_backend(s.backend)
    where = "" if s.backend != "auto" else " (sync.backend=auto on this host; another node may differ)"
    lines.append(f"weight sync: {backend}{where}")
    if not os.path.isdir(s.shm_dir):
        raise ConfigError(f"sync.shm_dir={s.shm_dir!r}: not a directory (every backend writes weights there)")
    cls = _sync_class(backend)
    if not issubclass(cls, WeightSync):
        raise ConfigError(f"sync.backend={backend!r}: {cls.__name__} does not implement WeightSync")

    model = "tiny-model" if r.model == "tiny" else r.model  # the engine reads nothing here
    try:
        args = engine_args(r, model, rollout_seed(cfg), transfer_backend(s))
    except TypeError as e:
        raise ConfigError(f"rollout.engine_kwargs={r.engine_kwargs!r}: vLLM's AsyncEngineArgs refuses it: {e}") from e
    transfer = getattr(args.weight_transfer_config, "backend", None)
    if backend == "nccl" and transfer != "nccl":
        raise ConfigError(
            f"sync.backend=nccl needs engines built with vLLM's nccl weight transfer; "
            f"rollout.engine_kwargs sets weight_transfer_config={args.weight_transfer_config!r}"
        )
    lines.append(f"engine: {model}, dtype {args.dtype}, weight_transfer_config {transfer or 'none'}")

    cuda = torch.cuda.is_available()
    needs = [
        what
        for what, needed in (
            ("sync.backend=nccl", backend == "nccl"),
            (f"learner.gpus_per_rank={learner.gpus_per_rank:g}", learner.gpus_per_rank > 0),
            (f"rollout.gpus_per_generator={r.gpus_per_generator:g}", r.gpus_per_generator > 0),
        )
        if needed
    ]
    if needs:
        state = "available" if cuda else "not available on this host: checked up to here"
        lines.append(f"needs CUDA: {', '.join(needs)} ({state})")
    return lines


def _sync_class(backend: str) -> type:
    if backend == "nccl":
        return NcclWeightSync
    if backend == "object_store":
        return ObjectStoreWeightSync

    return ShmWeightSync
