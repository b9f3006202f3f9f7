"""Records passed between components.

A `RolloutGroup` is one queue entry: all n samples of one prompt, so group-relative
advantages never see half a group. Arrays are numpy (the codec in `asyncrl.data.codec`
writes them as raw little-endian bytes); nothing here imports torch.

Versions: `behavior_version` of a sample is the policy version of the *oldest* token in
it; `token_versions` (optional) gives the version that produced each response token when
weights changed mid-request. The group's version is its oldest sample's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

MAX_ABS_REWARD = 1e6
"""Largest |reward| a sample may carry. Far past any task's scale, yet small enough that a
group's advantages (differences, variances: squares of rewards) stay finite in float32; a
larger one is a bug (or a hostile record) that would end the run at the next step."""
MIN_LOGPROB = -MAX_ABS_REWARD
"""Lowest log-prob a record may carry (rollout's or teacher's). Finite is not enough: under
rollout.teacher each token's log-probs are its reward (A_t = -coef * (rollout - teacher)), so
-1e30 would be a finite advantage that swamps every other. A real one is log_softmax(z / T) of
float32 logits, >= (z_min - z_max) / T - log V: past -1e6 only with a logit spread of 1e4 at
T = 1 (the learner's own mask for a banned token is -1e4) or an absurd temperature; a sampled
token that unlikely is never drawn. The bound keeps the term within a reward's (MAX_ABS_REWARD)."""

PER_TOKEN_ARRAYS = ("rollout_logprobs", "loss_mask", "token_versions", "token_rewards", "teacher_logprobs")
"""Sample arrays with one entry per response token (when present): the codec and the batch
builder check their lengths against response_ids."""


@dataclass
class Sample:
    """One sampled response (or one step of a multi-turn trajectory)."""

    response_ids: np.ndarray
    """int32 [T]: generated tokens (multi-turn: model and observation tokens interleaved)."""
    rollout_logprobs: np.ndarray
    """float32 [T]: log-prob of each response token under the behaviour policy (0 where loss_mask is 0)."""
    loss_mask: np.ndarray
    """uint8 [T]: 1 on tokens the policy generated and should be trained on."""
    reward: float
    """Scalar (outcome) reward; NaN if the reward function failed (see `error`)."""
    behavior_version: int
    stop_reason: str = "stop"
    """'stop' | 'length' | 'abort' | 'error' ..."""
    token_versions: np.ndarray | None = None
    """int32 [T] or None: policy version that produced each token."""
    token_rewards: np.ndarray | None = None
    """float32 [T] or None: per-token rewards (for token-level estimators)."""
    teacher_logprobs: np.ndarray | None = None
    """float32 [T] or None: log-prob of each response token under rollout.teacher (on-policy
    distillation; 0 where loss_mask is 0), at the student's sampling temperature."""
    generator_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Why the reward is missing (the reward function raised or returned NaN/None)."""
    prompt_ids: np.ndarray | None = None
    """int32 [P] or None: this sample's own prompt, exactly the ids the engine was given for its
    first token (every multi-turn sample: step-wise steps and interleaved); None means the group's."""
    trajectory_id: int = 0
    """Step-wise: which trajectory of the group this step belongs to."""
    routed_experts: np.ndarray | None = None
    """uint8 [P + T - 1, layers, k] or None: the experts the engine routed each forwarded
    position to (prompt, then response but the last token; asyncrl.data.routing), for routing
    replay (algo.routing_replay)."""
    step_index: int = 0

    def __post_init__(self) -> None:
        self.response_ids = np.asarray(self.response_ids, dtype=np.int32)
        self.rollout_logprobs = np.asarray(self.rollout_logprobs, dtype=np.float32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)
        if self.token_versions is not None:
            self.token_versions = np.asarray(self.token_versions, dtype=np.int32)
        if self.token_rewards is not None:
            self.token_rewards = np.asarray(self.token_rewards, dtype=np.float32)
        if self.prompt_ids is not None:
            self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = np.asarray(self.teacher_logprobs, dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])


@dataclass
class RolloutGroup:
    """All samples of one prompt: the unit of the replay queue."""

    group_id: str
    prompt_id: str
    prompt_ids: np.ndarray
    """int32 [P]."""
    samples: list[Sample]
    env: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    """msgpack-able env metadata (e.g. the target answer)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)

    @property
    def behavior_version(self) -> int:
        """The oldest sample's version: staleness is measured from it."""
        return min(s.behavior_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.samples], dtype=np.float32)


