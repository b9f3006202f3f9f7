"""Weight files are written through a private temp file: created O_EXCL, mode 0600, under a
name nobody can guess, then renamed. /dev/shm is world-writable: at the old predictable name
(`{path}.tmp-{pid}`) another user could plant a symlink and have the trainer write through it.
"""

from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import load_file

from asyncrl.learner.actor import LearnerActor
from asyncrl.sync.shm import save_state_dict, temp_beside


def _plant(path: str, victim) -> str:
    """A symlink at the name the writers used to pick, pointing at a file of the victim's."""
    victim.write_text("do not touch")
    planted = f"{path}.tmp-{os.getpid()}"
    os.symlink(victim, planted)
    return planted


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_temp_beside_is_private_and_unpredictable(tmp_path):
    path = str(tmp_path / "asyncrl-run-v1.safetensors")
    (fd1, a), (fd2, b) = temp_beside(path), temp_beside(path)
    os.close(fd1)
    os.close(fd2)
    assert a != b and os.path.dirname(a) == str(tmp_path)  # same filesystem: the rename is atomic
    assert os.path.basename(a).startswith("asyncrl-run-v1.safetensors.tmp-")
    assert _mode(a) == 0o600 and not os.path.islink(a)


def test_shm_writer_ignores_a_planted_symlink_and_writes_0600(tmp_path):
    path = str(tmp_path / "asyncrl-run-v1.safetensors")
    victim = tmp_path / "victim"
    planted = _plant(path, victim)
    save_state_dict({"w": torch.arange(4, dtype=torch.float32)}, path)
    assert victim.read_text() == "do not touch" and os.path.islink(planted)
    assert _mode(path) == 0o600 and not os.path.islink(path)
    assert load_file(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", os.path.basename(planted), os.path.basename(path)])


def test_learner_writer_ignores_a_planted_symlink_and_writes_0600(tmp_path):
    # Rank 0's write path alone, on an unsharded model (no process group needed for one rank).
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    actor = LearnerActor.__new__(LearnerActor)
    actor.rank, actor.version, actor.model = 0, 7, LlamaForCausalLM(config)
    path = str(tmp_path / "asyncrl-run-v7.safetensors")
    victim = tmp_path / "victim"
    planted = _plant(path, victim)
    assert actor.write_weights(path) == 7
    assert victim.read_text() == "do not touch" and os.path.islink(planted)
    assert _mode(path) == 0o600
    assert load_file(path)["lm_head.weight"].shape == (8, 4)
    assert len(os.listdir(tmp_path)) == 3  # no temp file left behind
