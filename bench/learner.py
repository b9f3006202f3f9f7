"""Learner throughput: train tokens/s per rank of the FSDP2 LearnerGroup (on Ray) against a
plain single-process torch loop doing the same work (no FSDP, no Ray), in the same run; and
packed against padded micro-batches on the realistic shape.

    .venv/bin/python bench/learner.py --quick          # both cases, ~2 min on 2 cores
    .venv/bin/python bench/learner.py --ranks 2 --steps 8 --hidden 384
    .venv/bin/python bench/learner.py --quick --case packing
    .venv/bin/python bench/learner.py --smoke          # all three cases on tiny models, one step (the test suite's)

Case `baseline`: both sides run, per optimizer step: the old-logprob pre-pass (no grad),
forward + backward of `microbatch_loss` over micro-batches cut by the same token budget,
clip_grad_norm_, AdamW. The model is a random Llama wide enough (hidden 256+) that per-step
overheads (Ray calls, FSDP all-gathers, collation) do not hide the work. Its batch has equal
lengths, so packing has nothing to remove there. Reported: tokens_per_s (per rank),
baseline_tokens_per_s and ratio (from median step times; steps of the two sides alternate so
load spikes on a shared box hit both), plus the ratio of the fastest steps; the goal at 1
rank is >= 0.9.

Case `packing`: two 1-rank LearnerGroups, `learner.packing` on and off, alternate steps on
one batch of the realistic shape (bench/peers.py's realistic workload: its 32M Llama, 8
samples per prompt, prompts of 8-16 tokens, per-prompt budgets B and, for one prompt in ten
(at least one), 6B; each response runs to its budget with probability 0.3, else stops
uniformly earlier). `--quick`: B = 16, 4 prompts, as peers' --quick; full: B = 128, 16
prompts. Reported under "packing": packed and padded train tokens/s, their ratio (goal >=
1.1) and each side's `learner/padding_frac` (goal < 1% packed).

Case `ac` (not part of `both`; no Ray): `learner.activation_checkpointing` off, then on, each
in a fresh process running the learner's model (one-rank gloo group) forward + backward on one
packed micro-batch of `--seqs` x `--seq-len` tokens (AC_MODEL). Reported under "ac": peak RSS,
the step's share of it (peak - RSS before the first step), their on/off ratios and the
median step-time ratio.

    .venv/bin/python bench/learner.py --case ac

The last line printed is JSON with the cases' figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

# bench/ holds scripts named like stdlib modules (bench/queue.py); drop this script's own
# directory from the import path so `import queue` inside redis/ray finds the stdlib one.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.jsonout import JsonStdout  # noqa: E402


def train_sequence(rng, prompt: int, length: int, total: int, vocab: int, group_id: str, index: int):
    """A random sequence of `length` tokens whose first `prompt` are the prompt, its loss
    weights token_mean over `total` response tokens in the mini-batch."""
    from asyncrl.types import TrainSequence

    m = np.zeros(length, dtype=np.float32)
    m[prompt:] = 1
    return TrainSequence(
        input_ids=rng.integers(4, vocab, length).astype(np.int32),
        loss_mask=m,
        rollout_logprobs=(m * (-4.0 + 0.2 * rng.standard_normal(length))).astype(np.float32),
        advantages=(m * rng.standard_normal()).astype(np.float32),
        reduction_weights=(m / total).astype(np.float32),
        token_versions=np.zeros(length, dtype=np.int32),
        behavior_version=0,
        group_id=group_id,
        sample_index=index,
    )


def make_batch(num_seqs: int, seq_len: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    prompt = 8
    total = num_seqs * (seq_len - prompt)
    return [train_sequence(rng, prompt, seq_len, total, vocab, f"g{i}", i) for i in range(num_seqs)]


def baseline_step(model, optimizer, minibatch, cfg, pad_token_id: int) -> None:
    """The same step as asyncrl.learner without FSDP or Ray: accumulate, clip, AdamW. One
    mini-batch per step, so old logprobs come from the training forward (as in the learner)."""
    import torch

    from asyncrl.data import microbatch as mbatch
    from asyncrl.learner.loss import microbatch_loss

    seqs = [mbatch.seq_fields(s) for s in minibatch]
    plan = mbatch.split_by_token_budget([len(s["input_ids"]) for s in seqs], cfg.learner.micro_batch_tokens)
    mbs = [mbatch.collate([seqs[i] for i in idx], pad_token_id=pad_token_id) for idx in plan]
    temperature = cfg.rollout.temperature
    optimizer.zero_grad(set_to_none=True)
    for mb in mbs:
        loss, _ = microbatch_loss(
            model(input_ids=mb["input_ids"]).logits.float(),
            mb,
            cfg.algo,
            temperature=temperature,
            num_microbatches=len(mbs),
            old_from_current=True,
        )
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip)
    optimizer.step()


def build_baseline(model_dir: str, cfg, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr)
    return model, optimizer, int(model.config.pad_token_id or 0)


def measure(model_dir: str, cfg, batch, *, steps: int, ranks: int, threads: int, progress) -> tuple[float, float, dict]:
    """Alternate one baseline step and one learner step, so load changes on a shared machine
    hit both sides alike; return (learner tokens/s per rank, baseline tokens/s, last metrics)."""
    from asyncrl.learner import LearnerGroup
    from asyncrl.rollout.envs import resolve_env_class

    model, optimizer, pad = build_baseline(model_dir, cfg, threads)
    special = resolve_env_class(cfg.rollout.env).sample_special_tokens
    group = LearnerGroup(cfg, model_dir, num_ranks=ranks, sample_special_tokens=special)
    tokens = sum(s.num_tokens for s in batch)
    task = progress.add_task(f"baseline vs LearnerGroup ({ranks} rank)", total=steps)
    t_base, t_learner = [], []
    last: dict[str, float] = {}
    try:
        baseline_step(model, optimizer, batch, cfg, pad)  # warm-up both sides
        group.train_step([batch])
        for _ in range(steps):
            t0 = time.perf_counter()
            baseline_step(model, optimizer, batch, cfg, pad)
            t1 = time.perf_counter()
            last = group.train_step([batch]).metrics
            t_base.append(t1 - t0)
            t_learner.append(time.perf_counter() - t1)
            progress.advance(task)
    finally:
        group.shutdown()
    # Median step time: robust to the load spikes of a shared CI box; min is the noise floor.
    timing = {
        "learner_step_s_median": float(np.median(t_learner)),
        "learner_step_s_min": min(t_learner),
        "baseline_step_s_median": float(np.median(t_base)),
        "baseline_step_s_min": min(t_base),
    }
    return tokens / np.median(t_learner) / ranks, tokens / np.median(t_base), {**last, **timing}


REALISTIC_MODEL = dict(hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=8, intermediate_size=1408)
REALISTIC_SHAPE = {
    "smoke": dict(prompts=2, budget=8),
    "quick": dict(prompts=4, budget=16),
    "full": dict(prompts=16, budget=128),
}
SMOKE_MODEL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
"""--smoke's model for every case: the bench's code paths, not its figures."""


def realistic_batch(prompts: int, budget: int, vocab: int, seed: int, samples: int = 8, p_full: float = 0.3):
    """A mini-batch of the realistic workload's shape (module docstring); token_mean weights."""
    rng = np.random.default_rng(seed)
    longs = set(rng.choice(prompts, max(1, round(0.1 * prompts)), replace=False).tolist())
    shapes = []
    for p in range(prompts):
        prompt, cap = int(rng.integers(8, 17)), budget * (6 if p in longs else 1)
        for _ in range(samples):
            shapes.append((p, prompt, cap if rng.random() < p_full else int(rng.integers(1, cap))))
    total = sum(r for _, _, r in shapes)
    return [
        train_sequence(rng, prompt, prompt + response, total, vocab, f"p{p}", i % samples)
        for i, (p, prompt, response) in enumerate(shapes)
    ]


