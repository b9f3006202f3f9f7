"""The code environment around its sandbox: program extraction, test comparison, the problem
file reader (file:line errors), env_kwargs checked at config load, and the shipped examples
solved by reference programs.

env PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_code_env.py -q
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control.step_metrics import episode_counts
from asyncrl.rollout.envs import RewardError, make_env, score
from asyncrl.rollout.envs.code import extract_program, load_problems, same_output
from asyncrl.rollout.envs.multiturn import EPISODE_COUNTS_KEY
from asyncrl.rollout.scoring import RewardLimits, RewardScorer
from asyncrl.types import RolloutGroup

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = ROOT / "examples" / "code" / "problems.jsonl"
DEMO = ROOT / "configs" / "demo.yaml"


def test_the_program_is_the_last_fenced_block_else_the_whole_text():
    assert extract_program("a\n```python\nprint(1)\n```\nb\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("print(4)") == "print(4)"
    assert extract_program("``` Python3 \nprint(5)\n```") == "print(5)\n"


def test_a_hostile_response_cannot_stall_the_reward_thread():
    """A fence followed by a long run of spaces backtracked quadratically (minutes for a few
    hundred kB): a bound on the whole search, run apart so a stall ends with the test."""
    code = (
        "from asyncrl.rollout.envs.code import extract_program\n"
        "r = '```' + ' ' * 300_000 + 'x'\n"
        "print(len(extract_program(r * 2 + '```\\nprint(1)\\n```')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout == "9\n", out.stderr[-500:]


def test_outputs_compare_up_to_trailing_whitespace():
    assert same_output("1 \n2\n\n", "1\n2")
    assert same_output("a\r\nb\r\n", "a\nb\n")
    assert not same_output("1\n2\n", "1\n3\n")
    assert not same_output(" 1\n", "1\n")


def test_all_or_nothing_and_the_fraction():
    tests = {"tests": [{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "3\n"}]}
    echo = "print(input())"
    assert make_env("code", {"timeout_s": 20}).reward("p", echo, tests) == 0.5
    assert make_env("code", {"timeout_s": 20, "all_or_nothing": True}).reward("p", echo, tests) == 0.0


def test_a_crashing_program_fails_its_tests_but_is_no_violation():
    env = make_env("code", {"timeout_s": 20})
    result = env.check("raise SystemExit(3)", {"tests": [{"input": "", "output": ""}]})
    assert result.verdicts == ["error"] and result.violation is None
    assert env.stats.counts["responses"] == 1


def test_missing_or_bad_tests_fail_the_sample_naming_them():
    env = make_env("code", {"timeout_s": 20})
    with pytest.raises(RewardError, match="metadata 'tests'"):
        score(env, "p", "print(1)", {})
    with pytest.raises(RewardError, match=r"tests'\[0\]"):
        score(env, "p", "print(1)", {"tests": [{"input": 1, "output": "1"}]})


def test_the_example_problems_are_solved_by_reference_programs():
    """Every shipped problem's tests are consistent: a reference solution scores 1."""
    solutions = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "print(input()[::-1])",
        "import math\nprint(math.factorial(int(input())))",
        "n = int(input())\nprint('YES' if n > 1 and all(n % d for d in range(2, n)) else 'NO')",
        "input()\nprint(max(map(int, input().split())))",
        "print(sum(c in 'aeiou' for c in input()))",
        "for i in range(1, int(input()) + 1):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)",
        "a, b = 0, 1\nfor _ in range(int(input())):\n    a, b = b, a + b\nprint(a)",
        "print(' '.join(sorted(input().split())))",
        "s = input().lower()\nprint('YES' if s == s[::-1] else 'NO')",
        "import math\nprint(math.gcd(*map(int, input().split())))",
        "print(sum(map(int, input().strip())))",
        "for i in range(1, int(input()) + 1):\n    print('*' * i)",
        "print(sum(int(x) % 2 == 0 for x in input().split()))",
    ]
    problems = load_problems(PROBLEMS)
    assert len(problems) == len(solutions)
    env = make_env("code", {"timeout_s": 10, "all_or_nothing": True})
    for problem, program in zip(problems, solutions, strict=True):
        assert env.reward(problem["prompt"], f"```python\n{program}\n```", problem) == 1.0, problem["prompt"]


