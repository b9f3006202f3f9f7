"""Token log-probs and entropy from logits at a temperature.

.venv/bin/python -m pytest tests/unit/test_logprobs.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo import entropy_from_logits, logprobs_from_logits
from asyncrl.learner.loss import token_entropy, token_logprobs

D = torch.float64
# softmax([0, ln 2, ln 3]) = [1/6, 2/6, 3/6]; at T = 0.5 the logits double: [1, 4, 9] / 14.
LOGITS = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]], dtype=D)


def test_logprob_at_temperature_by_hand():
    target = torch.tensor([2])
    assert math.isclose(logprobs_from_logits(LOGITS, target, 1.0).item(), math.log(0.5), rel_tol=1e-12)
    assert math.isclose(logprobs_from_logits(LOGITS, target, 0.5).item(), math.log(9 / 14), rel_tol=1e-12)


def test_entropy_by_hand():
    p = [1 / 6, 1 / 3, 1 / 2]
    expected = -sum(x * math.log(x) for x in p)
    assert math.isclose(entropy_from_logits(LOGITS, 1.0).item(), expected, rel_tol=1e-12)
    q = [1 / 14, 4 / 14, 9 / 14]
    assert math.isclose(entropy_from_logits(LOGITS, 0.5).item(), -sum(x * math.log(x) for x in q), rel_tol=1e-12)


def test_entropy_matches_naive_and_its_gradient_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 5, generator=g, dtype=D) * 3).requires_grad_(True)
    naive = -(torch.softmax(logits / 0.7, -1) * torch.log_softmax(logits / 0.7, -1)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, 0.7, chunk_rows=4), naive, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.7, chunk_rows=4), (logits,))


def test_huge_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [5e3, 5e3, 5e3]], dtype=torch.float32, requires_grad=True)
    ent = entropy_from_logits(logits, 1.0)
    assert torch.allclose(ent, torch.tensor([0.0, math.log(3.0)]), atol=1e-5)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.isfinite(logprobs_from_logits(logits, torch.tensor([1, 0]), 0.3)).all()


def test_sequence_alignment_position_t_comes_from_logits_t_minus_1():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3, 4, generator=g, dtype=D)
    ids = torch.tensor([[3, 1, 2]])
    lp = token_logprobs(logits, ids, 1.0)
    assert lp[0, 0].item() == 0.0
    assert math.isclose(lp[0, 1].item(), torch.log_softmax(logits[0, 0], -1)[1].item(), rel_tol=1e-12)
    assert math.isclose(lp[0, 2].item(), torch.log_softmax(logits[0, 1], -1)[2].item(), rel_tol=1e-12)
    ent = token_entropy(logits, 1.0)
    assert ent[0, 0].item() == 0.0
    assert math.isclose(ent[0, 2].item(), entropy_from_logits(logits[0, 1], 1.0).item(), rel_tol=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(LOGITS, torch.tensor([0]), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(LOGITS, -1.0)
    with pytest.raises(ValueError, match="line up"):
        logprobs_from_logits(LOGITS, torch.tensor([0, 1]), 1.0)


def test_bf16_logits_are_upcast_and_gradients_flow_back_in_bf16():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 50, generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
    exact = logits.detach().float()
    ent = entropy_from_logits(logits, 0.9)
    lp = logprobs_from_logits(logits, torch.tensor([0, 7, 49]), 0.9)
    assert ent.dtype == torch.float32 and lp.dtype == torch.float32
    assert torch.allclose(ent, entropy_from_logits(exact, 0.9), atol=1e-6)
    assert torch.allclose(lp, logprobs_from_logits(exact, torch.tensor([0, 7, 49]), 0.9), atol=1e-6)
    (ent.sum() + lp.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_importing_the_math_pulls_in_neither_vllm_nor_ray():
    import subprocess
    import sys

    code = "import sys, asyncrl.algo; print(sorted(m for m in ('vllm', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_learner_masks_the_tokens_the_engine_may_not_sample():
    """With token 1 banned (a synthetic task's special token), the learner's policy is the
    engine's: softmax over the allowed tokens only, by hand [1/6, -, 3/6] / (4/6) = [1/4, 3/4];
    the entropy stays finite (a banned prompt token too) and the banned logit gets no gradient."""
    from types import SimpleNamespace

    from asyncrl.learner.step import disallowed_mask, policy_logits

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.z = torch.nn.Parameter(LOGITS.float().repeat(3, 1))  # [L=3, V=3]

        def forward(self, input_ids, use_cache):
            return SimpleNamespace(logits=self.z.unsqueeze(0).expand(input_ids.shape[0], -1, -1))

    model = Fixed()
    mask = disallowed_mask([0, 2], 3, torch.device("cpu"))
    assert mask.tolist() == [False, True, False] and disallowed_mask(None, 3, torch.device("cpu")) is None
    ids = torch.tensor([[1, 0, 2]])  # the prompt's first token is a banned one: still finite
    logits = policy_logits(model, ids, mask)
    logp = token_logprobs(logits, ids, 1.0)
    assert torch.allclose(logp[0, 1:], torch.tensor([math.log(0.25), math.log(0.75)]), atol=1e-6)
    ent = token_entropy(logits, 1.0)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert torch.isfinite(ent).all() and abs(ent[0, 1].item() - expected) < 1e-6
    (logp.sum() + ent.sum()).backward()
    assert model.z.grad[:, 1].abs().max().item() == 0.0 and model.z.grad[:, 0].abs().max().item() > 0
