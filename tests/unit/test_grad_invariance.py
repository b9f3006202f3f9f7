"""The gradient-invariance contract: however a mini-batch is cut (micro-batches, DP ranks)
and laid out (padded rows, or packed into one row per micro-batch), the gradient of the loss
built by microbatch_loss is the same, for every term and reduction.

    .venv/bin/python -m pytest tests/unit/test_grad_invariance.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.config import AlgoConfig, CorrectionConfig, params_for
from asyncrl.config.losses import LOSS_MODELS
from asyncrl.data import microbatch as mbatch
from asyncrl.data.batch import build_minibatches
from asyncrl.data.microbatch import collate, field_dtypes, padding_microbatch, seq_fields
from asyncrl.learner.loss import microbatch_loss, token_logprobs
from asyncrl.learner.step import forward_logits, microbatch_logprobs
from asyncrl.types import RolloutGroup, Sample, merge_metrics
from tests.support import models

VOCAB, DIM, TEMP = 13, 6, 0.8
REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")
TERMS = ("policy", "kl_ref", "rollout_kl", "entropy")


class TinyLM(torch.nn.Module):
    """Embedding + a mixing layer + output head: logits at t depend on tokens <= t."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(DIM, VOCAB, generator=g, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb[ids]
        h = torch.tanh(h.cumsum(dim=1) / torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1))
        return h @ self.head


def make_groups(rng: np.random.Generator) -> list[RolloutGroup]:
    groups = []
    for g, (n, plen) in enumerate([(3, 2), (2, 4), (4, 3), (2, 1)]):
        samples = []
        for i in range(n):
            t = int(rng.integers(1, 7))
            mask = np.ones(t, dtype=np.uint8)
            if t > 3:
                mask[1] = 0  # an observation token inside the response
            samples.append(
                Sample(
                    response_ids=rng.integers(1, VOCAB, t),
                    rollout_logprobs=-rng.uniform(0.5, 3.0, t) * mask,
                    loss_mask=mask,
                    reward=float(rng.integers(0, 2) + 0.5 * i),
                    behavior_version=3,
                )
            )
        groups.append(RolloutGroup(f"g{g}", f"p{g}", rng.integers(1, VOCAB, plen), samples))
    return groups


# Losses whose ratio is already against the rollout policy take masks, not TIS.
ROLLOUT_MASKS = CorrectionConfig(
    token_mask_low=0.8, token_mask_high=1.3, outlier_mask=True, outlier_low=0.5, outlier_high=2.0
)


def algo_for(term: str, reduction: str, policy_loss: str = "ppo", correction=None, **loss_fields) -> AlgoConfig:
    coefs = {"kl_ref": ("kl_coef", 0.3), "rollout_kl": ("rollout_kl_coef", 0.7), "entropy": ("entropy_coef", 0.05)}
    has = LOSS_MODELS[policy_loss].model_fields
    clip = {k: v for k, v in (("eps_clip_low", 0.1), ("eps_clip_high", 0.15)) if k in has}
    kwargs = dict(
        loss_reduction=reduction,
        policy_loss=params_for(policy_loss, **{**clip, **loss_fields}),
        correction=correction or CorrectionConfig(tis="sequence" if policy_loss == "gmpo" else "token", tis_cap=1.5),
        reduction_constant=8.0 if reduction == "seq_mean_token_sum_norm" else None,
    )
    if term in coefs:
        name, value = coefs[term]
        kwargs[name] = value
    return AlgoConfig(**kwargs)


