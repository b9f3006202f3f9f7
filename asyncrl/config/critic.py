"""algo.critic: the PPO value model (asyncrl.learner.critic), trained beside the policy in the
learner's ranks; algo.advantage_estimator='gae' takes its values.

    algo:
      advantage_estimator: gae
      gamma: 1.0
      lam: 0.95
      critic: {enabled: true, lr: 1.0e-5, value_clip: 0.2}

Its model directory, when given, is checked here from its config.json alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from asyncrl.config.base import ConfigError, Section
from asyncrl.config.reward_model import read_config_json, read_model_dir


class CriticConfig(Section):
    """The value model: the policy's trunk (or a given model's) with a scalar head, its own optimizer."""

    enabled: bool = False
    """Train a critic; required by (and only allowed with) algo.advantage_estimator='gae'."""
    model: str | None = None
    """None: the policy's own model (rollout.model), its LM head replaced by a fresh scalar
    value head. Else a local directory written by save_pretrained: a *ForCausalLM (its trunk
    is taken, the head is fresh) or a *ForTokenClassification with num_labels=1 (a value model
    saved with save_pretrained, e.g. an earlier run's critic as `asyncrl export` writes it beside
    the policy: hf/step_N-critic). Its tokenizer must be the policy's: it reads the policy's token ids."""
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    """The critic's AdamW learning rate (same betas, weight decay, warm-up and schedule shape as
    learner.*); it has its own optimizer, so it never moves the policy."""
    value_loss_coef: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    """c1 of PPO's L^VF term: the critic's loss is value_loss_coef * the clipped value loss
    (the critic's own optimizer: with AdamW it mostly matters through learner.grad_clip)."""
    value_clip: float | None = Field(0.2, gt=0, allow_inf_nan=False)
    """eps of PPO2's value clipping: V stays within eps of the critic's value before the step;
    None: no clipping (plain 0.5 * (V - R)^2). It acts only with learner.mini_batches_per_step
    > 1: with one mini-batch per step the critic is trained on the very values it just
    computed (V = V_old), so nothing is clipped and critic/clip_frac is 0."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0, std 1 over each mini-batch's policy tokens."""


def check_critic(spec: CriticConfig) -> None:
    """A given critic model's config.json names a causal LM or a token classifier."""
    if spec.model is None:
        return
    key = f"algo.critic.model={spec.model!r}"
    _, config, arch = read_model_dir(
        key,
        spec.model,
        "critic",
        "",
        "Hugging Face model",
        "a critic starts from a *ForCausalLM (its trunk) or a *ForTokenClassification with num_labels=1",
    )
    if arch.endswith("ForTokenClassification") and len(config.get("id2label") or {"0": ""}) != 1:
        raise ConfigError(f"{key}: a token classifier with {len(config['id2label'])} labels; a critic has one")
    if not (arch.endswith("ForCausalLM") or arch.endswith("ForTokenClassification")):
        raise ConfigError(
            f"{key}: architecture {arch!r}; a critic starts from a *ForCausalLM or a *ForTokenClassification"
        )


def check_critic_vocabulary(spec: CriticConfig, policy_model: str) -> None:
    """A given critic reads the policy's token ids: its embedding must have a row for every id
    the policy's vocabulary holds (else the first learner step fails indexing it, or, on a
    GPU, asserts in a kernel). Checked when both are local directories with a config.json."""
    if spec.model is None:
        return
    policy_dir = Path(policy_model)
    if not (policy_dir / "config.json").is_file():
        return  # a hub id: the preflight reads it later; nothing to compare here
    key = f"algo.critic.model={spec.model!r}"
    theirs = _vocab_size(read_config_json(Path(spec.model), key))
    ours = _vocab_size(read_config_json(policy_dir, f"rollout.model={policy_model!r}"))
    if theirs is not None and ours is not None and theirs < ours:
        raise ConfigError(
            f"{key}: a vocabulary of {theirs} tokens, the policy's (rollout.model) has {ours}: the critic "
            "reads the policy's token ids, so it must share the policy's tokenizer (a model of the same family)"
        )


def _vocab_size(config: dict) -> int | None:
    size, text = config.get("vocab_size"), config.get("text_config")
    if size is None and isinstance(text, dict):  # a multimodal model's language part
        size = text.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_value_model_family(model_path: str, key: str = "algo.critic") -> None:
    """ConfigError naming ``key`` when the model directory's family has no token-classification
    class in transformers (the value model's form: OLMo-2, Granite, Gemma 3 have none), so a run
    is refused before anything starts rather than when its learners load. A hub id or a
    directory without a readable config.json is left to the loaders."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(model_type, str) and model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ConfigError(
            f"{key}: the value model {model_path!r} is a {model_type!r}, a family transformers has no "
            "*ForTokenClassification for (the critic's form: the trunk with a scalar head); set "
            "algo.critic.model to a model of a family that has one, with the policy's tokenizer"
        )
