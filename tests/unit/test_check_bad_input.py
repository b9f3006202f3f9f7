"""`asyncrl train --check` imports every import path the config names and reads every prompt
source through, so what a run would find only inside a generator or a learner is one line
here, before Redis, Ray or an engine starts.

    .venv/bin/python -m pytest tests/unit/test_check_bad_input.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = {
    "exploding_rewards.py": "raise RuntimeError('reward module exploded at import')\n",
    "user_code.py": "def exact(prompts, completions, **columns):\n    return [1.0]\n",
}


@pytest.mark.parametrize(
    ("override", "culprit"),
    [
        (
            "rollout.rewards=[{fn: exploding_rewards:exact}]",
            "rollout.rewards[0].fn: reward function 'exploding_rewards:exact': cannot import module "
            "'exploding_rewards': RuntimeError: reward module exploded at import",
        ),
        (
            "rollout.rewards=[{fn: user_code:missing}]",
            "rollout.rewards[0].fn: reward function 'user_code:missing': module 'user_code' has no attribute 'missing'",
        ),
        (
            "algo.policy_loss={type: user_code:no_loss}",
            "policy loss 'user_code:no_loss': module 'user_code' has no callable 'no_loss'",
        ),
        ("rollout.prompts={prompts}", "rollout.prompts: {prompts}:2: expected a JSON object (a record), got null"),
    ],
    ids=["reward-module-raises", "reward-function-missing", "custom-loss-missing", "malformed-prompt-file"],
)
def test_check_fails_in_one_line_naming_the_culprit(tmp_path, override, culprit):
    for name, code in USER_CODE.items():
        (tmp_path / name).write_text(code)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab="}\nnull\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "train",
        "configs/demo.yaml",
        "--check",
        override.replace("{prompts}", str(prompts)),
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"asyncrl train: config error: {culprit.replace('{prompts}', str(prompts))}"
    ]


def test_check_builds_the_environment_and_draws_a_prompt(tmp_path, monkeypatch, capsys):
    from asyncrl.cli import main

    (tmp_path / "fragile_env.py").write_text(
        "from asyncrl.rollout.envs.synthetic import CopyEnv\n\n"
        "class Fragile(CopyEnv):\n"
        "    def __init__(self, **kwargs):\n"
        "        raise RuntimeError('needs a GPU')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "configs/demo.yaml", "--check", "rollout.env=fragile_env:Fragile"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "asyncrl train: config error: rollout.env='fragile_env:Fragile': building it or drawing a prompt raised "
        "RuntimeError: needs a GPU\n"
    )
    # gsm8k reads its prompts from a dataset: without rollout.prompts a generator would fail at its first draw
    assert main(["train", "configs/demo.yaml", "--check", "rollout.env=gsm8k", "rollout.env_kwargs={}"]) == 2
    assert "GSM8KEnv does not make prompts; set rollout.prompts" in capsys.readouterr().err


def test_a_passing_check_prints_no_third_party_noise():
    """vLLM's INFO lines (its Triton probing on a CPU host) stay out of --check's output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "configs/demo.yaml", "--check"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "check: weight sync: " in out.stdout
    assert "vllm" not in out.stderr and "Triton" not in out.stderr, out.stderr[-2000:]
