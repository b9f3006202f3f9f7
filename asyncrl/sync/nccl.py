"""GPU weight sync: NCCL broadcast from the trainer to the engine workers (vLLM's weight-transfer API).

    sync = NcclWeightSync(cfg.sync, run_state=run_state, run="demo")   # the trainer process (CUDA)
    sync.register(generator_handle)       # its engine was built with weight_transfer_config nccl
    sync.publish(model.state_dict(), version=3)          # a PublishResult (sync/weight_sync.py)

Per generator, one NCCL group {this process as rank 0, the engine's workers} is opened on first
publish through ``NCCLTrainerWeightTransferEngine.trainer_init`` (vllm/distributed/
weight_transfer/nccl_engine.py). A round is: generator pauses (keep) and calls
``start_weight_update``; its ``update_weights`` receives while we broadcast; then
``finish_weight_update`` labels the version, drops stale KV/prefix cache and resumes. The
generator side of these calls is ``GeneratorActor.transfer_*``, done by rollout/transfer.py.
Between start and finish the engine's layers are on the meta device, so it must stay paused.

The weights are also a file (the learner's export, or written here): elastic generators
join through it, and it is how a failed transfer is recovered. When a generator's transfer
fails (NCCL error, a worker that rejects the update), its transfer group is torn down and
the generator is told ``transfer_abort(location, version)``: it abandons the half-done update
(layers back from the meta device; an engine that no longer answers is rebuilt), resumes,
and loads the file as that version the way the shm backend has it do. Only if that fails
too is the generator named in ``PublishResult.errors``; it has then closed its own
admission until it loads the announced version. The next publish opens a new group.

``transfer`` is the seam to vLLM's trainer-side engine: ``NcclTransfer`` (the default)
needs CUDA; a test passes one that moves the tensors without NCCL (tests.support.loopback).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace
from typing import Any, Protocol, cast

from asyncrl.config import SyncConfig
from asyncrl.infra import free_port
from asyncrl.sync.shm import ShmWeightSync, file_of, save_state_dict
from asyncrl.sync.weight_sync import PublishResult, WeightAnnouncer
from asyncrl.types import WeightLocation, WeightsFile

log = logging.getLogger(__name__)


def _node_address() -> str:
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def _call(handle: Any, method: str, *args: Any) -> Any:
    import ray

    fn = getattr(handle, method)
    return ray.get(fn.remote(*args)) if hasattr(fn, "remote") else fn(*args)


class GeneratorClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol, forwarded to one generator (Ray handle or object)."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.pending_version: int | None = None
        self.pending_path: str | None = None
        """The file holding the weights being sent: the generator's last good weights once applied."""

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        _call(self.handle, "transfer_init", init_info)

    def start_weight_update(self) -> None:
        _call(self.handle, "transfer_begin")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        _call(self.handle, "transfer_receive", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = self.pending_version if weight_version is None else int(weight_version)
        _call(self.handle, "transfer_finish", version, self.pending_path)


class StateDictSource:
    """A re-iterable ``WeightSource`` over a full (unsharded) state dict on ``device``."""

    def __init__(self, state_dict: dict, device: str = "cuda") -> None:
        import torch

        self.items = [
            (k, v.detach().to(device).contiguous()) for k, v in state_dict.items() if isinstance(v, torch.Tensor)
        ]

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name=k, dtype=v.dtype, shape=tuple(v.shape)) for k, v in self.items]

    def __iter__(self) -> Any:
        return iter(self.items)

    def held_names(self) -> None:
        return None


class TrainerTransfer(Protocol):
    """Opens the trainer side of one generator's transfer group (vLLM's ``TrainerWeightTransferEngine``)."""

    device: str
    """Where the source tensors must be."""

    def check(self) -> None:
        """Raise if this process cannot be the sender."""

    def open(self, client: GeneratorClient, world_size: int, source: StateDictSource, master_address: str) -> Any:
        """A ready trainer engine: ``send_weights()``, ``shutdown()``, ``source``."""


