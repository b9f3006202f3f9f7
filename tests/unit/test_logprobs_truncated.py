"""Log-probs and entropy under top-k / top-p, the learner loss's handling of tokens outside
the kept set, the drift metrics and the learner's eval-mode model.

    .venv/bin/python -m pytest tests/unit/test_logprobs_truncated.py -q

The reference for the cut is vLLM's own function (imported from the installed vLLM; only
this module imports it, the algo package never does).
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo import entropy_from_logits, logprobs_from_logits
from asyncrl.algo.logprobs import kept_threshold
from asyncrl.config import AlgoConfig, RolloutConfig
from asyncrl.learner.loss import Sampling, learner_loss_fn, microbatch_loss, token_logprobs
from asyncrl.monitor import alerts as A
from asyncrl.monitor import metrics as M

D = torch.float64
# p = [0.5, 0.3, 0.15, 0.05]
P4 = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=D)
L4 = P4.log()
ALL4 = torch.arange(4)


def all_logprobs(logits: torch.Tensor, temperature: float = 1.0, **cut) -> torch.Tensor:
    """[R, V] logits -> [R, V]: the logprob of every token of every row."""
    r, v = logits.shape
    rows = logits.unsqueeze(1).expand(r, v, v).reshape(r * v, v)
    return logprobs_from_logits(rows, torch.arange(v).repeat(r), temperature, **cut).reshape(r, v)


def test_top_p_keeps_the_token_that_crosses_the_threshold_by_hand():
    # Ascending cumsum 0.05, 0.20, 0.50, 1.0; p = 0.75 drops c <= 0.25: the 0.05 and 0.15
    # tokens. 0.5 alone is short of 0.75, so 0.3 (the one that crosses) stays: [0.5, 0.3] / 0.8.
    got = all_logprobs(L4, top_p=0.75)[0]
    assert got[0].item() == pytest.approx(math.log(0.5 / 0.8), abs=1e-12)
    assert got[1].item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-12)
    assert torch.isneginf(got[2:]).all()
    h = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))
    assert entropy_from_logits(L4, top_p=0.75).item() == pytest.approx(h, abs=1e-12)


def test_top_k_then_top_p_by_hand():
    # top_k = 1: only the argmax, logprob 0.
    got = all_logprobs(L4, top_k=1)[0]
    assert got[0].item() == 0.0 and torch.isneginf(got[1:]).all()
    assert entropy_from_logits(L4, top_k=1).item() == pytest.approx(0.0, abs=1e-12)
    # top-p alone at 0.6: ascending cumsum 0.05, 0.2, 0.5 -> drops c <= 0.4, keeps [0.5, 0.3].
    alone = all_logprobs(L4, top_p=0.6)[0]
    assert alone[1].item() == pytest.approx(math.log(0.3 / 0.8), abs=1e-12)
    # top_k = 2 first renormalises to [0.625, 0.375]; top-p 0.6 on that drops 0.375 <= 0.4:
    # the cut is on the top-k survivors' renormalised mass, as vLLM does it.
    k2 = all_logprobs(L4, top_k=2, top_p=0.6)[0]
    assert k2[0].item() == 0.0 and torch.isneginf(k2[1:]).all()


def test_temperature_comes_before_the_cut():
    # T = 0.5 squares p: [0.25, 0.09, 0.0225, 0.0025] / 0.365 = [0.685, 0.247, 0.062, 0.007].
    # p = 0.6 then keeps the top token alone (cumsum below it 0.315 <= 0.4). Cutting first at
    # T = 1 would have kept [0.5, 0.3] (0.5 > 0.4), then sharpened: the top token's logprob < 0.
    got = all_logprobs(L4, 0.5, top_p=0.6)[0]
    assert got[0].item() == 0.0 and torch.isneginf(got[1:]).all()
    assert entropy_from_logits(L4, 0.5, top_p=0.6).item() == pytest.approx(0.0, abs=1e-12)


def test_ties_at_the_top_k_cut_are_all_kept_as_vllm_keeps_them():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    got = all_logprobs(logits, top_k=2)[0]  # the 2nd largest value is tied three ways: all stay
    assert torch.allclose(got[:3], torch.full((3,), math.log(1 / 3), dtype=D), atol=1e-12)
    assert torch.isneginf(got[3])


def test_ties_at_the_top_p_cut_keep_every_tied_token():
    """vLLM cuts top-p by sorted position and keeps an arbitrary one of three tied tokens here;
    the learner keeps all three (a superset, so the sampled one is never dropped for a tie)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    engine = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.1])).isfinite()[0]
    assert engine.sum() == 1 and not engine[3]
    got = all_logprobs(logits, top_p=0.1)[0]
    assert torch.isfinite(got[:3]).all() and torch.isneginf(got[3])
    assert torch.allclose(got[:3], torch.full((3,), math.log(1 / 3)), atol=1e-6)


