"""One typed config tree for the whole system, validated once at start-up.

    cfg = load_config("configs/demo.yaml", ["control.max_staleness=2", "learner.lr=1e-5"])

Each component reads its own branch (``cfg.algo``, ``cfg.queue``, ...). Loading never
imports torch, vLLM or Ray, so a bad flag is rejected in well under a second. Every
error names the field (``algo.policy_loss``), the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

log = logging.getLogger(__name__)

# Names the algo registries ship with. Kept here (not imported from asyncrl.algo) so that
# validating a config never imports torch; tests/unit check both lists stay identical.
POLICY_LOSSES = (
    "ppo",
    "dual_clip",
    "gspo",
    "sapo",
    "cispo",
    "gmpo",
    "clip_cov",
    "kl_cov",
    "cross_entropy",
    "importance_sampling",
    "rollout_is",
    "dppo",
)
# Losses whose ratio is already taken against the rollout policy (cispo only with cispo_anchor='rollout').
ROLLOUT_ANCHORED_LOSSES = ("rollout_is", "dppo")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "maxrl")
OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "maxrl")
# Estimators whose baseline is the other samples of the same prompt: useless for groups of one.
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "maxrl")
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_per_microbatch")
ENVIRONMENTS = ("copy", "reverse", "arithmetic", "gsm8k", "countdown_chat")


class ConfigError(ValueError):
    """A config value is wrong. The message names the field, the value and what is allowed."""


def _is_import_path(name: str) -> bool:
    return ":" in name


def _check_import_path(field_name: str, path: str) -> None:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigError(f"{field_name}={path!r}: an import path must look like 'package.module:name'")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{field_name}={path!r}: module {module!r} cannot be found on the Python path")


# ----------------------------------------------------------------------------- algo


@dataclass
class CorrectionConfig:
    """Off-policy correction between the proximal (old) policy and the behaviour (rollout) policy.

    All ratios are exp(old_logprob - rollout_logprob). See docs/algorithms.md.
    """

    tis: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling weight: per token, or one per sequence (product of ratios)."""
    tis_cap: float = 2.0
    """Upper cap of the TIS weight."""
    geo_mask: bool = False
    """Mask a sequence whose geometric-mean ratio lies outside [geo_mask_low, geo_mask_high]."""
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    product_mask: bool = False
    """Mask a sequence whose product of ratios lies outside [product_mask_low, product_mask_high]."""
    product_mask_low: float = 0.5
    product_mask_high: float = 2.0
    outlier_mask: bool = False
    """Mask a whole sequence if any one token's ratio lies outside [outlier_low, outlier_high]."""
    outlier_low: float = 1e-4
    outlier_high: float = 100.0
    token_mask_low: float | None = None
    token_mask_high: float | None = None
    """Token IS mask: zero only the tokens whose ratio lies outside [token_mask_low,
    token_mask_high] (bounds keep), the rest of the sequence trains. On when both are set."""

    @property
    def token_mask(self) -> bool:
        return self.token_mask_low is not None and self.token_mask_high is not None

    @property
    def enabled(self) -> bool:
        return self.tis != "none" or self.geo_mask or self.product_mask or self.outlier_mask or self.token_mask


