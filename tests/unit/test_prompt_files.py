"""Prompt files as users write them: malformed ones fail naming the file and line, a JSON array
of objects and chat-format rows (``messages: [{role, content}, ...]``) are read, and chat rows
reach the engine rendered whole by the tokenizer's chat template.

    .venv/bin/python -m pytest tests/unit/test_prompt_files.py -q
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from asyncrl.rollout.prompts import PromptSourceError, check_source, encode_prompt, open_prompts, prompt_encoder


def take(path, k=1):
    return list(itertools.islice(open_prompts(str(path), None, seed=0, id_prefix="g0.1"), k))


GOOD = b'{"prompt": "ab="}\n'
CHAT_ROW = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("name", "data", "line", "what"),
    [
        ("number.jsonl", GOOD + b"42\n", 2, "expected a JSON object (a record), got 42"),
        ("null.jsonl", GOOD + b"\n" + GOOD + b"null\n", 4, "expected a JSON object (a record), got null"),
        ("list.jsonl", GOOD + b"[1, 2]\n", 2, "expected a JSON object (a record), got [1, 2]"),
        ("latin1.jsonl", GOOD + b'{"prompt": "caf\xe9"}\n', 2, "not UTF-8 (byte 0xe9"),
        ("array.json", b'[\n  {"prompt": "a"},\n  "b"\n]\n', 3, 'expected a JSON object (a record), got "b"'),
        ("broken.json", b'[\n  {"prompt": "a"},\n  {"prompt": "b" "c"}\n]', 3, "not valid JSON"),
        ("bad.jsonl", GOOD + b'{"prompt": "a"\n', 2, "not valid JSON"),
        (
            "role.jsonl",
            GOOD + json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(),
            2,
            "column 'messages': message 0: role 'bot' is not one of system, user, assistant, tool",
        ),
        (
            "content.jsonl",
            GOOD + json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(),
            2,
            "message 0: content holds a number, expected a string or a list of parts",
        ),
        (
            "part.jsonl",
            GOOD + json.dumps({"messages": [{"role": "user", "content": ["x"]}]}).encode(),
            2,
            "column 'messages': message 0: part 0 is \"x\", expected {'type': 'text' | 'image', ...}",
        ),
        (
            "shape.jsonl",
            GOOD + json.dumps({"messages": [CHAT_ROW, "hello"]}).encode(),
            2,
            'message 1 is "hello", expected {role, content}',
        ),
        (
            "ends.jsonl",
            GOOD + json.dumps({"messages": [CHAT_ROW, {"role": "assistant", "content": "x"}]}).encode(),
            2,
            "ends with an assistant turn",
        ),
        ("nouser.jsonl", GOOD + json.dumps({"messages": [{"role": "system", "content": "x"}]}).encode(), 2, "no user"),
    ],
)
def test_a_malformed_record_names_the_file_and_line(tmp_path, name, data, line, what):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(PromptSourceError) as e:  # what a generator does when it opens the source
        take(path)
    assert str(e.value).startswith(f"rollout.prompts: {path}:{line}: ")
    assert what in str(e.value)


def test_a_json_array_of_objects_is_a_prompt_file(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"prompt": "ab=", "answer": "ab"}, {"prompt": "ba=", "answer": "ba"}], indent=2))
    assert sorted((t, m["answer"]) for _, t, m in take(path, 2)) == [("ab=", "ab"), ("ba=", "ba")]
    assert check_source(str(path)).describe() == "2 records read and valid"
    # a .json of one object a line still works, and a byte-order mark is not data
    lines = tmp_path / "lines.json"
    lines.write_bytes(b"\xef\xbb\xbf" + GOOD + b'{"prompt": "x\xe2\x80\xa8y="}\n')  # U+2028 inside a string
    assert sorted(t for _, t, _ in take(lines, 2)) == ["ab=", "x\u2028y="]


def test_chat_rows_are_rendered_whole_by_the_chat_template(tmp_path):
    from tests.support.chat import CHATML, llama_style_tokenizer

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab="}]
    path = tmp_path / "chat.jsonl"
    # TRL's conversational "prompt" column, and the usual "messages" column
    path.write_text(
        json.dumps({"prompt": conversation, "answer": "ab"}) + "\n" + json.dumps({"messages": conversation}) + "\n"
    )
    rows = take(path, 2)
    tok = llama_style_tokenizer(tmp_path / "tok", CHATML)
    want = tok.encode(
        tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert tok.decode(want) == "<bos>system:be brief<eos>|<bos>user:ab=<eos>|<bos>assistant:"
    for _, text, meta in rows:
        assert text == "ab="  # the reward's prompt: the last user turn
        assert meta["prompt_messages"] == conversation
        assert encode_prompt(tok, text, True, meta) == want == prompt_encoder(tok, True)(text, meta)
    assert check_source(str(path), chat_template=True).describe() == "2 records read and valid (2 chat conversations)"
    # without the template there is no way to tokenize a conversation: said at start-up and at encoding
    with pytest.raises(PromptSourceError, match=rf"{re.escape(str(path))}:1: .*set rollout\.chat_template=true"):
        check_source(str(path))
    with pytest.raises(PromptSourceError, match=r"set rollout\.chat_template=true"):
        encode_prompt(tok, rows[0][1], False, rows[0][2])
    # a plain prompt still renders as one user turn
    assert tok.decode(encode_prompt(tok, "ab=", True)) == "<bos>user:ab=<eos>|<bos>assistant:"
