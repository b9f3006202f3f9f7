"""Prompt sources (jsonl, saved Hugging Face datasets, hub ids) and chat-template encoding.

    .venv/bin/python -m pytest tests/unit/test_prompt_sources.py -q

Datasets are written with ``save_to_disk`` to a temp dir; nothing touches the network (hub
ids are only recognised and validated, never loaded).
"""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from asyncrl.rollout.prompts import PromptSourceError, encode_prompt, is_hub_id, open_prompts

TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def take(source, k, **kw):
    return list(itertools.islice(open_prompts(source, None, seed=0, id_prefix="g0.1", **kw), k))


@pytest.fixture
def dataset_dict(tmp_path):
    import datasets

    path = tmp_path / "gsm"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"question": ["1+1=", "2+2="], "solution": ["2", "4"], "k": [1, 2]}),
            "test": datasets.Dataset.from_dict({"question": ["3+3="], "solution": ["6"], "k": [3]}),
        }
    ).save_to_disk(str(path))
    return str(path)


def test_a_dataset_dict_directory_gives_its_split_and_the_answer_column(dataset_dict):
    rows = take(dataset_dict, 4, split="train", prompt_field="question", answer_field="solution")
    assert sorted(t for _, t, _ in rows[:2]) == ["1+1=", "2+2="]  # one epoch: each row once
    for _, text, meta in rows:
        # the answer column becomes metadata["answer"] (what gsm8k scores against); others stay
        assert meta == {"answer": str(int(text[0]) * 2), "k": int(text[0])}
    assert {i.rsplit(":", 2)[0] for i, _, _ in rows} == {"g0.1:gsm"}
    ((_, text, meta),) = take(dataset_dict, 1, split="test", prompt_field="question", answer_field="solution")
    assert (text, meta["answer"]) == ("3+3=", "6")
    # the default prompt field falls back to GSM8K's "question"; the default answer field may be absent
    assert take(dataset_dict, 1, split="test")[0][1:] == ("3+3=", {"solution": "6", "k": 3})


def test_a_plain_saved_dataset_ignores_the_split(tmp_path):
    import datasets

    path = tmp_path / "plain"
    datasets.Dataset.from_dict({"prompt": ["ab="], "answer": ["ab"]}).save_to_disk(str(path))
    assert take(str(path), 2, split="no-such-split") == [
        ("g0.1:plain:0:0", "ab=", {"answer": "ab"}),
        ("g0.1:plain:1:0", "ab=", {"answer": "ab"}),
    ]


def test_errors_name_the_split_the_field_the_columns_and_the_path(dataset_dict, tmp_path):
    with pytest.raises(PromptSourceError, match=r"no split 'validation' \(rollout.prompt_split\).*\['test', 'train'\]"):
        take(dataset_dict, 1, split="validation")
    with pytest.raises(PromptSourceError, match=r"control.eval_prompts=.*no split 'dev' \(control.eval_split\)"):
        take(dataset_dict, 1, split="dev", where="control.eval_prompts")
    with pytest.raises(PromptSourceError) as e:
        take(dataset_dict, 1, prompt_field="text")
    msg = str(e.value)
    assert "'text'" in msg and "rollout.prompt_field" in msg and dataset_dict in msg
    assert "['k', 'question', 'solution']" in msg
    with pytest.raises(PromptSourceError, match=r"no answer column 'label' \(rollout.answer_field\).*'solution'"):
        take(dataset_dict, 1, prompt_field="question", answer_field="label")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a=", "target": "a"}) + "\n" + json.dumps({"input": "b="}))
    with pytest.raises(PromptSourceError, match=r"p.jsonl:2: no prompt column 'prompt'.*\['input'\]"):
        take(str(jsonl), 1)
    with pytest.raises(PromptSourceError, match="does not exist"):
        take(str(tmp_path / "missing.jsonl"), 1)
    (tmp_path / "not-a-dataset").mkdir()
    with pytest.raises(PromptSourceError, match="save_to_disk"):
        take(str(tmp_path / "not-a-dataset"), 1)