@dataclass
class AlgoConfig:
    """The RL objective: advantages, policy loss, reduction, KL and entropy terms."""

    advantage_estimator: str = "grpo"
    """One of ADVANTAGE_ESTIMATORS."""
    grpo_norm_std: bool = True
    """GRPO: divide group-centred rewards by the group std (False gives Dr.GRPO-style centring)."""
    gamma: float = 1.0
    lam: float = 1.0
    """GAE lambda (gae only)."""
    policy_loss: str = "ppo"
    """A built-in name (POLICY_LOSSES) or an import path 'package.module:function'."""
    loss_reduction: str = "token_mean"
    """How per-token terms are weighted within a mini-batch (all DP ranks together)."""
    reduction_constant: float | None = None
    """The constant C of seq_mean_token_sum_norm (usually the max response length)."""
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    """Asymmetric PPO clip range [1 - low, 1 + high] (DAPO clip-higher)."""
    dual_clip_c: float = 3.0
    """Dual-clip lower bound on negative-advantage tokens (dual_clip only); must be > 1."""
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cispo_eps_high: float = 5.0
    cispo_anchor: Literal["old", "rollout"] = "old"
    """The ratio CISPO caps: exp(logp - old) (the paper's) or exp(logp - rollout_logprob),
    which carries the async staleness itself (then algo.correction.tis must be 'none')."""
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    dppo_mask: Literal["binary_tv", "binary_kl"] = "binary_tv"
    """DPPO trust region on the sampled token's probability: total variation or binary KL."""
    dppo_delta_low: float = 0.2
    """DPPO bound for tokens with A < 0 (about 0.2 for binary_tv, 0.05 for binary_kl)."""
    dppo_delta_high: float = 0.2
    """DPPO bound for tokens with A > 0."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference term (0 disables the reference model)."""
    kl_estimator: str = "k3"
    rollout_kl_coef: float = 0.0
    """Rollout-KL trust region: penalty on (logprob - rollout_logprob)."""
    rollout_kl_estimator: str = "k2"
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coef * entropy)."""
    stepwise: bool = False
    """Multi-turn samples are step-wise trajectories (one sequence per step)."""
    merge_stepwise: bool = True
    """Merge consecutive steps that share a prefix into one sequence."""

    @property
    def rollout_anchored(self) -> bool:
        """The policy loss's ratio is already against the rollout policy."""
        return self.policy_loss in ROLLOUT_ANCHORED_LOSSES or (
            self.policy_loss == "cispo" and self.cispo_anchor == "rollout"
        )

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.correction.enabled or self.rollout_kl_coef > 0 or self.rollout_anchored


# ----------------------------------------------------------------------------- rollout


@dataclass
class RewardFnConfig:
    """One reward function of rollout.rewards."""

    fn: str
    """Import path 'package.module:function'."""
    weight: float = 1.0


