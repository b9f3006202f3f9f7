"""The rollout, queue, learner, sync, control and monitor sections, each with the rules that
involve only its own fields (rules across sections live on the root, asyncrl.config.tree)."""

from __future__ import annotations

import ipaddress
import math
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.config.base import (
    CREDENTIALS_URL,
    ENVIRONMENTS,
    SECRET,
    ConfigError,
    Section,
    check_import_path,
    is_import_path,
    one_of,
    prompt_source,
)
from asyncrl.config.base import parse_cpu_list as _parse_cpu_list
from asyncrl.config.envspec import check_library_env, env_mapping
from asyncrl.config.reward_model import RewardModelConfig, read_reward_model
from asyncrl.config.tool_env import TOOLS_ENV, tool_env_config
from asyncrl.infra import redact_url


def _cpu_list(name: str, text: str) -> str:
    try:
        _parse_cpu_list(text)
    except ValueError as e:
        raise ConfigError(f"{name}={e}") from None
    return text


def _custom_resources(name: str, res: dict[str, Any]) -> dict[str, Any]:
    for key, amount in res.items():
        if key in ("CPU", "GPU", "memory") or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(
                f"{name}.{key}={amount!r}: must be a custom resource name with an amount > 0 "
                f"(CPUs and GPUs are set by cpus_per_* / gpus_per_*)"
            )
    return res


def loopback_only(bind: str) -> bool:
    """Whether a Redis ``bind`` line (addresses separated by spaces, each maybe prefixed "-")
    names only loopback addresses. A wildcard, a host name or anything unparsable is not."""
    addresses = [a.removeprefix("-") for a in bind.split()]
    if not addresses:
        return False
    for a in addresses:
        if a == "localhost":
            continue
        try:
            if not ipaddress.ip_address(a).is_loopback:
                return False
        except ValueError:
            return False
    return True