def measure_packing(model_dir: str, cfg, batch, *, steps: int, progress) -> dict:
    """Alternate steps of a packed and a padded 1-rank LearnerGroup on the same batch."""
    from asyncrl.learner import LearnerGroup
    from asyncrl.rollout.envs import resolve_env_class

    special = resolve_env_class(cfg.rollout.env).sample_special_tokens
    sides = {}
    for name, packing in (("packed", True), ("padded", False)):
        side_cfg = cfg.model_copy(deep=True)
        side_cfg.learner.packing = packing
        sides[name] = LearnerGroup(side_cfg, model_dir, num_ranks=1, sample_special_tokens=special)
    tokens = sum(s.num_tokens for s in batch)
    times: dict[str, list[float]] = {name: [] for name in sides}
    last: dict[str, dict[str, float]] = {}
    task = progress.add_task("packed vs padded (realistic shape)", total=steps)
    try:
        for group in sides.values():  # warm-up
            group.train_step([batch])
        for _ in range(steps):
            for name, group in sides.items():
                t0 = time.perf_counter()
                last[name] = group.train_step([batch]).metrics
                times[name].append(time.perf_counter() - t0)
            progress.advance(task)
    finally:
        for group in sides.values():
            group.shutdown()
    tps = {name: tokens / float(np.median(t)) for name, t in times.items()}
    return {
        "packed_tokens_per_s": round(tps["packed"], 1),
        "padded_tokens_per_s": round(tps["padded"], 1),
        "ratio": round(tps["packed"] / tps["padded"], 3),
        "ratio_of_min_step_times": round(min(times["padded"]) / min(times["packed"]), 3),
        "padding_frac_packed": round(last["packed"]["learner/padding_frac"], 4),
        "padding_frac_padded": round(last["padded"]["learner/padding_frac"], 4),
        "microbatches_packed": last["packed"]["learner/microbatches"],
        "microbatches_padded": last["padded"]["learner/microbatches"],
        "forward_backward_s": {n: round(last[n]["time/learner_forward_backward"], 3) for n in sides},
        "step_s_median": {n: round(float(np.median(t)), 3) for n, t in times.items()},
        "tokens_per_step": tokens,
        "sequences": len(batch),
    }


