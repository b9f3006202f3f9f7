"""The rollout section: the generators' engines, sampling, environment, prompts and rewards,
with the rules that involve only its own fields (rules across sections live on the root,
asyncrl.config.tree)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.config.base import (
    ENVIRONMENTS,
    ConfigError,
    Section,
    check_import_path,
    cpu_list,
    custom_resources,
    is_import_path,
    one_of,
    prompt_source,
)
from asyncrl.config.code_env import CODE_ENV, check_code_prompts, code_env_config
from asyncrl.config.envspec import check_library_env, env_mapping
from asyncrl.config.reward_model import RewardModelConfig, read_reward_model
from asyncrl.config.teacher import TeacherConfig, check_teacher
from asyncrl.config.tool_env import TOOLS_ENV, tool_env_config


class RewardFnConfig(Section):
    """One reward function of rollout.rewards."""

    fn: str
    """Import path 'package.module:function'."""
    weight: float = 1.0
    """Its weight in the sum; finite."""
    timeout_s: float | None = Field(None, gt=0)
    """Seconds one call may run; None: rollout.reward_timeout_s."""


def _reward_kind(entry: Any) -> str:
    # An entry with a `model` key is a reward model; anything else is checked as a function,
    # so a mapping missing both keys is told it misses `fn`, as before reward models.
    has_model = (isinstance(entry, dict) and "model" in entry) or isinstance(entry, RewardModelConfig)
    return "RewardModelConfig" if has_model else "RewardFnConfig"


REWARD_KINDS: dict[str, type[Section]] = {"RewardFnConfig": RewardFnConfig, "RewardModelConfig": RewardModelConfig}
"""The kinds of rollout.rewards entry by their union tag (asyncrl.config.load leaves the tag
out of the field paths its messages name)."""

RewardSpec = Annotated[
    Annotated[RewardFnConfig, Tag("RewardFnConfig")] | Annotated[RewardModelConfig, Tag("RewardModelConfig")],
    Discriminator(_reward_kind),
]


class ImagesConfig(Section):
    """Prompt images of a vision-language run (docs/guide/vision.md): the limits every image is
    checked against where it is read (a prompt file, an environment's prompt, a record at the
    learner's intake, the learner's pixel values); past one, a prompt file's record is refused
    at start-up, and a record read back from Redis is dead-lettered (bad_image)."""

    max_bytes: int = Field(256 << 10, ge=1 << 10, le=64 << 20)
    """One image as PNG, in bytes (photos re-encoded from JPEG grow: ~1-3 bytes a pixel)."""
    max_pixels: int = Field(512 * 512, ge=1, le=8192 * 8192)
    """One image's width x height, as its header declares it (checked before any pixel is decoded)."""
    max_images: int = Field(4, ge=1, le=64)
    """Images per prompt (the engine is built for this many)."""


