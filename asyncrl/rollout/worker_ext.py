"""vLLM worker extension: load a safetensors file into the running model, in place.

vLLM imports it by name in each worker process (``worker_extension_cls=WORKER_EXTENSION``),
so the engine wrapper calls ``engine.collective_rpc("asyncrl_load_safetensors",
args=(path,))`` without shipping callables (no VLLM_ALLOW_INSECURE_SERIALIZATION) and without
tensors through the RPC (they arrive as lists). Source of the in-place reload:
vllm/model_executor/model_loader/reload/inplace.py (weights in checkpoint format, repacked
by the model's own ``load_weights``; ``model.load_weights`` alone fails on CPU).
"""

from __future__ import annotations

WORKER_EXTENSION = "asyncrl.rollout.worker_ext.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into vLLM's Worker class; ``self`` is the worker."""

    def asyncrl_load_safetensors(self, path: str) -> int:
        """Reload every tensor of ``path`` (HF names) into the model; return how many were read.

        On failure the model may be left half-loaded (layers on the meta device): the caller
        must load a good file before generating again.
        """
        from safetensors import safe_open

        count = 0

        def tensors():
            nonlocal count
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    count += 1
                    yield name, f.get_tensor(name)

        # Worker.reload_weights sets the current vLLM config around the model runner's reload.
        self.reload_weights(weights_iterator=tensors())
        return count

    def asyncrl_weights_sum(self) -> float:
        """Sum of all parameters, float64: a cheap fingerprint tests use to tell versions apart."""
        import torch

        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))