def full_batch(groups, algo, term: str) -> dict[str, torch.Tensor]:
    (seqs,), _ = build_minibatches(groups, algo, num_minibatches=1)
    mb = collate([seq_fields(s) for s in seqs], pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    mask = mb["loss_mask"] > 0
    mb["old_logprobs"] = torch.where(mask, mb["rollout_logprobs"] + 0.3 * torch.randn(mask.shape, generator=g), 1e4)
    mb["ref_logprobs"] = torch.where(mask, -torch.rand(mask.shape, generator=g) * 3, -1e4)
    mb["rollout_logprobs"] = torch.where(mask, mb["rollout_logprobs"], 7e3)  # garbage where unmasked
    mb["advantages"] = torch.where(mask, mb["advantages"], -5e3)
    if term != "policy":
        mb["advantages"] = torch.zeros_like(mb["advantages"])  # the policy term then has no gradient
    return {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in mb.items()}


def rows(mb: dict, idx: list[int]) -> dict:
    """A micro-batch of these rows, trimmed to its own longest sequence (so widths differ)."""
    width = int(max((mb["input_ids"][i] != 0).nonzero().max() for i in idx)) + 1
    return {k: v[idx, :width].clone() for k, v in mb.items()}


def grad_of(model, algo, micro: list[dict], scale_per_mb: bool = False) -> torch.Tensor:
    model.zero_grad()
    for mb in micro:
        loss, _ = microbatch_loss(model(mb["input_ids"]), mb, algo, temperature=TEMP, num_microbatches=len(micro))
        if scale_per_mb:
            loss = loss / len(micro)
        loss.backward()
    return torch.cat([p.grad.flatten().clone() for p in model.parameters()])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def splits(n: int) -> dict[str, list[list[int]]]:
    return {
        "ones": [[i] for i in range(n)],
        "twos": [list(range(i, min(i + 2, n))) for i in range(0, n, 2)],
        "uneven": [[0], list(range(1, n - 3)), list(range(n - 3, n))],
        "shuffled": [[n - 1, 0, 3], [i for i in range(1, n - 1) if i != 3]],
    }


@pytest.fixture(scope="module")
def groups():
    return make_groups(np.random.default_rng(0))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("term", TERMS)
def test_every_term_is_invariant_to_microbatching_and_dp(groups, term, reduction):
    algo = algo_for(term, reduction)
    mb = full_batch(groups, algo, term)
    n = mb["input_ids"].shape[0]
    model = TinyLM()
    whole = grad_of(model, algo, [mb])
    assert whole.abs().max() > 1e-3, "the term must produce a gradient for the test to mean anything"
    for name, parts in splits(n).items():
        got = grad_of(model, algo, [rows(mb, p) for p in parts])
        assert rel_diff(got, whole) <= 1e-6, f"{term}/{reduction}: split {name} changed the gradient"
    # Two simulated DP ranks, uneven micro-batches each; FSDP sums their gradients (divide factor 1).
    rank0 = grad_of(model, algo, [rows(mb, [0, 1]), rows(mb, [2])])
    # Rank 1 has less data: it runs a padding micro-batch so both ranks do 2 collectives.
    pad = padding_microbatch(field_dtypes(mb), pad_token_id=0)
    rank1 = grad_of(model, algo, [rows(mb, list(range(3, n))), pad])
    assert rel_diff(rank0 + rank1, whole) <= 1e-6


OTHER_LOSSES = [
    ("dual_clip", {}),
    ("gspo", {}),
    ("sapo", {}),
    ("cispo", {}),
    ("gmpo", {}),
    ("importance_sampling", {}),
    ("rollout_is", dict(eps_clip_low=0.9, eps_clip_high=3.0, correction=ROLLOUT_MASKS)),
    ("dppo", dict(dppo_mask="binary_tv", dppo_delta_low=0.05, dppo_delta_high=0.05, correction=ROLLOUT_MASKS)),
    ("dppo", dict(dppo_mask="binary_kl", dppo_delta_low=0.01, dppo_delta_high=0.01, correction=ROLLOUT_MASKS)),
    ("cispo", dict(cispo_anchor="rollout", cispo_eps_high=0.5, correction=ROLLOUT_MASKS)),
    (
        "ppo",
        dict(
            correction=CorrectionConfig(
                tis="sequence",
                tis_cap=1.5,
                token_mask_low=0.8,
                token_mask_high=1.3,
                geo_mask=True,
                geo_mask_low=0.8,
                geo_mask_high=1.25,
            )
        ),
    ),
]


@pytest.mark.parametrize("policy_loss, extra", OTHER_LOSSES)
@pytest.mark.parametrize("reduction", ["token_mean", "prompt_mean"])
def test_other_policy_losses_and_masks_are_invariant(groups, policy_loss, extra, reduction):
    reduction = "sequence_mean" if policy_loss == "gmpo" else reduction
    algo = algo_for("policy", reduction, policy_loss, **extra)
    mb = full_batch(groups, algo, "policy")
    model = TinyLM()
    whole, masked = grad_and_masked_frac(model, algo, [mb])
    assert whole.abs().max() > 1e-3
    if algo.correction.token_mask:  # the masks must bite, but not take everything
        assert 0 < masked < 1, masked
    n = mb["input_ids"].shape[0]
    for name in ("uneven", "ones"):
        got = grad_of(model, algo, [rows(mb, p) for p in splits(n)[name]])
        assert rel_diff(got, whole) <= 1e-6, f"{policy_loss}/{reduction}: split {name} changed the gradient"
    pad = padding_microbatch(field_dtypes(mb), pad_token_id=0)
    rank0 = grad_of(model, algo, [rows(mb, [0, 1]), rows(mb, [2])])
    rank1 = grad_of(model, algo, [rows(mb, list(range(3, n))), pad])
    assert rel_diff(rank0 + rank1, whole) <= 1e-6


def grad_and_masked_frac(model, algo, micro: list[dict]) -> tuple[torch.Tensor, float]:
    model.zero_grad()
    masked = total = 0.0
    for mb in micro:
        loss, m = microbatch_loss(model(mb["input_ids"]), mb, algo, temperature=TEMP)
        loss.backward()
        if "drift/masked_frac" in m:
            masked += float(m["drift/masked_frac"].total)
            total += float(m["drift/masked_frac"].count)
    return torch.cat([p.grad.flatten().clone() for p in model.parameters()]), masked / max(total, 1.0)


def test_prompt_mean_weights_are_per_prompt_over_the_whole_minibatch(groups):
    """The driver gives each prompt (rollout group) of a mini-batch the same total weight 1/G."""
    algo = AlgoConfig(loss_reduction="prompt_mean")
    for num_mb, per_prompt in ((1, 1 / 4), (2, 1 / 2)):
        minibatches, _ = build_minibatches(groups, algo, num_minibatches=num_mb)
        for seqs in minibatches:
            totals: dict[str, float] = {}
            for s in seqs:
                totals[s.group_id] = totals.get(s.group_id, 0.0) + float(s.reduction_weights.sum())
            assert all(abs(v - per_prompt) < 1e-6 for v in totals.values()), totals


@pytest.mark.parametrize("term", TERMS)
def test_negative_control_per_microbatch_scaling_is_caught(groups, term):
    """A term divided by the number of micro-batches (the classic bug) fails the comparison."""
    algo = algo_for(term, "token_mean")
    mb = full_batch(groups, algo, term)
    model = TinyLM()
    whole = grad_of(model, algo, [mb])
    parts = splits(mb["input_ids"].shape[0])["twos"]
    bad = grad_of(model, algo, [rows(mb, p) for p in parts], scale_per_mb=True)
    assert rel_diff(bad, whole) > 0.5  # off by the factor 1/len(parts)


def test_legacy_per_microbatch_token_mean_depends_on_the_split(groups):
    """token_mean_per_microbatch reproduces old runs: whole batch = token_mean; singletons = sequence_mean."""
    legacy = algo_for("policy", "token_mean_per_microbatch")
    mb = full_batch(groups, legacy, "policy")
    model = TinyLM()
    n = mb["input_ids"].shape[0]
    singles = grad_of(model, legacy, [rows(mb, [i]) for i in range(n)])
    whole_legacy = grad_of(model, legacy, [mb])
    token_mean = legacy.model_copy(update={"loss_reduction": "token_mean"})
    seq_mean = legacy.model_copy(update={"loss_reduction": "sequence_mean"})
    assert rel_diff(whole_legacy, grad_of(model, token_mean, [full_batch(groups, token_mean, "policy")])) <= 1e-6
    assert rel_diff(singles, grad_of(model, seq_mean, [full_batch(groups, seq_mean, "policy")])) <= 1e-6
    assert rel_diff(singles, whole_legacy) > 1e-3


# ---------------------------------------------------------------- packed vs padded rows
# Packing needs a model that takes position_ids and keeps attention inside each sequence:
# a real (tiny, float64) Hugging Face Llama, run through the learner's own forward.


@pytest.fixture(scope="module")
def llama():
    return models.tiny_llama(VOCAB)


def row_lengths(mb: dict) -> list[int]:
    return [int((row != 0).nonzero().max()) + 1 for row in mb["input_ids"]]


def packed(mb: dict, idx) -> dict:
    """These rows as one packed micro-batch (one row), built from their unpadded fields as the
    learner does."""
    n = row_lengths(mb)
    seqs = [{k: v[i, : n[i]].numpy() for k, v in mb.items()} for i in idx]
    return mbatch.collate_packed(seqs, pad_token_id=0)


def llama_grad(model, algo, micro: list[dict], **kw) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    parts = []
    for mb in micro:
        loss, metrics = microbatch_loss(
            forward_logits(model, mb), mb, algo, temperature=TEMP, num_microbatches=len(micro), **kw
        )
        loss.backward()
        if not mb.get(mbatch.PADDING_KEY, False):
            parts.append(metrics)
    grad = torch.cat([p.grad.flatten().clone() for p in model.parameters()])
    return grad, {k: float(m.value) for k, m in merge_metrics(parts).items()}


def assert_same_metrics(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-9 * max(1.0, abs(v)), f"{what}: {k} = {got[k]} packed, {v} padded"


def check_packed_like_padded(model, algo, mb: dict, split: str, *, ranks: bool = False, **kw) -> None:
    """One padded micro-batch against one packed row, and against packed micro-batches cut by
    `split` (and with `ranks`, two DP ranks, one running a padding micro-batch)."""
    n = mb["input_ids"].shape[0]
    padded, padded_metrics = llama_grad(model, algo, [mb], **kw)
    assert padded.abs().max() > 1e-5, "the loss must produce a gradient for the test to mean anything"
    whole, whole_metrics = llama_grad(model, algo, [packed(mb, range(n))], **kw)
    assert rel_diff(whole, padded) <= 1e-6, "packing changed the gradient"
    assert_same_metrics(whole_metrics, padded_metrics, "packed")
    if split:
        got, _ = llama_grad(model, algo, [packed(mb, p) for p in splits(n)[split]], **kw)
        assert rel_diff(got, padded) <= 1e-6, f"packed split {split} changed the gradient"
    if ranks:  # packed micro-batches on two ranks; rank 1 runs a (never packed) padding micro-batch
        rank0, _ = llama_grad(model, algo, [packed(mb, [0, 1]), packed(mb, [2])], **kw)
        pad = padding_microbatch(field_dtypes(mb), pad_token_id=0)
        rank1, _ = llama_grad(model, algo, [packed(mb, range(3, n)), pad], **kw)
        assert rel_diff(rank0 + rank1, padded) <= 1e-6


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("term", TERMS)
def test_packed_rows_give_every_term_the_padded_gradient_and_metrics(groups, llama, term, reduction):
    algo = algo_for(term, reduction)
    check_packed_like_padded(llama, algo, full_batch(groups, algo, term), "shuffled", ranks=True)


@pytest.mark.parametrize("policy_loss, extra", OTHER_LOSSES)
def test_packed_rows_give_other_losses_the_padded_gradient(groups, llama, policy_loss, extra):
    """Micro-batching is the term test's; here each loss sees one micro-batch, packed or not."""
    algo = algo_for("policy", "sequence_mean" if policy_loss == "gmpo" else "prompt_mean", policy_loss, **extra)
    check_packed_like_padded(llama, algo, full_batch(groups, algo, "policy"), "")


def test_packed_rows_with_top_k_top_p_and_old_from_the_same_forward(groups, llama):
    """The learner's default (old log-probs = this forward's, detached) under a truncating
    sampler, whose -inf log-probs also sit at the packed row's sequence boundaries."""
    algo = algo_for("entropy", "token_mean")
    mb = full_batch(groups, algo, "policy")
    kw = dict(top_k=6, top_p=0.9, old_from_current=True)
    check_packed_like_padded(llama, algo, mb, "twos", **kw)
    _, metrics = llama_grad(llama, algo, [packed(mb, range(mb["input_ids"].shape[0]))], **kw)
    assert 0 < metrics["drift/outside_kept_frac"] < 1  # the cut bites


def test_packed_logprobs_equal_padded_and_computes_no_pad(groups, llama):
    algo = AlgoConfig()
    mb = full_batch(groups, algo, "policy")
    n, lengths = mb["input_ids"].shape[0], row_lengths(mb)
    kw = dict(temperature=TEMP, logprob_fn=token_logprobs, device=torch.device("cpu"))
    with torch.no_grad():
        want = microbatch_logprobs(llama, mb, **kw)
        pk = packed(mb, range(n))
        got = microbatch_logprobs(llama, pk, **kw)
    real = torch.arange(mb["input_ids"].shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    assert (got[real] - want[real]).abs().max() <= 1e-12 and (got[~real] == 0).all()
    assert mbatch.computed_tokens(pk) == sum(lengths) < mbatch.computed_tokens(mb)
    # Negative control: positions that do not restart make one long sequence; it must show.
    broken = dict(pk, **{mbatch.POSITION_IDS: torch.arange(sum(lengths)).unsqueeze(0)})
    with torch.no_grad():
        leaked = microbatch_logprobs(llama, broken, **kw)
    assert (leaked[real] - want[real]).abs().max() > 1e-3