def test_hub_ids_are_recognised_and_validated_without_the_network(tmp_path):
    from asyncrl.config import ConfigError, load_config

    assert is_hub_id("openai/gsm8k") and is_hub_id("openai/gsm8k:main")
    assert not is_hub_id("data/train.jsonl") and not is_hub_id("gsm8k") and not is_hub_id("/abs/dir")
    cfg = load_config(None, ["rollout.prompts=openai/gsm8k:main", "control.eval_prompts=openai/gsm8k:main"])
    assert cfg.rollout.prompt_split == "train" and cfg.control.eval_split == "test"
    with pytest.raises(ConfigError, match=r"rollout.prompts='data/nope.jsonl': no such file.*hub dataset id"):
        load_config(None, ["rollout.prompts=data/nope.jsonl"])
    with pytest.raises(ConfigError, match=r"control.eval_prompts='./nope': no such file"):
        load_config(None, ["control.eval_prompts=./nope"])
    with pytest.raises(ConfigError, match=r"rollout.prompt_field='': String should have at least 1 character"):
        load_config(None, ["rollout.prompt_field="])


def test_an_unreachable_hub_dataset_fails_naming_the_option():
    import os
    import subprocess

    code = (
        "from asyncrl.rollout.prompts import PromptSourceError, read_records\n"
        "try:\n    read_records('nobody-here/none:x')\n"
        "except PromptSourceError as e:\n    print(e)\n"
    )
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")  # never the network
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.startswith("rollout.prompts='nobody-here/none:x' (hub dataset, split 'train'): datasets.load_dataset")


def test_the_config_parse_imports_no_datasets():
    import subprocess

    code = (
        "import sys; from asyncrl.config import load_config; "
        "load_config('configs/gsm8k_qwen2.5_0.5b_gpu.yaml'); "
        "print(sorted(m for m in ('datasets', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_chat_template_renders_the_user_turn_and_is_required(tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.rollout.prompts import check_chat_template
    from asyncrl.rollout.tiny import write_tokenizer

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert encode_prompt(tok, "abc=") == tok.encode("abc=")
    with pytest.raises(PromptSourceError, match=r"rollout.chat_template=true.*rollout.model='tiny'.*no chat template"):
        check_chat_template(tok, "tiny")
    tok.chat_template = TEMPLATE
    check_chat_template(tok, "tiny")
    ids = encode_prompt(tok, "abc=", chat_template=True)
    assert ids == [tok.bos_token_id, *tok.encode("user: abc=|assistant: ")]  # <bos> once: the template's


def test_evaluation_prompts_come_from_the_eval_split_templated(dataset_dict, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.control.evaluate import Evaluator
    from asyncrl.rollout.evaluation import HeldOut
    from asyncrl.rollout.prompts import prompt_encoder
    from asyncrl.rollout.tiny import write_tokenizer

    write_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    cfg = load_config(
        None,
        [
            "rollout.env=gsm8k",
            f"control.eval_prompts={dataset_dict}",
            "rollout.answer_field=solution",
            "rollout.chat_template=true",
            "control.eval_size=2",
        ],
    )
    ev = Evaluator(cfg)
    assert [(text, meta["answer"]) for _, text, meta in ev.prompts] == [("3+3=", "6")] * 2  # "test", cycled
    # A generator encodes them as its training prompts: its encoder, rollout.chat_template applied.
    held_out = HeldOut(cfg, None, tok, None, "g", prompt_encoder(tok, cfg.rollout.chat_template))
    items = held_out.items(ev.prompts)
    assert [i.prompt_id for i in items] == ["eval:gsm:0:0", "eval:gsm:1:0"]  # the request ids: fixed seeds
    assert items[0].ids == [tok.bos_token_id, *tok.encode("user: 3+3=|assistant: ")]
