"""rollout.teacher: on-policy distillation's teacher, a Hugging Face causal LM that scores the
student's own sampled tokens (asyncrl.rollout.teacher serves it as one Ray actor; the learner
turns its log-probs into a per-token reverse-KL advantage, asyncrl.algo.distill).

    rollout:
      teacher: {model: /models/teacher, coef: 1.0, batch_size: 16, num_gpus: 1}

The directory is checked here, at config load and `--check`, from its config.json alone; the
tokenizer's agreement with the student's is checked by the actor when it loads (it needs both
tokenizers, which only the run has resolved).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.base import ConfigError, Section
from asyncrl.config.reward_model import read_model_dir


class TeacherConfig(Section):
    """The teacher of on-policy distillation: its log-prob of each sampled token joins the advantage."""

    model: str
    """A local directory written by save_pretrained: a *ForCausalLM config.json, its weights and
    a tokenizer with the student's vocabulary (a hub model: download it first,
    e.g. `hf download ID --local-dir DIR`)."""
    coef: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    """Weight of the teacher term: A_t += -coef * (logp_student(t) - logp_teacher(t)), beside the
    task reward's advantage (a task reward that is constant makes it pure distillation). At most
    1e6, a reward's own bound: a larger weight overflows the float32 advantages to inf."""
    discount: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    """0: each token's term is its own reverse KL (as on-policy distillation is usually run);
    in (0, 1]: the discounted sum of the KLs from that token to the end of the response."""
    temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    """The temperature the teacher's log-probs are taken at; None: rollout.temperature, the
    one the student's log-probs (engine's and learner's) are taken at."""
    batch_size: int = Field(16, ge=1)
    """Samples per forward pass, gathered from every generator's requests (its logits are
    batch_size x longest sample x vocabulary numbers: lower it for a large vocabulary)."""
    max_wait_ms: float = Field(10.0, ge=0, allow_inf_nan=False)
    """How long a forward pass waits for more requests once it has one (0: run what is there)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_cpus: float = Field(1.0, ge=0, allow_inf_nan=False)
    """Ray CPUs of its actor (also its torch threads)."""
    num_gpus: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Ray GPUs of its actor; > 0 runs the model on CUDA."""
    timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    """Seconds a group's scoring may take (queueing and batching included); past it the group's
    samples fail as a failed reward does (left out of the loss, counted)."""
    max_restarts: int = Field(-1, ge=-1)
    """How often Ray restarts its actor after a crash (-1: always); requests in flight are
    retried on the restarted actor."""


def check_teacher(spec: TeacherConfig) -> str:
    """The teacher's architecture from its config.json; ConfigError naming rollout.teacher otherwise."""
    key = f"rollout.teacher.model={spec.model!r}"
    path, _, architecture = read_model_dir(
        key,
        spec.model,
        "teacher",
        "ForCausalLM",
        "causal language model",
        "a teacher is a *ForCausalLM that scores the student's tokens",
    )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        # Caught here rather than by the actor, which would fail only once Ray, the generators
        # and the learner are up (a download interrupted after config.json).
        raise ConfigError(
            f"{key}: no weights (*.safetensors or pytorch_model*.bin) beside its config.json; "
            f"a teacher is a directory written by save_pretrained"
        )
    return architecture
