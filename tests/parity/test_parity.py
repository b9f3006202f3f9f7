"""Log-prob parity across the config space: real vLLM-CPU engines, the real FSDP learner, and
`learner.lr=0`, so the policy never moves and every trained token's learner log-prob must equal
the engine's rollout log-prob (float32: max |diff| < 1e-3, every step's mean < 1e-4), every TIS
ratio must be 1 and no mask may fire (tests.support.parity).

    .venv/bin/python -m pytest tests/parity -q

(Heavy: it starts real vLLM-CPU engines; on a small machine run it on its own, not beside
other heavy tests, or start-up and timing-bound steps slow down past their timeouts.)

Five short runs cover the options users set, several at once each (a run costs a start-up,
so the matrix is folded):

| run | covers |
|---|---|
| A | async, top_p 0.9, top_k 20, T 0.7, chat template, mini_batches_per_step 2, inflight recompute, 2 ranks CP=2 |
| B | sync, temperature 1.3, no template, multi-turn step-wise, dropout in the model config, a teacher |
| C | async, multi-turn interleaved, chat template, inflight keep, crash + resume, elastic generator, a critic |
| D | the tools env (tool results in context, some cut by the context), LoRA adapter publishes, async on-policy |
| E | a verifiers env (multi-turn), LoRA with merged publishes, sync mode |

The vision-language variant (Idefics3, images in prompts) is `tests/integration/test_vision_job.py`:
the same rules (`tests.support.parity.parity_of_run`) on the suite's vision job, which shares its
start-up with `bench/vision_job.py --smoke`.

D and E train (lr 1e-2) on-policy instead of running at lr=0: a LoRA adapter starts as the
base model, so at lr=0 an engine without the adapter would pass too (see `LORA` below).

Each test prints the table of every variant run so far and writes it to parity.json under
the session's tmp dir; the table is also printed at the end of the session.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.train import train
from asyncrl.learner import checkpoint
from asyncrl.rundir import CHECKPOINTS_DIR
from tests.support.job import elastic_generator_argv, stop_process_tree
from tests.support.parity import PARITY_OVERRIDES, gate_problems, parity_of_run, read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # past the stall guards below

# Small steps: parity is per token, so a few steps of 8 groups x 4 samples say as much as a long run.
SMALL = ("control.groups_per_step=8", "rollout.n_samples=4", "monitor.console=false", "monitor.dashboard=false")
# A run that has not finished by then is stopped and fails: a guard against a hang, not a speed
# check. A run's steps take seconds, but its start-up (Ray actors, a vLLM engine, the gate) takes
# minutes on a 2-core box that runs another test lane beside it.
STALL_S = 360
COUNTDOWN = ("rollout.env=countdown_chat", "rollout.env_kwargs={start_min: 2, start_max: 6, max_turns: 3}")


def parity_config(tmp_path: Path, name: str, model: str, *overrides: str):
    return load_config(
        ROOT / "configs" / "demo.yaml",
        [
            f"control.run_name={name}",
            f"control.run_dir={tmp_path / name}",
            f"rollout.model={model}",
            "queue.ledger=true",
            *SMALL,
            *PARITY_OVERRIDES,
            *overrides,
        ],
    )


def train_within(seconds: float, cfg, **kwargs):
    """train(cfg, **kwargs), stopped gracefully (as Ctrl-C stops it) if it runs past `seconds`:
    a stalled run (a dead engine, a wait for data that never ends) calls no on_step, so only
    a signal reaches its loop. Returns (state, stalled)."""
    stalled = threading.Event()

    def interrupt() -> None:
        # Only while train's own handler is installed: a SIGINT elsewhere would end the session.
        if type(getattr(signal.getsignal(signal.SIGINT), "__self__", None)).__name__ == "StopFlag":
            stalled.set()
            os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(seconds, interrupt)
    timer.start()
    try:
        return train(cfg, **kwargs), stalled.is_set()
    finally:
        timer.cancel()


def check(parity_report, variant: str, covers: str, run_dir: Path, dtype: str = "float32", starts: int = 1):
    """The parity rules on every step, and the start-up parity gate once per start (``starts``)."""
    result = parity_of_run(variant, run_dir, covers=covers, dtype=dtype)
    parity_report(result)
    assert result.ok, result.why()
    gate = gate_problems(read_metrics(run_dir), starts, dtype=dtype)
    assert not gate, f"variant {variant}: {gate}"
    return result


def run_a(tmp_path: Path, model: str, *extra: str) -> Path:
    """A: the sampling options users set (top_p, top_k, temperature != 1) on chat-templated
    prompts, trained as two mini-batches per step by the async loop, on two learner ranks
    that split every packed row between them (learner.context_parallel=2): the proximal and
    training passes score each token from half a row, with the other half's keys gathered."""
    cfg = parity_config(
        tmp_path,
        "parity-a",
        model,
        "control.mode=async",
        "control.max_staleness=2",
        "control.total_steps=5",
        "control.checkpoint_every=5",
        "rollout.top_p=0.9",
        "rollout.top_k=20",
        "rollout.temperature=0.7",
        "rollout.chat_template=true",
        "learner.mini_batches_per_step=2",
        "learner.num_ranks=2",
        "learner.context_parallel=2",
        "sync.inflight=recompute",
        *extra,
    )
    state, stalled = train_within(STALL_S, cfg)
    # Two optimizer steps (versions) per trainer step.
    assert not stalled and state.step == 5 and state.version == 10, (stalled, state.step, state.version)
    return tmp_path / "parity-a"


