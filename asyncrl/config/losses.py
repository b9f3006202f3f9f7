"""``algo.policy_loss``: the policy losses' parameter models are asyncrl.algo.params's (one per
loss, the single source of their names, fields, defaults and checks); this module adds what
only the config needs, picked by ``type``:

    policy_loss: ppo                                           # the loss's defaults
    policy_loss: {type: ppo, eps_clip_low: 0.2, eps_clip_high: 0.28}
    policy_loss: {type: my_pkg.losses:my_loss, kwargs: {beta: 0.1}}

the shorthand, and errors that name the field and list what is allowed. Torch-free. The
names re-exported here are the config's view of the losses (``asyncrl.config`` exports them).
"""

from __future__ import annotations

import difflib
from typing import Any

from asyncrl.algo.params import (
    DEFAULT_LOSS,
    LOSS_FIELDS,
    LOSS_MODELS,
    POLICY_LOSSES,
    WHERE,
    CustomLoss,
    LossParams,
    PolicyLoss,
    is_import_path,
)
from asyncrl.config.base import ConfigError, check_import_path

__all__ = [
    "LOSS_FIELDS",
    "LOSS_MODELS",
    "POLICY_LOSSES",
    "WHERE",
    "CustomLoss",
    "LossParams",
    "PolicyLoss",
    "moved_loss_field",
    "normalise_loss",
    "wrong_loss_field",
]


def normalise_loss(value: Any) -> Any:
    """The shorthand `policy_loss: ppo` is `{type: ppo}`; a mapping without a type is the default
    loss. Checks the type before the union does, so the error lists the losses."""
    if isinstance(value, LossParams):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{WHERE}={value!r}: expected a loss name string (one of {', '.join(POLICY_LOSSES)}) "
            f"or a mapping like {{type: ppo, eps_clip_high: 0.28}}"
        )
    value = {"type": DEFAULT_LOSS, **value}
    name = value["type"]
    if not isinstance(name, str):
        raise ConfigError(f"{WHERE}.type={name!r}: expected a string, one of {', '.join(POLICY_LOSSES)}")
    if is_import_path(name):
        check_import_path(WHERE, name)
    elif name not in LOSS_MODELS:
        close = difflib.get_close_matches(name, POLICY_LOSSES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{WHERE}={name!r}: must be one of {', '.join(POLICY_LOSSES)} or an import path 'package.module:name'{hint}"
        )
    return value


def wrong_loss_field(loss: str, field: str) -> str:
    """Why `field` is not a setting of `loss` (for an unknown key inside algo.policy_loss)."""
    if loss == "custom":
        return f"{WHERE}.{field}: a custom loss takes its settings under {WHERE}.kwargs ({WHERE}.kwargs.{field})"
    own = [f for f in LOSS_MODELS[loss].model_fields if f != "type"]
    takes = f"takes: {', '.join(own)}" if own else "takes no settings"
    owners = LOSS_FIELDS.get(field)
    if owners:
        belongs = f"it belongs to {', '.join(owners)}"
        return f"{WHERE}.{field}: not a setting of policy loss {loss!r} ({belongs}); {loss} {takes}"
    close = difflib.get_close_matches(field, own, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{WHERE}.{field}: unknown setting of policy loss {loss!r}; {hint}{loss} {takes}"


def moved_loss_field(field: str) -> str:
    """The message for a loss knob still given at algo level (where older configs put it)."""
    owners = LOSS_FIELDS[field]
    return (
        f"algo.{field}: loss settings moved into algo.policy_loss; write "
        f"policy_loss: {{type: {owners[0]}, {field}: ...}} (override: {WHERE}.{field}=...). "
        f"{field} belongs to: {', '.join(owners)}"
    )
