"""Verified math rewards: hand-picked equivalent and non-equivalent answers through the gsm8k and
math environments (math-verify in its worker process), the time limit, and start-up cost.

.venv/bin/python -m pytest tests/unit/test_math_verify.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.rollout.envs import RewardError, make_env, score


@pytest.fixture(scope="module")
def math_env():
    env = make_env("math", {"format_reward": 0.1})
    yield env
    env.scorer.close()


@pytest.fixture(scope="module")
def gsm8k_env():
    env = make_env("gsm8k")
    yield env
    env.scorer.close()


# (reference, response, reward) with format_reward=0.1: 1.0 equal, 0.1 an answer but wrong, 0.0 none.
MATH_CASES = [
    ("\\frac{1}{2}", "The answer is $0.5$.", 1.0),
    ("0.5", "so $\\boxed{\\frac{1}{2}}$", 1.0),
    ("1/2", "Hence \\boxed{\\dfrac12}.", 1.0),
    ("3", "\\boxed{3}", 1.0),
    ("\\boxed{3}", "3", 1.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("1,000", "The answer is 1000.", 1.0),
    ("5", "\\boxed{\\$5}", 1.0),
    ("5", "It costs 5 dollars.", 1.0),
    ("5", "\\boxed{5 \\text{ dollars}}", 1.0),
    ("2", "$x=2$", 1.0),
    ("2", "$\\sqrt{4}$", 1.0),
    ("0.5", "$50\\%$", 1.0),  # math-verify's percent rule: 50% matches 0.5 ...
    ("50", "$50\\%$", 1.0),  # ... and 50
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt3}2}", 1.0),
    ("(x+1)^2", "\\boxed{x^2+2x+1}", 1.0),
    ("(1,2)", "the interval \\boxed{(1, 2)}", 1.0),
    ("A rectangle ... so the area is $\\boxed{12}$.", "\\boxed{12}", 1.0),  # MATH's worked solution
    ("10", "First \\boxed{10}; checking: 12 - 2", 1.0),  # the boxed answer wins over the last number
    ("1/3", "\\boxed{0.33}", 0.1),  # rounded too far
    ("2", "\\boxed{-2}", 0.1),
    ("\\frac{\\pi}{3}", "\\boxed{60^\\circ}", 0.1),  # degrees are not converted
    ("(-1, 3)", "\\boxed{-1 < x < 3}", 0.1),  # an inequality matches an interval only the other way round
    ("-1 < x < 3", "\\boxed{(-1, 3)}", 1.0),
    ("2", "", 0.0),
    ("2", "I do not know.", 0.0),
    ("2", "\\boxed{", 0.0),  # garbage
]


@pytest.mark.parametrize("reference,response,reward", MATH_CASES)
def test_math_env_rewards(math_env, reference, response, reward):
    assert math_env.reward("q", response, {"answer": reference}) == reward


def test_the_example_problems_are_scored(math_env):
    """examples/math/problems.jsonl (the math config's prompts): each reference is readable and
    matches a correct answer written another way, and not a wrong one."""
    correct = ["The sum is $0.75$.", "$x = 6$", "\\boxed{5 \\sqrt 2}", "\\boxed{0.25}", "\\boxed{3, 2}"]
    correct += ["\\boxed{(-1,3)}", "$x^{2}+4x+4$", "\\boxed{\\$34}"]
    records = [json.loads(line) for line in Path("examples/math/problems.jsonl").read_text().splitlines()]
    assert len(records) == len(correct)
    for record, answer in zip(records, correct, strict=True):
        assert math_env.reward(record["problem"], answer, record) == 1.0, (record["answer"], answer)
        assert math_env.reward(record["problem"], "\\boxed{7}", record) == 0.1, record["answer"]


def test_math_env_strict_needs_a_box():
    env = make_env("math", {"strict": True})
    try:
        assert env.reward("q", "The answer is 3.", {"answer": "3"}) == 0.0  # needs no worker
        assert env.scorer._proc is None
        assert env.reward("q", "so \\boxed{3}", {"answer": "3"}) == 1.0
    finally:
        env.scorer.close()


GSM8K_CASES = [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("#### 72", "48 + 24 = 72", 1.0),  # no marker: the last number
    ("#### 1,250", "She pays $1250.", 1.0),
    ("#### 1250", "#### $1,250", 1.0),
    ("#### 72", "so \\boxed{72} clips", 1.0),
    ("#### 72", "72 is wrong, it is\n#### 70", 0.0),  # the marker's answer, not the first number
    ("#### 9", "#### 8", 0.0),
    ("#### 9", "#### nine", 0.0),
]


@pytest.mark.parametrize("reference,response,reward", GSM8K_CASES)
def test_gsm8k_env_rewards(gsm8k_env, reference, response, reward):
    assert gsm8k_env.reward("q", response, {"answer": reference}) == reward


def test_a_bad_time_limit_is_named():
    with pytest.raises(ValueError, match="timeout_s=0: must be a number of seconds > 0"):
        make_env("math", {"timeout_s": 0})


def test_unreadable_reference_and_missing_answer_fail_the_sample(math_env):
    with pytest.raises(RewardError, match=r"math: .*cannot read an answer from the reference"):
        score(math_env, "q", "\\boxed{3}", {"answer": "\\text{}"})
    with pytest.raises(RewardError, match="no 'answer' field"):
        score(math_env, "q", "\\boxed{3}", {})


def test_a_hung_comparison_times_out_without_freezing_the_caller():
    """sympy holds the GIL for minutes on 10^(10^10): in-process, no thread could even run. The
    worker is killed at timeout_s, the sample fails, other threads kept running, and the next call
    gets a fresh worker."""
    env = make_env("math", {"timeout_s": 1})
    try:
        assert env.reward("q", "\\boxed{3}", {"answer": "3"}) == 1.0  # worker up before timing
        ticks, stop = [], threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.05)

        ticker = threading.Thread(target=tick)
        ticker.start()
        start = time.monotonic()
        with pytest.raises(RewardError, match="TimeoutError: math-verify took over 1 s"):
            score(env, "q", "\\boxed{10^{10^{10}}}", {"answer": "3"})
        took = time.monotonic() - start
        stop.set()
        ticker.join()
        assert 1.0 <= took < 5.0, took  # killed at the limit (slack for a loaded box)
        assert len(ticks) >= 5, ticks  # the caller's process was not frozen (~20 ticks a second)
        assert env.reward("q", "\\boxed{3}", {"answer": "3"}) == 1.0
    finally:
        env.scorer.close()


def test_scoring_works_off_the_main_thread(math_env):
    """Generators score from their event-loop thread, where math-verify's signal timeout raises."""
    got: list[float] = []
    worker = threading.Thread(target=lambda: got.append(math_env.reward("q", "$x=2$", {"answer": "2"})))
    worker.start()
    worker.join()
    assert got == [1.0]


def test_building_the_envs_imports_no_sympy():
    """asyncrl train --check builds the environment: it must not pay for sympy (~0.3 s)."""
    code = (
        "import sys; from asyncrl.rollout.envs import make_env; "
        "make_env('math'); make_env('gsm8k', {'strict': True}); "
        "print(sorted(m for m in ('sympy', 'math_verify') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