def test_parity_async_top_p_top_k_temperature_template_two_minibatches(
    ray_session, tmp_path, chat_model, parity_report
):
    run_a(tmp_path, chat_model)
    covers = "async, top_p 0.9, top_k 20, T 0.7, chat template, m=2, inflight recompute, 2 ranks CP=2"
    check(parity_report, "A", covers, tmp_path / "parity-a")


def run_b(tmp_path: Path, model: str, *extra: str) -> Path:
    """B: the synchronous loop at temperature 1.3, untemplated multi-turn prompts trained step
    by step (one sequence per turn), with a model whose config asks for dropout: the engine
    samples without it, so the learner must score without it too."""
    cfg = parity_config(
        tmp_path,
        "parity-b",
        model,
        *COUNTDOWN,
        "control.mode=sync",
        "control.max_staleness=0",
        "control.total_steps=4",
        "control.checkpoint_every=4",
        "rollout.temperature=1.3",
        "rollout.max_tokens=4",
        "rollout.chat_template=false",
        "algo.stepwise=true",
        "learner.mini_batches_per_step=1",
        "sync.inflight=recompute",
        *extra,
    )
    state, stalled = train_within(STALL_S, cfg)
    assert not stalled and state.step == 4, f"stopped at step {state.step} of 4 (stalled: {stalled})"
    return tmp_path / "parity-b"


def test_parity_sync_temperature_stepwise_multiturn_dropout_model(ray_session, tmp_path, dropout_model, parity_report):
    """B with on-policy distillation switched on: the teacher (rollout.teacher) is the student's
    own model, so its log-prob of each sampled token (no top-k/top-p here, T 1.3 both) is the
    engine's: the teacher term |coef * (rollout logp - teacher logp)| must be ~0 on every
    trained token. A teacher that scored the wrong token (an off-by-one: ~0.09 nats a token
    on this model), at another temperature or with dropout on is far off."""
    coef = 0.1
    run_dir = run_b(tmp_path, dropout_model, f"rollout.teacher={{model: {dropout_model}, coef: {coef}}}")
    covers = "sync, T 1.3, no template, multi-turn step-wise, dropout 0.1 in the model config, teacher"
    check(parity_report, "B", covers, run_dir)
    rows = read_metrics(run_dir)
    per_token = [row.get("teacher/adv_abs_mean") for row in rows]  # coef * mean |diff| per trained token
    assert len(per_token) == 4 and all(d is not None and d / coef < 1e-3 for d in per_token), per_token
    assert all(
        row.get("teacher/kl_mean") is not None and row.get("teacher/missing_samples") is not None for row in rows
    )


class _Crash(RuntimeError):
    """Ends the first leg of run C between two checkpoints, like a crashed trainer."""


