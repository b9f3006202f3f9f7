"""Every in-place weight reload of a vLLM-CPU engine leaves its MoE experts in the kernel's layout.

    repack_cpu_moe_on_reload(model)    # once per worker, before any reload (idempotent)

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``, the "vec"/"amx" grouped GEMM) does not read
the checkpoint's ``w13``/``w2`` layout: its ``process_weights_after_loading`` prepacks them.
vLLM 0.32 runs that step on the first load only. A reload (``reload_weights``: every publish
in place, and the return to the original checkpoint) goes through
``UnquantizedFusedMoEMethod._setup_kernel``, which on a weight update copies the new weights
in the checkpoint's layout into the kernel's storage and skips the experts' own step ("setup
moe kernel only on the first call"). The kernel then reads unpacked weights as packed ones:
the engine's expert outputs are wrong while everything else (attention, router, norms) holds
the new weights. Measured on the tiny Qwen3-MoE: the engine's log-probs equal transformers'
(max |diff| 4.8e-7) after its first load and differ by 0.03 after one publish; the experts'
``w13_weight`` equals the checkpoint tensor, not its prepacked form. Real experts carry far
more of the output than a random tiny model's, so the engine would sample from a different
model, with nothing failing.

The fix is vLLM's missing step, in vLLM's own flow: each CPU MoE layer's quant method runs its
experts' ``process_weights_after_loading`` after a weight update too, on the freshly loaded
layer, before the layer-wise reload copies the result into the kernel's storage (so a padded
intermediate size is padded again as well). Nothing changes on the first load, on CUDA, or
for any other kernel.
"""

from __future__ import annotations

from typing import Any

PATCHED = "_asyncrl_repacks_on_reload"


def cpu_moe_methods(model: Any) -> list[Any]:
    """The quant methods of ``model``'s unquantized MoE layers run by the CPU experts kernel."""
    with_kernels = [
        method
        for module in model.modules()
        if getattr(method := getattr(module, "quant_method", None), "moe_kernel", None) is not None
    ]
    if not with_kernels:  # a dense model: nothing to import
        return []
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return [
        method
        for method in with_kernels
        if isinstance(method, UnquantizedFusedMoEMethod)
        and isinstance(getattr(method.moe_kernel, "fused_experts", None), CPUUnquantizedExperts)
    ]


def repack_cpu_moe_on_reload(model: Any) -> int:
    """Make every later reload of ``model`` repack its CPU MoE experts (module docstring);
    return how many layers were newly covered. Safe to call before every reload."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.utils import is_weights_pre_processed

    covered = 0
    for method in cpu_moe_methods(model):
        if getattr(method, PATCHED, False):
            continue
        process = method.process_weights_after_loading  # the bound method of its class

        def process_and_repack(layer: Any, _method: Any = method, _process: Any = process) -> None:
            update = _method.moe_kernel is not None  # _setup_kernel's own test for a weight update
            _process(layer)
            if update and not is_weights_pre_processed():
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_and_repack
        setattr(method, PATCHED, True)
        covered += 1
    return covered