def test_a_malformed_problem_line_is_named_by_file_and_line(tmp_path):
    bad = tmp_path / "problems.jsonl"
    good = json.dumps({"prompt": "p", "tests": [{"input": "", "output": "1"}]})
    bad.write_text(f"{good}\n{{not json\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: not valid JSON"):
        load_problems(bad)
    bad.write_text(f"{good}\n\n{json.dumps({'prompt': 'p', 'tests': [{'input': ''}]})}\n")
    with pytest.raises(ValueError, match=rf"{bad}:3: tests\[0\]"):
        load_problems(bad)


def _code_config(tmp_path, **rollout):
    overrides = [f"rollout.{k}={v}" for k, v in rollout.items()]
    return load_config(DEMO, ["rollout.env=code", *overrides])


def test_env_kwargs_and_the_problem_file_are_checked_at_config_load(tmp_path):
    cfg = _code_config(tmp_path, prompts=PROBLEMS, env_kwargs="{timeout_s: 1, all_or_nothing: true}")
    assert cfg.rollout.env == "code" and cfg.rollout.env_kwargs["all_or_nothing"] is True
    with pytest.raises(ConfigError, match=r"rollout.env_kwargs.timeout_secs: .*\(rollout.env=code\)"):
        _code_config(tmp_path, prompts=PROBLEMS, env_kwargs="{timeout_secs: 1}")
    # values no run could start with (every sample would fail): refused at config load
    for key, value in (("max_open_files", 2_000_000), ("memory_mb", 10**14), ("max_concurrent", 1000)):
        with pytest.raises(ConfigError, match=rf"rollout.env_kwargs.{key}: .*less than or equal"):
            _code_config(tmp_path, prompts=PROBLEMS, env_kwargs=f"{{{key}: {value}}}")
    # a NaN reward would reach the loss; a timeout shorter than starting Python fails every program
    bad = ("{violation_reward: .nan}", "{violation_reward: -.inf}", "{timeout_s: 0.01}", "{hide: [/]}", "{hide: [a]}")
    for kwargs in bad:
        with pytest.raises(ConfigError, match=r"rollout.env_kwargs.(violation_reward|timeout_s|hide): "):
            _code_config(tmp_path, prompts=PROBLEMS, env_kwargs=kwargs)
    with pytest.raises(ConfigError, match=r"rollout.env_kwargs.memory_mb: .*greater than or equal to 32"):
        _code_config(tmp_path, prompts=PROBLEMS, env_kwargs="{memory_mb: 1}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "p", "tests": "not a list"}\n')
    with pytest.raises(ConfigError, match=rf"rollout.prompts: {bad}:1: tests"):
        _code_config(tmp_path, prompts=bad, env_kwargs="{}")
    with pytest.raises(ConfigError, match=r"rollout\.env=code needs rollout\.prompts"):
        _code_config(tmp_path, env_kwargs="{}")


def test_the_reward_s_counts_reach_the_step_metrics():
    """Generators score through reward_with_counts; the trainer sums the counts per step."""
    tests = {"tests": [{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "3\n"}]}

    def judge(timeout_s: float, response: str):
        scorer = RewardScorer(make_env("code", {"timeout_s": timeout_s}), RewardLimits(timeout_s=60, workers=2))
        try:
            return asyncio.run(scorer.judge("p", response, tests))
        finally:
            scorer.close()

    ok = judge(10, "print(input())")
    hung = judge(1, "while True: pass")
    assert ok.reward == 0.5 and ok.counts["code_tests"] == 2 and ok.counts["code_passed"] == 1
    assert hung.reward == 0.0 and hung.counts["code_timeouts"] == 1 and hung.counts["code_violations"] == 1
    assert hung.counts["code_sandbox_ms"] > 0
    totals = {k: ok.counts[k] + hung.counts[k] for k in ok.counts}
    group = RolloutGroup("g", "g", np.zeros(1, np.int32), [], "code", {EPISODE_COUNTS_KEY: totals})
    metrics = episode_counts([group])
    assert metrics["rollout/code_tests"] == 3.0 and metrics["rollout/code_timeouts"] == 1.0
    assert metrics["rollout/code_violations"] == 1.0 and metrics["rollout/code_passed"] == 1.0