@dataclass
class RolloutConfig:
    """Generators: the vLLM engines, sampling, environment and prompts."""

    model: str = "tiny"
    """A local model directory or hub id; 'tiny' writes a tiny random Llama for the env's alphabet."""
    num_generators: int = 1
    n_samples: int = 8
    """Samples per prompt (one rollout group)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    env: str = "copy"
    """A built-in environment (ENVIRONMENTS) or an import path 'package.module:Class'."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    rewards: list[RewardFnConfig] = field(default_factory=list)
    """Reward functions by import path, summed with their weights, in place of the
    environment's own reward (its prompts stay): [{fn: pkg.mod:fn, weight: 1.0}, ...].
    TRL's signature: fn(prompts, completions, **columns) -> list[float | None]."""
    prompts: str | None = None
    """jsonl / parquet / a local datasets directory; None lets the environment make prompts."""
    max_prompt_tokens: int = 192
    """Prompts longer than this are skipped and counted."""
    max_inflight_groups: int = 16
    """Groups a generator keeps in flight at once."""
    engine_max_model_len: int = 256
    engine_max_num_seqs: int = 64
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    kvcache_gib: int = 1
    logprobs: bool = True
    """Record per-token rollout logprobs (needed by every off-policy correction)."""
    seed: int = 0
    heartbeat_timeout_s: float = 60.0
    """A generator whose last heartbeat (one a second) is older than this is killed and
    restarted by the trainer (its admitted prompts are re-issued by the successor)."""
    cpus_per_generator: float = 1.0
    gpus_per_generator: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each generator needs, e.g. {gen: 1}: generators then run only on
    nodes started with that resource (`ray start --resources='{"gen": 8}'`)."""
    cpu_affinity: str = ""
    """CPU cores for the generators' engines, e.g. "0" or "0-3" ("" = no pinning). Benchmarks give
    generators and learners disjoint cores, as a cluster gives them disjoint GPUs."""


# ----------------------------------------------------------------------------- queue


@dataclass
class QueueConfig:
    """The Redis replay queue; embedded redis-server unless a URL is given."""

    redis_url: str | None = None
    """redis:// or rediss:// URL; None starts an embedded redis-server on 127.0.0.1."""
    password: str | None = None
    maxlen: int = 4096
    """Bound on queued groups; put() waits (backpressure) rather than dropping fresh data."""
    put_timeout_s: float = 60.0
    """How long one put() waits on a full queue before raising QueueFull; a generator then
    logs a warning and keeps waiting with its finished group (it never drops one)."""
    aof: bool = True
    """Embedded server: append-only persistence so un-acked records survive a restart."""
    max_record_bytes: int = 64 * 1024 * 1024
    bind: str = "127.0.0.1"
    ledger: bool = False
    """Record every produced group id in Redis (asyncrl:{run}:produced) so a run can be
    audited: produced = trained + dropped-stale + dead-lettered + still queued."""
    claim_idle_s: float = 900.0
    """Another consumer's un-acked entry idle this long is presumed orphaned and claimed;
    keep it above the time between checkpoints (entries stay un-acked until then)."""
    retry_deadline_s: float = 30.0
    """How long every Redis call retries (with backoff, a warning per retry) through an outage:
    a server restart or network blip shorter than this is ridden out quietly. A longer outage
    pauses the job (trainer and generators wait, one line a minute) until queue.outage_deadline_s."""
    outage_deadline_s: float | None = None
    """None: wait out any Redis outage. A number (>= retry_deadline_s): after that many seconds
    unreachable the trainer checkpoints, prints the resume command and fails (QueueUnavailable)."""


# ----------------------------------------------------------------------------- learner


@dataclass
class LearnerConfig:
    """FSDP2 learner ranks, optimiser and schedule."""

    num_ranks: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (sequences are never split)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per trainer step (each bumps the policy version)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the ranks (one bundle each); see docs/multinode.md."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rank needs, e.g. {train: 1}, to keep ranks on training nodes."""
    seed: int = 0
    collective_timeout_s: float = 300.0
    """A rank that does not answer a collective in this long fails the step (LearnerError), not a hang."""
    cpu_affinity: str = ""
    """CPU cores for the learner ranks, e.g. "1" ("" = no pinning); see rollout.cpu_affinity."""


# ----------------------------------------------------------------------------- sync


@dataclass
class SyncConfig:
    """Weight sync from learner rank 0 back to the engines."""

    sync_every: int = 1
    """Publish weights every this many optimizer steps."""
    backend: Literal["auto", "shm", "nccl", "object_store"] = "auto"
    """auto: nccl with CUDA; else shm when every generator shares the trainer's host, and
    object_store (bytes through Ray's object store, no shared filesystem) when one does not."""
    inflight: Literal["recompute", "keep"] = "recompute"
    """In-flight requests at a sync: recompute with the new weights, or finish on stale KV."""
    shm_dir: str = "/dev/shm"


# ----------------------------------------------------------------------------- control


@dataclass
class ControlConfig:
    """The driver loop: staleness, batching, checkpoints."""

    mode: Literal["async", "sync"] = "async"
    max_staleness: int = 1
    groups_per_step: int = 8
    total_steps: int = 100
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    """Keep the newest this many complete checkpoints (older ones are deleted after each save)..."""
    keep_every: int = 0
    """...plus every checkpoint whose step is a multiple of this (0: none kept for good)."""
    eval_every: int = 0
    """Evaluate every this many steps on a held-out prompt set (0: never); logged as eval/*."""
    eval_size: int = 32
    """Held-out prompts per evaluation."""
    eval_prompts: str | None = None
    """A prompt file for evaluation (like rollout.prompts); None: the environment makes them."""
    eval_temperature: float = 0.0
    """0 = greedy."""
    export_every: int = 0
    """Write a Hugging Face folder to run_dir/hf/step_N every this many steps (0: only
    run_dir/hf/final, which every run writes when it ends)."""
    run_name: str = "demo"
    run_dir: str = "runs/demo"
    seed: int = 0
    batch_timeout_s: float = 600.0
    """After this long without a full batch the trainer checks its generators: it waits on
    (saying why, once a minute) while any can run, alive or being restarted, and fails with a
    checkpoint and the resume command when none can."""
    ray_address: str | None = None
    ray_object_store_mb: int = 512


