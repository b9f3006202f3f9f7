"""The weight-sync contract, and which backend a run uses.

    sync = build_weight_sync(cfg.sync, run_state=run_state, run=cfg.control.run_name, learner=group)
    sync.register(generator_handle)
    result = sync.publish_file(sync.location_for(3), 3)     # PublishResult, the same for every backend

Every backend is a ``WeightSync``: register(handle), location_for(version), publish(state_dict,
version), publish_file(location, version), close(). A location is an ``asyncrl.types``
``WeightsFile`` (shm, nccl) or ``WeightsObject`` (object_store); it becomes text only in
Redis. publish and publish_file return a frozen ``PublishResult`` once every registered
generator has applied the version or failed to; a generator that failed is named in
``errors`` and has closed its own admission (the generator's weight watcher blocks it until
it loads the announced version), so announcing the version cannot let it start work counted
against weights it lacks.

"auto" is NCCL (vLLM's weight-transfer API, learner rank 0 -> engine workers) when CUDA
is available; on CPU it is shared memory (/dev/shm safetensors, the fastest on one host)
when the Ray cluster is this one machine, and Ray's object store when it has other nodes
(any generator, elastic ones included, may sit there, and no filesystem is shared).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncrl.config import ConfigError, LoraConfig, SyncConfig
from asyncrl.types import WeightLocation, WeightsObject

BACKENDS = ("auto", "shm", "nccl", "object_store")


@dataclass(frozen=True)
class PublishResult:
    """What one publish did; every backend fills the same fields."""

    version: int
    seconds: float
    """Wall time of the whole call (write, if any, plus apply)."""
    apply_s: float
    """From announcing the version until every registered generator applied it (or failed)."""
    engines: int
    """Registered generators asked to apply it."""
    errors: tuple[str, ...] = ()
    """One line per generator that failed to apply it (it then admits nothing until it can)."""
    write_s: float = 0.0
    """Writing or serialising the weights in this call (0 when the learner exported them)."""
    bytes: int = 0
    """Bytes written in this call (0 when the learner exported them)."""
    engine_load_s: float = 0.0
    """The slowest generator's own load (pause excluded), where the backend reports it."""
    fetch_s: float = 0.0
    """The slowest generator's fetch of the bytes to its node (object_store)."""
    fallbacks: int = 0
    """Generators that got this version from the file after their direct transfer failed (nccl)."""

    @property
    def ok(self) -> bool:
        return not self.errors

    @classmethod
    def of_apply(
        cls, version: int, start: float, engines: int, results: list, errors: tuple[str, ...]
    ) -> PublishResult:
        """The result of asking ``engines`` generators to apply a version announced at ``start``
        (perf_counter); ``results`` holds each generator's reply, a dict of its timings where it
        loaded (``load_s``, ``fetch_s``)."""
        applied = [r for r in results if isinstance(r, dict)]
        apply_s = time.perf_counter() - start
        return cls(
            version=version,
            seconds=apply_s,
            apply_s=apply_s,
            engines=engines,
            errors=errors,
            engine_load_s=max((r.get("load_s", 0.0) for r in applied), default=0.0),
            fetch_s=max((r.get("fetch_s", 0.0) for r in applied), default=0.0),
        )


class WeightAnnouncer(Protocol):
    """Where a backend announces each version for generators that poll (``RunState`` in a run)."""

    def set_weights(self, location: WeightLocation, version: int) -> None: ...


class ExportHolder(Protocol):
    """What the object_store backend needs of the learner: the object its last export made."""

    def take_export(self, location: WeightsObject) -> Any:
        """The Ray object ``export_to_object(location)`` made (once), or None."""


@runtime_checkable
class WeightSync(Protocol):
    """Weights from the learner to the registered generators' engines."""

    def register(self, handle: Any) -> None:
        """Push every later publish to this generator (Ray actor handle or in-process object)."""

    def location_for(self, version: int) -> WeightLocation:
        """Where the learner exports ``version`` for ``publish_file`` (a file, or an object-store name)."""
        ...

    def publish(self, state_dict: dict, version: int) -> PublishResult:
        """Write ``state_dict`` as ``version`` and have every generator apply it."""
        ...

    def publish_file(self, location: WeightLocation, version: int) -> PublishResult:
        """Announce weights already exported to ``location`` as ``version`` and have every generator apply them."""
        ...

    def close(self) -> None:
        """Release what the backend holds (files, stores, transfer groups)."""


def engine_errors(results: list) -> tuple[str, ...]:
    """The failures among ``call_engines`` results, one line each naming the generator's index."""
    return tuple(f"generator {i}: {type(r).__name__}: {r}" for i, r in enumerate(results) if isinstance(r, Exception))


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


def lora_publish(lora: LoraConfig | None, sync: SyncConfig) -> str | None:
    """What a LoRA run's publishes carry: "adapter" (the adapter alone; the engines load it as
    a vLLM LoRA), "merged" (base + adapter as full weights, loaded as any publish), or None
    without LoRA. ``auto`` is the adapter except over nccl, whose transfer writes into the
    engine's own weights, named as the base model's."""
    if lora is None:
        return None
    nccl = resolve_backend(sync.backend) == "nccl"
    if lora.publish == "adapter" and nccl:
        raise ConfigError(
            "learner.lora.publish=adapter: the nccl sync moves full weights into the engines; "
            "use publish=merged (or auto) with nccl, or sync.backend=shm/object_store for adapters"
        )
    if lora.publish != "auto":
        return lora.publish
    return "merged" if nccl else "adapter"


def build_weight_sync(
    cfg: SyncConfig,
    *,
    run_state: WeightAnnouncer | None = None,
    run: str,
    engines: list | None = None,
    learner: ExportHolder | None = None,
    model_package: dict | None = None,
) -> WeightSync:
    match resolve_backend(cfg.backend, multinode=cfg.backend == "auto" and cluster_is_multinode()):
        case "shm":
            # The backends subclass this module's classes (they import it at load): imported here,
            # where one is built, or the import would be circular.
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
    raise AssertionError("unreachable")
