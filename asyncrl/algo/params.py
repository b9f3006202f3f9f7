"""The math's parameter types, defined once: one model per policy loss (``params`` of the loss
functions) and the off-policy correction's. Torch-free pydantic models, so the config tree holds
these very models (``algo.policy_loss`` is one of the loss models, ``algo.correction`` extends
CorrectionParams by its 'auto' default) and the names, defaults and checks live only here:

    params_for("ppo", eps_clip_high=0.28)                    # -> PpoLoss
    params_for("my_pkg.losses:my_loss", beta=0.1)            # -> CustomLoss(kwargs={"beta": 0.1})
    CorrectionParams(tis="token", tis_cap=2.0)

Error messages name a field as the config spells it (``algo.policy_loss.clip_cov_lb``), the
place users set it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

WHERE = "algo.policy_loss"
"""Where the config holds a policy loss's parameters."""
CORRECTION = "algo.correction"
"""Where the config holds the correction's."""
DEFAULT_LOSS = "ppo"


class ParamsError(ValueError):
    """A parameter value is wrong. The message names the field, the value and what is allowed."""


class Params(BaseModel):
    """Unknown keys are errors, the docstring under a field is its description (the config's
    `--help-config`), a number given for a text field is its text."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)


def is_import_path(name: str) -> bool:
    """'package.module:name' (a user's loss or estimator) rather than a built-in's name."""
    return ":" in name


class LossParams(Params):
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
            raise ParamsError(
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
    a CustomLoss whose kwargs are ``fields``. ParamsError for an unknown name; pydantic's
    ValidationError (a ValueError) for a bad field."""
    if is_import_path(name_or_path):
        return CustomLoss(type=name_or_path, kwargs=fields)
    if name_or_path not in LOSS_MODELS:
        raise ParamsError(f"{WHERE}={name_or_path!r}: must be one of {', '.join(POLICY_LOSSES)}")
    return LOSS_MODELS[name_or_path](**fields)


def _ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    if not low < high:
        raise ParamsError(f"{CORRECTION}.{low_name}={low!r} must be < {CORRECTION}.{high_name}={high!r}")


class CorrectionParams(Params):
    """Off-policy correction between the proximal (old) policy and the behaviour (rollout) policy.

    All ratios are exp(old_logprob - rollout_logprob). See docs/algorithms.md.
    """

    model_config = ConfigDict(frozen=True)

    tis: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling weight: per token, or one per sequence (product of ratios)."""
    tis_cap: float = Field(2.0, gt=0)
    """Upper cap of the TIS weight."""
    geo_mask: bool = False
    """Mask a sequence whose geometric-mean ratio lies outside [geo_mask_low, geo_mask_high]."""
    geo_mask_low: float = Field(0.99, gt=0)
    geo_mask_high: float = 1.01
    product_mask: bool = False
    """Mask a sequence whose product of ratios lies outside [product_mask_low, product_mask_high]."""
    product_mask_low: float = Field(0.5, gt=0)
    product_mask_high: float = 2.0
    outlier_mask: bool = False
    """Mask a whole sequence if any one token's ratio lies outside [outlier_low, outlier_high]."""
    outlier_low: float = Field(1e-4, gt=0)
    outlier_high: float = 100.0
    token_mask_low: float | None = Field(None, gt=0)
    """Token IS mask: zero only the tokens whose ratio lies outside [token_mask_low,
    token_mask_high] (bounds keep), the rest of the sequence trains. On when both are set."""
    token_mask_high: float | None = None

    @property
    def token_mask(self) -> bool:
        return self.token_mask_low is not None and self.token_mask_high is not None

    @property
    def enabled(self) -> bool:
        return self.tis != "none" or self.geo_mask or self.product_mask or self.outlier_mask or self.token_mask

    @model_validator(mode="after")
    def _ranges(self) -> CorrectionParams:
        _ordered("geo_mask_low", self.geo_mask_low, "geo_mask_high", self.geo_mask_high)
        _ordered("product_mask_low", self.product_mask_low, "product_mask_high", self.product_mask_high)
        _ordered("outlier_low", self.outlier_low, "outlier_high", self.outlier_high)
        if (self.token_mask_low is None) != (self.token_mask_high is None):
            unset = "token_mask_high" if self.token_mask_high is None else "token_mask_low"
            given = "token_mask_low" if unset == "token_mask_high" else "token_mask_high"
            w = f"{CORRECTION}."
            raise ParamsError(
                f"{w}{unset}=None while {w}{given}={getattr(self, given)!r}: the token mask needs both "
                f"bounds (set {w}{unset}, or unset both to turn it off)"
            )
        if self.token_mask_low is not None and self.token_mask_high is not None:
            _ordered("token_mask_low", self.token_mask_low, "token_mask_high", self.token_mask_high)
        return self