# ----------------------------------------------------------------------------- monitor


@dataclass
class MonitorConfig:
    """Metrics sinks and the thresholds the dashboard alerts on."""

    wandb: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "asyncrl"
    console: bool = True
    console_every: int = 10
    verbose: bool = False
    """Stream every Ray worker's output (vLLM engines included) to the console, as Ray does by
    default. Off: it stays in Ray's worker logs, linked from run_dir/logs/ray, and the console
    shows asyncrl's own lines (`asyncrl train --verbose` turns it on)."""
    """Print a metrics line every this many steps (the progress bar updates every step)."""
    dashboard: bool = True
    """`asyncrl train` serves the dashboard itself on dashboard_host:dashboard_port."""
    dashboard_port: int = 8470
    dashboard_host: str = "127.0.0.1"
    dashboard_token: str | None = None
    alert_rollout_kl: float = 0.05
    alert_masked_frac: float = 0.2
    alert_staleness_frac: float = 1.0
    """Alert when max staleness reaches this fraction of max_staleness."""


@dataclass
class Config:
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Turn a YAML/override value into `tp`, or raise ConfigError naming `path`."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}={value!r}: must be one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{path}={value!r}: expected {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}={value!r}: expected a mapping of {tp.__name__} fields")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads `1e-5` (no dot) as a string; users mean a number.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # `a.b=1` parses as YAML int; a str field means the text "1"
        raise ConfigError(f"{path}={value!r}: expected a string")
    if origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{path}={value!r}: expected a mapping")
    if origin is list:
        if isinstance(value, (list, tuple)):
            (arg,) = get_args(tp)
            return [_coerce(f"{path}[{i}]", v, arg) for i, v in enumerate(value)]
        raise ConfigError(f"{path}={value!r}: expected a list")
    if origin is tuple:
        args = get_args(tp)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        raise ConfigError(f"{path}={value!r}: expected a list of {len(args)} values")
    raise ConfigError(f"{path}: unsupported field type {tp!r}")


def _where(prefix: str, key: Any) -> str:
    """'algo.kl_coef' for a normal key; 'algo[3]' or "config root['']" for odd ones."""
    if isinstance(key, str) and key.isidentifier():
        return f"{prefix}.{key}" if prefix else key
    return f"{prefix or 'config root'}[{key!r}]"


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{_where(prefix, key)}: unknown field; {cls.__name__} has: {', '.join(sorted(names))}")
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for key in required:
        if key not in data:
            raise ConfigError(
                f"{prefix or 'config root'}: missing field {key!r} ({cls.__name__} needs: {', '.join(required)})"
            )
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(where, value, hints[key])
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Parse the right-hand side of an `a.b.c=value` override with YAML's scalar rules."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected the form a.b.c=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"config root: expected a mapping of sections, got {type(data).__name__}")
    cfg = _build(Config, data)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply `a.b.c=value` overrides, build and validate the tree."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping of sections at the top")
        data = loaded
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data)


# ----------------------------------------------------------------------------- validation


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; '' -> []. ValueError on anything else."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r}: expected core numbers and ranges like '0-2,5'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: range {part!r} runs backwards")
        cores += range(first, last + 1)
    return sorted(set(cores))


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}={value!r}: must be > 0")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{name}={value!r}: must be >= {low}")