class RolloutConfig(Section):
    """Generators: the vLLM engines, sampling, environment and prompts."""

    model: str = "tiny"
    """A local model directory or hub id; 'tiny' writes a tiny random Llama for the env's alphabet."""
    num_generators: int = Field(1, ge=0)
    n_samples: int = Field(8, ge=1)
    """Samples per prompt (one rollout group)."""
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    """-1 (off) or >= 1."""
    env: str = "copy"
    """A built-in environment (copy, reverse, arithmetic, gsm8k, math, countdown_chat, tools,
    verifiers, code) or an import path 'package.module:Class'; or a mapping {type: NAME, **env_kwargs}
    (a library's: {type: verifiers, id: module, args: {...}})."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    rewards: list[RewardSpec] = Field(default_factory=list)
    """Reward functions by import path, summed with their weights, in place of the
    environment's own reward (its prompts stay): [{fn: pkg.mod:fn, weight: 1.0}, ...].
    TRL's signature: fn(prompts, completions, **columns) -> list[float | None]; `async def` too.
    An entry {model: DIR, ...} is a sequence-classification reward model (RewardModelConfig)."""
    images: ImagesConfig = Field(default_factory=ImagesConfig)
    """Limits on prompt images (a vision-language model's)."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: a causal LM that scores the student's sampled tokens; its per-token
    reverse KL joins the advantage (asyncrl.algo.distill). None: no teacher."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Seconds one reward call may run before its sample is scored as failed (counted in
    rollout/reward_timeouts); the generator keeps going either way."""
    reward_workers: int = Field(8, ge=1)
    """Threads per generator running plain `def` rewards (a hung call's thread is replaced)."""
    reward_on_failure: float | None = None
    """The reward of a sample whose reward timed out or raised: None leaves the sample out of
    the loss (reward NaN); a number (e.g. 0.0, as verl and SkyRL do) trains on it with that reward."""
    prompts: str | None = None
    """jsonl / parquet, a datasets directory (Dataset(Dict).save_to_disk) or a hub id
    'owner/name[:config]'; None lets the environment make prompts (asyncrl.rollout.prompts)."""
    prompt_split: str = Field("train", min_length=1)
    """The split of a DatasetDict directory or a hub dataset."""
    prompt_field: str = Field("prompt", min_length=1)
    """The column holding the prompt text (the default falls back to GSM8K's 'question')."""
    answer_field: str = Field("answer", min_length=1)
    """The column handed to the reward as metadata['answer'] (the reference answer)."""
    chat_template: bool = False
    """Render each prompt as one user turn with the tokenizer's chat template (generation
    prompt added) before tokenizing, in training and evaluation alike."""
    max_prompt_tokens: int = Field(192, ge=1)
    """Prompts longer than this are skipped and counted."""
    max_inflight_groups: int = Field(16, ge=1)
    """Groups a generator keeps in flight at once."""
    drop_uniform_groups: bool = False
    """DAPO's dynamic sampling: a group whose rewards all tie (after algo.overlong's penalty) has
    advantage 0 under a group baseline; the generator drops it instead of putting it, gives its
    admission back and draws a new prompt (counted: rollout/dropped_uniform_groups)."""
    engine_max_model_len: int = 256
    engine_max_num_seqs: int = 64
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    kvcache_gib: int = 1
    logprobs: bool = True
    """Record per-token rollout logprobs (needed by every off-policy correction)."""
    seed: int = 0
    """Offset on control.seed for prompt order and every request's sampling seed (asyncrl.seeding)."""
    heartbeat_timeout_s: float = Field(60.0, ge=5)
    """A generator whose last heartbeat (one a second) is older than this is killed and
    restarted by the trainer (its admitted prompts are re-issued by the successor); >= 5."""
    cpus_per_generator: float = 1.0
    gpus_per_generator: float = 0.0
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each generator needs, e.g. {gen: 1}: generators then run only on
    nodes started with that resource (`ray start --resources='{"gen": 8}'`)."""
    cpu_affinity: str = ""
    """CPU cores for the generators' engines, e.g. "0" or "0-3" ("" = no pinning). Benchmarks give
    generators and learners disjoint cores, as a cluster gives them disjoint GPUs."""

    @model_validator(mode="before")
    @classmethod
    def _env_mapping(cls, data: Any) -> Any:
        return env_mapping(data)

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, value: Any) -> Any:
        return custom_resources("rollout.resources", value) if isinstance(value, dict) else value

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity(cls, value: str) -> str:
        return cpu_list("rollout.cpu_affinity", value)

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, value: str | None) -> str | None:
        return prompt_source("rollout.prompts", value)

    @model_validator(mode="after")
    def _rules(self) -> RolloutConfig:
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k={self.top_k!r}: must be -1 (off) or >= 1")
        one_of("rollout.env", self.env, ENVIRONMENTS, import_path_ok=True)
        if self.env == TOOLS_ENV:
            tool_env_config(self.env_kwargs)
            if not self.chat_template:
                raise ConfigError(
                    "rollout.env=tools needs rollout.chat_template=true: the tool schemas, the model's calls "
                    "and the tools' output are written in the chat template's tool format"
                )
        if self.env == CODE_ENV:
            code_env_config(self.env_kwargs)
            check_code_prompts(self.prompts, self.prompt_field)
        check_library_env(self.env, self.env_kwargs, self.prompts)
        for i, spec in enumerate(self.rewards):
            if isinstance(spec, RewardModelConfig):
                if not math.isfinite(spec.weight):
                    raise ConfigError(f"rollout.rewards[{i}].weight={spec.weight!r}: must be a finite number")
                read_reward_model(f"rollout.rewards[{i}]", spec)
                continue
            if not is_import_path(spec.fn):
                raise ConfigError(
                    f"rollout.rewards[{i}].fn={spec.fn!r}: must be an import path 'package.module:function'"
                )
            check_import_path(f"rollout.rewards[{i}].fn", spec.fn)
            if not math.isfinite(spec.weight):
                raise ConfigError(f"rollout.rewards[{i}].weight={spec.weight!r}: must be a finite number")
        if self.teacher is not None:
            check_teacher(self.teacher)
            if not self.logprobs:
                raise ConfigError(
                    "rollout.logprobs=false with rollout.teacher: the teacher's term is the student's recorded "
                    "log-prob minus the teacher's, so the engine must record it"
                )
            if self.drop_uniform_groups:
                raise ConfigError(
                    "rollout.drop_uniform_groups with rollout.teacher: a group whose rewards tie still carries "
                    "the teacher's per-token signal; dropping it would drop the distillation data"
                )
        if self.reward_on_failure is not None and not math.isfinite(self.reward_on_failure):
            raise ConfigError(f"rollout.reward_on_failure={self.reward_on_failure!r}: must be a finite number or null")
        if self.max_prompt_tokens + self.max_tokens > self.engine_max_model_len:
            raise ConfigError(
                f"rollout.max_prompt_tokens + rollout.max_tokens = {self.max_prompt_tokens + self.max_tokens} "
                f"exceeds rollout.engine_max_model_len={self.engine_max_model_len}"
            )
        return self
