"""The tiny model's character tokenizer made Llama-style (BOS on every ``encode``), with a chat template.

    tok = llama_style_tokenizer(tmp_dir, CHATML)                 # tokenizer only
    path = write_chat_model(tiny_model_dir, tmp_dir / "chat")    # the tiny model with that tokenizer

``CHATML`` is shaped like ChatML: each message is ``<bos>role:content<eos>|`` and the
generation prompt ``<bos>assistant:``. The ``|`` after ``<eos>`` plays ChatML's "\\n" after
``<|im_end|>``: part of the template's end of turn that an engine stopping at ``<eos>`` never
samples. Only the tokenizer changes: the ids of the vocabulary, hence the model, stay the same.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHATML = (
    "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>|{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)


def llama_style_tokenizer(path: str | Path, template: str | None = CHATML):
    """Write the tiny character tokenizer with a BOS post-processor and ``template`` to ``path``; load it back."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from asyncrl.rollout.tiny import write_tokenizer

    tok = write_tokenizer(path)
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(path))
    loaded = AutoTokenizer.from_pretrained(str(path))
    if loaded.encode("a")[0] != bos:
        raise RuntimeError(f"{path}: the saved tokenizer does not add a BOS")
    return loaded


def write_chat_model(model_dir: str | Path, path: str | Path, template: str | None = CHATML) -> Path:
    """A copy of the tiny model at ``model_dir`` whose tokenizer is ``llama_style_tokenizer``'s."""
    path = Path(path)
    shutil.copytree(model_dir, path)
    llama_style_tokenizer(path, template)
    return path


def scripted_policy(tok, replies, *, logprob: float, version: int):
    """The model's side of an episode without a model: fixed (text, finish_reason) replies, each
    token with `logprob` and weight `version`; it records every context it was given."""
    from asyncrl.rollout.envs.multiturn import Turn

    contexts, queue = [], iter(replies)

    async def policy(context):
        text, finish = next(queue)
        ids = tok.encode(text, add_special_tokens=False)
        contexts.append(list(context))
        return Turn(ids, [logprob] * len(ids), [version] * len(ids), finish)

    return policy, contexts
