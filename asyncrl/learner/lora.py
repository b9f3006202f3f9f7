"""LoRA on the learner's model through PEFT: adapters injected before FSDP2 shards the model.

    peft_model = apply_lora(hf_model, cfg.learner.lora)   # base frozen, adapters trainable
    model = peft_model.base_model.model                   # the HF model the learner runs and shards
    ref = AdapterDisabled(model)                          # the base model: the KL reference
    adapter_state(model)                                  # collective: PEFT-format adapter (rank 0)
    merged_weights(fsdp.full_state_dict(model), scale)    # rank 0: HF names, base + adapter

The learner runs the plain HF model with PEFT's LoRA layers in it (names like
``model.layers.0.self_attn.q_proj.base_layer.weight`` and ``...q_proj.lora_A.default.weight``),
not PeftModel's forward, so every step function works unchanged. The reference is the same
weights with the adapters switched off (as PEFT's ``disable_adapter``): no second copy of
the model. FSDP2 shards each block's frozen base weights and trainable adapters in one group;
only the adapters get gradients, optimizer state and checkpoint entries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from asyncrl.config import LoraConfig

ADAPTER_NAME = "default"
"""PEFT's name for the one adapter; it is part of every adapter parameter's name in the model
and absent from the saved (PEFT-format) names."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's saved adapter names start with (PeftModel -> LoraModel -> the HF model)."""


def peft_config(cfg: LoraConfig, base_model: str | None = None) -> Any:
    """PEFT's LoraConfig for ``cfg`` (no bias training, causal LM)."""
    from peft import LoraConfig as PeftLoraConfig  # peft imports transformers: heavy at import

    targets: str | list[str] = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cast(Any, cfg.alpha),  # typed int in PEFT, used as a float (alpha / r)
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def apply_lora(model: nn.Module, cfg: LoraConfig, base_model: str | None = None) -> Any:
    """Inject LoRA adapters into ``model`` in place and return PEFT's PeftModel around it.

    Only Linear layers are accepted: the merged export and the merged publish add B @ A to a
    Linear's weight, and vLLM's LoRA takes Linear adapters. A target that matches nothing is
    PEFT's error, which names the targets."""
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    peft_model = get_peft_model(cast(Any, model), peft_config(cfg, base_model))
    odd = sorted(
        name
        for name, m in peft_model.named_modules()
        if isinstance(m, BaseTunerLayer) and not isinstance(m, LoraLinear)
    )
    if odd:
        raise ValueError(
            f"learner.lora.target_modules={cfg.target_modules!r} matched layers that are not Linear: {odd[:3]}"
        )
    return peft_model


def scale(cfg: LoraConfig) -> float:
    """PEFT's scaling of B @ A (alpha / r; rsLoRA is not used)."""
    return cfg.alpha / cfg.r


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


class AdapterDisabled:
    """Calls ``model`` with the adapters switched off: the base model, the KL reference.

    What PEFT's ``disable_adapter`` does, less its requires_grad flip: that flip reaches
    whichever parameter objects a layer holds at the time, and under FSDP2 a block left
    gathered after its forward (the last one, see asyncrl.learner.fsdp.shard_model) holds its
    unsharded ones, so the sharded adapters would come back frozen and stop training."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self.config = getattr(model, "config", None)
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            return self.model(*args, **kwargs)
        finally:
            for layer in self.layers:
                layer._disable_adapters = False


@contextlib.contextmanager
def dropout_active(model: nn.Module, active: bool) -> Iterator[None]:
    """Put the adapters' dropout modules in train mode for the block (the rest of the model
    stays in eval mode, see asyncrl.learner.fsdp.load_sharded_model)."""
    drops = [m for name, m in model.named_modules() if ".lora_dropout." in name and isinstance(m, nn.Dropout)]
    if not active or not drops:
        yield
        return
    for m in drops:
        m.train(True)
    try:
        yield
    finally:
        for m in drops:
            m.train(False)


def peft_name(name: str) -> str:
    """A model parameter's name in PEFT's saved adapter format:
    ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the adapter alone, full (unsharded), PEFT names, on CPU; rank 0 gets the
    tensors, the other ranks {}. Gathers the trainable parameters only, never the base."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {peft_name(k): cast(torch.Tensor, v).contiguous() for k, v in state.items() if is_adapter(k)}


def merged_weights(state: dict[str, torch.Tensor], lora_scale: float) -> dict[str, torch.Tensor]:
    """The base model's HF-named weights with each adapter folded in, W + scale * B @ A, from
    the learner's full state dict (adapter layers' names); what a model without LoRA loads."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if ".base_layer." not in name:
            out[name] = tensor
            continue
        prefix, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a = state[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"]
            b = state[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"]
            tensor = tensor + lora_scale * (b.to(tensor.dtype) @ a.to(tensor.dtype))
        out[f"{prefix}.{leaf}"] = tensor
    return out


def zero_adapter(cfg: LoraConfig, base_model: str) -> dict[str, torch.Tensor]:
    """The adapter ``cfg`` puts on ``base_model`` with every tensor zero, in PEFT's saved format:
    the base model's outputs exactly. Shaped on the meta device, so no weight is read."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = get_peft_model_state_dict(get_peft_model(model, peft_config(cfg, base_model)))
    return {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in state.items()}
