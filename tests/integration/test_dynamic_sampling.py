"""DAPO's dynamic sampling at the generator against a real redis-server: a group whose rewards
all tie is dropped instead of put, its admission slot comes back, its prompt is consumed (never
re-issued), and the next prompts are admitted in its place, with the exactly-once ledger intact.

    .venv/bin/python -m pytest tests/integration/test_dynamic_sampling.py -q

The production line is the real one (admission, slots, drop, put); only the rollout is canned:
each prompt's rewards come from its metadata instead of an engine, so which groups tie is known.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from asyncrl.config import Config
from asyncrl.control.ledger import Ledger
from asyncrl.queue import RolloutQueue, RunState
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.groups import GroupMaker
from asyncrl.rollout.production import Production
from asyncrl.rollout.prompts import PromptItem
from asyncrl.types import RolloutGroup, Sample

GEN = "gen-0"


class CannedRollouts(GroupMaker):
    """GroupMaker whose samples' rewards are the prompt's metadata['rewards'] (no engine)."""

    async def make(self, item: PromptItem) -> RolloutGroup:
        await asyncio.sleep(0.01)
        samples = [Sample([5, 6], [-0.5, -0.5], [1, 1], r, 0) for r in item.metadata["rewards"]]
        return RolloutGroup(item.prompt_id, item.prompt_id, item.ids, samples)


class Engine:
    """What the line reads of its engine: the weights version it samples with."""

    version = 0

    async def abort_all(self) -> None:
        return None


class Loaded:
    blocked = None


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_drop_admitted_gives_the_slot_back_once(redis_url):
    rs = RunState.connect(redis_url, "drop-once")
    rs.configure_admission(max_staleness=0, groups_per_step=2)
    before = rs.counters().get("groups_started", 0)
    assert rs.admit_prompt(GEN, "p0", b"note")
    assert rs.counters()["groups_started"] == before + 1
    assert rs.drop_admitted(GEN, "p0")
    assert rs.counters()["groups_started"] == before and rs.inflight_prompts(GEN) == {}
    # A retry (lost reply) or a stop that already released it hands nothing back twice.
    assert rs.admit_prompt(GEN, "p1", b"note")
    assert not rs.drop_admitted(GEN, "p0")
    assert rs.counters()["groups_started"] == 1 and rs.counters()["dropped_uniform"] == 1
    rs.close()


def test_tie_groups_are_dropped_their_slots_reused_and_their_prompts_consumed(redis_url):
    run = "dapo"
    cfg = Config()
    cfg.rollout.drop_uniform_groups = True
    cfg.rollout.max_inflight_groups = 2
    cfg.queue.ledger = True
    q = RolloutQueue.connect(redis_url, run, maxlen=64, ledger=True)
    rs = RunState.of(q)
    rs.configure_admission(max_staleness=0, groups_per_step=2)  # budget: 2 groups at version 0
    rewards = {
        "p0": [0.0, 0.0, 0.0],  # all zero: dropped
        "p1": [1.0, 0.0, 1.0],
        "p2": [1.0, 1.0, 1.0],  # all one: dropped
        "p3": [0.5, 0.5, 0.5],  # all equal: dropped
        "p4": [0.0, 1.0, 0.0],
        "p5": [1.0, 0.0, 0.0],
        "p6": [0.0, 0.0, 1.0],
    }
    prompts = iter([(pid, f"{pid}=", {"rewards": r}) for pid, r in rewards.items()])
    drawn: list[str] = []
    failures: list[str] = []

    def source():
        for pid, text, meta in prompts:
            drawn.append(pid)
            yield pid, text, meta

    env, engine = make_env("copy", {}), Engine()
    line = Production(
        cfg,
        q,
        rs,
        engine,  # type: ignore[arg-type]
        Loaded(),  # type: ignore[arg-type]
        CannedRollouts(cfg, env, None, None, GEN),  # type: ignore[arg-type]
        source(),
        lambda text, meta: [1, 2],
        GEN,
        on_fail=lambda why, e: failures.append(f"{why}: {e}"),
    )

    async def drive() -> None:
        task = asyncio.ensure_future(line.run())
        try:
            # Three drops, each slot given back and refilled: the budget of 2 ends up spent
            # on the two groups with signal, and the next prompt waits for a new version.
            await asyncio.to_thread(wait_until, lambda: rs.counters().get("groups_produced", 0) == 2)
            await asyncio.sleep(0.3)  # had a slot leaked or been counted twice, more would show now
            c = rs.counters()
            assert (c["groups_started"], c["groups_produced"], c["dropped_uniform"]) == (2, 2, 3)
            assert line.counts.dropped_uniform == 3 and line.counts.groups == 2
            assert rs.inflight_prompts(GEN) == {}  # no dropped prompt is left noted for a successor
            assert rs.pop_reissued() is None  # nor queued to run again
            assert sorted(g.group_id for g in q.queued_groups()) == ["p1", "p4"]
            assert drawn == ["p0", "p1", "p2", "p3", "p4", "p5"]  # p5 drawn, waiting for admission
            # The next version's budget admits the next groups: the learner is not starved.
            rs.set_policy_version(1)
            engine.version = 1
            await asyncio.to_thread(wait_until, lambda: rs.counters().get("groups_produced", 0) == 4)
        finally:
            line.halt()
            await line.drain(5.0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(drive())
    assert failures == []
    groups = q.queued_groups()
    assert sorted(g.group_id for g in groups) == ["p1", "p4", "p5", "p6"]
    assert all(np.ptp(g.rewards) > 0 for g in groups)
    counters = rs.counters()
    assert counters["dropped_uniform"] == 3 and counters["groups_started"] == 4
    # The ledger knows only what was put: every produced group is queued, none was lost.
    queued = {g.group_id for g in groups}
    Ledger(produced=q.produced_ids(), trained=[], dropped=q.dropped_ids(), dead_lettered=set(), queued=queued).check()
    assert q.produced_ids() == {"p1", "p4", "p5", "p6"}
    q.close()


def test_a_reissued_prompt_that_does_not_encode_is_skipped_with_the_reason(redis_url, tmp_path):
    """A re-issue entry is read back from Redis: untrusted. One whose metadata the encoder refuses
    (a chat conversation in a run without the chat template, images that do not decode) is
    skipped and counted, never the end of the generator; the next entry runs."""
    import msgpack

    from asyncrl.data.images import IMAGES_KEY, ImageLimits
    from asyncrl.queue import keys
    from asyncrl.rollout.prompts import MESSAGES_KEY, prompt_encoder
    from asyncrl.rollout.tiny import write_tokenizer
    from asyncrl.rollout.vision_prompts import with_images

    run = "reissue-hostile"
    q = RolloutQueue.connect(redis_url, run, maxlen=64)
    rs = RunState.of(q)
    encode = with_images(prompt_encoder(write_tokenizer(tmp_path / "tok"), False), None, ImageLimits())
    cfg = Config()
    env = make_env("copy", {})
    line = Production(
        cfg,
        q,
        rs,
        Engine(),  # type: ignore[arg-type]
        Loaded(),  # type: ignore[arg-type]
        CannedRollouts(cfg, env, None, None, GEN),  # type: ignore[arg-type]
        iter([]),
        encode,
        GEN,
        on_fail=lambda why, e: None,
    )
    entries = [
        ("chat", {MESSAGES_KEY: [{"role": "user", "content": "ab"}]}),  # the run has no chat template
        ("image", {IMAGES_KEY: [b"\x89PNG\r\n\x1a\n garbage"]}),
        ("plain", {"target": "ab"}),
    ]
    for pid, meta in entries:
        entry = {"prompt_id": pid, "text": "ab=", "metadata": meta}
        rs._r.rpush(keys.reissue(run), msgpack.packb(entry, use_bin_type=True))
    assert line._next_prompt() is None and line._next_prompt() is None
    item = line._next_prompt()
    assert item is not None and item.prompt_id == "plain" and item.ids == encode("ab=", {})
    assert line.counts.prompts_skipped == 2 and rs.counters()["prompts_skipped"] == 2
    q.close()