def run_packing(args, cfg, tmp: str, progress) -> dict:
    from asyncrl.rollout.tiny import write_tiny_model

    shape = REALISTIC_SHAPE["smoke" if args.smoke else "quick" if args.quick else "full"]
    model = SMOKE_MODEL if args.smoke else REALISTIC_MODEL
    model_dir = str(write_tiny_model(f"{tmp}/realistic", alphabet="abcde", max_position_embeddings=1024, **model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = realistic_batch(shape["prompts"], shape["budget"], vocab, seed=0)
    result = measure_packing(model_dir, cfg, batch, steps=args.steps, progress=progress)
    return {**result, "budget": shape["budget"], "long_budget": 6 * shape["budget"], "prompts": shape["prompts"]}


AC_MODEL = dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=1024)
"""Case `ac`'s model: deep and narrow, so activations (which checkpointing drops) outweigh the
weights and gradients (which it keeps)."""


def ac_child(model_dir: str, checkpointing: bool, *, seqs: int, seq_len: int, steps: int, threads: int) -> dict:
    """One setting of case `ac`, alone in its process (so its peak RSS is its own): the
    learner's model (fsdp.load_sharded_model on a one-rank gloo group) runs forward + backward
    of microbatch_loss over one packed micro-batch, `steps` times. Reports the peak RSS, the
    RSS just before the first step (weights, imports) and the median step time."""
    import resource

    import psutil
    import torch
    import torch.distributed as dist

    from asyncrl.config import Config
    from asyncrl.data import microbatch as mbatch
    from asyncrl.learner import fsdp
    from asyncrl.learner.loss import microbatch_loss
    from asyncrl.learner.step import forward_logits

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = fsdp.build_mesh(torch.device("cpu"), 1)
    model = fsdp.load_sharded_model(
        model_dir, mesh, device=torch.device("cpu"), dtype="float32", activation_checkpointing=checkpointing
    )
    cfg = Config()
    batch = make_batch(seqs, seq_len, model.config.vocab_size, seed=0)
    mb = mbatch.collate_packed([mbatch.seq_fields(s) for s in batch], pad_token_id=0)
    before = psutil.Process().memory_info().rss
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss, _ = microbatch_loss(
            forward_logits(model, mb), mb, cfg.algo, temperature=1.0, num_microbatches=1, old_from_current=True
        )
        loss.backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    dist.destroy_process_group()
    return {"peak_rss": peak, "rss_before_steps": before, "step_s_median": float(np.median(times))}


def run_ac(args) -> dict:
    """Case `ac`: activation checkpointing off, then on, each in a fresh process."""
    import subprocess

    from asyncrl.rollout.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = SMOKE_MODEL if args.smoke else AC_MODEL
        model_dir = str(write_tiny_model(f"{tmp}/ac", max_position_embeddings=args.seq_len, **model))
        sides = {}
        for name, flag in (("off", "0"), ("on", "1")):
            cmd = [sys.executable, os.path.abspath(__file__), "--ac-child", flag, "--model-dir", model_dir]
            cmd += ["--seqs", str(args.seqs), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
            cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            sides[name] = json.loads(out.strip().splitlines()[-1])
    off, on = sides["off"], sides["on"]
    mib = 1024 * 1024
    return {
        "tokens_per_step": args.seqs * args.seq_len,
        "model": model,
        "peak_rss_mib": {k: round(v["peak_rss"] / mib) for k, v in sides.items()},
        "step_peak_mib": {k: round((v["peak_rss"] - v["rss_before_steps"]) / mib) for k, v in sides.items()},
        "peak_ratio": round(on["peak_rss"] / off["peak_rss"], 3),
        "step_peak_ratio": round(
            (on["peak_rss"] - on["rss_before_steps"]) / (off["peak_rss"] - off["rss_before_steps"]), 3
        ),
        "step_time_ratio": round(on["step_s_median"] / off["step_s_median"], 3),
        "step_s_median": {k: round(v["step_s_median"], 3) for k, v in sides.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    with JsonStdout() as out:
        out.result = run(argv)
    return out.result


def run(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small run, ~2 min for both cases")
    parser.add_argument("--smoke", action="store_true", help="every case (ac too), tiny models, 1 step")
    parser.add_argument("--case", choices=("baseline", "packing", "both", "ac"), default="both")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024, help="budget of the baseline case")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads per rank / baseline")
    parser.add_argument("--ac-child", choices=("0", "1"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ac_child is not None:  # one side of case `ac`, in its own process
        kw = dict(seqs=args.seqs, seq_len=args.seq_len, steps=args.steps, threads=args.threads)
        return ac_child(args.model_dir, args.ac_child == "1", **kw)
    if args.quick:
        args.steps, args.seqs, args.layers = 3, 8, 2
    if args.smoke:
        args.steps, args.seqs, args.seq_len, args.hidden, args.layers = 1, 4, 32, 64, 2
    if args.case == "ac":  # no Ray: one process per setting, the learner's model on a gloo group
        return {"ac": run_ac(args)}

    import ray
    from rich.progress import Progress

    from asyncrl.config import Config

    cfg = Config()
    cfg.algo.rollout_kl_coef = 0.1
    cfg.learner.cpus_per_rank = float(args.threads)
    packing_cfg = cfg.model_copy(deep=True)  # the realistic case keeps the default budget (4096)
    cfg.learner.micro_batch_tokens = args.micro_batch_tokens
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(transient=True) as progress:
        ray.init(
            num_cpus=max(args.ranks * args.threads, 2 * args.threads),  # the packing case holds two groups
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=256 * 1024 * 1024,
        )
        try:
            if args.case in ("baseline", "both") or args.smoke:
                result.update(run_baseline(args, cfg, tmp, progress))
            if args.case in ("packing", "both") or args.smoke:
                result["packing"] = run_packing(args, packing_cfg, tmp, progress)
        finally:
            ray.shutdown()
    if args.smoke:
        result["ac"] = run_ac(args)
        result["checks"] = smoke_checks(result)
    return result


def smoke_checks(result: dict) -> dict:
    """What --smoke asserts: each case ran a step, and the packed side computed no pad (one row
    per micro-batch, its attention per sequence: asyncrl.learner.attention)."""
    pk, ac = result["packing"], result["ac"]
    return {
        "baseline_trained": result["tokens_per_s"] > 0 and result["baseline_tokens_per_s"] > 0,
        "packing_trained": pk["packed_tokens_per_s"] > 0 and pk["padded_tokens_per_s"] > 0,
        "packing_pads_nothing": pk["padding_frac_packed"] == 0.0,
        "ac_ran": all(v > 0 for v in ac["peak_rss_mib"].values()),
    }


def run_baseline(args, cfg, tmp: str, progress) -> dict:
    from asyncrl.rollout.tiny import write_tiny_model

    model_dir = str(
        write_tiny_model(
            f"{tmp}/baseline",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=max(1, args.hidden // 128),
            intermediate_size=4 * args.hidden,
        )
    )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = make_batch(args.seqs, args.seq_len, vocab, seed=0)
    tps, baseline, last = measure(
        model_dir, cfg, batch, steps=args.steps, ranks=args.ranks, threads=args.threads, progress=progress
    )
    return {
        "tokens_per_s": round(tps, 1),
        "baseline_tokens_per_s": round(baseline, 1),
        "ratio": round(tps / baseline, 3),
        "ranks": args.ranks,
        "threads_per_rank": args.threads,
        "hidden": args.hidden,
        "layers": args.layers,
        "tokens_per_step": args.seqs * args.seq_len,
        "ratio_of_min_step_times": round(last["baseline_step_s_min"] / last["learner_step_s_min"] / args.ranks, 3),
        "learner_seconds": {
            k.split("/")[-1]: round(v, 4)
            for k, v in last.items()
            if k.startswith("time/learner") or k.endswith(("_median", "_min"))
        },
    }


if __name__ == "__main__":
    main(sys.argv[1:])
