"""The policy losses' parameters: one model per loss, the single source of their names,
fields, defaults and checks. ``algo.policy_loss`` is one of them, picked by ``type``:

    policy_loss: ppo                                           # the loss's defaults
    policy_loss: {type: ppo, eps_clip_low: 0.2, eps_clip_high: 0.28}
    policy_loss: {type: my_pkg.losses:my_loss, kwargs: {beta: 0.1}}

The loss functions in asyncrl.algo receive the same object as ``params`` (a custom loss
reads ``params.kwargs``), and the registry there is keyed by POLICY_LOSSES. Torch-free.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from asyncrl.config.base import ConfigError, Section, check_import_path, is_import_path

WHERE = "algo.policy_loss"
DEFAULT_LOSS = "ppo"


class LossParams(Section):
    """What every policy loss's parameters have: the loss's name (or import path)."""

    type: str
    sequence_level: ClassVar[bool] = False
    """The objective is per sequence, so a per-token TIS weight has no place in it."""

    @property
    def rollout_anchored(self) -> bool:
        """The loss's ratio is already taken against the rollout (behaviour) policy."""
        return False


class ClippedLoss(LossParams):
    eps_clip_low: float = Field(0.2, gt=0, lt=1)
    """Clip range [1 - eps_clip_low, 1 + eps_clip_high] (DAPO clip-higher: high > low); < 1."""
    eps_clip_high: float = Field(0.2, gt=0)
    """Upper half of the clip range."""


class PpoLoss(ClippedLoss):
    """PPO clipped surrogate -min(r A, clip(r) A) (Schulman et al. 2017)."""

    type: Literal["ppo"] = "ppo"


class DualClipLoss(ClippedLoss):
    """PPO, and for A < 0 also capped at -c A (Ye et al. 2020)."""

    type: Literal["dual_clip"] = "dual_clip"
    dual_clip_c: float = Field(3.0, gt=1)
    """Dual-clip lower bound c on negative-advantage tokens; must be > 1."""


class GspoLoss(ClippedLoss):
    """The PPO clip on the length-normalised sequence ratio (Zheng et al. 2025; the paper uses eps ~3e-4)."""

    type: Literal["gspo"] = "gspo"


class SapoLoss(LossParams):
    """A smooth sigmoid gate -(4/tau) sigmoid(tau (r - 1)) A instead of a clip (Gao et al. 2025)."""

    type: Literal["sapo"] = "sapo"
    sapo_tau_pos: float = Field(1.0, gt=0)
    """Gate temperature for tokens with A > 0."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """Gate temperature for tokens with A <= 0."""


class CispoLoss(LossParams):
    """Clip the stop-gradient IS weight, never the token's gradient (MiniMax-M1)."""

    type: Literal["cispo"] = "cispo"
    cispo_eps_high: float = Field(5.0, gt=0)
    """The weight is capped at 1 + cispo_eps_high."""
    cispo_anchor: Literal["old", "rollout"] = "old"
    """The ratio CISPO caps: exp(logp - old) (the paper's) or exp(logp - rollout_logprob),
    which carries the async staleness itself (then algo.correction.tis must be 'none')."""

    @property
    def rollout_anchored(self) -> bool:
        return self.cispo_anchor == "rollout"


class GmpoLoss(ClippedLoss):
    """Geometric mean of the token ratios, clipped in log space (Zhao et al. 2025); needs sequence_mean."""

    type: Literal["gmpo"] = "gmpo"
    sequence_level: ClassVar[bool] = True


class ClipCovLoss(ClippedLoss):
    """PPO with the highest-covariance unclipped tokens dropped (Cui et al. 2025)."""

    type: Literal["clip_cov"] = "clip_cov"
    clip_cov_ratio: float = Field(2e-4, gt=0)
    """Fraction of the tokens that may be dropped."""
    clip_cov_lb: float = 1.0
    """A token is eligible when clip_cov_lb < cov < clip_cov_ub."""
    clip_cov_ub: float = 5.0

    @model_validator(mode="after")
    def _bounds(self) -> ClipCovLoss:
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ConfigError(
                f"{WHERE}.clip_cov_lb={self.clip_cov_lb!r} must be < {WHERE}.clip_cov_ub={self.clip_cov_ub!r}"
            )
        return self


