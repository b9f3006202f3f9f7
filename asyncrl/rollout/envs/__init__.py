"""Environments: prompts and rewards. See ``base.py`` for the contract and the registry."""

from asyncrl.rollout.envs.base import (
    BUILTIN,
    Environment,
    RewardError,
    allowed_token_ids,
    make_env,
    resolve_env_class,
    score,
)

__all__ = [
    "BUILTIN",
    "Environment",
    "RewardError",
    "allowed_token_ids",
    "make_env",
    "resolve_env_class",
    "score",
]