def run_c(tmp_path: Path, model: str, *extra: str) -> Path:
    """C: chat-templated multi-turn trajectories trained as one interleaved sequence each, with
    in-flight requests kept across weight updates; the trainer dies one step after its step-3
    checkpoint and resumes from it (the queue redelivers what the dead trainer consumed), then
    an elastic generator joins from another process, knowing only Redis, and its groups train."""
    run_dir = tmp_path / "parity-c"
    cfg = parity_config(
        tmp_path,
        "parity-c",
        model,
        *COUNTDOWN,
        "control.mode=async",
        "control.max_staleness=1",
        "control.total_steps=1000",  # the second leg ends once the elastic generator's groups trained
        "control.checkpoint_every=3",
        "rollout.temperature=1.0",
        "rollout.max_tokens=4",
        "rollout.chat_template=true",
        "algo.stepwise=false",
        "sync.inflight=keep",
        *extra,
    )

    def crash_at_4(loop, metrics):
        if loop.state.step == 4:
            raise _Crash("simulated crash after step 4")

    with pytest.raises(_Crash):
        _, stalled = train_within(STALL_S, cfg, on_step=crash_at_4)
        assert not stalled, "the first leg stalled before its crash at step 4"

    seen: dict = {"first": None, "elastic": None, "elastic_groups": 0, "done_at": None, "loop": None}
    log_path = tmp_path / "elastic.log"

    def on_step(loop, metrics):
        seen["loop"] = loop
        if seen["first"] is None:
            seen["first"] = loop.state.step
            seen["elastic"] = subprocess.Popen(
                elastic_generator_argv(loop.rt.redis_url, "parity-c", "elastic-1", "--max-groups", "3"),
                stdout=log_path.open("w"),
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        seen["elastic_groups"] += sum(g.generator_id == "elastic-1" for g in loop.last_trained)
        left = seen["elastic"].poll() is not None
        if left and seen["elastic_groups"] and seen["done_at"] is None:
            seen["done_at"] = loop.state.step
        if seen["done_at"] is not None and loop.state.step >= seen["done_at"] + 2:
            loop.stop.event.set()

    stalled = True
    try:
        _, stalled = train_within(2 * STALL_S, cfg, resume_dir=run_dir, on_step=on_step)
    finally:
        if seen["elastic"] is not None:
            stop_process_tree(seen["elastic"], signal.SIGTERM, timeout=60)
    elastic_log = log_path.read_text()[-3000:] if log_path.exists() else "(no elastic log)"
    assert not stalled, (
        f"the resumed run stalled or the elastic generator never left: stopped after {2 * STALL_S} s at step "
        f"{seen['loop'].state.step if seen['loop'] else '?'} (engine errors are in Ray's worker logs)\n{elastic_log}"
    )
    assert seen["first"] == 4, f"resumed at step {seen['first']}, not from the step-3 checkpoint"
    assert seen["elastic_groups"] > 0, f"no elastic group trained:\n{elastic_log}"
    return run_dir


def test_parity_multiturn_interleaved_keep_resume_and_elastic_generator(
    ray_session, tmp_path, chat_model, parity_report
):
    """C with a PPO critic: the learner's advantages come from its value model (GAE over the
    policy tokens, observations stepped over), which must not move the policy's log-probs; the
    critic is checkpointed at step 3 and resumed with the run, and reports its metrics."""
    run_dir = run_c(tmp_path, chat_model, "algo.advantage_estimator=gae", "algo.lam=0.95", "algo.critic.enabled=true")
    covers = "async, multi-turn interleaved, chat template, inflight keep, crash+resume at 3, elastic generator, critic"
    check(parity_report, "C", covers, run_dir, starts=2)  # the gate ran again after the resume
    names = ("value_loss", "value_mean", "explained_variance", "clip_frac", "grad_norm")
    for row in read_metrics(run_dir):
        values = [row.get(f"critic/{name}") for name in names]
        assert all(v is not None and math.isfinite(v) for v in values), (row.get("step"), values)
    assert (checkpoint.resolve(run_dir / CHECKPOINTS_DIR) / "critic" / "dcp").is_dir()


# LoRA at lr=0 would prove nothing: PEFT starts every adapter at B = 0, the base model, so an
# engine that ignored the adapter would be at parity too. D and E train their adapters
# (lr 1e-2, an entropy bonus so that even groups of equal rewards give a gradient) on-policy
# (max_staleness 0, one mini-batch): each step's groups were sampled by the version the
# learner scores, so parity holds only if the engine ran the newest adapter (D) or the newest
# merged weights (E) at every version; a stale one is ~1e-2 nats off per token.
LORA = (
    "learner.lr=1.0e-2",
    "algo.entropy_coef=0.01",
    "control.max_staleness=0",
    "learner.mini_batches_per_step=1",
    "control.total_steps=4",
    "control.checkpoint_every=4",
    "rollout.engine_max_model_len=256",
    "rollout.max_tokens=4",
    "rollout.chat_template=true",
)


def lora(publish: str) -> str:
    return (
        "learner.lora={r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj, "
        f"gate_proj, up_proj, down_proj, lm_head], publish: {publish}}}"
    )


def check_lora(parity_report, variant: str, covers: str, run_dir: Path, log_text: str, publish: str):
    """The parity rules, the publish mode the run announced, and an adapter that moved every step."""
    result = check(parity_report, variant, covers, run_dir)
    announced = {"adapter": "the adapter alone", "merged": "the weights with the adapter merged in"}[publish]
    assert f"LoRA: each publish sends {announced}" in log_text
    norms = [row.get("learner/grad_norm") for row in read_metrics(run_dir)]
    assert len(norms) == result.steps == 4 and all(n and n > 0 for n in norms), norms
    return result


TOOLS = {
    "tools": ["asyncrl.rollout.envs.calculator:calculator"],
    "reward": "tests.support.tools:final_number",
    "parser": "tests.support.tools:every_reply_calls",  # every reply calls calculator(TINY_CALL)
    "max_turns": 3,
}


# D's episodes at the context limit: a context (engine_max_model_len 160) that the short prompts'
# three turns fit in (~110 tokens with the tools' system turn) and the long prompt's do not
# (~130 before its first reply, ~25 a turn), so some episodes end at max_turns and the long
# prompt's are cut by the context: scored on their last reply, stop reason "length", counted
# in rollout/context_full, and their tokens at parity like any other.
D_PROMPTS = (
    ("1+1=", 2),
    ("2+2=", 4),
    ("3+4= (add the two numbers up and write only the sum; nothing else is asked of you here)", 7),
)
D_CONTEXT = ("rollout.engine_max_model_len=160", "rollout.max_prompt_tokens=120")


def test_parity_lora_adapter_publish_tool_env(ray_session, tmp_path, tools_model, parity_report, caplog):
    """D: tool episodes (each reply calls the calculator, its result comes back as a tool turn in
    the context, loss mask 0; the long prompt's episodes cut by the context limit) trained as LoRA
    adapters that every publish sends alone; the async loop held on-policy (max_staleness 0)."""
    prompts = tmp_path / "calc.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in D_PROMPTS))
    cfg = parity_config(
        tmp_path,
        "parity-d",
        tools_model,
        *LORA,
        lora("adapter"),
        "control.mode=async",
        f"rollout.prompts={prompts}",
        "rollout.env=tools",
        f"rollout.env_kwargs={json.dumps(TOOLS)}",
        *D_CONTEXT,
    )
    with caplog.at_level("INFO", logger="asyncrl.control.bringup"):
        state, stalled = train_within(STALL_S, cfg)
    assert not stalled and state.step == 4, f"stopped at step {state.step} (stalled: {stalled})"
    rows = read_metrics(tmp_path / "parity-d")
    # Three replies per episode, the first two's calls run and answered (tool turns were in the
    # contexts), unless the context filled first (one or two replies, each call run).
    episodes = cfg.control.groups_per_step * cfg.rollout.n_samples
    cut = [int(r.get("rollout/context_full", -1)) for r in rows]
    calls = [(r.get("rollout/tool_calls"), r.get("rollout/tool_errors")) for r in rows]
    assert all(0 <= c <= episodes for c in cut) and 0 < sum(cut) < 4 * episodes, cut
    assert all(errors == 0 and episodes <= n <= 2 * episodes for n, errors in calls), calls
    assert [n for (n, _), c in zip(calls, cut, strict=True) if c == 0] == [2 * episodes] * cut.count(0), (calls, cut)
    covers = (
        "tools env (3 turns, tool results in context, some cut by the context), LoRA adapter publish, "
        "async staleness 0, lr 1e-2"
    )
    check_lora(parity_report, "D", covers, tmp_path / "parity-d", caplog.text, "adapter")


def test_parity_lora_merged_publish_verifiers_env(ray_session, tmp_path, chat_model, parity_report, caplog):
    """E: a verifiers environment that answers each reply (two turns), trained as LoRA adapters
    published merged into full weights; the synchronous loop."""
    cfg = parity_config(
        tmp_path,
        "parity-e",
        chat_model,
        *LORA,
        lora("merged"),
        "control.mode=sync",
        "rollout.env=verifiers",
        "rollout.env_kwargs={id: tests.support.vf_copy_task, args: {turns: 2}}",  # the taskset's prompts
    )
    with caplog.at_level("INFO", logger="asyncrl.control.bringup"):
        state, stalled = train_within(STALL_S, cfg)
    assert not stalled and state.step == 4, f"stopped at step {state.step} (stalled: {stalled})"
    covers = "verifiers env (2 turns), LoRA merged publish, sync, lr 1e-2 on-policy"
    check_lora(parity_report, "E", covers, tmp_path / "parity-e", caplog.text, "merged")
