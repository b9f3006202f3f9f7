"""Staleness study: how learning degrades as the data gets older, and which correction holds it.

    .venv/bin/python bench/staleness.py --quick     # 2 tasks x k 0,1,2,4,8 x 4 corrections x 2 seeds, 60 steps
                                                    # (23.5 min on the shared 2-core box, 2026-11-28)
    .venv/bin/python bench/staleness.py             # the full grid: 3 seeds, 100 steps
    .venv/bin/python bench/staleness.py --smoke     # the code paths in seconds (the test suite's)

For two tasks the project's defaults were not tuned on (`reverse` and `arithmetic`, the
built-in synthetic environments), each cell trains a tiny random Llama for a fixed sample
budget with the data exactly k policy versions old, k in {0, 1, 2, 4, 8} (0: synchronous),
under each correction:

    none        ppo, algo.correction.tis=none             stale data trained as if on-policy
    tis         ppo, token TIS (cap 2): the default        AReaL's decoupled objective: the ratio
                                                           is clipped against the proximal policy
                                                           and exp(proximal - behaviour) weighs it
    tis_geo     tis + algo.correction.geo_mask=true        sequences whose geometric-mean ratio
                                                           leaves 0.99-1.01 are masked
    rollout_is  policy_loss=rollout_is, tis=none           no proximal anchor: the ratio to the
                                                           behaviour policy, tokens outside
                                                           (0.8, 1.2) dropped (its own clip)

At one mini-batch per step (the default, and here) the proximal policy is the current weights,
so the PPO clip of `none`, `tis` and `tis_geo` never acts: their only difference is the
behaviour weight and the mask. At k = 0 every correction is the same objective (all ratios are
1), so one synchronous run per task and seed stands for k = 0 of every row.

The harness (bench/staleness_harness.py) is one process: the trainer's real batch building
and learner rank (FSDP2 on a one-rank gloo group, the loss with its corrections, AdamW), and a
plain torch sampler that samples each step's groups with the weights of exactly k versions
back. A real async run sees a mix of ages up to its max_staleness; exactly k is the worst case
that bound allows. Reported per cell: reward of the current policy on a fixed evaluation set
(every `eval_every` steps and at the end) against samples trained and against a modeled
wall-clock (bench/simulate.py's pipeline with the per-step generation and training times
measured here, generator and learner on their own devices: the sync run pays both, an async
one about the larger; plus an assumed 0.05 s per weight publish on each side),
`drift/abs_logp_diff` (|learner - behaviour| log-prob, per token),
`drift/rollout_kl` (k3) and the masked fraction (`drift/masked_frac`; rollout_is: its dropped
fraction `policy/clip_frac`). Written to --out: staleness.json, staleness.md (the tables),
staleness.png. The last stdout line is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# bench/ holds scripts named like stdlib modules (bench/queue.py): keep this script's own
# directory off the import path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.jsonout import JsonStdout  # noqa: E402
from bench.staleness_report import SAMPLES_PER_GROUP, markdown, plot, summarise  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TASKS: dict[str, dict] = {
    "reverse": {"env": "reverse", "env_kwargs": {"alphabet": "abc", "min_len": 3, "max_len": 3}},
    "arithmetic": {"env": "arithmetic", "env_kwargs": {"max_operand": 4, "ops": "+-"}},
}
CORRECTIONS: dict[str, dict] = {
    "none": {"correction": {"tis": "none"}},
    "tis": {"correction": {"tis": "token", "tis_cap": 2.0}},
    "tis_geo": {"correction": {"tis": "token", "tis_cap": 2.0, "geo_mask": True}},
    "rollout_is": {"policy_loss": {"type": "rollout_is"}, "correction": {"tis": "none"}},
}
SYNC = "sync"
"""The k = 0 run's correction label: every correction is the same objective there (run as tis)."""
MODEL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@dataclass(frozen=True)
class Mode:
    staleness: tuple[int, ...]
    corrections: tuple[str, ...]
    seeds: int
    steps: int
    groups: int
    eval_every: int
    eval_prompts: int


