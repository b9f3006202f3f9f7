"""rollout.rewards entries that name a reward model instead of a function: a Hugging Face
sequence-classification directory, served by one Ray actor per entry
(asyncrl.rollout.reward_model). The directory is checked here, at config load and `--check`,
from its config.json alone: no transformers import, no weights read.

    rollout:
      rewards:
        - {fn: examples.custom_reward:exact_copy, weight: 1.0}
        - {model: /models/my-rm, weight: 0.5, batch_size: 64, num_gpus: 1}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.config.base import ConfigError, Section


class RewardModelConfig(Section):
    """One reward model of rollout.rewards: its score, times weight, joins the sum."""

    model: str
    """A local directory written by save_pretrained: a *ForSequenceClassification config.json,
    its weights and its tokenizer (a hub model: download it first, e.g. `hf download ID --local-dir DIR`)."""
    weight: float = 1.0
    """Its weight in the sum; finite."""
    label: str | None = None
    """None: the model has one label (num_labels=1, as TRL's and OpenRLHF's reward models) and
    the reward is its logit. A label name of a classifier with several: the reward is that
    label's probability (softmax over the labels)."""
    batch_size: int = Field(32, ge=1)
    """Samples per forward pass, gathered from every generator's requests."""
    max_wait_ms: float = Field(10.0, ge=0)
    """How long a forward pass waits for more requests once it has one (0: run what is there)."""
    max_length: int | None = Field(None, ge=1)
    """Tokens per input; a longer one keeps its last max_length tokens (the completion's end).
    None: no truncation."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_cpus: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Ray CPUs of its actor (also its torch threads)."""
    num_gpus: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Ray GPUs of its actor; > 0 runs the model on CUDA."""
    timeout_s: float | None = Field(None, gt=0)
    """Seconds one sample's score may take (queueing and batching included); None: rollout.reward_timeout_s."""
    max_restarts: int = Field(-1, ge=-1)
    """How often Ray restarts its actor after a crash (-1: always, as generators); requests in
    flight are retried on the restarted actor."""


@dataclass(frozen=True)
class RewardModelInfo:
    """What a reward model's config.json says."""

    architecture: str
    labels: tuple[str, ...]
    """id2label's names in id order; one entry for a single-logit reward model."""
    label_index: int | None
    """The label whose probability is the reward; None: the single logit is."""

    def describe(self) -> str:
        if self.label_index is None:
            return f"{self.architecture}, reward = its logit (num_labels=1)"
        return f"{self.architecture}, reward = P({self.labels[self.label_index]!r}) over {len(self.labels)} labels"


def read_config_json(path: Path, key: str) -> dict:
    """A model directory's config.json as a JSON object; ConfigError naming ``key`` otherwise."""
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}: no config.json in it (not a Hugging Face model directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: its config.json cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: its config.json is not a JSON object")
    return config


def read_model_dir(key: str, model: str, role: str, suffix: str, kind: str, hint: str) -> tuple[Path, dict, str]:
    """A local model directory whose config.json names a ``*{suffix}`` architecture: (path,
    config, that architecture). ConfigError naming ``key``, saying what a ``role`` is (``hint``),
    otherwise. Hub ids are not fetched: a scorer's weights must be on the host at start-up."""
    path = Path(model)
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ConfigError(
            f"{key}: {what}; a {role} is a local directory written by save_pretrained "
            f"(download a hub model first, e.g. `hf download ID --local-dir DIR`)"
        )
    config = read_config_json(path, key)
    architectures = config.get("architectures") or []
    matching = [a for a in architectures if isinstance(a, str) and a.endswith(suffix)]
    if not matching:
        raise ConfigError(f"{key}: not a {kind} (config.json architectures={architectures!r}); {hint}")
    return path, config, matching[0]


def read_reward_model(where: str, spec: RewardModelConfig) -> RewardModelInfo:
    """``spec.model``'s config.json as a sequence classifier whose output ``spec.label`` picks;
    ConfigError naming ``where`` (e.g. 'rollout.rewards[1]') and the path otherwise."""
    key = f"{where}.model={spec.model!r}"
    _, config, architecture = read_model_dir(
        key,
        spec.model,
        "reward model",
        "ForSequenceClassification",
        "sequence-classification model",
        "a reward model is a *ForSequenceClassification, e.g. saved by "
        "AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(DIR)",
    )
    labels = _labels(config)
    if spec.label is None:
        if len(labels) != 1:
            raise ConfigError(
                f"{where}.label: {spec.model!r} has {len(labels)} labels {list(labels)}; name the one whose "
                f"probability is the reward (label: NAME), or use a reward model with num_labels=1 (its logit)"
            )
        return RewardModelInfo(architecture, labels, None)
    if spec.label not in labels:
        raise ConfigError(f"{where}.label={spec.label!r}: {spec.model!r} has labels {list(labels)}")
    if len(labels) < 2:
        raise ConfigError(
            f"{where}.label={spec.label!r}: {spec.model!r} has a single label, whose softmax is always 1; "
            f"leave label unset to use its logit"
        )
    return RewardModelInfo(architecture, labels, labels.index(spec.label))


def _labels(config: dict) -> tuple[str, ...]:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            return tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        except (TypeError, ValueError):
            pass
    n = config.get("num_labels")
    n = n if isinstance(n, int) and n > 0 else 2  # transformers' default
    return tuple(f"LABEL_{i}" for i in range(n))
