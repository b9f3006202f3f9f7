"""`asyncrl train --check` on ``rollout.model``: a local model directory is read as the
engine and the learner would read it, a hub id is checked for its form and, where the hub
answers within a few seconds, for existence.

    line = check_model("Qwen/Qwen2.5-0.5B-Instruct")   # ConfigError when the run would die of it

A local directory needs a config.json (a JSON object), weights (``*.safetensors`` or
``*.bin``; every shard an index names) and a tokenizer that loads. Anything that does not
exist on this host is a hub id, which must have the hub's form ('name' or 'owner/name'):
a mistyped path otherwise passes --check and fails minutes later in every generator, after
Ray's start-up, with a traceback ending in "Repo id must be in the form ...".

Whether a hub model exists is asked of the hub only when this host may reach it: with
HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set it is "not checked", as it is when the hub
does not answer in HUB_TIMEOUT_S (the request runs on a daemon thread, so neither a DNS
lookup nor a dead proxy can hang --check). A model in this host's Hugging Face cache needs no
request at all.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from asyncrl.config import ConfigError
from asyncrl.config.reward_model import read_config_json

HUB_TIMEOUT_S = 5.0
"""How long --check waits for the hub to say whether a model id exists."""

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_model(model: str, key: str = "rollout.model") -> str:
    """A line for --check's output; ConfigError naming ``key`` when the model cannot be used."""
    if model == "tiny":
        return f"{key}: tiny (written from the seed at start-up)"
    path = Path(model).expanduser()
    if path.exists():
        return check_model_dir(path, f"{key}={model!r}")
    if _looks_like_path(model):
        raise ConfigError(f"{key}={model!r}: no such directory (nor is it a hub model id 'owner/name')")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as e:
        raise ConfigError(f"{key}={model!r}: not a local directory, nor a hub model id 'owner/name' ({e})") from None
    return f"{key}: {model}: {hub_status(model, key)}"


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith(("/", "./", "../", "~", "\\")) or model.count("/") > 1 or (os.sep != "/" and os.sep in model)
    )


def check_model_dir(path: Path, key: str) -> str:
    """config.json, weights and a tokenizer in a local directory (ConfigError naming what is missing)."""
    if not path.is_dir():
        raise ConfigError(f"{key}: not a directory (a model is a directory written by save_pretrained)")
    config = read_config_json(path, key)
    if not (config.get("model_type") or config.get("architectures")):
        raise ConfigError(f"{key}: its config.json names no model_type or architectures")
    weights = sorted({p.name for pattern in WEIGHT_PATTERNS for p in path.glob(pattern) if p.is_file()})
    for index in WEIGHT_INDEXES:
        if (path / index).is_file():
            weights.append(index)
            _check_shards(path, index, key)
    if not weights:
        raise ConfigError(
            f"{key}: no weights in it (expected *.safetensors or *.bin, e.g. written by model.save_pretrained)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}: no tokenizer in it (expected one of {', '.join(TOKENIZER_FILES)}; "
            f"write it with tokenizer.save_pretrained into the same directory)"
        )
    # transformers only here: --check must start without it.
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # whatever a broken tokenizer raises, every generator would die of it
        raise ConfigError(f"{key}: its tokenizer cannot be loaded: {type(e).__name__}: {e}") from e
    kind = config.get("model_type") or config.get("architectures")
    return f"{key.split('=')[0]}: {path}: {kind}, {len(weights)} weight file(s), tokenizer loaded"


def _check_shards(path: Path, index: str, key: str) -> None:
    try:
        shards = set(json.loads((path / index).read_text())["weight_map"].values())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{key}: its {index} cannot be read: {type(e).__name__}: {e}") from None
    missing = sorted(s for s in shards if not (path / str(s)).is_file())
    if missing:
        raise ConfigError(f"{key}: {index} names weight files that are missing: {', '.join(missing[:5])}")


def _offline() -> str | None:
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return var
    # huggingface_hub reads the variable once, at its import; it refuses every request after.
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def hub_status(repo_id: str, key: str) -> str:
    """Where a hub model id stands for this host: cached, found, or not checked (and why);
    ConfigError when the hub says there is no such model."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return "in this host's Hugging Face cache"
    if var := _offline():
        return f"not checked ({var} is set: the hub is not asked)"
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    result: list[BaseException | None] = []

    def ask() -> None:
        try:
            HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).model_info(repo_id, timeout=HUB_TIMEOUT_S)
            result.append(None)
        except BaseException as e:  # reported by the caller's thread
            result.append(e)

    thread = threading.Thread(target=ask, name="asyncrl-hub-check", daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    if not result:
        return f"not checked (the hub did not answer in {HUB_TIMEOUT_S:g} s)"
    error = result[0]
    if error is None:
        return "found on the hub"
    if isinstance(error, GatedRepoError):  # a subclass of RepositoryNotFoundError: exists, needs access
        return "found on the hub (gated: its licence must be accepted and HF_TOKEN set)"
    if isinstance(error, RepositoryNotFoundError):
        raise ConfigError(
            f"{key}={repo_id!r}: no such model on the hub (or a private one this host's token cannot see), "
            f"and no such local directory"
        )
    return f"not checked (the hub is unreachable from this host: {type(error).__name__})"


def hub_offline_if_unreachable(ids: list[str]) -> list[str]:
    """Switch this process to the hub's offline mode when the config names hub models or datasets
    (``ids``) and the hub does not answer within HUB_TIMEOUT_S: what is in this host's cache is
    still read, the rest is "not checked", and no request is retried for a minute with each
    retry logged. One line saying so; none when the hub answers or offline mode is already on."""
    ids = list(dict.fromkeys(ids))
    if not ids or _offline():
        return []
    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    result: list[BaseException | None] = []

    def ask() -> None:
        import httpx

        try:
            httpx.head(endpoint, timeout=HUB_TIMEOUT_S)
            result.append(None)
        except BaseException as e:  # reported by the caller's thread
            result.append(e)

    thread = threading.Thread(target=ask, name="asyncrl-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S + 1)
    if result and result[0] is None:
        return []
    why = type(result[0]).__name__ if result else f"no answer in {HUB_TIMEOUT_S:g} s"
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    # Both libraries read the variable once, at import: the ones already imported are told too.
    for module in (constants, sys.modules.get("datasets.config")):
        if module is not None:
            setattr(module, "HF_HUB_OFFLINE", True)  # noqa: B010 (not declared in the stubs)
    return [
        f"hub: {endpoint} does not answer from this host ({why}): checked offline (HF_HUB_OFFLINE=1); "
        f"{', '.join(ids)}: read from this host's cache where they are, else not checked"
    ]
