"""`asyncrl train CONFIG --check` resolves what start-up would (weight sync, engine arguments)
without a model download, Redis, Ray or CUDA, so a GPU config is checked on a CPU box up to
where CUDA is needed.

.venv/bin/python -m pytest tests/unit/test_train_check.py -q
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.cli import main

GPU_CONFIG = "configs/gsm8k_qwen2.5_0.5b_gpu.yaml"


def check(capsys, *args: str) -> tuple[int, list[str], str]:
    rc = main(["train", *args, "--check"])
    out, err = capsys.readouterr()
    return rc, [line for line in out.splitlines() if line.startswith("check: ")], err


@pytest.fixture
def gsm_file(tmp_path) -> list[str]:
    """The GPU config's hub dataset as a local file (the check reads it; no network here)."""
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "1+1=", "answer": "#### 2"}\n')
    return [f"rollout.prompts={path}", f"control.eval_prompts={path}"]


def test_the_gpu_config_passes_up_to_cuda_with_nccl_engines(capsys, gsm_file):
    rc, lines, err = check(capsys, GPU_CONFIG, *gsm_file)
    assert rc == 0, err
    assert "check: rollout.env=gsm8k: imported and built" in lines
    assert sum(line.endswith("gsm.jsonl: 1 records read and valid") for line in lines) == 2  # train and eval
    assert "check: weight sync: nccl" in lines
    # the engines a generator builds for a nccl sync take vLLM's nccl weight transfer
    assert "check: engine: Qwen/Qwen2.5-0.5B-Instruct, dtype float32, weight_transfer_config nccl" in lines
    cuda = "(available)" if torch.cuda.is_available() else "(not available on this host: checked up to here)"
    assert lines[-1] == (
        f"check: needs CUDA: sync.backend=nccl, learner.gpus_per_rank=1, rollout.gpus_per_generator=1 {cuda}"
    )


def test_engines_without_the_nccl_transfer_are_refused(capsys, gsm_file):
    rc, _, err = check(
        capsys, GPU_CONFIG, *gsm_file, 'rollout.engine_kwargs={"weight_transfer_config": {"backend": "ipc"}}'
    )
    assert rc == 2 and "sync.backend=nccl needs engines built with vLLM's nccl weight transfer" in err


def test_unknown_engine_kwargs_and_a_missing_sync_dir_are_refused(capsys, tmp_path):
    rc, _, err = check(capsys, "configs/demo.yaml", 'rollout.engine_kwargs={"max_num_seqz": 4}')
    assert rc == 2 and "rollout.engine_kwargs=" in err and "max_num_seqz" in err
    rc, _, err = check(capsys, "configs/demo.yaml", f"sync.shm_dir={tmp_path / 'nope'}")
    assert rc == 2 and "sync.shm_dir=" in err and "not a directory" in err


def test_a_cpu_config_needs_no_cuda(capsys):
    rc, lines, err = check(capsys, "configs/demo.yaml", "sync.backend=shm")
    assert rc == 0, err
    assert lines[0] == "check: rollout.env=copy: imported and built (makes the prompts)"
    assert lines[1] == "check: weight sync: shm" and "weight_transfer_config none" in lines[2]
    assert not any("needs CUDA" in line for line in lines)
