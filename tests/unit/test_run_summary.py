"""The end-of-run summary says what metrics.jsonl says, and where everything is."""

from __future__ import annotations

from pathlib import Path

from asyncrl.control.summary import run_summary


def rows(n: int):
    return [
        {
            "step": s,
            "reward/mean": s / 10,
            "response/length_mean": 8.0 - s / 10,
            "staleness/mean": 1.0,
            "staleness/max": 2.0 if s == 7 else 1.0,
            "time/wait_data": 0.5,
            "time/train": 0.25,
            "time/sync": 0.125,
        }
        for s in range(1, n + 1)
    ]


def test_summary_of_a_finished_run():
    text = run_summary(
        rows(20),
        startup_s=30.0,
        wall_s=45.25,
        counters={"groups_produced": 330, "groups_trained": 320, "dropped_stale": 6, "dead_lettered": 1},
        max_staleness=2,
        status="finished",
        metrics=Path("/r/metrics.jsonl"),
        checkpoint=Path("/r/checkpoints/step_000020"),
        hf_dir=Path("/r/hf/final"),
        resume_cmd="asyncrl train --resume /r",
        dashboard_cmd="asyncrl dashboard /r",
    )
    lines = text.splitlines()
    # 20 steps x (0.5 + 0.25 + 0.125) s; reward: mean of steps 1-10 = 0.55, of 11-20 = 1.55.
    assert lines[0] == (
        "run finished: 20 steps in 45.2 s (start-up 30.0 s, waiting for data 10.0 s, training 5.0 s, weight sync 2.5 s)"
    )
    assert "0.550 (first 10 steps) -> 1.550 (last 10)" in lines[1]
    assert "7.5 -> 6.5 tokens" in lines[2]
    assert "mean 1.00, max 2 (bound 2)" in lines[3]
    assert "produced 330, trained 320, dropped as stale 6, dead-lettered 1" in lines[4]
    assert "/r/checkpoints/step_000020" in text and "/r/hf/final" in text and "/r/metrics.jsonl" in text
    assert lines[-1].endswith("asyncrl train --resume /r")
    # The live URL dies with the process as the summary is printed: only the finished run's command.
    assert "http://" not in text and "while this process runs" not in text
    assert lines[-2] == "  dashboard       asyncrl dashboard /r   (this finished run's charts, from the run dir)"


def test_summary_of_a_run_stopped_before_its_first_step():
    text = run_summary(
        [],
        startup_s=12.0,
        wall_s=13.0,
        counters={},
        max_staleness=0,
        status="stopped",
        metrics=Path("/r/metrics.jsonl"),
        checkpoint=None,
        hf_dir=None,
        resume_cmd="asyncrl train --resume /r",
    )
    assert text.splitlines()[0].startswith("run stopped: 0 steps in 13.0 s")
    assert "reward          - (first 0 steps) -> - (last 0)" in text
    assert "checkpoint      -" in text and "dashboard" not in text


def test_summary_file_is_replaced_whole(tmp_path):
    import json

    from asyncrl.control.summary import SUMMARY_FILE, write_summary_file

    write_summary_file(tmp_path, {"status": "stopped", "step": 5})
    path = write_summary_file(tmp_path, {"status": "finished", "step": 9, "wall_s": 1.5})
    assert path == tmp_path / SUMMARY_FILE
    assert json.loads(path.read_text()) == {"status": "finished", "step": 9, "wall_s": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == [SUMMARY_FILE]  # no temp file left


def test_summary_shows_response_length_against_the_tasks_target():
    """The demo's length must visibly approach "3 characters + EOS" (and padding show up)."""
    from asyncrl.config import load_config
    from asyncrl.rollout.envs.reward_fns import task_target_length

    demo = load_config("configs/demo.yaml")
    target = task_target_length(demo.rollout)
    assert target == 3.0  # copy, min_len = max_len = 3
    kwargs = dict(
        startup_s=1.0,
        wall_s=2.0,
        counters={},
        max_staleness=2,
        status="finished",
        metrics=Path("/r/metrics.jsonl"),
        checkpoint=None,
        hf_dir=None,
        resume_cmd="asyncrl train --resume /r",
    )
    line = run_summary(rows(20), target_length=target, **kwargs).splitlines()[2]
    assert line == "  response length 7.5 -> 6.5 tokens (a correct answer: 3 characters + EOS)"
    # unknown target (a prompt file, reward functions, gsm8k): the line stays as it was
    demo.rollout.prompts = "prompts.jsonl"
    assert task_target_length(demo.rollout) is None
    assert run_summary(rows(20), **kwargs).splitlines()[2] == "  response length 7.5 -> 6.5 tokens"


def test_summary_says_what_became_of_stale_groups():
    counters = {"groups_produced": 40, "groups_trained": 32, "dropped_stale": 5, "stale_reissued": 4}
    counters |= {"stale_abandoned": 1, "dropped_samples": 10, "dropped_response_tokens": 120}
    counters |= {"trained_samples": 64, "trained_response_tokens": 256}
    common = dict(startup_s=1.0, wall_s=2.0, max_staleness=2, status="finished", metrics=Path("/r/m.jsonl"))
    common |= dict(checkpoint=None, hf_dir=None, resume_cmd="asyncrl train --resume /r")
    text = run_summary(rows(3), counters=counters, **common)
    assert "  stale prompts   re-issued 4, given up 1; response length dropped 12.0 vs trained 4.0 tokens" in text
    assert "stale prompts" not in run_summary(rows(3), counters={"groups_trained": 32}, **common)
