"""A vision-language run end to end on CPU: the tiny Idefics3 (SmolVLM's architecture) on the colour
task, in a real job (Redis, Ray, a 1-rank FSDP2 learner, a vLLM-CPU generator).

Prompts with images -> the engine with ``multi_modal_data`` -> records carrying the engine's
expanded prompt ids and the images once per group -> the learner's forward with pixel values
rebuilt from those images -> the weights (vision tower, connector and text model) published back
to the engine. On-policy (max_staleness 0), so every step's data was sampled by the weights the
learner holds: the parity gate at v0 and every step's learner-vs-engine log-prob drift say the two
compute the same function, with the images, at every version.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.train import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
STEPS = 3


def test_a_vision_language_run_trains_on_its_images_end_to_end(ray_session, tmp_path):
    from safetensors.torch import load_file

    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    model = write_tiny_idefics3(tmp_path / "idefics3")
    run_dir = tmp_path / "vl"
    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        [
            f"rollout.model={model}",
            "rollout.env=asyncrl.rollout.envs.colour:ColourEnv",
            "rollout.env_kwargs={colours: 'red,blue'}",
            "rollout.chat_template=true",
            "rollout.n_samples=4",
            "rollout.max_tokens=4",
            "rollout.engine_max_model_len=64",
            "rollout.max_prompt_tokens=32",
            "rollout.max_inflight_groups=4",
            "learner.lr=1.0e-2",
            "control.groups_per_step=4",
            f"control.total_steps={STEPS}",
            "control.max_staleness=0",
            "control.checkpoint_every=200",
            f"control.run_dir={run_dir}",
            "control.run_name=vl",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
        ],
    )
    steps: list[dict] = []
    state = train(cfg, on_step=lambda loop, metrics: steps.append(dict(metrics)))
    assert state.step == state.version == STEPS == len(steps)

    summary = json.loads((run_dir / "summary.json").read_text())
    gate = summary["parity_gate"]
    assert gate["passed"] is True and gate["max_abs_diff"] <= 1e-3, gate
    for k, m in enumerate(steps):
        # the data of step k came from the engine at version k (staleness 0): after each publish
        # the engine computes the learner's function, its vision side included
        assert m["drift/logprob_abs_diff_max"] <= 1e-3, (k, m["drift/logprob_abs_diff_max"])
        assert m.get("queue/dead_lettered", 0) == 0 and m.get("vision/refused_samples", 0) == 0, m

    # the update reached the vision tower and the connector, not the text model alone (the
    # final Hugging Face export: the learners' weights, by the names the engine loads)
    before = load_file(str(model / "model.safetensors"))
    after = load_file(str(run_dir / "hf" / "final" / "model.safetensors"))
    assert sorted(after) == sorted(before)
    vision = ["model.vision_model.encoder.layers.0.mlp.fc1.weight", "model.connector.modality_projection.proj.weight"]
    for name in vision:
        assert not after[name].equal(before[name]), name
    # and the export is a vision-language model folder: its processor expands an image as the run's did
    from transformers import AutoProcessor

    assert AutoProcessor.from_pretrained(str(run_dir / "hf" / "final")).image_seq_len == 4
