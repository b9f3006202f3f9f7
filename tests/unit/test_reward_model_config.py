"""rollout.rewards entries {model: DIR, ...}: checked at config load and by `--check` from the
directory's config.json and tokenizer, each error naming the entry and the path."""

from __future__ import annotations

import json
import re

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.reward_model import RewardModelConfig

COPY = "rollout.env_kwargs={alphabet: abc, min_len: 3, max_len: 3}"


def with_rewards(*entries: str):
    return load_config(None, [COPY, f"rollout.rewards=[{', '.join(entries)}]"])


def model_dir(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_bad_reward_model_path_fails_at_load_naming_the_entry_and_the_path(tmp_path):
    rule = "{fn: examples.custom_reward:exact_copy}"
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=re.escape(f"rollout.rewards[1].model='{missing}': no such directory")):
        with_rewards(rule, f"{{model: {missing}}}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].model='.*file': not a directory"):
        with_rewards(f"{{model: {tmp_path / 'file'}}}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].model='.*empty': no config.json in it"):
        with_rewards(f"{{model: {tmp_path / 'empty'}}}")
    lm = model_dir(tmp_path, "lm", {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].model='.*lm': not a sequence-classification model"):
        with_rewards(f"{{model: {lm}}}")


def test_the_reward_is_the_single_logit_or_a_named_labels_probability(tmp_path):
    arch = ["BertForSequenceClassification"]
    one = model_dir(tmp_path, "one", {"architectures": arch, "id2label": {"0": "LABEL_0"}})
    two = model_dir(tmp_path, "two", {"architectures": arch, "id2label": {"0": "bad", "1": "good"}})
    cfg = with_rewards(f"{{model: {one}, weight: 0.5, batch_size: 4}}", f"{{model: {two}, label: good}}")
    first, second = cfg.rollout.rewards
    assert isinstance(first, RewardModelConfig) and (first.weight, first.batch_size, first.label) == (0.5, 4, None)
    assert isinstance(second, RewardModelConfig) and second.label == "good"
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].label: .* has 2 labels \['bad', 'good'\]; name the"):
        with_rewards(f"{{model: {two}}}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].label='ok': .* has labels \['bad', 'good'\]"):
        with_rewards(f"{{model: {two}, label: ok}}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].label='LABEL_0': .* single label"):
        with_rewards(f"{{model: {one}, label: LABEL_0}}")


def test_reward_model_fields_are_checked_like_any_section(tmp_path):
    one = model_dir(tmp_path, "one", {"architectures": ["XForSequenceClassification"], "num_labels": 1})
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].weight=nan: must be a finite number"):
        with_rewards(f"{{model: {one}, weight: .nan}}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].batch_size=0: must be >= 1"):
        with_rewards(f"{{model: {one}, batch_size: 0}}")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[0\].fn: unknown field; RewardModelConfig has: model,"):
        with_rewards(f"{{model: {one}, fn: examples.custom_reward:exact_copy}}")
    # The config round-trips (a resumed run reads its config.yaml back).
    cfg = with_rewards("{fn: examples.custom_reward:exact_copy}", f"{{model: {one}, num_gpus: 1}}")
    again = load_config(None, [COPY, f"rollout.rewards={json.dumps(cfg.to_dict()['rollout']['rewards'])}"])
    assert again.rollout.rewards == cfg.rollout.rewards


def test_check_reads_the_reward_models_tokenizer(tmp_path):
    from asyncrl.control.preflight import check_imports
    from examples.tiny_reward_model import write_tiny_reward_model

    path = write_tiny_reward_model(tmp_path / "rm")
    cfg = with_rewards("{fn: examples.custom_reward:exact_copy}", f"{{model: {path}, weight: 0.5}}")
    lines = check_imports(cfg)
    assert (
        f"rollout.rewards[1].model={path}: LlamaForSequenceClassification, reward = its logit (num_labels=1), "
        "tokenizer loaded" in lines
    )
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"rollout.rewards\[1\].model='.*rm': its tokenizer cannot be loaded"):
        check_imports(cfg)


def test_the_example_config_loads_once_its_tiny_reward_model_is_written(tmp_path, monkeypatch):
    from pathlib import Path

    from examples.tiny_reward_model import write_tiny_reward_model

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)  # the example names runs/tiny-reward-model, relative to where it runs
    with pytest.raises(ConfigError, match=r"rollout.rewards\[1\].model='runs/tiny-reward-model': no such directory"):
        load_config(root / "configs" / "reward_model.yaml")
    write_tiny_reward_model(tmp_path / "runs" / "tiny-reward-model")
    rewards = load_config(root / "configs" / "reward_model.yaml").rollout.rewards
    assert [(type(r).__name__, r.weight) for r in rewards] == [("RewardFnConfig", 1.0), ("RewardModelConfig", 0.1)]
