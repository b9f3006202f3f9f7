"""One typed config tree for the whole system, validated once at start-up (pydantic models).

    cfg = load_config("configs/demo.yaml", ["control.max_staleness=2", "algo.policy_loss.eps_clip_high=0.3"])

Each component reads its own branch (``cfg.algo``, ``cfg.queue``, ...). Loading never
imports torch, vLLM or Ray, so a bad flag is rejected in well under a second. Every error
names the field (``algo.policy_loss``), the bad value and what is allowed;
``asyncrl train --help-config`` prints every field with its type, default and description.

    base.py      ConfigError, the section base model, built-in name lists
    losses.py    one parameter model per policy loss (algo.policy_loss, tagged by `type`)
    algo.py      the algo section;  rollout.py  the rollout section (environment, rewards, engines)
    training.py  learner (and LoRA), sync, control;  services.py  queue and monitor (Redis, dashboard)
    tree.py      the root and its cross-section rules;  load.py  YAML, overrides, error messages
    help.py      the schema as text;  secrets.py  the redacted copy every channel but config.yaml gets
"""

from asyncrl.config.algo import AlgoConfig, CorrectionConfig
from asyncrl.config.base import (
    ADVANTAGE_ESTIMATORS,
    ENVIRONMENTS,
    GROUP_BASELINE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_REDUCTIONS,
    OUTCOME_ESTIMATORS,
    ConfigError,
    parse_cpu_list,
)
from asyncrl.config.critic import CriticConfig
from asyncrl.config.help import schema_text
from asyncrl.config.load import apply_overrides, config_from_dict, load_config, params_for
from asyncrl.config.losses import POLICY_LOSSES, CustomLoss, LossParams, PolicyLoss
from asyncrl.config.rollout import RewardFnConfig, RolloutConfig
from asyncrl.config.secrets import REDACTED, redact_config, rejoin_config
from asyncrl.config.services import MonitorConfig, QueueConfig
from asyncrl.config.training import ControlConfig, LearnerConfig, LoraConfig, SyncConfig
from asyncrl.config.tree import Config, validate

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ENVIRONMENTS",
    "GROUP_BASELINE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_REDUCTIONS",
    "OUTCOME_ESTIMATORS",
    "POLICY_LOSSES",
    "REDACTED",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "CorrectionConfig",
    "CriticConfig",
    "CustomLoss",
    "LearnerConfig",
    "LoraConfig",
    "LossParams",
    "MonitorConfig",
    "PolicyLoss",
    "QueueConfig",
    "RewardFnConfig",
    "RolloutConfig",
    "SyncConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "params_for",
    "parse_cpu_list",
    "redact_config",
    "rejoin_config",
    "schema_text",
    "validate",
]
