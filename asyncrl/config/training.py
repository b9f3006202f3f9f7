"""The learner (and its LoRA adapters), sync and control sections: what trains, how its weights
reach the engines, and the loop that drives both, each with the rules that involve only its own
fields (rules across sections live on the root, asyncrl.config.tree)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import CREDENTIALS_URL, SECRET, ConfigError, Section, cpu_list, custom_resources, prompt_source


class LoraConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on the learner's model: only they train, sit in the
    optimizer and in checkpoints, and (publish: auto/adapter) travel to the engines."""

    r: int = Field(16, ge=1)
    """Rank of each adapter."""
    alpha: float = Field(32.0, gt=0)
    """Scale numerator: the update is (alpha / r) * B @ A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the training forward only (the engines, and the
    learner's own log-prob passes, run without it; docs/design/lora.md)."""
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
    The log-probs, loss and gradient are the same either way (docs/design/learner.md, "Packed sequences")."""
    mini_batches_per_step: int = Field(1, ge=1)
    """Optimizer steps per trainer step (each bumps the policy version)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    context_parallel: int = Field(1, ge=1)
    """Ranks that share one packed row: each runs the model on 1/context_parallel of it (keys
    and values gathered per block), so a sequence too long for one rank trains. Must divide
    num_ranks; needs packing. Gradients are unchanged (docs/guide/context-parallel.md)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them:
    activation memory drops to about one block's worth plus each block's input, for one more
    forward's compute. Gradients are unchanged (docs/design/learner.md)."""
    lora: LoraConfig | None = None
    """{r, alpha, dropout, target_modules, publish}: train LoRA adapters instead of every
    weight (off when absent); see docs/design/lora.md."""
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

    @model_validator(mode="after")
    def _context_parallel(self) -> LearnerConfig:
        cp = self.context_parallel
        if cp > 1 and self.num_ranks % cp:
            raise ConfigError(
                f"learner.context_parallel={cp} must divide learner.num_ranks={self.num_ranks} "
                "(each group of context_parallel ranks shares one row)"
            )
        if cp > 1 and not self.packing:
            raise ConfigError(
                f"learner.context_parallel={cp} needs learner.packing=true: it splits a micro-batch's packed row"
            )
        return self

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, value: Any) -> Any:
        return custom_resources("learner.resources", value) if isinstance(value, dict) else value

    @field_validator("cpu_affinity")
    @classmethod
    def _affinity(cls, value: str) -> str:
        return cpu_list("learner.cpu_affinity", value)


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
    max_load_failures: int | None = Field(3, ge=1)
    """Publishes in a row that every generator fails to load (a weight name the engine's model
    does not have, an engine that refuses the adapter) after which the trainer checkpoints,
    prints the resume command and fails (WeightsUnloadable). None: no limit by count."""
    load_failure_deadline_s: float | None = Field(300.0, gt=0)
    """The same, by time since the first such publish: the generators retry the announced
    weights on their own meanwhile, and the trainer says every 30 s what fails. None: no limit."""


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
    eval_timeout_s: float = Field(600.0, gt=0, le=7 * 86400)
    """How long an evaluation may take: a held-out prompt not rolled out by then, and a
    generator that has not answered, count as eval/timeouts (one that died: eval/failed), and
    the run goes on."""
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
    parity_gate: Literal["stop", "warn", "off"] = "stop"
    """Before the first optimizer update of every start and resume, the learner scores the first
    batch's tokens sampled with its own current weights (staleness 0) and compares them with the
    engines' log-probs (docs/design/parity-gate.md). stop: fail naming the gap and its
    likely causes; warn: say so and train anyway; off: no check."""
    parity_tolerance: float | None = Field(None, gt=0)
    """Largest |learner - engine| log-prob the gate accepts. None: by the dtype both sides
    compute in (float32 1e-3, float16 3e-2, bfloat16 1e-1)."""
    batch_timeout_s: float = 600.0
    """After this long without a full batch the trainer checks its generators: it waits on
    (saying why, once a minute) while any can run, alive or being restarted, and fails with a
    checkpoint and the resume command when none can."""
    shutdown_grace_s: float = Field(25.0, gt=0, le=86400)
    """After SIGTERM (Slurm, Kubernetes, `kill`) the run finishes or abandons its step,
    checkpoints, stops everything it started, and exits with status 143 within this many
    seconds; past them (or at a second SIGTERM) it exits at once, still stopping what it
    started. 25: inside Kubernetes' default terminationGracePeriodSeconds (30) and Slurm's
    default KillWait (30). See docs/guide/clusters.md."""
    ray_address: Annotated[str | None, CREDENTIALS_URL] = None
    ray_object_store_mb: int = 512
    private_files: bool = True
    """Files and directories the run creates (run dir, Redis AOF, metrics, summary, logs,
    checkpoints, exported and /dev/shm weights) are its user's only, 0600 and 0700: the umask is
    077 while the run is up, and the Redis and Ray it starts inherit it. false: the process's
    umask applies (e.g. for a group that shares run dirs). Objects on an object store
    (a run_dir URL) have no mode bits: who reads them is the bucket's policy."""

    @field_validator("parity_gate", mode="before")
    @classmethod
    def _parity_gate(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @field_validator("eval_prompts")
    @classmethod
    def _eval_prompts(cls, value: str | None) -> str | None:
        return prompt_source("control.eval_prompts", value)
