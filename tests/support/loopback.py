"""A weight transfer without NCCL, for driving ``sync.backend=nccl`` on a CPU box in tests.

vLLM's weight-transfer API is the boundary: the trainer side stands in for
``NCCLTrainerWeightTransferEngine`` and the engine side registers a vLLM
``WeightTransferEngine`` backend ("asyncrl_loopback") that the engine's real worker runs,
with vLLM's own start/update/finish lifecycle and layer-wise reload, as the NCCL backend
does. Only the wire differs: a safetensors file in a directory instead of a broadcast.

    sync = NcclWeightSync(cfg.sync, run="t", transfer=LoopbackTransfer(tmp_dir))
    cfg.rollout.engine_kwargs = LOOPBACK_ENGINE_KWARGS          # the engine side

``LoopbackTransfer.fail_next`` injects the failures a real broadcast can have: "trainer"
raises after ``start_weight_update`` (the engine's layers are then on the meta device),
"worker" makes the engine's worker raise part-way through receiving.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from asyncrl.rollout.worker_ext import WeightLoaderExtension

BACKEND = "asyncrl_loopback"
LOOPBACK_ENGINE_KWARGS = {
    "weight_transfer_config": {"backend": BACKEND},
    "worker_extension_cls": "tests.support.loopback.LoopbackWorkerExtension",
}


class LoopbackWorkerExtension(WeightLoaderExtension):
    """The usual worker extension; importing this module (vLLM does, in the worker) registers the backend."""


class TransferFailed(RuntimeError):
    """Injected by ``LoopbackTransfer.fail_next``."""


@dataclass
class LoopbackInitInfo:
    dir: str


@dataclass
class LoopbackUpdateInfo:
    path: str
    fail_after: int = -1
    """Raise after loading this many tensors (-1: never)."""


def _register() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    class LoopbackWeightTransferEngine(WeightTransferEngine):
        init_info_cls = LoopbackInitInfo
        update_info_cls = LoopbackUpdateInfo

        def init_transfer_engine(self, init_info: Any) -> None:
            self.dir = init_info.dir

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator to synchronize

        def receive_weights(self, update_info: Any) -> None:
            from safetensors import safe_open

            with safe_open(update_info.path, framework="pt") as f:
                for i, name in enumerate(f.keys()):
                    if i == update_info.fail_after:
                        raise TransferFailed(f"injected: worker failed after {i} tensors")
                    self.model.load_weights([(name, f.get_tensor(name))])

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, LoopbackWeightTransferEngine)


_register()


class LoopbackTrainerEngine:
    """``NCCLTrainerWeightTransferEngine``'s round (start, update, finish) over a file."""

    def __init__(self, client, source, dir: str, transfer: LoopbackTransfer):
        self.client, self.source, self.dir, self.transfer = client, source, dir, transfer
        self.rounds = 0
        client.init_weight_transfer_engine({"dir": dir})

    def send_weights(self) -> None:
        from asyncrl.sync.shm import save_state_dict

        self.rounds += 1
        path = os.path.join(self.dir, f"round-{id(self)}-{self.rounds}.safetensors")
        save_state_dict(dict(iter(self.source)), path)
        fail, self.transfer.fail_next = self.transfer.fail_next, None
        try:
            self.client.start_weight_update()
            if fail == "trainer":
                raise TransferFailed("injected: broadcast failed after start_weight_update")
            self.client.update_weights({"path": path, "fail_after": 2 if fail == "worker" else -1})
            self.client.finish_weight_update()
        finally:
            os.unlink(path)
        self.transfer.sent += 1

    def shutdown(self) -> None:
        self.transfer.closed += 1


class LoopbackTransfer:
    """A ``TrainerTransfer`` (asyncrl.sync.nccl) for CPU: no CUDA, no NCCL."""

    device = "cpu"

    def __init__(self, dir: str):
        self.dir = dir
        self.fail_next: str | None = None
        self.opened = self.sent = self.closed = 0

    def check(self) -> None:
        pass

    def open(self, client, world_size: int, source, master_address: str) -> LoopbackTrainerEngine:
        self.opened += 1
        return LoopbackTrainerEngine(client, source, self.dir, self)