CASES = [(-1, 0.9, 0.7), (20, 1.0, 0.7), (20, 0.9, 0.7), (50, 0.95, 1.0), (5, 0.5, 1.3), (1, 0.9, 0.7)]


@pytest.mark.parametrize(("top_k", "top_p", "temperature"), CASES)
def test_matches_vllms_own_top_k_top_p_on_random_logits(top_k, top_p, temperature):
    """The sampler's processed logprobs: logits / T, vLLM's apply_top_k_top_p, log_softmax
    (vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py, float32 as on the engine)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    g = torch.Generator().manual_seed(top_k * 7 + int(top_p * 100))
    rows, vocab = 48, 300
    logits = torch.randn(rows, vocab, generator=g) * 3
    z = logits / temperature
    k = torch.full((rows,), top_k, dtype=torch.int32) if top_k > 0 else None
    p = torch.full((rows,), top_p, dtype=torch.float32) if top_p < 1 else None
    want = apply_top_k_top_p(z.clone(), k, p).log_softmax(dim=-1, dtype=torch.float32)
    got = all_logprobs(logits, temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # the same kept sets
    kept = torch.isfinite(want)
    assert (got[kept] - want[kept]).abs().max().item() < 1e-5
    if top_k > 0:
        assert kept.sum(-1).max().item() <= top_k
    ent = entropy_from_logits(logits, temperature, top_k=top_k, top_p=top_p, chunk_rows=7)
    want_ent = -(want.exp() * want.nan_to_num(neginf=0.0)).sum(-1)
    assert (ent - want_ent).abs().max().item() < 1e-5
    # The threshold form: row r keeps exactly {v : z_v >= t_r}.
    t = kept_threshold(z, top_k, top_p)
    assert torch.equal(z >= t.unsqueeze(-1), kept)


def test_gradients_pass_gradcheck_and_chunking_changes_nothing():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 2, 8, generator=g, dtype=D) * 2).requires_grad_(True)
    targets = logits.detach().argmax(-1)  # the argmax is always kept
    cut = {"top_k": 5, "top_p": 0.8}
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, targets, 0.7, chunk_rows=2, **cut), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.7, chunk_rows=2, **cut), (logits,))
    a = entropy_from_logits(logits, 0.7, chunk_rows=1, **cut)
    b = entropy_from_logits(logits, 0.7, chunk_rows=1000, **cut)
    assert torch.equal(a, b)
    # The truncated logprob is the plain log_softmax over the kept tokens, gradient included.
    t = kept_threshold(logits.detach() / 0.7, **cut)
    z = (logits / 0.7).masked_fill(logits.detach() / 0.7 < t.unsqueeze(-1), -torch.inf)
    naive = torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = logprobs_from_logits(logits, targets, 0.7, **cut)
    assert torch.allclose(got, naive, atol=1e-12)
    (gn,) = torch.autograd.grad(naive.sum(), logits)
    (gg,) = torch.autograd.grad(got.sum(), logits)
    assert torch.allclose(gg, gn, atol=1e-12)


def test_a_target_outside_the_kept_set_is_minus_inf_with_a_zero_gradient():
    logits = L4.clone().requires_grad_(True)
    lp = logprobs_from_logits(logits, torch.tensor([3]), top_k=2)
    assert torch.isneginf(lp).all()
    torch.where(torch.isfinite(lp), lp, 0.0).sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_bf16_logits_under_the_cut_are_upcast_and_gradients_flow_back_in_bf16():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 50, generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
    targets = logits.detach().float().argmax(-1)
    exact = logits.detach().float()
    lp = logprobs_from_logits(logits, targets, 0.9, top_k=10, top_p=0.9)
    ent = entropy_from_logits(logits, 0.9, top_k=10, top_p=0.9)
    assert lp.dtype == ent.dtype == torch.float32
    assert torch.allclose(lp, logprobs_from_logits(exact, targets, 0.9, top_k=10, top_p=0.9), atol=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_bad_cut_settings():
    with pytest.raises(ValueError, match="top_k"):
        logprobs_from_logits(L4, torch.tensor([0]), top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        entropy_from_logits(L4, top_p=1.5)


def test_masked_tokens_stay_out_of_the_kept_set():
    """A token the engines may not sample carries a -1e4 logit (asyncrl.learner.step): with
    top_k above the allowed count it is still never kept with any mass, and nothing NaNs."""
    logits = torch.tensor([[2.0, -1e4, 1.0, -1e4]])
    got = all_logprobs(logits, 0.7, top_k=3)[0]
    assert got[1].item() < -1e3 and torch.isfinite(got[[0, 2]]).all()
    assert torch.isfinite(entropy_from_logits(logits, 0.7, top_k=3, top_p=0.9)).all()


# ---------------------------------------------------------------------------- the loss


def loss_batch():
    """One row: prompt token, then 3 loss tokens. Row logits are fixed so the kept set at
    top_k = 2 is tokens {0, 1}; token 3 (position 3) lies outside it."""
    logits = torch.zeros(1, 4, 4, dtype=D)
    logits[0, :] = L4[0]
    ids = torch.tensor([[2, 0, 1, 3]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=D)
    mb = {
        "input_ids": ids,
        "loss_mask": mask,
        "reduction_weights": mask / 3,
        "rollout_logprobs": torch.tensor([[0.0, -0.5, -1.2, -1.0]], dtype=D),
        "advantages": torch.tensor([[0.0, 1.0, 1.0, 1.0]], dtype=D),
    }
    return logits, mb


def test_loss_masks_counts_and_survives_a_token_outside_the_kept_set():
    logits, mb = loss_batch()
    logits.requires_grad_(True)
    algo = AlgoConfig(rollout_kl_coef=0.1, entropy_coef=0.01)
    algo.correction.tis = "token"
    loss, m = microbatch_loss(logits, mb, algo, temperature=1.0, top_k=2, old_from_current=True)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert m["drift/outside_kept_frac"].value.item() == pytest.approx(1 / 3)
    # The two kept tokens: learner logprobs log(0.5/0.8) and log(0.3/0.8).
    lp = [math.log(0.5 / 0.8), math.log(0.3 / 0.8)]
    worst = max(abs(lp[0] + 0.5), abs(lp[1] + 1.2))
    assert m["drift/logprob_abs_diff_max"].value.item() == pytest.approx(worst, abs=1e-12)
    assert m["drift/abs_logp_diff"].value.item() == pytest.approx((abs(lp[0] + 0.5) + abs(lp[1] + 1.2)) / 2)
    new = ("drift/outside_kept_frac", "drift/logprob_abs_diff_max", "drift/rollout_kl", "policy/entropy")
    assert all(M.is_known(k) for k in new) and set(new) <= set(m)


def test_logprob_abs_diff_max_is_the_max_over_loss_tokens_of_old_minus_rollout():
    logits, mb = loss_batch()
    mb["old_logprobs"] = torch.tensor([[-9.0, -0.7, -1.0, -2.0]], dtype=D)  # position 0 is no loss token
    mb["rollout_logprobs"] = torch.tensor([[0.0, -0.6, -1.5, -1.9]], dtype=D)
    _, m = microbatch_loss(logits, mb, AlgoConfig(), temperature=1.0)
    assert m["drift/logprob_abs_diff_max"].reduce == "max"
    assert m["drift/logprob_abs_diff_max"].value.item() == pytest.approx(0.5, abs=1e-12)
    assert M.spec("drift/logprob_abs_diff_max").reduce == "max"


def test_no_drift_metrics_when_the_engines_recorded_no_logprobs():
    """rollout.logprobs = false leaves zeros in rollout_logprobs: comparing against them
    reports a made-up drift (here |logp - 0| ~ 1 nat, KL ~ 0.4), so none is reported."""
    logits, mb = loss_batch()
    # No correction: it needs engine log-probs (with them off the config resolves tis to none).
    algo = AlgoConfig.model_validate({"correction": {"tis": "none"}})
    recorded = learner_loss_fn(algo, Sampling.of(RolloutConfig()), old_from_current=True)
    _, with_logprobs = recorded(logits, dict(mb, rollout_logprobs=torch.zeros_like(mb["loss_mask"])))
    assert with_logprobs["drift/abs_logp_diff"].value.item() > 0.5  # what the zeros would report
    off = learner_loss_fn(algo, Sampling.of(RolloutConfig(logprobs=False)), old_from_current=True)
    _, m = off(logits, dict(mb, rollout_logprobs=torch.zeros_like(mb["loss_mask"])))
    assert not [k for k in m if k.startswith("drift/") and k != "drift/outside_kept_frac"]
    assert "policy/entropy" in m and "loss/policy" in m


def test_the_learner_takes_the_cut_from_the_rollout_config():
    rollout = RolloutConfig(temperature=0.7, top_k=2, top_p=0.9)
    s = Sampling.of(rollout)
    assert (s.temperature, s.top_k, s.top_p, s.rollout_logprobs) == (0.7, 2, 0.9, True)
    logits, mb = loss_batch()
    fn = s.logprob_fn()
    assert torch.equal(
        fn(logits, mb["input_ids"], 0.7), token_logprobs(logits, mb["input_ids"], 0.7, top_k=2, top_p=0.9)
    )
    assert torch.isneginf(fn(logits, mb["input_ids"], 0.7)[0, 3])


def test_logprob_diff_alert():
    t = A.Thresholds()
    assert t.logprob_diff_max == 0.5
    kw = {"thresholds": t, "max_staleness": 1, "policy_version": 1, "generators": {}, "now": 0.0}
    assert not A.evaluate_alerts({"drift/logprob_abs_diff_max": 0.5}, **kw)
    (alert,) = A.evaluate_alerts({"drift/logprob_abs_diff_max": 0.9, "staleness/max": 0}, **kw)
    assert alert["kind"] == "logprob_diff_max" and alert["threshold"] == 0.5
    # Stale tokens differ by the policy's own updates: not a mismatch.
    stale = A.evaluate_alerts({"drift/logprob_abs_diff_max": 0.9, "staleness/max": 1}, **kw)
    assert "logprob_diff_max" not in {a["kind"] for a in stale}


def test_a_token_the_reference_cannot_sample_is_left_out_of_the_kl_term_only():
    logits, mb = loss_batch()
    mb["input_ids"] = torch.tensor([[2, 0, 1, 0]])  # every loss token inside the policy's top-2
    mb["ref_logprobs"] = torch.tensor([[0.0, -0.4, -torch.inf, -0.5]], dtype=D)
    logits.requires_grad_(True)
    algo = AlgoConfig(kl_coef=1.0, kl_estimator="k1")
    loss, m = microbatch_loss(logits, mb, algo, temperature=1.0, top_k=2, old_from_current=True)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert m["policy/ref_outside_kept_frac"].value.item() == pytest.approx(1 / 3)
    assert "drift/outside_kept_frac" in m and m["drift/outside_kept_frac"].value.item() == 0.0
    # k1 = logp - ref over the two tokens the reference keeps, weights 1/3 each.
    lp = math.log(0.5 / 0.8)
    assert m["loss/kl_ref"].value.item() == pytest.approx(((lp + 0.4) + (lp + 0.5)) / 3, abs=1e-12)
