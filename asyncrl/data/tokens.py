"""Which tokens the policy may sample: the generators' ban on special tokens, applied by vLLM
as a -inf logits mask, and the same ban in the learner's logits (``asyncrl.learner.step``),
so the policy it trains is the one the engine sampled from, not a renormalised cousin.

An environment says whether it bans them (``Environment.sample_special_tokens``); the driver
hands that flag to the learner, which never imports the environments.
"""

from __future__ import annotations


def sampleable_ids(tokenizer) -> list[int]:
    """Every id of `tokenizer` but its special ones, EOS excepted (a task must still stop)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special.discard(tokenizer.eos_token_id)
    return [i for i in range(len(tokenizer)) if i not in special]
