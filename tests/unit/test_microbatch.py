"""Dealing to ranks, token-budget splitting, collation and padding micro-batches."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.config import AlgoConfig
from asyncrl.data import microbatch as mbatch
from asyncrl.types import TrainSequence


def _seq(ids, *, rollout=-1.0, adv=0.5, version=3) -> TrainSequence:
    ids = np.asarray(ids, dtype=np.int32)
    mask = np.ones(len(ids), dtype=np.float32)
    mask[0] = 0
    return TrainSequence(
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=mask * rollout,
        advantages=mask * adv,
        reduction_weights=mask * 0.25,
        token_versions=np.full(len(ids), version, dtype=np.int32),
        behavior_version=version,
    )


def test_deal_balances_tokens_longest_first():
    # 10 -> r0; 9 -> r1; 3 -> r1 (9 < 10); 2 -> r0 (10 < 12); 1 -> tie 12/12 -> r0.
    assert mbatch.deal_to_ranks([10, 9, 3, 2, 1], 2) == [[0, 3, 4], [1, 2]]
    assert mbatch.deal_to_ranks([4, 4, 4], 1) == [[0, 1, 2]]
    # More ranks than sequences: the extra ranks get nothing (they will run padding micro-batches).
    assert mbatch.deal_to_ranks([7], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="num_ranks=0"):
        mbatch.deal_to_ranks([1], 0)


def test_split_by_token_budget_counts_padded_tokens():
    # Sorted 8, 5, 3, 2. 8 alone (2*8 > 10); 5, 3, 2 need two runs (3*5 > 10): [5] + [3, 2]
    # pads 5 + 6 = 11 tokens, [5, 3] + [2] pads 10 + 2 = 12, so the first.
    assert mbatch.split_by_token_budget([5, 3, 8, 2], 10) == [[2], [0], [1, 3]]
    # A budget of one token: every sequence alone (never split, even when longer than the budget).
    assert mbatch.split_by_token_budget([5, 3, 8], 1) == [[2], [0], [1]]
    # A big budget: everything in one micro-batch.
    assert mbatch.split_by_token_budget([5, 3, 8], 1000) == [[2, 0, 1]]
    assert mbatch.split_by_token_budget([], 10) == []
    with pytest.raises(ValueError, match="budget=0"):
        mbatch.split_by_token_budget([1], 0)


def _plan_cost(lengths, plan, overhead):
    return sum(len(mb) * max(lengths[i] for i in mb) + overhead for mb in plan)


def _brute_force_cost(lengths, budget, overhead):
    """Least cost over every partition of the sequences into budget-fitting micro-batches."""
    best = None

    def go(rest, cost):
        nonlocal best
        if not rest:
            best = cost if best is None else min(best, cost)
            return
        first, others = rest[0], rest[1:]
        for mask in range(1 << len(others)):
            mb = [first] + [others[k] for k in range(len(others)) if mask >> k & 1]
            longest = max(lengths[i] for i in mb)
            if len(mb) > 1 and len(mb) * longest > budget:
                continue
            go([i for i in rest if i not in mb], cost + len(mb) * longest + overhead)

    go(list(range(len(lengths))), 0)
    return best


def test_split_by_token_budget_pays_the_least_padding():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.choice([rng.randint(1, 6), rng.randint(8, 30)]) for _ in range(rng.randint(1, 7))]
        budget, overhead = rng.choice([8, 20, 40, 200]), rng.choice([0, 3, 10])
        plan = mbatch.split_by_token_budget(lengths, budget, overhead)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        assert all(len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= budget for mb in plan)
        assert _plan_cost(lengths, plan, overhead) == _brute_force_cost(lengths, budget, overhead), (lengths, budget)


def test_split_by_token_budget_keeps_a_straggler_from_padding_the_rest():
    # A long-tailed batch: 28 short sequences and 4 long ones. Filling greedily put all 32 in one
    # micro-batch padded to 110 (3,520 tokens, 3,066 of them padding); the plan isolates the tail.
    lengths = [12] * 28 + [40, 60, 90, 110]
    plan = mbatch.split_by_token_budget(lengths, 4096)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in plan)
    assert padded < 1000 and len(plan) <= 4
    assert sorted(plan[-1]) == list(range(28))


def test_plan_gives_a_common_count():
    plans, count = mbatch.plan_microbatches([[8, 8, 8], [4]], budget=8)
    assert plans == [[[0], [1], [2]], [[0]]]
    assert count == 3
    # No data at all still runs one (padding) micro-batch, so ranks stay in step.
    assert mbatch.plan_microbatches([[], []], budget=8)[1] == 1


def test_pack_by_token_budget_fills_micro_batches_by_real_tokens():
    # Longest first (8, 6, 5, 4, 3, 2), each into the first micro-batch with room: 8+2 | 6+4 | 5+3.
    assert mbatch.pack_by_token_budget([5, 3, 8, 2, 6, 4], 10) == [[2, 3], [4, 5], [0, 1]]
    # 8 and 2 fill one micro-batch to the budget exactly, where padding would charge 2 x 8.
    plan = mbatch.pack_by_token_budget([8, 2], 10)
    assert plan == [[0, 1]] and mbatch.split_by_token_budget([8, 2], 10) == [[0], [1]]
    # A sequence longer than the budget still goes, alone; none is ever split.
    assert mbatch.pack_by_token_budget([12, 3, 3], 10) == [[0], [1, 2]]
    assert mbatch.pack_by_token_budget([], 10) == []
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.choice([16, 64, 300])
        plan = mbatch.pack_by_token_budget(lengths, budget)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        assert all(len(mb) == 1 or sum(lengths[i] for i in mb) <= budget for mb in plan)
        # No two micro-batches could be merged: first-fit leaves none that small.
        loads = sorted(sum(lengths[i] for i in mb) for mb in plan)
        assert len(loads) < 2 or loads[0] + loads[1] > budget
    with pytest.raises(ValueError, match="budget=0"):
        mbatch.pack_by_token_budget([1], 0)
    plans, count = mbatch.plan_microbatches([[8, 2, 6], [4]], budget=10, packing=True)
    assert plans == [[[0, 1], [2]], [[0]]] and count == 2


def test_collate_packed_adds_one_row_with_per_sequence_positions():
    a, b, c, d = (mbatch.seq_fields(_seq(ids)) for ids in ([5, 6, 7], [9, 8], [4], [3, 2]))
    padded = mbatch.collate([a, b, c, d], pad_token_id=0)
    one = mbatch.collate_packed([a, b, c, d], pad_token_id=0)
    assert set(one) == set(padded) | set(mbatch.PACKING_FIELDS)
    assert all(torch.equal(one[k], v) for k, v in padded.items())  # the [B, L] fields are unchanged
    # One row, the sequences in their order, no pad at all.
    assert one[mbatch.PACKED_IDS].tolist() == [[5, 6, 7, 9, 8, 4, 3, 2]]
    assert one[mbatch.PACKED_IDS].dtype == torch.int64
    assert one[mbatch.POSITION_IDS].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    assert one[mbatch.UNPACK_INDEX].tolist() == [[-1, 1, 2], [-1, 4, -1], [-1, -1, -1], [-1, 7, -1]]
    assert mbatch.is_packed(one) and not mbatch.is_packed(padded)
    assert mbatch.forward_ids(one) is one[mbatch.PACKED_IDS] and mbatch.forward_ids(padded) is padded["input_ids"]
    assert [mbatch.computed_tokens(m) for m in (one, padded)] == [8, 12]
    # Values per packed position come back per row, 0 at each position 0 and on padding.
    values = torch.arange(8, dtype=torch.float64).mul(10).unsqueeze(0).requires_grad_()
    got = mbatch.unpack(values, one)
    assert got.tolist() == [[0, 10, 20], [0, 40, 0], [0, 0, 0], [0, 70, 0]]
    got.sum().backward()  # only the positions read get a gradient
    assert values.grad.tolist() == [[0, 1, 1, 0, 1, 0, 0, 1]]


def test_rank_microbatches_packed_except_the_padding_ones():
    seqs = [mbatch.seq_fields(_seq([5, 6, 7])), mbatch.seq_fields(_seq([9, 8]))]
    fields = {n: (torch.int64 if n in mbatch.INTEGER_FIELDS else torch.float32) for n in mbatch.SEQUENCE_FIELDS}
    mbs = mbatch.build_rank_microbatches(seqs, [[0, 1]], 2, fields, pad_token_id=0, packing=True)
    assert [mbatch.is_packed(mb) for mb in mbs] == [True, False]
    assert mbs[0][mbatch.PACKED_IDS].tolist() == [[5, 6, 7, 9, 8]]
    assert set(mbs[1]) - {mbatch.PADDING_KEY} == set(fields)


def test_collate_right_pads_every_field():
    a, b = mbatch.seq_fields(_seq([5, 6, 7])), mbatch.seq_fields(_seq([9, 8], rollout=-2.0))
    mb = mbatch.collate([a, b], pad_token_id=0)
    assert set(mb) == set(mbatch.SEQUENCE_FIELDS)
    assert mb["input_ids"].tolist() == [[5, 6, 7], [9, 8, 0]]
    assert mb["input_ids"].dtype == torch.int64
    assert mb["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert mb["rollout_logprobs"].tolist() == [[0, -1, -1], [0, -2, 0]]
    assert mb["reduction_weights"].tolist() == [[0, 0.25, 0.25], [0, 0.25, 0]]
    assert mb["token_versions"].tolist() == [[3, 3, 3], [3, 3, 0]]
    bad = dict(b, advantages=np.zeros(5, dtype=np.float32))
    with pytest.raises(ValueError, match="field 'advantages' of sequence 1"):
        mbatch.collate([a, bad], pad_token_id=0)
    with pytest.raises(ValueError, match="fields"):
        mbatch.collate([a, {"input_ids": b["input_ids"]}], pad_token_id=0)


def test_padding_microbatches_carry_every_field_with_zero_mask():
    seqs = [mbatch.seq_fields(_seq([5, 6, 7, 8])), mbatch.seq_fields(_seq([9, 8]))]
    real = mbatch.collate(seqs, pad_token_id=0)
    real["old_logprobs"] = torch.full((2, 4), -1.5)  # added by the pre-pass on ranks
    fields = mbatch.field_dtypes(real)
    pad = mbatch.padding_microbatch(fields, pad_token_id=2)
    assert set(pad) - {mbatch.PADDING_KEY} == set(real)
    assert pad[mbatch.PADDING_KEY] is True
    for name, t in real.items():
        assert pad[name].dtype == t.dtype, name
        assert pad[name].shape == (1, 1)
    assert pad["input_ids"].tolist() == [[2]]
    assert pad["loss_mask"].sum() == 0 and pad["reduction_weights"].sum() == 0
    with pytest.raises(ValueError, match="lacks 'loss_mask'"):
        mbatch.padding_microbatch({"input_ids": torch.int64, "reduction_weights": torch.float32}, pad_token_id=0)
    # Forward only (the learner's log-probs, e.g. the parity gate on a rank with fewer sequences).
    forward = mbatch.padding_microbatch({"input_ids": torch.int64}, pad_token_id=2)
    assert forward["input_ids"].tolist() == [[2]] and set(forward) == {"input_ids", mbatch.PADDING_KEY}


def test_rank_microbatches_padded_up_to_the_common_count():
    seqs = [mbatch.seq_fields(_seq([5, 6, 7])), mbatch.seq_fields(_seq([9, 8]))]
    fields = {n: (torch.int64 if n in mbatch.INTEGER_FIELDS else torch.float32) for n in mbatch.SEQUENCE_FIELDS}
    mbs = mbatch.build_rank_microbatches(seqs, [[0], [1]], 4, fields, pad_token_id=0)
    assert [mb[mbatch.PADDING_KEY] for mb in mbs] == [False, False, True, True]
    assert all(set(mb) - {mbatch.PADDING_KEY} == set(fields) for mb in mbs)
    assert mbs[1]["input_ids"].tolist() == [[9, 8]]
    # A rank with no sequences at all: only padding micro-batches, still with every field.
    empty = mbatch.build_rank_microbatches([], [], 2, fields, pad_token_id=0)
    assert len(empty) == 2 and all(set(mb) - {mbatch.PADDING_KEY} == set(fields) for mb in empty)
    with pytest.raises(ValueError, match="more than the common count"):
        mbatch.build_rank_microbatches(seqs, [[0], [1]], 1, fields, pad_token_id=0)


def test_padding_microbatch_feeds_the_real_loss_and_contributes_zero():
    """With rollout-KL, KL-to-reference and a TIS correction on, the loss needs rollout/ref
    logprobs: a padding micro-batch built from the real field list has them, and adds 0."""
    from asyncrl.learner.loss import microbatch_loss

    algo = AlgoConfig(kl_coef=0.1, rollout_kl_coef=0.2, entropy_coef=0.01)
    algo.correction.tis = "token"
    real = mbatch.collate([mbatch.seq_fields(_seq([5, 6, 7]))], pad_token_id=0)
    real["old_logprobs"] = torch.full((1, 3), -1.0)
    real["ref_logprobs"] = torch.full((1, 3), -1.2)
    pad = mbatch.padding_microbatch(mbatch.field_dtypes(real), pad_token_id=0)
    logits = torch.randn(1, 1, 11, requires_grad=True)
    tensors = {k: v for k, v in pad.items() if isinstance(v, torch.Tensor)}
    loss, _ = microbatch_loss(logits, tensors, algo, temperature=1.0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