class KlCovLoss(LossParams):
    """-r A plus a |logp - old| penalty on the highest-covariance tokens (Cui et al. 2025)."""

    type: Literal["kl_cov"] = "kl_cov"
    kl_cov_ratio: float = Field(2e-3, gt=0)
    """Fraction of the tokens that get the penalty."""
    kl_cov_coef: float = 1.0
    """Coefficient of the penalty."""


class CrossEntropyLoss(LossParams):
    """Supervised fine-tuning: -logp (advantages unused)."""

    type: Literal["cross_entropy"] = "cross_entropy"


class ImportanceSamplingLoss(LossParams):
    """Plain importance-weighted policy gradient -r A, no clip (Tinker)."""

    type: Literal["importance_sampling"] = "importance_sampling"


class RolloutIsLoss(ClippedLoss):
    """-sg(w) A logp with w the ratio to the rollout policy inside the band [1 - eps_clip_low, 1 + eps_clip_high]."""

    type: Literal["rollout_is"] = "rollout_is"

    @property
    def rollout_anchored(self) -> bool:
        return True


class DppoLoss(LossParams):
    """A divergence trust region on the sampled token's probability (Divergence PPO)."""

    type: Literal["dppo"] = "dppo"
    dppo_mask: Literal["binary_tv", "binary_kl"] = "binary_tv"
    """Total variation or binary KL between the token's probability now and at rollout."""
    dppo_delta_low: float = Field(0.2, gt=0)
    """Bound for tokens with A < 0 (about 0.2 for binary_tv, 0.05 for binary_kl)."""
    dppo_delta_high: float = Field(0.2, gt=0)
    """Bound for tokens with A > 0."""

    @property
    def rollout_anchored(self) -> bool:
        return True


class CustomLoss(LossParams):
    """A user's loss by import path 'package.module:function'; it reads its settings from params.kwargs."""

    type: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings handed to the loss as params.kwargs."""


def _loss_tag(value: Any) -> str | None:
    name = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if isinstance(name, str) and is_import_path(name) else name


PolicyLoss = Annotated[
    Annotated[PpoLoss, Tag("ppo")]
    | Annotated[DualClipLoss, Tag("dual_clip")]
    | Annotated[GspoLoss, Tag("gspo")]
    | Annotated[SapoLoss, Tag("sapo")]
    | Annotated[CispoLoss, Tag("cispo")]
    | Annotated[GmpoLoss, Tag("gmpo")]
    | Annotated[ClipCovLoss, Tag("clip_cov")]
    | Annotated[KlCovLoss, Tag("kl_cov")]
    | Annotated[CrossEntropyLoss, Tag("cross_entropy")]
    | Annotated[ImportanceSamplingLoss, Tag("importance_sampling")]
    | Annotated[RolloutIsLoss, Tag("rollout_is")]
    | Annotated[DppoLoss, Tag("dppo")]
    | Annotated[CustomLoss, Tag("custom")],
    Discriminator(_loss_tag),
]


def _built_ins() -> dict[str, type[LossParams]]:
    found: dict[str, type[LossParams]] = {}
    for member in get_args(get_args(PolicyLoss)[0]):
        cls, tag = get_args(member)[0], member.__metadata__[0].tag
        if cls is CustomLoss:
            continue
        if cls.model_fields["type"].default != tag:
            raise TypeError(f"policy loss {cls.__name__}: tag {tag!r} is not its type")
        found[tag] = cls
    return found


LOSS_MODELS = _built_ins()
POLICY_LOSSES = tuple(LOSS_MODELS)
TAGS = (*POLICY_LOSSES, "custom")
# Every loss's own knobs -> the losses that have them (they once were flat algo.* fields).
LOSS_FIELDS: dict[str, list[str]] = {}
for _name, _cls in LOSS_MODELS.items():
    for _field in _cls.model_fields:
        if _field != "type":
            LOSS_FIELDS.setdefault(_field, []).append(_name)


def params_for(name_or_path: str, **fields: Any) -> LossParams:
    """The parameters of a built-in loss (fields override its defaults) or, for an import path,
    a CustomLoss whose kwargs are ``fields``."""
    from asyncrl.config.load import config_error  # load imports the tree, which imports this module

    if is_import_path(name_or_path):
        return CustomLoss(type=name_or_path, kwargs=fields)
    if name_or_path not in LOSS_MODELS:
        raise ConfigError(f"{WHERE}={name_or_path!r}: must be one of {', '.join(POLICY_LOSSES)}")
    try:
        return LOSS_MODELS[name_or_path](**fields)
    except ValidationError as e:
        raise config_error(e, prefix=("algo", "policy_loss")) from None


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