@dataclass
class TrainSequence:
    """One sequence ready for the learner: prompt + response, every field aligned to `input_ids`.

    Position t holds the quantities for predicting input_ids[t] from input_ids[:t]; prompt
    positions (and observation tokens) have loss_mask 0. The driver computes advantages and
    reduction weights over the whole mini-batch (all DP ranks), so ranks only ever compute
    sum(reduction_weights * term) and the result cannot depend on how the batch is cut.
    """

    input_ids: np.ndarray
    """int32 [L]."""
    loss_mask: np.ndarray
    """float32 [L]."""
    rollout_logprobs: np.ndarray
    """float32 [L] (0 on masked positions)."""
    advantages: np.ndarray
    """float32 [L]."""
    reduction_weights: np.ndarray
    """float32 [L]: this token's weight in the mini-batch loss (0 where loss_mask is 0)."""
    token_versions: np.ndarray
    """int32 [L]: behaviour version per position."""
    behavior_version: int
    group_id: str = ""
    sample_index: int = 0
    token_rewards: np.ndarray | None = None
    """float32 [L], only with algo.critic: the reward of each policy token (the outcome on the
    last one unless the sample carries its own), from which the learner computes GAE."""
    routed_experts: np.ndarray | None = None
    """uint8 [L - 1, layers, k], only with algo.routing_replay='rollout' and a sample that
    carries the engine's routing (Sample.routed_experts, rows = L - 1): the learner's forward
    routes position t to these experts (asyncrl.learner.routing_replay)."""
    pixel_values: np.ndarray | None = None
    """float32 [tiles, 3, size, size], only for a prompt with images (a vision-language model):
    its images' tiles in prompt order, whose features the model places at the prompt's image
    tokens (asyncrl.data.pixels)."""
    pixel_attention_mask: np.ndarray | None = None
    """bool [tiles, size, size], with pixel_values: each tile's real pixels."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class MetricValue:
    """A metric that carries its own reduction, so partial results merge without re-deriving it.

    mean: total / count;  sum: total;  max / min: total is the extreme so far (count unused).
    """

    reduce: str
    # float, or a 0-d tensor: the learner keeps its metrics on the device until they are merged
    # (no host sync per micro-batch), so these are typed by what they support, not as float.
    total: Any
    count: Any = 1.0

    def merge(self, other: MetricValue) -> MetricValue:
        if self.reduce != other.reduce:
            raise ValueError(f"cannot merge a {self.reduce!r} metric with a {other.reduce!r} one")
        if self.reduce == "max":
            return MetricValue("max", max(self.total, other.total), 1.0)
        if self.reduce == "min":
            return MetricValue("min", min(self.total, other.total), 1.0)
        return MetricValue(self.reduce, self.total + other.total, self.count + other.count)

    @property
    def value(self) -> float:
        if self.reduce == "mean":
            return self.total / self.count if self.count else float("nan")
        return self.total


def merge_metrics(parts: list[dict[str, MetricValue]]) -> dict[str, MetricValue]:
    out: dict[str, MetricValue] = {}
    for part in parts:
        for name, m in part.items():
            out[name] = out[name].merge(m) if name in out else m
    return out


# ---------------------------------------------------------------------- weight locations

OBJECT_SCHEME = "ray-object://"
"""How an object-store location is written where a string must carry it (Redis)."""


@dataclass(frozen=True)
class WeightsFile:
    """Published weights as a safetensors file every reader can open (sync.backend shm, nccl)."""

    path: str

    def __str__(self) -> str:
        return format_location(self)


@dataclass(frozen=True)
class WeightsObject:
    """Published weights as one object in the run's Ray object store, one per version
    (sync.backend=object_store): no file any two nodes share."""

    run: str
    version: int

    def __str__(self) -> str:
        return format_location(self)


WeightLocation = WeightsFile | WeightsObject
"""Where a version's weights were published. Code switches on the type; the text form exists
only where a string must carry it (Redis), through format_location and parse_location."""


def format_location(location: WeightLocation) -> str:
    """The text form: a file's path, or ``ray-object://RUN/vN``."""
    if isinstance(location, WeightsObject):
        return f"{OBJECT_SCHEME}{location.run}/v{location.version}"
    return location.path


def parse_location(text: str) -> WeightLocation:
    """The inverse of format_location."""
    if not text.startswith(OBJECT_SCHEME):
        return WeightsFile(text)
    run, sep, version = text[len(OBJECT_SCHEME) :].rpartition("/v")
    if not sep or not run or not version.isdigit():
        raise ValueError(f"weights location {text!r}: expected {OBJECT_SCHEME}RUN/vVERSION")
    return WeightsObject(run, int(version))
