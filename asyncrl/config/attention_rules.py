"""Which models the learner's varlen attention can run, read from a model's Hugging Face
config without importing torch, so that start-up and ``--check`` refuse a model for context
parallelism before anything heavy loads, in the same words the learner would use.

    check_context_parallel("/models/llama4", config_json, 2)   # ConfigError: its mask has rules

The varlen attention (asyncrl.learner.attention) honours every rule that reaches the attention
call; a rule a model expresses only through its mask (a chunked or non-causal mask) is lost
there, so such a model runs on eager attention instead, and cannot run context parallel at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncrl.config.base import ConfigError

_UNSUPPORTED_CONFIG = ("attention_chunk_size",)
"""Config fields whose attention rule lives in the mask, which the varlen attention never sees."""

_CLASS_RULES: dict[str, dict[str, Any]] = {"llama4_text": {"attention_chunk_size": 8192}}
"""Rules a model's transformers config class holds by default, by model_type: a config.json that
leaves them out (a hand-written one) gets them when transformers loads it, so the learner sees them."""


def _field(config: Any, name: str, default: Any = None) -> Any:
    if not isinstance(config, Mapping):
        return getattr(config, name, default)
    if name in config:
        return config[name]
    model_type = config.get("model_type")
    return _CLASS_RULES.get(model_type, {}).get(name, default) if isinstance(model_type, str) else default


def supports_varlen(config: Any) -> bool:
    """Whether a model with this config (a transformers config object or config.json's dict)
    can run the varlen attention: a causal decoder whose attention rules all reach the call.
    Truthiness as transformers' own mask code reads `is_causal` (null or false: bidirectional)."""
    if not _field(config, "is_causal", True):
        return False
    # The Gemma 4 text configs turn is_causal off from this field when the config is loaded.
    if isinstance(config, Mapping) and "is_causal" not in config and config.get("use_bidirectional_attention") == "all":
        return False
    return all(_field(config, name) is None for name in _UNSUPPORTED_CONFIG)


def check_context_parallel(model: str, config: Any, context_parallel: int) -> None:
    """Refuse a model whose attention rules the context-parallel attention cannot honour.
    ``config`` is its config (None for a hub id, which start-up does not read: the learner
    checks the loaded config); nothing to check without context parallelism."""
    if context_parallel > 1 and config is not None and not supports_varlen(config):
        raise ConfigError(
            f"learner.context_parallel={context_parallel}: {model} has attention rules (a chunked or "
            "non-causal mask) that the context-parallel attention cannot honour"
        )
