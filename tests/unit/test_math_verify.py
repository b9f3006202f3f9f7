"""Verified math rewards: hand-picked equivalent and non-equivalent answers through the gsm8k and
math environments (math-verify in its worker process), the time limit, and start-up cost.

.venv/bin/python -m pytest tests/unit/test_math_verify.py -q
"""

from __future__ import annotations

import json
import math
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
        assert env.scorer.processes == 0
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


PATHOLOGICAL = "\\boxed{10^{10^{10}}}"  # sympy spends minutes on it, holding its process's GIL


def test_children_start_on_demand_and_are_reused():
    """One child per comparison running at once: calls one after another share one."""
    env = make_env("math", {"timeout_s": 30})
    try:
        assert env.scorer.processes == 0  # built, nothing started
        for answer in ("2", "3", "\\frac{1}{2}"):
            assert env.reward("q", f"\\boxed{{{answer}}}", {"answer": answer}) == 1.0
        assert env.scorer.started == env.scorer.processes == 1
    finally:
        env.scorer.close()
    assert env.scorer.processes == 0


def test_a_pathological_answer_holds_up_no_other_comparison():
    """While one call is stuck on a pathological answer, others are compared (on another child):
    they finish before it, not after it has timed out."""
    env = make_env("math", {"timeout_s": 60})
    stuck_done = threading.Event()
    got: list = []

    def stuck():
        try:
            env.scorer.check("3", PATHOLOGICAL)
        except Exception as e:  # closed below, or timed out
            got.append(type(e).__name__)
        stuck_done.set()

    t = threading.Thread(target=stuck)
    try:
        t.start()
        time.sleep(1.0)  # the pathological call is underway (its child starting or comparing)
        verdicts = [env.scorer.check(a, f"\\boxed{{{a}}}") for a in ("2", "7", "\\frac{1}{3}")]
        assert all(v.correct for v in verdicts)
        assert not stuck_done.is_set(), f"the correct answers waited for the pathological one ({got})"
    finally:
        env.scorer.close()
        t.join()


def test_every_correct_answer_is_scored_among_pathological_ones():
    """Through the generator's reward threads: pathological answers mixed with correct ones,
    more of them (times math's timeout) than the reward's own timeout allows one after another.
    Each pathological one times out on its own child; every correct one is scored 1.0."""
    import asyncio

    from asyncrl.rollout.scoring import RewardLimits, RewardScorer

    env = make_env("math", {"timeout_s": 4})
    scorer = RewardScorer(env, RewardLimits(timeout_s=20.0, workers=6))
    answers = ["5", "7", "11", "13", "17", "19"]
    responses = [PATHOLOGICAL] * 4 + [f"\\boxed{{{a}}}" for a in answers]  # 4 x 4 s and restarts, one by one: > 20 s
    golds = ["3"] * 4 + answers

    async def run():
        calls = [scorer.score("q", r, {"answer": g}) for r, g in zip(responses, golds, strict=True)]
        return await asyncio.gather(*calls)

    try:
        out = asyncio.run(run())
    finally:
        scorer.close()
        env.scorer.close()
    assert [r for r, _ in out[4:]] == [1.0] * len(answers), out[4:]
    # Killed at math's 4 s (or, on a box too loaded to start their children in time, at the reward's 20 s).
    assert all(math.isnan(r) for r, _ in out[:4]), out[:4]
    assert scorer.timeouts + scorer.errors == 4
