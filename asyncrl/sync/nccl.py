"""GPU weight sync: NCCL broadcast from learner rank 0 to the engine workers (vLLM's weight-transfer API).

    sync = NcclWeightSync(cfg.sync, run_state=run_state, run="demo")   # on learner rank 0 (CUDA)
    sync.register(generator_handle)       # its engine was built with weight_transfer_config nccl
    sync.publish(model.state_dict(), version=3)

Per generator, one NCCL group {learner rank 0, the engine's workers} is opened on first
publish through ``NCCLTrainerWeightTransferEngine.trainer_init`` (vllm/distributed/
weight_transfer/nccl_engine.py). A round is: generator pauses (keep) and calls
``start_weight_update``; its ``update_weights`` receives while we broadcast; then
``finish_weight_update`` labels the version, drops stale KV/prefix cache and resumes. The
generator side of these calls is ``GeneratorActor.transfer_*``, done by ``RolloutEngine.transfer_*``.
Between start and finish the engine's layers are on the meta device, so it must stay paused.
"""

from __future__ import annotations

import logging
import socket
import time

from asyncrl.config import SyncConfig
from asyncrl.queue.server import free_port
from asyncrl.sync.shm import ShmWeightSync

log = logging.getLogger(__name__)


def _node_address() -> str:
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def _call(handle, method: str, *args):
    import ray

    fn = getattr(handle, method)
    return ray.get(fn.remote(*args)) if hasattr(fn, "remote") else fn(*args)


class GeneratorClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol, forwarded to one generator (Ray handle or object)."""

    def __init__(self, handle):
        self.handle = handle
        self.pending_version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        _call(self.handle, "transfer_init", init_info)

    def start_weight_update(self) -> None:
        _call(self.handle, "transfer_begin")

    def update_weights(self, update_info: dict) -> None:
        _call(self.handle, "transfer_receive", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = self.pending_version if weight_version is None else int(weight_version)
        _call(self.handle, "transfer_finish", version)


class StateDictSource:
    """A re-iterable ``WeightSource`` over a full (unsharded) state dict on the current CUDA device."""

    def __init__(self, state_dict: dict):
        import torch

        self.items = [
            (k, v.detach().to("cuda").contiguous()) for k, v in state_dict.items() if isinstance(v, torch.Tensor)
        ]

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name=k, dtype=v.dtype, shape=tuple(v.shape)) for k, v in self.items]

    def __iter__(self):
        return iter(self.items)

    def held_names(self):
        return None


class NcclWeightSync(ShmWeightSync):
    """NCCL broadcast per generator; file paths and Redis bookkeeping as in ``ShmWeightSync``."""

    def __init__(
        self,
        cfg: SyncConfig,
        *,
        run_state=None,
        run: str,
        engines: list | None = None,
        master_address: str | None = None,
    ):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("sync.backend='nccl' needs a CUDA device; use sync.backend='shm' on CPU")
        super().__init__(cfg, run_state=run_state, run=run, engines=engines)
        # NCCL rank 0 is this process: its node's address as the Ray cluster knows it
        # (gethostname() may resolve to 127.0.1.1, nobody's address on another node).
        self.master_address = master_address or _node_address()
        self._transfers: dict[int, tuple] = {}

    def _transfer_for(self, handle, source):
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        key = id(handle)
        if key not in self._transfers:
            client = GeneratorClient(handle)
            world = 1 + int(_call(handle, "transfer_world_size"))
            info = NCCLTrainerInitInfo(
                master_address=self.master_address, master_port=free_port(""), world_size=world, rank=0
            )
            engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
            self._transfers[key] = (engine, client)
        engine, client = self._transfers[key]
        engine.source = source
        return engine, client

    def publish(self, state_dict: dict, version: int) -> dict:
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the published version {self.version}")
        t0 = time.perf_counter()
        source = StateDictSource(state_dict)
        errors = []
        for handle in self.engines:
            try:
                engine, client = self._transfer_for(handle, source)
                client.pending_version = version
                engine.send_weights()
            except Exception as e:  # one bad engine must not stop the others from updating
                errors.append(f"{type(e).__name__}: {e}")
                self._transfers.pop(id(handle), None)
        self.version = version
        if self.run_state is not None and self.cfg.shm_dir:
            # Elastic generators (not registered here) still join through a file.
            from asyncrl.sync.shm import save_state_dict

            path = self.path_for(version)
            save_state_dict(state_dict, path)
            self.run_state.set_weights(path, version)
            self._delete_older(version)
        return {"version": version, "seconds": time.perf_counter() - t0, "engines": len(self.engines), "errors": errors}

    def publish_file(self, path: str, version: int) -> dict:
        from safetensors.torch import load_file

        return self.publish(load_file(path), version)

    def close(self) -> None:
        for engine, _client in self._transfers.values():
            engine.shutdown()
        self._transfers.clear()
        super().close()
