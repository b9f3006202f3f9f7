"""A mistake in what a user types is one line at config load (exit 2), naming the field and
what to do, before Redis, Ray or an engine starts.

    .venv/bin/python -m pytest tests/unit/test_start_messages.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

import asyncrl.control.train as train_module
from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config


@pytest.fixture
def nothing_starts(monkeypatch):
    """A run that got past its checks would build its Runtime (Redis, Ray): that is the failure."""

    def started(*args, **kwargs):
        raise AssertionError("the run started before refusing its config")

    monkeypatch.setattr(train_module, "Runtime", started)


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_switching_the_env_keeps_the_old_env_kwargs_and_is_refused_before_anything_starts(capsys, nothing_starts):
    err = _refused(capsys, "train", "configs/demo.yaml", "rollout.env=countdown_chat")
    assert err.startswith("asyncrl train: config error: environment 'countdown_chat': bad rollout.env_kwargs")
    assert "does not take 'alphabet', 'min_len', 'max_len'" in err
    assert "(it takes: start_min, start_max, max_turns)" in err and "rollout.env_kwargs={}" in err


def test_a_misspelled_reward_function_names_the_field_and_the_likely_name(capsys, nothing_starts):
    bad = "rollout.rewards=[{fn: examples.custom_reward:exact_cpy}]"
    for argv in (["train", "configs/demo.yaml", bad], ["train", "configs/demo.yaml", bad, "--check"]):
        err = _refused(capsys, *argv)
        assert "rollout.rewards[0].fn: reward function 'examples.custom_reward:exact_cpy'" in err
        assert "has no attribute 'exact_cpy'; did you mean 'exact_copy'?" in err


def test_a_misspelled_environment_class_gets_the_likely_name(capsys, nothing_starts):
    err = _refused(capsys, "train", "configs/demo.yaml", "rollout.env=asyncrl.rollout.envs.synthetic:CopyEn")
    assert "has no attribute 'CopyEn'; did you mean 'CopyEnv'?" in err


def test_resume_from_a_run_dir_that_does_not_exist(capsys, tmp_path):
    err = _refused(capsys, "train", "--resume", str(tmp_path / "notarun"))
    assert (
        err == f"asyncrl train: config error: --resume {str(tmp_path / 'notarun')!r}: the run directory does not exist"
    )
    err = _refused(capsys, "train", "--resume", str(tmp_path))
    assert err.endswith("not a run directory (no config.yaml)")


@pytest.mark.parametrize(
    "override",
    [
        "rollout.rewards=[{fn: examples.custom_reward:exact_copy}",
        "rollout.env_kwargs={alphabet: abc",
        'control.run_name="demo',
    ],
)
def test_a_yaml_error_inside_an_override_is_reported_as_one(override):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", [override])
    assert str(e.value).startswith(f"override {override!r}: the value is not valid YAML: ")
    assert "expected a" not in str(e.value).partition("YAML: ")[0]


def test_plain_text_that_is_not_yaml_stays_a_string():
    assert load_config("configs/demo.yaml", ["control.run_name=@demo"]).control.run_name == "@demo"


def test_a_module_not_on_the_path_says_how_to_put_it_there(capsys):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", ["rollout.rewards=[{fn: my_rewards.scoring:exact}]"])
    assert "module 'my_rewards.scoring' cannot be found on the Python path" in str(e.value)
    assert "PYTHONPATH=." in str(e.value) and "install the package" in str(e.value)


def test_a_config_files_paths_resolve_against_its_directory(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.jsonl").write_text('{"prompt": "ab="}\n')
    (project / "run.yaml").write_text(
        "rollout: {prompts: data/train.jsonl}\ncontrol: {eval_prompts: data/train.jsonl}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "run.yaml")
    assert cfg.rollout.prompts == cfg.control.eval_prompts == str(project / "data" / "train.jsonl")
    # an override is the user's typing: relative to the working directory
    with pytest.raises(ConfigError, match=r"rollout\.prompts='data/train\.jsonl': no such file"):
        load_config(project / "run.yaml", ["rollout.prompts=data/train.jsonl"])


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_loads_from_any_directory(tmp_path, monkeypatch, config):
    monkeypatch.chdir(tmp_path)
    if config.stem == "reward_model":  # its reward model is written by a command run first (its header)
        with pytest.raises(ConfigError, match="runs/tiny-reward-model"):
            load_config(config)
        return
    if config.stem == "distill":  # its teacher is exported by commands run first (its header)
        with pytest.raises(ConfigError, match="runs/distill-teacher/hf"):
            load_config(config)
        return
    cfg = load_config(config)
    if cfg.rollout.prompts and not cfg.rollout.prompts.count(":"):
        assert Path(cfg.rollout.prompts).is_file()  # a prompt file next to the repo, found from elsewhere


def test_every_option_of_every_command_is_described():
    """`asyncrl COMMAND --help` says what each option does (argparse shows an undescribed one bare)."""
    import argparse

    from asyncrl.cli import _parser
    from asyncrl.monitor.dashboard.__main__ import _parser as dashboard_parser

    root = _parser()
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction)).choices
    parsers = {f"asyncrl {name}": p for name, p in commands.items() if name != "dashboard"}
    parsers["asyncrl dashboard"] = dashboard_parser()
    bare = [
        f"{prog} {action.option_strings or action.dest}"
        for prog, parser in parsers.items()
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert bare == []


def test_a_run_prints_neither_rays_token_notice_nor_a_shard_progress_bar(tmp_path, capfd, monkeypatch):
    """Ray's notice that the private instance has a token (our default) and transformers' bar
    for the tiny model's one shard are noise in every run's output; Ray's warning for a cluster
    WITHOUT a token stays."""
    import logging

    from ray._private.authentication import authentication_token_setup as ray_token

    from asyncrl.control.cluster import RAY_TOKEN_LOGGER, mute_ray_token_notice
    from asyncrl.rollout.tiny import write_tiny_model

    write_tiny_model(tmp_path / "tiny")
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err

    # Ray's logger as a run leaves it (whatever earlier tests did to logging), with a handler
    # that records what passes its filters.
    logger = logging.getLogger(RAY_TOKEN_LOGGER)
    monkeypatch.setattr(logger, "disabled", False)
    monkeypatch.setattr(logger, "level", logging.INFO)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        mute_ray_token_notice()
        ray_token._warn_token_auth_enabled()
        ray_token._warn_token_auth_disabled()
    finally:
        logger.removeHandler(handler)
    assert not any(m.startswith("Token authentication is enabled") for m in seen), seen
    assert any(m.startswith("Token authentication is disabled") for m in seen), seen
