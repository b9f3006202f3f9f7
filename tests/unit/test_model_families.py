"""Model families without an engine: every tiny family writes and loads back, the learner's
weights in the checkpoint format are exactly what save_pretrained writes (tied copies dropped,
fused experts split), and a refused family is refused in one line before anything starts.
The engine side of each family is tests/parity/test_model_matrix.py.

    .venv/bin/python -m pytest tests/unit/test_model_families.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import ConfigError
from asyncrl.learner import hf_format
from asyncrl.rollout import families
from asyncrl.rollout.tiny import ARCHS, write_tiny_model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Every family's tiny model, written once."""
    root = tmp_path_factory.mktemp("families")
    return {arch: write_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_checkpoint_format_is_what_save_pretrained_writes(arch, written):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = written[arch]
    on_disk = load_file(str(path / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # As fsdp.full_state_dict hands it over: every name the module has, tied copies cloned apart.
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    published = hf_format.checkpoint_format(model, state)
    assert sorted(published) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(published[name], tensor), name
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in published) == (not tied)
    engine = hf_format.engine_format(model, state)  # a publish: the tied copy where vLLM reloads it by name
    assert ("lm_head.weight" in engine) == (not tied or model.config.model_type not in hf_format.NO_LM_HEAD)
    assert sorted(set(engine) - set(published)) == (["lm_head.weight"] if tied and arch != "gemma2" else [])
    if arch == "qwen3-moe":  # the module fuses the experts; the checkpoint (and vLLM) has them one by one
        assert any(".mlp.experts.gate_up_proj" in k for k in state)
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in published


def test_the_default_tiny_model_is_the_untied_llama(written):
    config = json.loads((written["llama"] / "config.json").read_text())
    assert (config["model_type"], config["tie_word_embeddings"]) == ("llama", False)
    gemma = json.loads((written["gemma2"] / "config.json").read_text())
    assert gemma["attn_logit_softcapping"] == 5.0 and gemma["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="arch='nope'"):
        write_tiny_model(written["llama"].parent / "x", arch="nope")


def test_every_tiny_family_is_tested_or_refused(written):
    for arch, path in written.items():
        if arch == "olmo2":
            continue
        family = families.check_model(str(path))
        assert family is not None and arch in family.archs, arch
    with pytest.raises(families.ModelRefused, match=r"model_type olmo2\): vLLM 0.32 has no OLMo-2 model"):
        families.check_model(str(written["olmo2"]))


def test_a_refused_family_is_refused_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(families.ModelRefused, match=r"model_type t5\): an encoder-decoder model"):
        families.check_model(str(tmp_path))
    assert families.check_model("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub id is not read
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "somethingnew"}))
    assert families.check_model(str(tmp_path)) is None  # untested: neither refused nor vouched for


def test_a_run_of_a_refused_family_stops_before_anything_starts(written, tmp_path):
    """`asyncrl train` (and `--check`, through families.describe) refuse it in one line."""
    from asyncrl.config import ConfigError, load_config
    from asyncrl.control.train import train

    root = Path(__file__).resolve().parents[2]
    olmo2 = str(written["olmo2"])
    cfg = load_config(root / "configs" / "demo.yaml", [f"rollout.model={olmo2}", f"control.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="model_type olmo2") as refused:
        train(cfg)
    assert isinstance(refused.value, families.ModelRefused) and "\n" not in str(refused.value)
    assert not (tmp_path / "run" / "redis").exists()  # no Redis (nor Ray, started after it) was started
    with pytest.raises(families.ModelRefused):
        families.describe(olmo2)
    assert families.describe(str(written["gemma2"])).startswith("model family: Gemma 2 (tested at parity")
    assert "not checked" in families.describe("Qwen/Qwen2.5-0.5B-Instruct")


def test_a_config_json_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "config.json").write_bytes(b"{not json\xff")
    with pytest.raises(ConfigError, match=r"config\.json: not readable as a JSON object"):
        families.check_model(str(tmp_path))


def test_the_cli_refuses_a_refused_family_in_one_line(written, tmp_path, capsys):
    """`asyncrl train` and `asyncrl train --check` print the reason as one line and exit 2."""
    from asyncrl.cli import main

    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    olmo2 = f"rollout.model={written['olmo2']}"
    for extra in (["--check"], [f"control.run_dir={tmp_path / 'run'}"]):
        assert main(["train", demo, olmo2, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "(model_type olmo2): vLLM 0.32 has no OLMo-2 model" in err, err
    assert not (tmp_path / "run" / "redis").exists()