class NcclTransfer:
    """vLLM's NCCL trainer engine, this process as rank 0."""

    device = "cuda"

    def check(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("sync.backend='nccl' needs a CUDA device; use sync.backend='shm' on CPU")

    def open(self, client: GeneratorClient, world_size: int, source: StateDictSource, master_address: str) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        info = NCCLTrainerInitInfo(
            master_address=master_address, master_port=free_port(""), world_size=world_size, rank=0
        )
        # Duck-typed: the dense NCCL engine reads only metadata() and iteration of its source.
        return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=cast(Any, source))


class NcclWeightSync(ShmWeightSync):
    """A transfer per generator; the file, Redis bookkeeping and fallback as in ``ShmWeightSync``."""

    def __init__(
        self,
        cfg: SyncConfig,
        *,
        run_state: WeightAnnouncer | None = None,
        run: str,
        engines: list | None = None,
        master_address: str | None = None,
        transfer: TrainerTransfer | None = None,
    ):
        self.transfer: TrainerTransfer = transfer or NcclTransfer()
        self.transfer.check()
        super().__init__(cfg, run_state=run_state, run=run, engines=engines)
        # NCCL rank 0 is this process: its node's address as the Ray cluster knows it
        # (gethostname() may resolve to 127.0.1.1, nobody's address on another node).
        self.master_address = master_address or _node_address()
        self._transfers: dict[int, tuple[Any, GeneratorClient]] = {}

    def _transfer_for(self, handle: Any, source: StateDictSource) -> tuple[Any, GeneratorClient]:
        key = id(handle)
        if key not in self._transfers:
            client = GeneratorClient(handle)
            world = 1 + int(_call(handle, "transfer_world_size"))
            self._transfers[key] = (self.transfer.open(client, world, source, self.master_address), client)
        engine, client = self._transfers[key]
        engine.source = source
        return engine, client

    def _drop_transfer(self, handle: Any) -> None:
        engine, _ = self._transfers.pop(id(handle), (None, None))
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # the group is unusable either way
                log.warning("closing a failed weight-transfer group: %s", e)

    def publish(self, state_dict: dict, version: int) -> PublishResult:
        """Write the file (elastic generators, recovery), then send ``state_dict`` to every generator."""
        t0 = time.perf_counter()
        location = self.location_for(version)
        nbytes = save_state_dict(state_dict, location.path)
        write_s = time.perf_counter() - t0
        result = self._send(state_dict, location, version)
        return replace(result, write_s=write_s, bytes=nbytes, seconds=time.perf_counter() - t0)

    def publish_file(self, location: WeightLocation, version: int) -> PublishResult:
        from safetensors.torch import load_file

        file = file_of(location)
        if not os.path.exists(file.path):
            raise FileNotFoundError(f"weights file {file.path} does not exist")
        return self._send(load_file(file.path), file, version)

    def _send(self, state_dict: dict, location: WeightsFile, version: int) -> PublishResult:
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the published version {self.version}")
        start = time.perf_counter()
        if self.run_state is not None:
            self.run_state.set_weights(location, version)  # elastic generators join through the file
        source = StateDictSource(state_dict, self.transfer.device)
        errors: list[str] = []
        fallbacks = 0
        for i, handle in enumerate(self.engines):
            try:
                engine, client = self._transfer_for(handle, source)
                client.pending_version, client.pending_path = version, location.path
                engine.send_weights()
                continue
            except Exception as e:  # one bad engine must not stop the others from updating
                log.warning(
                    "weights v%d: transfer to generator %d failed (%s: %s); loading the file",
                    version,
                    i,
                    type(e).__name__,
                    e,
                )
                self._drop_transfer(handle)
            try:
                _call(handle, "transfer_abort", location, version)
                fallbacks += 1
            except Exception as e:
                errors.append(f"generator {i}: {type(e).__name__}: {e}")
        if errors:
            log.warning("weights v%d: %d generator(s) failed to load: %s", version, len(errors), errors)
        self.version = version
        if not errors:
            self._delete_older(version)
        apply_s = time.perf_counter() - start
        return PublishResult(
            version=version,
            seconds=apply_s,
            apply_s=apply_s,
            engines=len(self.engines),
            errors=tuple(errors),
            fallbacks=fallbacks,
        )

    def close(self) -> None:
        for handle_id in list(self._transfers):
            engine, _client = self._transfers.pop(handle_id)
            engine.shutdown()
        super().close()