MODES = {
    "smoke": Mode((0, 2), ("tis_geo", "rollout_is"), 1, 3, 2, 3, 4),
    "quick": Mode((0, 1, 2, 4, 8), tuple(CORRECTIONS), 2, 60, 16, 15, 64),
    "full": Mode((0, 1, 2, 4, 8), tuple(CORRECTIONS), 3, 100, 16, 20, 64),
}


@dataclass
class Cell:
    task: str
    staleness: int
    correction: str
    seed: int
    samples: list[int] = field(default_factory=list)
    eval_reward: list[float] = field(default_factory=list)
    train_reward: list[float] = field(default_factory=list)
    abs_logp_diff: list[float] = field(default_factory=list)
    rollout_kl: list[float] = field(default_factory=list)
    masked_frac: list[float] = field(default_factory=list)
    gen_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    final_reward: float = float("nan")
    wall_s: float = 0.0
    ring_checked: bool = False

    @property
    def name(self) -> str:
        return f"{self.task}/k{self.staleness}/{self.correction}/s{self.seed}"


def config(task: str, correction: str, *, steps: int, staleness: int, model_dir: str, seed: int, groups: int):
    from asyncrl.config import Config

    algo = {"advantage_estimator": "grpo", "policy_loss": {"type": "ppo", "eps_clip_low": 0.2, "eps_clip_high": 0.28}}
    algo.update(CORRECTIONS["tis" if correction == SYNC else correction])
    return Config.model_validate(
        {
            "algo": algo,
            "rollout": {
                **TASKS[task],
                "model": model_dir,
                "n_samples": SAMPLES_PER_GROUP,
                "max_tokens": 8,
                "temperature": 1.0,
            },
            "learner": {"lr": 3e-3, "grad_clip": 1.0, "packing": False},
            "control": {"total_steps": steps, "max_staleness": staleness, "seed": seed, "groups_per_step": groups},
        }
    )


def run_cell(cell: Cell, mode: Mode, model_dir: str, threads: int) -> Cell:
    """Train one cell; its curves filled in."""
    import random

    import numpy as np
    import torch

    from asyncrl.rollout.envs import make_env, resolve_env_class
    from bench.staleness_harness import HarnessLearner, Sampler, SnapshotRing

    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    k = cell.staleness
    cfg = config(
        cell.task,
        cell.correction,
        steps=mode.steps,
        staleness=k,
        model_dir=model_dir,
        seed=cell.seed,
        groups=mode.groups,
    )
    special = resolve_env_class(cfg.rollout.env).sample_special_tokens
    env = make_env(cfg.rollout.env, cfg.rollout.env_kwargs)
    learner = HarnessLearner.start(cfg, model_dir, sample_special_tokens=special)
    sampler = Sampler(model_dir, env, cfg.rollout, special)
    ring = SnapshotRing(k + 1)
    ring.put(0, learner.weights())
    rng, gen = random.Random(cell.seed), torch.Generator().manual_seed(cell.seed)
    eval_prompts = sampler.prompts(random.Random(10_000 + cell.seed), mode.eval_prompts)
    eval_gen = torch.Generator()

    def evaluate() -> float:
        eval_gen.manual_seed(20_000 + cell.seed)  # the same draws for every evaluation of a run
        groups = sampler.groups(ring.get(learner.version), eval_prompts, version=learner.version, gen=eval_gen, tag="e")
        return float(np.mean([s.reward for g in groups for s in g.samples]))

    per_step = mode.groups * cfg.rollout.n_samples
    cell.samples.append(0)
    cell.eval_reward.append(evaluate())
    ring_ok = True
    for t in range(mode.steps):
        behaviour = max(0, t - k)  # the first k steps can only be as stale as there are versions
        t0 = time.perf_counter()
        groups = sampler.groups(
            ring.get(behaviour), sampler.prompts(rng, mode.groups), version=behaviour, gen=gen, tag=f"s{t}"
        )
        t1 = time.perf_counter()
        metrics = learner.train(groups)
        ring.put(learner.version, learner.weights())
        cell.train_s.append(time.perf_counter() - t1)
        cell.gen_s.append(t1 - t0)
        ring_ok &= ring.versions[0] == max(0, learner.version - k)
        cell.train_reward.append(metrics["reward/mean"])
        cell.abs_logp_diff.append(metrics.get("drift/abs_logp_diff", float("nan")))
        cell.rollout_kl.append(metrics.get("drift/rollout_kl", float("nan")))
        masked = "policy/clip_frac" if cell.correction == "rollout_is" else "drift/masked_frac"
        cell.masked_frac.append(metrics.get(masked, 0.0))
        if (t + 1) % mode.eval_every == 0 or t + 1 == mode.steps:
            cell.samples.append((t + 1) * per_step)
            cell.eval_reward.append(evaluate())
    cell.final_reward = cell.eval_reward[-1]
    cell.ring_checked = ring_ok
    cell.wall_s = time.perf_counter() - t_start
    return cell


