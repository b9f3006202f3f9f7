"""The learner's weights in the checkpoint format: the names and layout every engine and
``from_pretrained`` read, whatever the model family.

    state = fsdp.full_state_dict(model)           # the module's own names (what DCP checkpoints hold)
    state = checkpoint_format(model, state)       # what an export writes (save_pretrained's files)
    state = engine_format(model, state)           # what a publish sends into running engines

A Hugging Face model in memory is not laid out as its checkpoint on disk, and vLLM's loaders
read the checkpoint's layout:

- **Tied parameters** (``tie_word_embeddings``: Qwen2.5 below 1.5B, Llama 3.2, Gemma 2/3,
  Granite) are one tensor under two names in memory; a checkpoint holds only the source
  (``model.embed_tokens.weight``), and some engine loaders have no parameter for the other
  (vLLM's Gemma-2 has no ``lm_head``: publishing it fails every load). The tie's targets
  (``model.all_tied_weights_keys``) are dropped, as ``save_pretrained`` drops them.
- **Fused or renamed parameters** (transformers 5 fuses each MoE layer's experts into one
  ``experts.gate_up_proj`` / ``experts.down_proj`` tensor; Mixtral's checkpoint also names
  the block ``block_sparse_moe`` and its experts ``w1/w2/w3``) are split and renamed back by
  reversing the conversions transformers applied on load, the same code
  ``save_pretrained`` runs (``revert_weight_conversion``), so each family's mapping lives
  once, beside the modelling code that defines it.

Families whose module names already are the checkpoint's (Llama, Qwen2/3, Mistral, Phi-3,
Granite) pass through unchanged. The DCP checkpoints keep the module's own names: they are
loaded back into the same module.

**A publish is not a checkpoint** for tied models: vLLM reloads a running engine layer by
layer, in place, and a tied ``lm_head`` that is a module of its own there (Llama, Qwen2/3,
Gemma 3, Granite) is reloaded from its own name, not re-tied to the new embeddings: without
``lm_head.weight`` in the file it keeps the old weights (measured: max |logprob diff| 1.7
after a publish of a tied Qwen3). vLLM's Gemma and Gemma 2 have no ``lm_head`` at all (the
embeddings make the logits) and refuse the name. So ``engine_format`` keeps the tied copy
except for the families in ``NO_LM_HEAD``.
"""

from __future__ import annotations

from typing import Any

import torch


def tied_targets(model: Any) -> set[str]:
    """Names that are another parameter under a second name (the tie's target, e.g.
    ``lm_head.weight`` when the embeddings are tied)."""
    return set(getattr(model, "all_tied_weights_keys", None) or {})


def checkpoint_format(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the HF model's own parameter names, full tensors) as its checkpoint holds it:
    tied targets dropped, transformers' load-time conversions (fused experts, renames) undone.
    ``model`` is the Hugging Face model the names belong to (sharded or not)."""
    from transformers.core_model_loading import revert_weight_conversion  # transformers: heavy at import

    tied = tied_targets(model)
    kept = {name: tensor for name, tensor in state.items() if name not in tied}
    reverted = revert_weight_conversion(model, kept)
    # Split experts are views of one fused tensor; safetensors refuses tensors that share memory.
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in reverted.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen or not tensor.is_contiguous() else tensor
        seen.add(ptr)
    return out


NO_LM_HEAD = frozenset({"gemma", "gemma2"})
"""model_types whose vLLM model computes logits from the embeddings and has no ``lm_head``."""


def engine_format(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``checkpoint_format``, with each tied copy kept where the engine reloads it by its own
    name (module docstring): what a publish sends."""
    out = checkpoint_format(model, state)
    if getattr(model.config, "model_type", None) in NO_LM_HEAD:
        return out
    for target in tied_targets(model):
        if target in state and target not in out:
            out[target] = state[target].clone()  # its own storage: it shares the source's
    return out