def _ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    if not low < high:
        raise ConfigError(f"{low_name}={low!r} must be < {high_name}={high!r}")


def _one_of(name: str, value: str, allowed: tuple[str, ...], import_path_ok: bool = False) -> None:
    if import_path_ok and _is_import_path(value):
        _check_import_path(name, value)
        return
    if value not in allowed:
        extra = " or an import path 'package.module:name'" if import_path_ok else ""
        raise ConfigError(f"{name}={value!r}: must be one of {', '.join(allowed)}{extra}")


def _validate_algo(a: AlgoConfig, rollout: RolloutConfig) -> None:
    _one_of("algo.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS, import_path_ok=True)
    _one_of("algo.policy_loss", a.policy_loss, POLICY_LOSSES, import_path_ok=True)
    _one_of("algo.loss_reduction", a.loss_reduction, LOSS_REDUCTIONS)
    _one_of("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _one_of("algo.rollout_kl_estimator", a.rollout_kl_estimator, KL_ESTIMATORS)
    _positive("algo.eps_clip_low", a.eps_clip_low)
    _positive("algo.eps_clip_high", a.eps_clip_high)
    if a.eps_clip_low >= 1:
        raise ConfigError(f"algo.eps_clip_low={a.eps_clip_low!r}: must be < 1 (the lower clip bound is 1 - eps)")
    if a.dual_clip_c <= 1:
        raise ConfigError(f"algo.dual_clip_c={a.dual_clip_c!r}: must be > 1")
    for name in (
        "sapo_tau_pos",
        "sapo_tau_neg",
        "cispo_eps_high",
        "clip_cov_ratio",
        "kl_cov_ratio",
        "gamma",
        "dppo_delta_low",
        "dppo_delta_high",
    ):
        _positive(f"algo.{name}", getattr(a, name))
    _ordered("algo.clip_cov_lb", a.clip_cov_lb, "algo.clip_cov_ub", a.clip_cov_ub)
    if not 0 <= a.lam <= 1:
        raise ConfigError(f"algo.lam={a.lam!r}: must be in [0, 1]")
    for name in ("kl_coef", "rollout_kl_coef", "entropy_coef"):
        if getattr(a, name) < 0:
            raise ConfigError(f"algo.{name}={getattr(a, name)!r}: must be >= 0")

    if a.loss_reduction == "seq_mean_token_sum_norm":
        if a.reduction_constant is None:
            raise ConfigError(
                "algo.reduction_constant is required when algo.loss_reduction='seq_mean_token_sum_norm' "
                "(set it to the max response length, e.g. rollout.max_tokens)"
            )
        _positive("algo.reduction_constant", a.reduction_constant)

    if a.policy_loss == "gmpo" and a.loss_reduction != "sequence_mean":
        raise ConfigError(
            f"algo.policy_loss='gmpo' requires algo.loss_reduction='sequence_mean' "
            f"(got {a.loss_reduction!r}): GMPO's objective is a per-sequence geometric mean"
        )
    if a.policy_loss == "gmpo" and a.correction.tis == "token":
        raise ConfigError(
            "algo.correction.tis='token' does not compose with algo.policy_loss='gmpo': GMPO averages "
            "log-ratios per sequence, so a per-token weight has no place in its objective. "
            "Use algo.correction.tis='sequence' (applied to the sequence objective) or a sequence mask."
        )

    c = a.correction
    _positive("algo.correction.tis_cap", c.tis_cap)
    _positive("algo.correction.geo_mask_low", c.geo_mask_low)
    _positive("algo.correction.product_mask_low", c.product_mask_low)
    _positive("algo.correction.outlier_low", c.outlier_low)
    _ordered("algo.correction.geo_mask_low", c.geo_mask_low, "algo.correction.geo_mask_high", c.geo_mask_high)
    _ordered(
        "algo.correction.product_mask_low", c.product_mask_low, "algo.correction.product_mask_high", c.product_mask_high
    )
    _ordered("algo.correction.outlier_low", c.outlier_low, "algo.correction.outlier_high", c.outlier_high)
    if (c.token_mask_low is None) != (c.token_mask_high is None):
        unset = "token_mask_high" if c.token_mask_high is None else "token_mask_low"
        given = "token_mask_low" if unset == "token_mask_high" else "token_mask_high"
        raise ConfigError(
            f"algo.correction.{unset}=None while algo.correction.{given}={getattr(c, given)!r}: the token "
            f"mask needs both bounds (set algo.correction.{unset}, or unset both to turn it off)"
        )
    if c.token_mask:
        _positive("algo.correction.token_mask_low", c.token_mask_low)
        _ordered(
            "algo.correction.token_mask_low", c.token_mask_low, "algo.correction.token_mask_high", c.token_mask_high
        )
    if a.policy_loss == "cispo" and a.cispo_anchor == "rollout" and c.tis != "none":
        raise ConfigError(
            f"algo.correction.tis={c.tis!r} does not compose with algo.cispo_anchor='rollout': the CISPO "
            f"weight already is the rollout ratio exp(logp - rollout_logprob), so a TIS weight would "
            f"correct twice. Use algo.correction.tis='none' (the masks still apply) or algo.cispo_anchor='old'."
        )
    if a.policy_loss in ROLLOUT_ANCHORED_LOSSES and c.tis != "none":
        log.warning(
            "algo.policy_loss=%r already takes its ratio against the rollout policy; algo.correction.tis=%r "
            "multiplies in exp(old - rollout) on top. Use algo.correction.tis='none' unless that is meant.",
            a.policy_loss,
            c.tis,
        )

    if (
        a.advantage_estimator in GROUP_BASELINE_ESTIMATORS
        and rollout.n_samples < 2
        and a.policy_loss != "cross_entropy"
    ):
        raise ConfigError(
            f"rollout.n_samples={rollout.n_samples}: algo.advantage_estimator={a.advantage_estimator!r} "
            f"measures each sample against the other samples of its prompt, so a group of one has no "
            f"baseline, every advantage is 0 and nothing is trained. Use rollout.n_samples >= 2, or "
            f"algo.advantage_estimator='reinforce_pp' (baseline over the whole batch)."
        )
    if a.advantage_estimator == "maxrl":
        why = _negative_rewards_possible(rollout)
        if why:
            log.warning(
                "algo.advantage_estimator='maxrl' gives advantage 0 to every group whose mean reward is <= 0 "
                "(it divides by the mean, which must be a success rate), and %s: such groups will not train. "
                "MaxRL is meant for rewards in [0, 1]; consider grpo or dr_grpo.",
                why,
            )

    if a.stepwise and a.advantage_estimator not in OUTCOME_ESTIMATORS:
        raise ConfigError(
            f"algo.advantage_estimator={a.advantage_estimator!r} cannot be used with algo.stepwise=true: "
            f"step-wise trajectories broadcast one scalar advantage per trajectory, so only outcome "
            f"estimators work ({', '.join(OUTCOME_ESTIMATORS)})"
        )
    if a.advantage_estimator == "gae":
        raise ConfigError(
            "algo.advantage_estimator='gae' needs a value model (critic), which asyncrl does not train yet; "
            f"use one of {', '.join(e for e in ADVANTAGE_ESTIMATORS if e != 'gae')}"
        )
    if a.needs_rollout_logprobs and not rollout.logprobs:
        log.warning(
            "algo.correction / algo.rollout_kl_coef / algo.policy_loss=%r (cispo_anchor=%r) need engine "
            "logprobs: setting rollout.logprobs=true",
            a.policy_loss,
            a.cispo_anchor,
        )
        rollout.logprobs = True


def _negative_rewards_possible(r: RolloutConfig) -> str | None:
    """Why the configured environment's rewards can be negative, or None when they cannot."""
    if r.env in ("copy", "reverse", "arithmetic"):
        penalty = r.env_kwargs.get("length_penalty", 0.05)
        if isinstance(penalty, (int, float)) and penalty <= 0:
            return None
        return (
            f"rollout.env={r.env!r} subtracts length_penalty={penalty!r} per character of length error, "
            f"so its rewards go below 0"
        )
    if r.env == "gsm8k":
        low = min(r.env_kwargs.get("correct_reward", 1.0), r.env_kwargs.get("format_reward", 0.0))
        return None if low >= 0 else f"rollout.env='gsm8k' has a reward of {low!r}"
    if r.env == "countdown_chat":
        return "rollout.env='countdown_chat' subtracts 0.05 per character of length error in every turn"
    return f"the rewards of rollout.env={r.env!r} are not known to be >= 0"


def _validate_rollout(r: RolloutConfig) -> None:
    _at_least("rollout.num_generators", r.num_generators, 0)
    _at_least("rollout.n_samples", r.n_samples, 1)
    _at_least("rollout.max_tokens", r.max_tokens, 1)
    _at_least("rollout.max_inflight_groups", r.max_inflight_groups, 1)
    _at_least("rollout.max_prompt_tokens", r.max_prompt_tokens, 1)
    _positive("rollout.temperature", r.temperature)
    if r.heartbeat_timeout_s < 5:
        raise ConfigError(
            f"rollout.heartbeat_timeout_s={r.heartbeat_timeout_s!r}: must be >= 5 (generators beat once a second)"
        )
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p={r.top_p!r}: must be in (0, 1]")
    if r.top_k == 0 or r.top_k < -1:
        raise ConfigError(f"rollout.top_k={r.top_k!r}: must be -1 (off) or >= 1")
    _one_of("rollout.env", r.env, ENVIRONMENTS, import_path_ok=True)
    for i, spec in enumerate(r.rewards):
        if not _is_import_path(spec.fn):
            raise ConfigError(f"rollout.rewards[{i}].fn={spec.fn!r}: must be an import path 'package.module:function'")
        _check_import_path(f"rollout.rewards[{i}].fn", spec.fn)
        if not math.isfinite(spec.weight):
            raise ConfigError(f"rollout.rewards[{i}].weight={spec.weight!r}: must be a finite number")
    if r.max_prompt_tokens + r.max_tokens > r.engine_max_model_len:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.max_tokens = {r.max_prompt_tokens + r.max_tokens} "
            f"exceeds rollout.engine_max_model_len={r.engine_max_model_len}"
        )


def validate(cfg: Config) -> None:
    """Cross-field rules. Raises ConfigError naming the field; may switch on required features."""
    _validate_algo(cfg.algo, cfg.rollout)
    _validate_rollout(cfg.rollout)
    q, lr, s, c = cfg.queue, cfg.learner, cfg.sync, cfg.control
    _at_least("queue.maxlen", q.maxlen, 1)
    _positive("queue.put_timeout_s", q.put_timeout_s)
    _at_least("queue.max_record_bytes", q.max_record_bytes, 1024)
    _positive("queue.claim_idle_s", q.claim_idle_s)
    _positive("queue.retry_deadline_s", q.retry_deadline_s)
    if q.outage_deadline_s is not None and not q.outage_deadline_s >= q.retry_deadline_s:
        raise ConfigError(
            f"queue.outage_deadline_s={q.outage_deadline_s!r}: must be >= queue.retry_deadline_s="
            f"{q.retry_deadline_s:g} (an outage is retried that long first), or null (the default) to wait "
            "out any outage"
        )
    # Entries stay un-acked until the checkpoint that covers them and count against maxlen;
    # a smaller bound would make generators and trainer wait on each other forever.
    need = c.groups_per_step * (c.checkpoint_every + c.max_staleness + 2)
    if q.maxlen < need:
        raise ConfigError(
            f"queue.maxlen={q.maxlen}: must be >= control.groups_per_step * (control.checkpoint_every + "
            f"control.max_staleness + 2) = {need}, since entries stay queued until a checkpoint acks them"
        )
    if q.redis_url is not None and not q.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"queue.redis_url={q.redis_url!r}: must start with redis://, rediss:// or unix://")
    _at_least("learner.num_ranks", lr.num_ranks, 1)
    _positive("learner.lr", lr.lr)
    _positive("learner.grad_clip", lr.grad_clip)
    _positive("learner.collective_timeout_s", lr.collective_timeout_s)
    _at_least("learner.micro_batch_tokens", lr.micro_batch_tokens, 1)
    _at_least("learner.mini_batches_per_step", lr.mini_batches_per_step, 1)
    _at_least("learner.warmup_steps", lr.warmup_steps, 0)
    _at_least("sync.sync_every", s.sync_every, 1)
    _at_least("control.max_staleness", c.max_staleness, 0)
    _at_least("control.groups_per_step", c.groups_per_step, 1)
    _at_least("control.total_steps", c.total_steps, 1)
    _at_least("control.checkpoint_every", c.checkpoint_every, 1)
    _at_least("control.keep_checkpoints", c.keep_checkpoints, 1)
    _at_least("control.keep_every", c.keep_every, 0)
    _at_least("control.export_every", c.export_every, 0)
    _at_least("control.eval_every", c.eval_every, 0)
    _at_least("control.eval_size", c.eval_size, 1)
    if c.eval_temperature < 0:
        raise ConfigError(f"control.eval_temperature={c.eval_temperature!r}: must be >= 0 (0 = greedy)")
    if c.eval_prompts is not None and not Path(c.eval_prompts).exists():
        raise ConfigError(f"control.eval_prompts={c.eval_prompts!r}: no such file or directory")
    if c.groups_per_step % lr.mini_batches_per_step:
        raise ConfigError(
            f"control.groups_per_step={c.groups_per_step} must be divisible by "
            f"learner.mini_batches_per_step={lr.mini_batches_per_step}"
        )
    # Weights are published at the end of the trainer step in which the version reaches a
    # multiple of sync_every; the last mini-batch of a step trains on data up to this old.
    floor = s.sync_every + lr.mini_batches_per_step - 2
    if c.max_staleness < floor:
        raise ConfigError(
            f"control.max_staleness={c.max_staleness} must be >= sync.sync_every + "
            f"learner.mini_batches_per_step - 2 = {floor}: generators only see new weights every "
            f"sync_every optimizer steps, so fresher data cannot exist"
        )
    for name, res in (("rollout.resources", cfg.rollout.resources), ("learner.resources", lr.resources)):
        for key, amount in res.items():
            if key in ("CPU", "GPU", "memory") or not isinstance(amount, (int, float)) or not amount > 0:
                raise ConfigError(
                    f"{name}.{key}={amount!r}: must be a custom resource name with an amount > 0 "
                    f"(CPUs and GPUs are set by cpus_per_* / gpus_per_*)"
                )
    if c.mode == "async" and cfg.rollout.num_generators < 1:
        raise ConfigError("rollout.num_generators=0: async mode needs at least one generator")
    _at_least("monitor.console_every", cfg.monitor.console_every, 1)
    for name, text in (
        ("rollout.cpu_affinity", cfg.rollout.cpu_affinity),
        ("learner.cpu_affinity", cfg.learner.cpu_affinity),
    ):
        try:
            parse_cpu_list(text)
        except ValueError as e:
            raise ConfigError(f"{name}={e}") from None
    if cfg.monitor.dashboard_host not in ("127.0.0.1", "localhost", "::1") and not cfg.monitor.dashboard_token:
        raise ConfigError(
            f"monitor.dashboard_host={cfg.monitor.dashboard_host!r}: binding beyond loopback requires "
            f"monitor.dashboard_token"
        )
