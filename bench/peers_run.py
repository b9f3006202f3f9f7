"""bench/peers.py's workloads and runs: the workload shapes, writing a workload's model and
prompt file once, asyncrl's side of a run (in a child process of asyncrl's python) and
launching one trainer's subprocess with its timeout. TRL's side is bench/peers_trl.py; the
figures and ratios are bench/peers_report.py's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-peers"
N_PROMPTS = 2048
# The realistic quick run's reward threshold, fixed before any measured run by a rule: the
# synchronous baseline's rolling reward at the budget in a pilot (asyncrl_sync, seed 0, 150 s:
# -0.112), rounded down to a multiple of 0.05. asyncrl async was not in the pilot (bench/README.md, "Peers").
THRESHOLD_QUICK = -0.15

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
        # Every trainer gets the same wall-clock from launch and stops at its first step past it.
        budget_s=1800.0,
    ),
}
# The controlled-length case: the realistic workload with every completion run to its budget
# (asyncrl: each prompt's own; TRL: its one max_completion_length, the long budget), so the work
# per step is fixed by construction and useful tokens/s is system throughput, not where each
# policy's completion length drifts.
WORKLOADS["realistic_exact"] = dict(WORKLOADS["realistic"], exact=True, budget_s=None)
# The realistic quick shape (2 cores cannot do the full one in minutes). The learned-length case
# runs to a wall-clock budget, twice; the throughput-only cases (demo, controlled length) once,
# the controlled one for 5 steps (4 measured after the first), so --quick stays near half an hour.
QUICK_SHAPE = dict(budget=16, long_budget=96, prompts_per_step=4)
QUICK = {
    "demo": dict(steps=20, repeats=1),
    "realistic": dict(QUICK_SHAPE, budget_s=150.0, threshold=THRESHOLD_QUICK, repeats=2),
    "realistic_exact": dict(QUICK_SHAPE, steps=5, repeats=1),
}
# Under a budget the step count is only a cap, far past what the budget allows (~1 step/s at best here).
STEP_CAP = 5_000
COMMON = dict(
    n_samples=8, temperature=1.0, lr=2e-3, grad_clip=1.0, eps_clip_low=0.2, eps_clip_high=0.28, tis_cap=2.0, seed=0
)


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
        if wl.get("exact"):
            rec["ignore_eos"] = True  # metadata asyncrl's generator reads: run to the budget
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
        "steps": STEP_CAP if wl.get("budget_s") else wl["steps"],
        "prompts_per_step": wl["prompts_per_step"],
        "budget": wl["budget"],
        "max_tokens": max_tokens,
        "max_prompt_tokens": wl["max_prompt_tokens"],
        "max_model_len": wl["max_prompt_tokens"] + max_tokens,
        "threshold": wl["threshold"],
        "budget_s": wl.get("budget_s"),
        # TRL's side of the controlled length: min_new_tokens (HF) / min_tokens (vLLM) = its one budget.
        "min_tokens": max_tokens if wl.get("exact") else None,
        "workdir": str(d),
    }


# ---------------------------------------------------------------- asyncrl side (child process)

# Where an asyncrl step's time goes, per step (docs/design/step-time.md's profiles read these):
# waiting for data, the learner's train (forward+backward, optimizer), publishing the weights,
# the engines' pause + load + resume, and the generators' token rate.
PROFILE = (
    "time/step",
    "time/wait_data",
    "time/train",
    "time/learner_forward_backward",
    "time/learner_optimizer",
    "time/sync",
    "sync/apply_s",
    "throughput/gen_tokens_per_s",
    "learner/train_tokens",
    "staleness/mean",
)
RECORD = ("steps", "rewards", "completions", "tokens", "useful_tokens", "padding", "profile")


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
        "profile": [],
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
        # Entries stay queued until a checkpoint acks them, and there is none before the end: room for them all.
        f"queue.maxlen={max(4096, spec['prompts_per_step'] * (spec['steps'] + 8))}",
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
        result["profile"].append({k: m[k] for k in PROFILE if k in m})
        # A wall-clock budget (from the parent's launch): stop at the first step past it, as TRL's side does.
        if spec.get("budget_s") and time.time() - spec["t0"] >= spec["budget_s"]:
            loop.stop.event.set()

    try:
        train(load_config(ROOT / "configs" / "demo.yaml", overrides), on_step=on_step)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        Path(result_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- running one trainer


def read_result(path: Path) -> dict:
    """A child's result file; {} when there is none or it is not a JSON object (a child killed
    while writing it): the run is then reported failed, the bench goes on."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def run_error(raw: dict, rc: int, spec: dict, error: str | None = None) -> str | None:
    """Why a run failed, None if it did not; `error` is the parent's own (a timeout). A child's
    crash is named by its own error first. Under a wall-clock budget a run ends at its first step
    past it: one that ended before it (without reaching the step cap) did not get the same time
    as the others and is reported; without a budget, a run short of its steps."""
    steps = raw.get("steps") or []
    if error is None and rc != 0:
        error = raw.get("error") or f"exit code {rc}"
    if error is None and spec.get("budget_s"):
        if not steps:
            error = "no step within the budget"
        elif len(steps) < spec["steps"] and steps[-1] - spec["t0"] < spec["budget_s"]:
            error = f"stopped {steps[-1] - spec['t0']:.0f} s after launch, before the {spec['budget_s']:g} s budget"
    if error is None and not spec.get("budget_s") and len(steps) < spec["steps"]:
        error = f"{len(steps)} of {spec['steps']} steps"
    return error


def run_trainer(trainer: str, spec: dict, out: Path, timeout: float, rep: int = 0) -> dict:
    """Launch one trainer's subprocess, wait (at most `timeout`), return its raw result + launch time.
    Each repetition gets its own work dir: an asyncrl run dir left by the first would be resumed."""
    tag = f"{Path(spec['workdir']).name}-{trainer}-run{rep + 1}"
    spec = {
        **spec,
        "backend": "vllm" if trainer == "trl_vllm" else "hf",
        "mode": trainer.split("_")[-1],
        # Each repetition its own seed (sampling, prompt order; the model file stays the same).
        "seed": spec["seed"] + rep,
        "workdir": str(Path(spec["workdir"]) / f"{trainer}-run{rep + 1}"),
    }
    Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
    spec_path, result_path = Path(spec["workdir"]) / "spec.json", Path(spec["workdir"]) / "result.json"
    # The launch time, which a budget counts from, is the children's too (same clock, same box).
    spec["t0"] = time.time()
    spec_path.write_text(json.dumps(spec))
    if trainer.startswith("trl"):
        cmd = [str(VENV / "bin" / "python"), str(ROOT / "bench" / "peers_trl.py"), str(spec_path), str(result_path)]
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--asyncrl-child", str(spec_path), str(result_path)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log_path = out / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = spec["t0"]
    with open(log_path, "w") as logf:
        try:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as e:  # e.g. the peers venv could not be made
            return {
                "t0": t0,
                "seed": spec["seed"],
                "wall_s": 0.0,
                "error": f"could not start {cmd[0]}: {e}",
                "log": str(log_path),
                "steps": [],
                "rewards": [],
                "completions": [],
                "tokens": [],
                "useful_tokens": [],
                "profile": [],
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
    raw = read_result(result_path)
    error = run_error(raw, rc, spec, error)
    if error:
        error += f" (log: {log_path})"
    return {
        "t0": t0,
        "seed": spec["seed"],
        "wall_s": wall,
        "error": error,
        "log": str(log_path),
        **{k: raw.get(k, []) for k in RECORD},
    }