def smoke_checks(cells: list[Cell], summary: dict) -> dict:
    import math

    sync = [c for c in cells if c.staleness == 0]
    stale = [c for c in cells if c.staleness > 0]
    return {
        "every_cell_trained": all(len(c.train_s) > 0 and math.isfinite(c.final_reward) for c in cells),
        # At k = 0 the sampler's log-probs are the learner's: what the engine stand-in must be.
        "sync_logprobs_match_learner": all(max(c.abs_logp_diff) < 1e-4 for c in sync),
        # After the first steps a stale cell's data is off-policy: the learner sees it.
        "stale_cells_are_off_policy": all(c.abs_logp_diff[-1] > 1e-4 for c in stale),
        "ring_held_exactly_k": all(c.ring_checked for c in cells),
        "summary_complete": all(t["corrections"] for t in summary.values()),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every k and correction, 2 seeds, 60 steps (~25 min)")
    p.add_argument("--smoke", action="store_true", help="k 0 and 2, two corrections, 3 steps (seconds)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", type=_positive, help="override the mode's seed count")
    p.add_argument("--steps", type=_positive, help="override the mode's steps per run")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per process")
    p.add_argument("--jobs", type=_positive, default=2, help="cells run at once, one process each")
    p.add_argument("--report-only", action="store_true", help="rebuild the report from --out's cells.jsonl")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "staleness"))
    args = p.parse_args(argv)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.seeds or args.steps:
        mode = Mode(**{**asdict(mode), "seeds": args.seeds or mode.seeds, "steps": args.steps or mode.steps})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with JsonStdout() as stdout:
        if args.report_only:  # the cells a run wrote so far (e.g. one stopped after its first seed)
            cells = read_cells(out / "cells.jsonl", p)
            # The cells' own seeds and steps, not the mode flag's (a --quick run reported
            # without --quick would otherwise be costed at the full grid's 100 steps).
            seeds = len({c.seed for c in cells})
            steps = max(len(c.train_s) for c in cells)
            mode = Mode(**{**asdict(mode), "seeds": seeds, "steps": steps})
            stdout.result = write_report(args, cells, mode, out, time.perf_counter())
        else:
            stdout.result = run(args, mode, out, stdout)
    return stdout.result


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def read_cells(path: Path, parser: argparse.ArgumentParser) -> list[Cell]:
    """The finished cells in `path`; a line that is not a whole cell (a run killed while
    writing it, a hand edit) is skipped and named on stderr, so the rest still report."""
    if not path.exists():
        parser.error(f"--report-only: {path} does not exist (run the study with this --out first)")
    cells = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            cell = Cell(**json.loads(line))
            if not cell.train_s or len(cell.samples) != len(cell.eval_reward):
                raise ValueError("no training steps, or samples and eval_reward of different lengths")
        except (ValueError, TypeError) as e:
            print(f"{path}:{n}: skipped, not a whole cell ({e})", file=sys.stderr)
            continue
        cells.append(cell)
    if not cells:
        parser.error(f"--report-only: {path} holds no whole cell")
    return cells