MIN_DASHBOARD_TOKEN = 16


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
    verifiers) or an import path 'package.module:Class'; or a mapping {type: NAME, **env_kwargs}
    (a library's: {type: verifiers, id: module, args: {...}})."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    rewards: list[RewardSpec] = Field(default_factory=list)
    """Reward functions by import path, summed with their weights, in place of the
    environment's own reward (its prompts stay): [{fn: pkg.mod:fn, weight: 1.0}, ...].
    TRL's signature: fn(prompts, completions, **columns) -> list[float | None]; `async def` too.
    An entry {model: DIR, ...} is a sequence-classification reward model (RewardModelConfig)."""
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
        return _custom_resources("rollout.resources", value) if isinstance(value, dict) else value

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity(cls, value: str) -> str:
        return _cpu_list("rollout.cpu_affinity", value)

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
        if self.reward_on_failure is not None and not math.isfinite(self.reward_on_failure):
            raise ConfigError(f"rollout.reward_on_failure={self.reward_on_failure!r}: must be a finite number or null")
        if self.max_prompt_tokens + self.max_tokens > self.engine_max_model_len:
            raise ConfigError(
                f"rollout.max_prompt_tokens + rollout.max_tokens = {self.max_prompt_tokens + self.max_tokens} "
                f"exceeds rollout.engine_max_model_len={self.engine_max_model_len}"
            )
        return self


class QueueConfig(Section):
    """The Redis replay queue; embedded redis-server unless a URL is given."""

    redis_url: Annotated[str | None, CREDENTIALS_URL] = None
    """redis://, rediss:// or unix:// URL; None starts an embedded redis-server on 127.0.0.1."""
    password: Annotated[str | None, SECRET] = None
    """A secret: only the run's config.yaml (0600) holds it; Redis, the dashboard, wandb and
    logs get "<redacted>" (asyncrl.config.secrets). So does a password inside redis_url."""
    maxlen: int = Field(4096, ge=1)
    """Bound on queued groups; put() waits (backpressure) rather than dropping fresh data."""
    put_timeout_s: float = Field(60.0, gt=0)
    """How long one put() waits on a full queue before raising QueueFull; a generator then
    logs a warning and keeps waiting with its finished group (it never drops one)."""
    aof: bool = True
    """Embedded server: append-only persistence so un-acked records survive a restart."""
    max_record_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    bind: str = "127.0.0.1"
    ledger: bool = False
    """Record every produced group id in Redis (asyncrl:{run}:produced) so a run can be
    audited: produced = trained + dropped-stale + dead-lettered + still queued."""
    stale_reissues: int = Field(2, ge=0)
    """How many times a prompt whose group was dropped as too stale is run again (under a new
    id; 0: never). Stale groups are mostly the slow ones, so dropping them for good would
    bias training against long answers and hard prompts."""
    claim_idle_s: float = Field(900.0, gt=0)
    """Another consumer's un-acked entry idle this long is presumed orphaned and claimed;
    keep it above the time between checkpoints (entries stay un-acked until then)."""
    retry_deadline_s: float = Field(30.0, gt=0)
    """How long every Redis call retries (with backoff, a warning per retry) through an outage:
    a server restart or network blip shorter than this is ridden out quietly. A longer outage
    pauses the job (trainer and generators wait, one line a minute) until outage_deadline_s."""
    outage_deadline_s: float | None = Field(None, gt=0)
    """None: wait out any Redis outage. A number (>= retry_deadline_s): after that many seconds
    unreachable the trainer checkpoints, prints the resume command and fails (QueueUnavailable)."""

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"queue.redis_url={redact_url(value)!r}: must start with redis://, rediss:// or unix://")
        return value

    @model_validator(mode="after")
    def _exposed_redis(self) -> QueueConfig:
        # redis-server turns protected mode off under an explicit bind: without a password,
        # anyone who reaches the port can write the queue and files as this user.
        if self.redis_url is None and not loopback_only(self.bind) and not self.password:
            raise ConfigError(
                f"queue.bind={self.bind!r}: binding beyond loopback requires queue.password "
                "(or keep queue.bind=127.0.0.1)"
            )
        return self

    @model_validator(mode="after")
    def _deadlines(self) -> QueueConfig:
        if self.outage_deadline_s is not None and not self.outage_deadline_s >= self.retry_deadline_s:
            raise ConfigError(
                f"queue.outage_deadline_s={self.outage_deadline_s!r}: must be >= queue.retry_deadline_s="
                f"{self.retry_deadline_s:g} (an outage is retried that long first), or null (the default) to wait "
                "out any outage"
            )
        return self


class LoraConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on the learner's model: only they train, sit in the
    optimizer and in checkpoints, and (publish: auto/adapter) travel to the engines."""

    r: int = Field(16, ge=1)
    """Rank of each adapter."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the training forward only (the engines, and the
    learner's own log-prob passes, run without it; docs/design.md, "LoRA")."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the Linear layers that get adapters (PEFT's target_modules), or ["all-linear"]."""
    publish: Literal["auto", "adapter", "merged"] = "auto"
    """What each publish sends: adapter (the adapter alone, vLLM loads it as a LoRA), merged
    (base + adapter as full weights, loaded as today), auto (adapter unless the sync backend
    is nccl, whose transfer moves full weights)."""

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: list[str]) -> list[str]:
        if not value or any(not isinstance(v, str) or not v.strip() for v in value):
            raise ConfigError(f"learner.lora.target_modules={value!r}: must name at least one module")
        return value


class LearnerConfig(Section):
    """FSDP2 learner ranks, optimiser and schedule."""

    num_ranks: int = Field(1, ge=1)
    lr: float = Field(1e-4, ge=0)
    """0 is allowed: the policy then never moves, which parity checks and eval-only runs rely on."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(4096, ge=1)
    """Token budget of one micro-batch: packed, its row's length; padded, rows x longest
    (sequences are never split)."""
    packing: bool = True
    """Pack each micro-batch's sequences into one row, each with its own positions and its
    attention kept inside it, so no pad token is computed; false: right-pad them into rows.
    The log-probs, loss and gradient are the same either way (docs/design.md, "Packed sequences")."""
    mini_batches_per_step: int = Field(1, ge=1)
    """Optimizer steps per trainer step (each bumps the policy version)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them:
    activation memory drops to about one block's worth plus each block's input, for one more
    forward's compute. Gradients are unchanged (docs/design.md, "Activation checkpointing")."""
    lora: LoraConfig | None = None
    """{r, alpha, dropout, target_modules, publish}: train LoRA adapters instead of every
    weight (off when absent); see docs/design.md, "LoRA"."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy for the ranks (one bundle each); see docs/multinode.md."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rank needs, e.g. {train: 1}, to keep ranks on training nodes."""
    seed: int = 0
    """Offset on control.seed for torch/numpy on the learner ranks (asyncrl.seeding)."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """A rank that does not answer a collective in this long fails the step (LearnerError), not a hang."""
    cpu_affinity: str = ""
    """CPU cores for the learner ranks, e.g. "1" ("" = no pinning); see rollout.cpu_affinity."""

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, value: Any) -> Any:
        return _custom_resources("learner.resources", value) if isinstance(value, dict) else value

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity(cls, value: str) -> str:
        return _cpu_list("learner.cpu_affinity", value)


class SyncConfig(Section):
    """Weight sync from learner rank 0 back to the engines."""

    sync_every: int = Field(1, ge=1)
    """Publish weights every this many optimizer steps."""
    backend: Literal["auto", "shm", "nccl", "object_store"] = "auto"
    """auto: nccl with CUDA; else shm when every generator shares the trainer's host, and
    object_store (bytes through Ray's object store, no shared filesystem) when one does not."""
    inflight: Literal["recompute", "keep"] = "recompute"
    """In-flight requests at a sync: recompute with the new weights, or finish on stale KV."""
    shm_dir: str = "/dev/shm"
    publish_deadline_s: float | None = Field(None, gt=0)
    """A publish whose weights cannot be written (shm_dir full, Ray's object store full) is
    retried with backoff, one line a minute saying what is full and how much is needed, while
    the engines keep their weights and admission holds the staleness bound. None: wait for
    space for ever; a number: after that many seconds the trainer checkpoints, prints the
    resume command and fails (WeightsUnwritable)."""


class ControlConfig(Section):
    """The driver loop: staleness, batching, checkpoints, evaluation."""

    mode: Literal["async", "sync"] = "async"
    max_staleness: int = Field(1, ge=0)
    groups_per_step: int = Field(8, ge=1)
    total_steps: int = Field(100, ge=1)
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    """Keep the newest this many complete checkpoints (older ones are deleted after each save)..."""
    keep_every: int = Field(0, ge=0)
    """...plus every checkpoint whose step is a multiple of this (0: none kept for good)."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every this many steps on a held-out prompt set (0: never); logged as eval/*."""
    eval_size: int = Field(32, ge=1)
    """Held-out prompts per evaluation."""
    eval_prompts: str | None = None
    """A prompt source for evaluation (anything rollout.prompts takes); None: the environment makes them."""
    eval_split: str = Field("test", min_length=1)
    """The split of eval_prompts when it is a DatasetDict directory or a hub dataset."""
    eval_temperature: float = Field(0.0, ge=0)
    """0 = greedy."""
    export_every: int = Field(0, ge=0)
    """Write a Hugging Face folder to run_dir/hf/step_N every this many steps (0: only
    run_dir/hf/final, which every run writes when it ends)."""
    run_name: str = "demo"
    run_dir: str = "runs/demo"
    """A local path, or an fsspec URL (s3://bucket/runs/x; gs://... with gcsfs installed):
    checkpoints, metrics.jsonl, summary.json, config.yaml and the Hugging Face exports go
    there, so the nodes of a cluster need no shared filesystem."""
    storage_options: Annotated[dict[str, Any] | None, SECRET] = None
    """For a run_dir URL: the fsspec filesystem's options, e.g. {endpoint_url: ..., key: ...,
    secret: ...} for s3fs. None: its standard credentials (for S3 the AWS_* variables, ~/.aws,
    AWS_ENDPOINT_URL). A secret: redacted everywhere but config.yaml."""
    local_dir: str | None = None
    """For a run_dir URL: the trainer's local directory for what must stay local (the Redis
    AOF, the metrics.jsonl spool, the tiny model, logs). None: ~/.cache/asyncrl/runs/<url path>."""
    seed: int = 0
    """The run's one seed: rollout, learner and the tiny model's initial weights derive from it."""
    batch_timeout_s: float = 600.0
    """After this long without a full batch the trainer checks its generators: it waits on
    (saying why, once a minute) while any can run, alive or being restarted, and fails with a
    checkpoint and the resume command when none can."""
    ray_address: Annotated[str | None, CREDENTIALS_URL] = None
    ray_object_store_mb: int = 512
    private_files: bool = True
    """Files and directories the run creates (run dir, Redis AOF, metrics, summary, logs,
    checkpoints, exported and /dev/shm weights) are its user's only, 0600 and 0700: the umask is
    077 while the run is up, and the Redis and Ray it starts inherit it. false: the process's
    umask applies (e.g. for a group that shares run dirs). Objects on an object store
    (a run_dir URL) have no mode bits: who reads them is the bucket's policy."""

    @field_validator("eval_prompts")
    @classmethod
    def _eval_prompts(cls, value: str | None) -> str | None:
        return prompt_source("control.eval_prompts", value)


class MonitorConfig(Section):
    """Metrics sinks and the thresholds the dashboard alerts on."""

    wandb: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "asyncrl"
    tensorboard: bool = False
    """Also write every step's metrics as TensorBoard scalars under run_dir/tensorboard."""
    console: bool = True
    console_every: int = Field(10, ge=1)
    """Print a metrics line every this many steps (the progress bar updates every step)."""
    verbose: bool = False
    """Stream every Ray worker's output (vLLM engines included) to the console, as Ray does by
    default. Off: it stays in Ray's worker logs, linked from run_dir/logs/ray, and the console
    shows asyncrl's own lines (`asyncrl train --verbose` turns it on)."""
    dashboard: bool = True
    """`asyncrl train` serves the dashboard itself on dashboard_host:dashboard_port. A
    dashboard_token is at least 16 characters, or "generate": a random one, written to
    run_dir/dashboard_token (0600); every request then needs it (?token=, a bearer header,
    or the cookie the first visit sets)."""
    dashboard_port: int = 8470
    dashboard_host: str = "127.0.0.1"
    """Beyond loopback it needs dashboard_token."""
    dashboard_token: Annotated[str | None, SECRET] = None
    """A secret, kept like queue.password."""
    alert_rollout_kl: float = 0.05
    alert_masked_frac: float = 0.2
    alert_staleness_frac: float = 1.0
    """Alert when max staleness reaches this fraction of max_staleness."""
    alert_logprob_diff_max: float = Field(0.5, gt=0)
    """Alert when drift/logprob_abs_diff_max (max over a step's loss tokens of |learner old
    logprob - engine logprob|, nats) exceeds this on a step that trained only fresh data
    (staleness/max = 0, as every sync-mode step): the learner then holds the very weights that
    sampled, so the gap is float noise (~1e-6 in float32, ~0.1 in bf16) unless a sampling
    setting, a token mask or the weights differ. 0.5 nats is a factor of 1.65 in probability.
    Steps with stale tokens are not judged: the policy's own updates move single tokens by
    several nats there (the demo at lr 1e-3, staleness <= 2: median 0.27, max 3.3)."""

    @model_validator(mode="after")
    def _exposed_dashboard(self) -> MonitorConfig:
        if self.dashboard_host not in ("127.0.0.1", "localhost", "::1") and not self.dashboard_token:
            raise ConfigError(
                f"monitor.dashboard_host={self.dashboard_host!r}: binding beyond loopback requires "
                f"monitor.dashboard_token"
            )
        token = self.dashboard_token
        if token is not None and token != "generate" and len(token) < MIN_DASHBOARD_TOKEN:
            raise ConfigError(
                f"monitor.dashboard_token: {len(token)} characters; give at least {MIN_DASHBOARD_TOKEN}, "
                "or 'generate' for a random one written to the run directory"
            )
        return self
