"""Records checked against the run at intake: each breach of the contract is named by its
reason, dead-lettered (never handed out), counted, logged once per reason; the admission of
only the entries a generator admitted is given back."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from asyncrl.data.codec import RecordError, decode_group, encode_group
from asyncrl.data.contract import LOGPROB_TOLERANCE, RecordContract, check_group
from asyncrl.queue import keys
from asyncrl.queue.intake import DEADLETTER_KEEP_BYTES, sort_entries
from asyncrl.types import MAX_ABS_REWARD, RolloutGroup, Sample

CONTRACT = RecordContract(vocab_size=16, max_len=12, group_size=2, stepwise=False, max_version=5)


def _group(gid: str = "g", n: int = 2, length: int = 4, version: int = 3, **sample_kw) -> RolloutGroup:
    samples = [
        Sample([3] * length, [-0.5] * length, [1] * length, 1.0, version, generator_id="gen-0", **sample_kw)
        for _ in range(n)
    ]
    return RolloutGroup(gid, gid, [1, 2, 3], samples, env="copy")


def _broken(how: str) -> RolloutGroup:
    g = _group()
    s = g.samples[1]
    if how == "token_out_of_range":
        s.response_ids[2] = 10**6  # what a generator with another tokenizer sends
    elif how == "negative_token":
        g.prompt_ids[0] = -1
    elif how == "own_prompt_out_of_range":
        s.prompt_ids = np.array([1, 16], np.int32)
    elif how == "too_long":
        g.prompt_ids = np.arange(10, dtype=np.int32)  # 10 + 4 > 12
    elif how == "positive_logprob":
        s.rollout_logprobs[0] = 0.5
    elif how == "absurd_logprob":
        s.rollout_logprobs[1] = -1e30  # finite: its importance ratio exp(logp + 1e30) is not
    elif how == "future_version":
        s.behavior_version = 6
    elif how == "future_token_version":
        s.token_versions = np.array([3, 3, 9, 3], np.int32)
    elif how == "negative_token_version":
        s.token_versions = np.array([3, -1, 3, 3], np.int32)
    elif how == "group_size":
        g.samples.append(_group().samples[0])
    elif how == "nan_token_reward":
        s.token_rewards = np.array([0, np.nan, 0, 1], np.float32)
    elif how == "long_id":
        g.group_id = "x" * 5000
    elif how == "empty_prompt":
        g.prompt_ids = np.zeros(0, np.int32)  # an empty dataset line, a tokenizer that adds no BOS
    elif how == "huge_reward":
        s.reward = 1e308  # finite, but its group's advantages are not: used to end the run
    elif how == "huge_token_reward":
        s.token_rewards = np.array([0, 0, 0, 3e38], np.float32)
    elif how == "empty":
        g.prompt_ids = np.zeros(0, np.int32)
        for x in g.samples:
            x.response_ids, x.rollout_logprobs, x.loss_mask = (np.zeros(0, d) for d in (np.int32, np.float32, np.uint8))
            x.token_versions = None
    return decode_group(encode_group(g))  # what the queue reads: through the wire format


CASES = {
    "token_out_of_range": "token_out_of_range",
    "negative_token": "token_out_of_range",
    "own_prompt_out_of_range": "token_out_of_range",
    "too_long": "too_long",
    "positive_logprob": "positive_logprob",
    "absurd_logprob": "logprob_out_of_range",
    "future_version": "future_version",
    "future_token_version": "future_version",
    "negative_token_version": "bad_token_version",
    "group_size": "group_size",
    "nan_token_reward": "nonfinite_reward",
    "long_id": "bad_id",
    "empty": "empty_prompt",
    "empty_prompt": "empty_prompt",
    "huge_reward": "reward_out_of_range",
    "huge_token_reward": "reward_out_of_range",
}


@pytest.mark.parametrize("how", sorted(CASES))
def test_each_breach_is_refused_with_its_reason(how):
    with pytest.raises(RecordError) as err:
        check_group(_broken(how), CONTRACT)
    assert err.value.reason == CASES[how], err.value


def test_what_an_honest_generator_makes_passes():
    check_group(_group(), CONTRACT)  # the learner's own version is not the future
    check_group(_group(version=5), CONTRACT)
    g = _group()
    g.samples[0].rollout_logprobs[0] = LOGPROB_TOLERANCE / 2  # float32 log-softmax rounding
    g.samples[0].token_rewards = np.array([np.nan] * 4, np.float32)  # NaN with a failed outcome ...
    g.samples[0].reward, g.samples[0].error = float("nan"), "reward raised"  # ... is the failure marker
    check_group(g, CONTRACT)
    g.prompt_ids = np.arange(8, dtype=np.int32)  # 8 + 4 = max_len exactly
    check_group(g, CONTRACT)
    g.samples[1].reward = -MAX_ABS_REWARD  # the bound itself is a reward
    check_group(g, CONTRACT)


def test_stepwise_groups_hold_every_trajectory_once():
    contract = RecordContract(vocab_size=16, max_len=12, group_size=2, stepwise=True, max_version=5)
    g = _group(n=3)
    for s, (traj, step) in zip(g.samples, [(0, 0), (0, 1), (1, 0)], strict=True):
        s.trajectory_id, s.step_index = traj, step
    check_group(g, contract)
    g.samples[2].trajectory_id = 0  # trajectory 1 missing
    with pytest.raises(RecordError, match="group_size"):
        check_group(g, contract)
    g.samples[2].trajectory_id, g.samples[2].step_index = 1, 0
    g.samples[1].step_index = 0  # one step twice
    with pytest.raises(RecordError, match="group_size"):
        check_group(g, contract)


def test_intake_dead_letters_breaches_logs_each_reason_once_and_counts_admitted(caplog):
    entries = [
        ("1-1", {keys.RECORD_FIELD: encode_group(_group("good-1"))}),
        ("1-2", {keys.RECORD_FIELD: encode_group(_broken("token_out_of_range")), keys.NOTE_FIELD: b"note"}),
        ("1-3", {keys.RECORD_FIELD: encode_group(_broken("future_version"))}),
        ("1-4", {keys.RECORD_FIELD: encode_group(_broken("token_out_of_range"))}),
        ("1-5", {keys.RECORD_FIELD: b"\xc1 not msgpack" * 10_000}),
        ("1-6", {keys.RECORD_FIELD: encode_group(_group("old", version=0))}),
    ]
    said: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="asyncrl.queue"):
        intake = sort_entries(entries, 2, set(), 1 << 20, 1, contract=CONTRACT, said=said)
        again = sort_entries(entries[1:2], 2, set(), 1 << 20, 1, contract=CONTRACT, said=said)
    assert [g.group_id for _, g in intake.out] == ["good-1"]
    reasons = [d["reason"] for d in intake.dead]
    assert reasons == ["token_out_of_range", "future_version", "token_out_of_range", "bad_msgpack"]
    assert [d["source_id"] for d in intake.dead] == ["1-2", "1-3", "1-4", "1-5"]
    assert all(d["detail"] for d in intake.dead) and intake.dead[0]["group_id"] == "g"
    assert len(intake.dead[3]["d"]) == DEADLETTER_KEEP_BYTES and "group_id" not in intake.dead[3]  # bounded
    assert intake.dead_admitted == 1  # only 1-2 carried an in-flight note: a generator admitted it
    assert set(intake.finished) == {"1-2", "1-3", "1-4", "1-5", "1-6"}  # acked: a resume never replays them
    assert intake.dropped == ["old"]  # an old valid record is the ordinary stale drop
    assert len(again.dead) == 1
    lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(lines) == 3, lines  # one per distinct reason, however often it comes
    assert said == {"token_out_of_range", "future_version", "bad_msgpack"}


def test_without_a_contract_only_the_codec_judges():
    entries = [("1-1", {keys.RECORD_FIELD: encode_group(_broken("token_out_of_range"))})]
    assert len(sort_entries(entries, 0, set(), 1 << 20, 0).out) == 1
