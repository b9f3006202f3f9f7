"""Which vLLM engine settings (`rollout.engine_kwargs`) an elastic generator takes from the
job's published config: an allow-list of keys whose values cannot name code or files.

    refused = refused_engine_keys(kwargs, allowed_keys=frozenset(), allowed_values=frozenset())
    # [EngineKeyRefusal(key="reasoning_parser_plugin", why="not a setting ...")]

vLLM's engine arguments grow with every release, and many name code or files: a parser plugin
file it executes (``reasoning_parser_plugin``), classes it imports by name (``scheduler_cls``,
``worker_cls``, a ``distributed_executor_backend`` given as a qualified name), nested configs
holding module paths (``compilation_config.backend``, ``kv_transfer_config``,
``ec_transfer_config``, ``speculative_config``), files or directories it reads (``tokenizer``,
``download_dir``, ``hf_overrides``, ``load_format`` plugins). So a generator takes only the keys
listed here, each with a value of the one plain shape it names (numbers, booleans, one of a few
fixed words), and no nested mapping at all: a key vLLM adds later is refused until it is listed
here or the generator's host allows it (``asyncrl generate --allow-engine-key KEY``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any], bool]

_NAME = re.compile(r"[a-z0-9_]{1,64}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_int(value: Any) -> bool:
    return _int(value) and value >= 1


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def _gib(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 20


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 1024 and all(_positive_int(v) for v in value)


def _one_of(*words: str) -> Check:
    return lambda value: value in words


def _name(value: Any) -> bool:
    # A word of vLLM's own vocabulary: no dot, slash or colon, so never a module, class or path.
    return isinstance(value, str) and bool(_NAME.fullmatch(value))


@dataclass(frozen=True)
class EngineKey:
    check: Check
    shape: str
    """The value's shape, for the refusal message."""
    why: str
    """Why the key cannot load code or read files (docs/security.md lists these)."""


_COUNT = "a count or size that bounds the engine's batch, cache or context"
SAFE_ENGINE_KEYS: dict[str, EngineKey] = {
    # Batching, cache and context sizes: plain numbers vLLM checks against the device.
    "max_num_seqs": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "max_num_batched_tokens": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "max_model_len": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "block_size": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "num_gpu_blocks_override": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "kv_cache_memory_bytes": EngineKey(_positive_int, "an int >= 1", _COUNT),
    "long_prefill_token_threshold": EngineKey(_int, "an int >= 0", _COUNT),
    "max_logprobs": EngineKey(_int, "an int >= 0", "how many log-probs a request may ask for"),
    "max_cudagraph_capture_size": EngineKey(_positive_int, "an int >= 1", "the largest CUDA graph batch"),
    "cudagraph_capture_sizes": EngineKey(_int_list, "a list of ints >= 1", "the CUDA graph batch sizes"),
    "stream_interval": EngineKey(_positive_int, "an int >= 1", "how often outputs are streamed"),
    "seed": EngineKey(_int, "an int >= 0", "the engine's seed (asyncrl seeds each request itself)"),
    "gpu_memory_utilization": EngineKey(_fraction, "a number in (0, 1]", "the share of device memory"),
    "cpu_offload_gb": EngineKey(_gib, "a number >= 0", "GiB of weights kept in host memory"),
    "tensor_parallel_size": EngineKey(
        _positive_int, "an int >= 1", "how many of this host's devices one engine spans (local processes only)"
    ),
    # Switches: booleans.
    "enable_prefix_caching": EngineKey(_bool, "true or false", "a cache switch"),
    "enable_chunked_prefill": EngineKey(_bool, "true or false", "a scheduling switch"),
    "async_scheduling": EngineKey(_bool, "true or false", "a scheduling switch"),
    "enforce_eager": EngineKey(_bool, "true or false", "CUDA graphs off"),
    "disable_log_stats": EngineKey(_bool, "true or false", "a logging switch"),
    "disable_custom_all_reduce": EngineKey(_bool, "true or false", "a kernel switch"),
    "disable_sliding_window": EngineKey(_bool, "true or false", "an attention switch"),
    "disable_cascade_attn": EngineKey(_bool, "true or false", "an attention switch"),
    "kv_sharing_fast_prefill": EngineKey(_bool, "true or false", "a cache switch"),
    # Fixed vocabularies: vLLM checks the word; none is a path or an import.
    "dtype": EngineKey(
        _one_of("auto", "half", "float16", "bfloat16", "float", "float32"), "a dtype name", "the compute dtype"
    ),
    "kv_cache_dtype": EngineKey(_name, "a dtype name", "the cache's dtype, a word from vLLM's fixed list"),
    "quantization": EngineKey(_name, "a method name", "a quantization method from vLLM's registry (no path)"),
    "scheduling_policy": EngineKey(_one_of("fcfs", "priority"), "fcfs or priority", "the scheduler's order"),
    "logprobs_mode": EngineKey(
        _one_of("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"),
        "a log-prob mode",
        "which log-probs are returned",
    ),
    "performance_mode": EngineKey(
        _one_of("balanced", "interactivity", "throughput"), "a performance mode", "a tuning preset"
    ),
    # A word, never a qualified class name (which vLLM would import).
    "distributed_executor_backend": EngineKey(
        _one_of("mp", "uni", "ray"), "mp, uni or ray", "one of vLLM's built-in executors, not a class path"
    ),
}
"""Engine keys an elastic generator accepts from the published config, each with the one value
shape it accepts and why that value cannot run code or read a file."""


@dataclass(frozen=True)
class EngineKeyRefusal:
    key: str
    why: str


def refused_engine_keys(
    kwargs: Any, *, allowed_keys: frozenset[str], allowed_values: frozenset[tuple[str, str]], canonical: Callable
) -> list[EngineKeyRefusal]:
    """The engine settings in `kwargs` (the published ``rollout.engine_kwargs``) this host does
    not take: neither listed above with a value of its shape, nor allowed by the host (any value
    of a key in `allowed_keys`; the exact value of a (key, canonical(value)) in
    `allowed_values`)."""
    if kwargs is None:
        return []
    if not isinstance(kwargs, Mapping):
        return [EngineKeyRefusal("", f"is {type(kwargs).__name__}, not a mapping of engine settings")]
    refused = []
    for key, value in kwargs.items():
        if not isinstance(key, str):
            refused.append(EngineKeyRefusal(repr(key), "is not a setting name"))
            continue
        if key in allowed_keys or (key, canonical(value)) in allowed_values:
            continue
        spec = SAFE_ENGINE_KEYS.get(key)
        if spec is None:
            shape = "a nested mapping" if isinstance(value, Mapping) else "a setting"
            refused.append(EngineKeyRefusal(key, f"is {shape} outside the engine keys a generator takes by itself"))
        elif not spec.check(value):
            refused.append(EngineKeyRefusal(key, f"must be {spec.shape} to be taken without the host's allow"))
    return refused
