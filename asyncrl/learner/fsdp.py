"""All FSDP2 code: process group, device mesh, sharding a Hugging Face causal LM, full state dict.

    init_distributed(rank=r, world_size=n, master_port=port, backend="gloo", timeout_s=300)
    mesh = build_mesh(torch.device("cpu"), world_size=n)
    model = load_sharded_model(model_path, mesh, device=torch.device("cpu"), dtype="float32")
    state = full_state_dict(model)      # collective; the full HF-named state on rank 0, {} elsewhere

FSDP2 (`fully_shard`) runs on CPU with gloo; FSDP1 does not (it needs a device_id and
segfaults gathering a full state dict with cpu_offload on torch 2.13 CPU), so only FSDP2 is
used. As in torchtitan, each decoder block is sharded as its own unit (its parameters are
all-gathered just before it runs and freed after), then the root picks up the rest
(embeddings, final norm, lm_head). A vision-language model (Idefics3 / SmolVLM) adds its
vision tower's encoder layers, the tower itself (patch and position embeddings, final norm)
and the connector as units of their own (`vision_units`); its vision tower keeps
transformers' SDPA (bidirectional), the text blocks get the varlen attention.
Parameter names stay Hugging Face's, so the gathered state dict loads into a plain HF model
and into vLLM's reload_weights.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from asyncrl.config import LoraConfig
from asyncrl.config.attention_rules import check_context_parallel, supports_varlen


def pick_device(gpus_per_rank: float) -> torch.device:
    """cuda:0 (Ray already narrowed CUDA_VISIBLE_DEVICES to this rank's GPU) or cpu."""
    if gpus_per_rank > 0:
        if not torch.cuda.is_available():
            raise RuntimeError("learner.gpus_per_rank > 0 but this rank sees no CUDA device")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def pick_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("learner.backend='nccl' needs GPUs (learner.gpus_per_rank > 0)")
    return backend


def init_distributed(
    *, rank: int, world_size: int, master_port: int, backend: str, timeout_s: float, master_addr: str = "127.0.0.1"
) -> None:
    """Join the rank's process group over TCP. `timeout_s` bounds every collective, so a dead
    peer turns into an error on the survivors instead of a hang."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def build_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh named 'dp' over all ranks."""
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def mixed_precision(dtype: str, device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; none on CPU
    (CPU bf16 matmuls are slower than fp32 on AVX2 and the point there is exactness)."""
    if dtype == "bfloat16" and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def attention_implementation(device: torch.device, dtype: str, config: Any = None, context_parallel: int = 1) -> str:
    """flash_attention_2 where it can run (CUDA, bf16 compute, the flash_attn package
    installed), else the varlen SDPA of asyncrl.learner.attention; both run each sequence of a
    packed row alone and compute no attention between sequences. A model whose attention
    rules the varlen SDPA cannot honour (`supports_varlen` on its Hugging Face `config`)
    gets transformers' eager attention, which implements every rule the model's own code
    has (its mask, soft-capping, sinks) and keeps a packed row's sequences apart with a dense
    block-diagonal mask: exact, at the dense mask's cost. Never SDPA there: it drops the
    arguments it has no parameter for (soft-capping, sinks) without a word, so the learner
    would score another function than the engine samples.

    With context parallelism the varlen SDPA always: it is where a rank's chunk of the row
    attends to the keys gathered from its group (asyncrl.learner.context_parallel)."""
    from transformers.utils import is_flash_attn_2_available  # transformers: heavy at import

    from asyncrl.learner import attention

    check_context_parallel(type(config).__name__, config, context_parallel)
    if context_parallel == 1 and device.type == "cuda" and dtype == "bfloat16" and is_flash_attn_2_available():
        return "flash_attention_2"
    if config is not None and not supports_varlen(config):
        return "eager"
    attention.register()
    return attention.VARLEN_SDPA


def vision_units(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision side as FSDP units, innermost first: each encoder layer
    of the vision tower, the tower (its embeddings and final norm), the connector. [] for a text
    model. Idefics3's layout (``model.vision_model``, ``model.connector``); another vision
    model is refused rather than sharded as one root unit with its vision side left unwrapped."""
    from asyncrl.data.pixels import vision_config  # kept next to its only use

    if vision_config(getattr(model, "config", None)) is None:
        return []
    inner = getattr(model, "model", None)
    tower, connector = getattr(inner, "vision_model", None), getattr(inner, "connector", None)
    if tower is None or connector is None:
        raise ValueError(f"{type(model).__name__}: no model.vision_model and model.connector to shard")
    return [*tower.encoder.layers, tower, connector]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class HF lists as never-split (_no_split_modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__}: found no decoder blocks (_no_split_modules={sorted(names)})")
    return blocks


class CheckpointedForward:
    """A decoder block's forward run under non-reentrant activation checkpointing: only the
    block's inputs are kept, its activations are recomputed when its backward runs.

    It replaces the block's ``forward`` on the instance rather than wrapping the module (as
    checkpoint_wrapper does), so every parameter keeps its Hugging Face name (the state dict
    that vLLM, DCP and the export read). Non-reentrant checkpointing takes keyword arguments
    (position_ids, position_embeddings, a packed row's masks or cu_seqlens all arrive as
    keywords) and inputs that need no gradient. Installed before ``fully_shard``, it sits
    inside FSDP's hooks, as torchtitan's apply_ac does: the block's parameters are gathered
    by FSDP's pre-backward hook before the recompute runs. Hugging Face's own
    gradient_checkpointing_enable would do nothing here: it only checkpoints in train mode, and
    the learner runs its model in eval mode (see load_sharded_model).
    """

    def __init__(self, forward: Any) -> None:
        self.inner = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint  # kept next to its only use

        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(blocks: list[nn.Module]) -> None:
    """Run every block's forward under activation checkpointing (in place, idempotent)."""
    for block in blocks:
        if not isinstance(block.forward, CheckpointedForward):
            # An instance attribute: nn.Module.__call__ calls self.forward, its hooks stay outside.
            block.forward = CheckpointedForward(block.forward)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    *,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """fully_shard each decoder block, then the root (in place); return the model. Gradients
    are summed over the ranks (divide factor 1, as torchtitan does), not averaged.

    The last block keeps its parameters gathered after forward (reshard_after_forward=False):
    backward starts with it, so freeing and re-gathering them would only add a copy.
    With ``activation_checkpointing``, each block is checkpointed before it is sharded.
    """
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    vision = vision_units(model)
    inside = {id(m) for unit in vision for m in unit.modules()}
    blocks = [b for b in decoder_blocks(model) if id(b) not in inside]  # the text model's
    if activation_checkpointing:
        checkpoint_blocks(blocks)
    for unit in vision:  # innermost first: a module is sharded before any module holding it
        fully_shard(unit, **kwargs)
    for i, block in enumerate(blocks):
        fully_shard(block, reshard_after_forward=i < len(blocks) - 1, **kwargs)
    fully_shard(model, **kwargs)
    # Sum gradients over the DP ranks instead of FSDP's default mean: the loss of each rank is
    # already its share of the whole mini-batch's loss (reduction weights over all ranks). A
    # custom factor makes FSDP reduce with PREMUL_SUM, which gloo lacks; forcing SUM
    # collectives then scales by 1, i.e. not at all, on gloo and NCCL alike.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def load_sharded_model(
    model_path: str,
    mesh: DeviceMesh,
    *,
    device: torch.device,
    dtype: str,
    trainable: bool = True,
    activation_checkpointing: bool = False,
    lora: LoraConfig | None = None,
    context_parallel: int = 1,
) -> nn.Module:
    """Load the HF causal LM in float32 (master weights), shard it with FSDP2 over `mesh`.

    With `lora`, PEFT's adapters are injected first (base frozen, adapters trainable) and the
    PeftModel is returned; the HF model inside it (``.base_model.model``) is what is sharded
    and what the learner runs (asyncrl.learner.lora).

    A frozen model (the KL reference) gets requires_grad=False, so it holds no gradients and
    no optimizer state, and is only ever run under no_grad.

    Every model runs in eval mode, the trained one too (gradients do not depend on the mode):
    the engines sample without dropout, so a learner forward with dropout on computes a
    different policy's log-probs, noisy from one forward to the next. Eval mode is what turns
    off every kind of dropout a Hugging Face model has: most of it is functional and keyed on
    ``self.training`` (Llama's attention passes ``dropout=0.0 if not self.training else
    self.attention_dropout``), from float attributes copied out of the config at build time,
    under names that differ per architecture; zeroing ``nn.Dropout`` modules or the config
    would miss those. (HF also gates gradient checkpointing on ``self.training``; the learner
    checkpoints its blocks itself, see CheckpointedForward, and only a trainable model's:
    a frozen one keeps no activations for a backward.)
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from asyncrl.data.pixels import vision_config

    config = AutoConfig.from_pretrained(model_path)  # read once: it picks the attention, then builds the model
    if vision_config(config) is None:
        attn: Any = attention_implementation(device, dtype, config, context_parallel)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, config=config, dtype=torch.float32, attn_implementation=attn
        )
    else:
        if context_parallel > 1:
            raise ValueError(
                f"learner.context_parallel={context_parallel}: not for a vision-language model "
                "(its image features are placed over the whole row)"
            )
        # The text model's attention as for a text model; the vision tower attends both ways (SDPA).
        text = attention_implementation(device, dtype, config.get_text_config(), context_parallel)
        attn = {"text_config": text, "vision_config": "sdpa", "": "sdpa"}
        model = AutoModelForImageTextToText.from_pretrained(
            model_path, config=config, dtype=torch.float32, attn_implementation=attn
        )
    model.config.use_cache = False
    model.requires_grad_(trainable)
    model.train(False)
    peft_model = None
    if lora is not None:
        from asyncrl.learner.lora import apply_lora  # imports peft: only for LoRA runs

        peft_model = apply_lora(model, lora, model_path)
        peft_model.train(False)
    shard_model(
        model, mesh, mixed_precision(dtype, device), activation_checkpointing=activation_checkpointing and trainable
    )
    return model if peft_model is None else peft_model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded) state dict on rank 0, on CPU, HF names; {} on other ranks.

    Tied weights (e.g. lm_head = embed_tokens) come back as separate tensors sharing storage;
    they are cloned apart so safetensors can write them.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        tensor = cast(torch.Tensor, value)  # a full, CPU-offloaded state dict holds plain tensors
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