def drain(futures, report) -> list[BaseException]:
    """Report each cell as it finishes; a cell that fails (its worker raised or died) is
    named on stderr and the others still report. Returns the failures."""
    from concurrent.futures import as_completed

    failures = []
    for future in as_completed(futures):
        try:
            cell = future.result()
        except Exception as e:  # one cell's failure must not lose the others'
            print(f"a cell failed: {type(e).__name__}: {e}", file=sys.stderr)
            failures.append(e)
            continue
        report(cell)
    return failures


def run(args, mode: Mode, out: Path, stdout: JsonStdout) -> dict:
    import tempfile

    from asyncrl.rollout.tiny import write_tiny_model

    # Seed by seed: a run stopped early still holds whole grids (cells.jsonl; --report-only).
    plan = [
        Cell(task, k, corr, seed)
        for seed in range(mode.seeds)
        for task in args.tasks
        for k in mode.staleness
        for corr in ((SYNC,) if k == 0 else mode.corrections)
    ]
    started = time.perf_counter()
    cells: list[Cell] = []

    log = (out / "cells.jsonl").open("w")

    def report(cell: Cell) -> None:
        cells.append(cell)
        log.write(json.dumps(asdict(cell)) + "\n")
        log.flush()
        stdout.line(
            f"[{time.perf_counter() - started:6.0f} s] {len(cells)}/{len(plan)} {cell.name}: "
            f"final reward {cell.final_reward:.3f}, |dlogp| {cell.abs_logp_diff[-1]:.4f}, "
            f"masked {cell.masked_frac[-1]:.2f}, {cell.wall_s:.0f} s"
        )

    with tempfile.TemporaryDirectory() as tmp:
        models = {
            seed: str(write_tiny_model(f"{tmp}/seed{seed}", seed=seed, max_position_embeddings=64, **MODEL))
            for seed in range(mode.seeds)
        }
        work = [(cell, mode, models[cell.seed], args.threads) for cell in plan]
        if args.jobs == 1 or args.smoke:
            for item in work:
                report(run_cell(*item))
        else:  # cells are independent: one per process (each its own one-rank gloo group)
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
                failures = drain([pool.submit(run_cell, *item) for item in work], report)
            if failures:
                log.close()
                raise RuntimeError(
                    f"{len(failures)} of {len(plan)} cells failed (first: {failures[0]!r}); the "
                    f"{len(cells)} that finished are in {out / 'cells.jsonl'} (--report-only reports them)"
                )
    log.close()
    order = [c.name for c in plan]
    cells.sort(key=lambda c: order.index(c.name))
    return write_report(args, cells, mode, out, started)


def write_report(args, cells: list[Cell], mode: Mode, out: Path, started: float) -> dict:
    summary = summarise(cells, mode)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    label = f"{name}, {mode.steps} steps x {mode.groups * SAMPLES_PER_GROUP} samples"
    (out / "staleness.md").write_text(markdown(summary, mode, label))
    (out / "staleness.json").write_text(
        json.dumps({"mode": asdict(mode), "summary": summary, "cells": [asdict(c) for c in cells]})
    )
    plot(cells, summary, mode, out / "staleness.png")
    result = {
        "mode": asdict(mode),
        "runs": len(cells),
        "wall_s": round(time.perf_counter() - started, 1),
        "summary": summary,
        "out": str(out),
    }
    if args.smoke:
        result["checks"] = smoke_checks(cells, summary)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
