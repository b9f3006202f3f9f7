"""A publish of a vision-language model (Idefics3, SmolVLM's architecture) loads into vLLM's own
Idefics3 module: every parameter of the engine's model (vision tower, connector, text model,
lm_head) is written, with the learner's values, through vLLM's ``load_weights`` (its weight
mappers and stacked q/k/v, gate/up parameters), the code an engine's weight reload runs. No
engine: the module is built on the CPU in a subprocess (vLLM's model-parallel state is
process-global), from the tiny model's config.

    .venv/bin/python -m pytest tests/unit/test_vision_weight_names.py -q    # about 30 s
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused parameters, from the checkpoint's (concatenated along the output dimension)."""


def sources(name: str) -> list[str]:
    """The published names a vLLM parameter is made of."""
    for fused, parts in STACKED.items():
        if f".{fused}." in name:
            return [name.replace(f".{fused}.", f".{part}.") for part in parts]
    return [name]


def subprocess_env() -> dict[str, str]:
    """This process's environment, less the model-runner choice an earlier test's engine
    arguments may have left in it (routing replay asks for vLLM's V2 runner, which the CPU
    install refuses), with the repository on the path."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])
    return env


def test_a_publish_writes_every_parameter_of_vllms_idefics3(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from asyncrl.learner import hf_format
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    engine_dir = write_tiny_idefics3(tmp_path / "engine", seed=0)
    trained = AutoModelForImageTextToText.from_pretrained(str(write_tiny_idefics3(tmp_path / "new", seed=1)))
    sent = hf_format.engine_format(trained, dict(trained.state_dict()))
    save_file({k: v.contiguous() for k, v in sent.items()}, str(tmp_path / "publish.safetensors"))

    out = tmp_path / "vllm.pt"
    run = subprocess.run(
        [sys.executable, __file__, str(engine_dir), str(tmp_path / "publish.safetensors"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(out)
    assert got["unloaded"] == []
    used = set()
    for name, value in got["params"].items():
        want = torch.cat([sent[s] for s in sources(name)])
        # vLLM pads the vocabulary rows (embeddings, lm_head) to a multiple of 64 with zeros.
        assert torch.equal(value[: len(want)], want) and not value[len(want) :].any(), name
        used.update(sources(name))
    assert used == set(sent)  # nothing published that the engine has no place for
    assert any(n.startswith("model.vision_model.encoder.") and "qkv_proj" in n for n in got["params"])
    assert "model.connector.modality_projection.proj.weight" in got["params"]


def _load_into_vllm(model_dir: str, weights: str, out: str) -> None:
    """Build vLLM's Idefics3 from `model_dir`'s config on the CPU, load `weights` through its
    load_weights, save every parameter."""
    from safetensors.torch import load_file
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.idefics3 import Idefics3ForConditionalGeneration

    from asyncrl.infra import free_port

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256),
        device_config=DeviceConfig("cpu"),
    )
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        with torch.device("cpu"):
            model = Idefics3ForConditionalGeneration(vllm_config=config)
        loaded = model.load_weights(load_file(weights).items())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": params, "unloaded": sorted(set(params) - set(loaded))}, out)


if __name__ == "__main__":
    _load_into_vllm(*sys.argv[1:4])


def test_an_export_carries_the_base_models_processor_files(tmp_path):
    """The exported folder expands images as the run did: the base model's processor files are
    copied, the legacy chat_template.json of older checkpoints (SmolVLM's) included."""
    import json
    import shutil

    from asyncrl.control.export import _assemble
    from asyncrl.rollout.tiny_vl import write_tiny_idefics3

    base = write_tiny_idefics3(tmp_path / "base")
    legacy = {"chat_template": "{% for m in messages %}<image>{% endfor %}"}
    (base / "chat_template.json").write_text(json.dumps(legacy))
    out = _assemble(tmp_path / "hf", str(base), lambda file: shutil.copyfile(base / "model.safetensors", file))
    for name in ("processor_config.json", "chat_template.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert json.loads((out / "processor_config.json").read_text())["image_seq_len"] == 4
