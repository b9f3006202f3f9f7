"""Context parallelism (learner.context_parallel): the longest sequence one training step fits
in a per-rank memory cap, and the step-time cost, CP=1 against CP=2.

    .venv/bin/python bench/context_parallel.py                      # lengths 1k..8k, cap 768 MiB
    .venv/bin/python bench/context_parallel.py --lengths 2048 4096 --cap-mib 512
    .venv/bin/python bench/context_parallel.py --smoke              # tiny model, one short length

Every (CP, length) point runs in fresh processes (CP gloo ranks, no Ray): the learner's own
model path (asyncrl.learner.fsdp.shard_model over all ranks, activation checkpointing on, the
varlen SDPA attention) and its own step (asyncrl.learner.step.train_step with the learner's
loss) on one packed micro-batch holding one sequence of that length. Memory is each rank's
peak resident set during the steps minus its resident set just before the first step
(getrusage's ru_maxrss against /proc/self/statm): what the step itself needs, the weights and
the interpreter left out; the figure is the largest over the ranks. Time is the median of the
steps after the first. Reported: per point those figures; per CP the longest length whose
step fits the cap; the CP=2 / CP=1 step-time ratio at each length both ran.

The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncrl.config import AlgoConfig
    from asyncrl.data import microbatch as mbatch
    from asyncrl.learner import fsdp, step
    from asyncrl.learner.context_parallel import ContextParallel
    from asyncrl.learner.loss import Sampling, learner_loss_fn
    from bench.learner import train_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.cp)
    try:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.length,
            attn_implementation=fsdp.attention_implementation(torch.device("cpu"), "float32", None, args.cp),
        )
        model = LlamaForCausalLM(config).train(False)
        mesh = fsdp.build_mesh(torch.device("cpu"), args.cp)
        model = fsdp.shard_model(model, mesh, None, activation_checkpointing=True)
        seq = train_sequence(np.random.default_rng(0), 8, args.length, args.length - 8, args.vocab, "g", 0)
        mb = mbatch.collate_packed([mbatch.seq_fields(seq)], pad_token_id=0)
        mb[mbatch.PADDING_KEY] = False
        sampling = Sampling()
        cp = None
        if args.cp > 1:
            cp = ContextParallel.build(rank=rank, world_size=args.cp, size=args.cp, sampling=sampling)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        loss_fn = learner_loss_fn(AlgoConfig(), sampling, old_from_current=True)
        before = rss_mib()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            step.train_step(model, opt, sched, [dict(mb)], loss_fn, grad_clip=1.0, device=torch.device("cpu"), cp=cp)
            times.append(time.perf_counter() - t0)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"step_mib": peak_mib() - before, "seconds": float(np.median(times[1:] or times))}, f)
    finally:
        dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_rank, args=(args, os.path.join(tmp, "store"), out), nprocs=args.cp, join=True)
        ranks = []
        for r in range(args.cp):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    print(json.dumps({"step_mib": max(r["step_mib"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}))


def point(args: argparse.Namespace, cp: int, length: int) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--cp", str(cp), "--length", str(length)]
    argv += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    argv += ["--steps", str(args.steps)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"cp": cp, "length": length, "error": done.stderr[-2000:]}
    return {"cp": cp, "length": length, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--cap-mib", type=float, default=768.0)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny model at one short length, CP=1 and 2")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.smoke:
        args.lengths, args.hidden, args.layers, args.vocab, args.steps = [63], 32, 2, 128, 2
    points = [point(args, cp, n) for n in args.lengths for cp in (1, 2)]
    for p in points:
        said = "error" if "error" in p else f"step {p['step_mib']:.0f} MiB, {p['seconds']:.2f} s"
        print(f"cp={p['cp']} length={p['length']}: {said}", p.get("error", ""))
    ok = [p for p in points if "error" not in p]
    longest = {
        cp: max([p["length"] for p in ok if p["cp"] == cp and p["step_mib"] <= args.cap_mib], default=None)
        for cp in (1, 2)
    }
    by = {(p["cp"], p["length"]): p for p in ok}
    ratio = {n: by[2, n]["seconds"] / by[1, n]["seconds"] for n in args.lengths if (1, n) in by and (2, n) in by}
    summary = {
        "cap_mib": args.cap_mib,
        "longest_within_cap": longest,
        "step_time_ratio_cp2_over_cp1": ratio,
        "points": points,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
    }
    print(json.dumps(summary))
    if len(ok) != len(points):
        sys.exit(1)


if __name__ == "__main__":
    main()
