"""Packed micro-batches on CUDA: the learner's forward on a packed row gives each sequence the
log-probs of its own padded row (transformers' SDPA), under the learner's per-sequence SDPA
(asyncrl.learner.attention: a float32 learner on CUDA) and, where the flash_attn package is
installed, flash_attention_2 (varlen kernel).

.venv/bin/python -m pytest tests/gpu/test_packing_cuda.py -q     # skipped without CUDA
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.data import microbatch as mbatch
from asyncrl.learner import attention
from asyncrl.learner.fsdp import attention_implementation
from asyncrl.learner.loss import token_logprobs
from asyncrl.learner.step import microbatch_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = [37, 5, 64, 1, 23, 64, 12]


def _logprobs(model_dir: str, attn: str, dtype: torch.dtype, packing: bool) -> tuple[torch.Tensor, int]:
    """[B, L] log-probs of LENGTHS' random sequences, and the token slots the forward computed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    model = model.to("cuda").train(False)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    seqs = [{"input_ids": rng.integers(4, vocab, n).astype(np.int64)} for n in LENGTHS]
    mb = mbatch.collate_packed(seqs, pad_token_id=0) if packing else mbatch.collate(seqs, pad_token_id=0)
    with torch.no_grad():
        logp = microbatch_logprobs(
            model, mb, temperature=0.8, logprob_fn=token_logprobs, device=torch.device("cuda")
        ).cpu()
    return logp, mbatch.computed_tokens(mb)


def _real(logp: torch.Tensor) -> torch.Tensor:
    return torch.cat([logp[k, 1:n] for k, n in enumerate(LENGTHS)])


def test_packed_varlen_sdpa_on_cuda_matches_padded(tiny_model_dir):
    attn = attention_implementation(torch.device("cuda"), "float32")
    assert attn == attention.VARLEN_SDPA
    padded, _ = _logprobs(tiny_model_dir, "sdpa", torch.float32, packing=False)
    packed, computed = _logprobs(tiny_model_dir, attn, torch.float32, packing=True)
    assert (_real(packed) - _real(padded)).abs().max() < 1e-4
    assert computed == sum(LENGTHS)  # one row, no pad at all


def test_packed_flash_attention_varlen_matches_padded_sdpa(tiny_model_dir):
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip("the flash_attn package is not installed")
    assert attention_implementation(torch.device("cuda"), "bfloat16") == "flash_attention_2"
    padded, _ = _logprobs(tiny_model_dir, "sdpa", torch.bfloat16, packing=False)
    packed, computed = _logprobs(tiny_model_dir, "flash_attention_2", torch.bfloat16, packing=True)
    assert computed == sum(LENGTHS)  # one row, no pad at all
    # bf16: two kernels agree to bf16's resolution, not bit for bit; a sequence that saw
    # another's tokens would be off by far more.
    assert (_real(packed) - _real(padded)).abs().mean() < 0.05
