"""An elastic generator (`asyncrl generate`) runs no code its own host did not allow, whatever
was written into Redis: with a queue password the job's config must carry its trainer's
signature, and with or without one every import path in it must be on the generator's
allow-list, checked before anything is imported. Real redis-servers on loopback; the refusals
happen before any engine would start, so no vLLM and no training job here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from asyncrl.config import ConfigError, load_config
from asyncrl.control.allowlist import ImportAllowList, ImportPath, named_imports, typed_imports
from asyncrl.control.elastic import job_config
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.queue.server import EmbeddedRedis
from tests.support.job import elastic_generator_argv

ROOT = Path(__file__).resolve().parents[2]
MARKER = "asyncrl_elastic_marker"
"""A module that leaves a file next to itself when imported: proof that code from Redis ran."""
MARKER_ENV = f"{MARKER}:MarkerEnv"
PASSWORD = "elastic-trust-password-0123"


@pytest.fixture
def marker(tmp_path, monkeypatch) -> Path:
    """The marker module's folder, on this process's path; returns the file an import leaves."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / f"{MARKER}.py").write_text(
        "from pathlib import Path\nPath(__file__).with_suffix('.imported').touch()\nclass MarkerEnv:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    yield mods / f"{MARKER}.imported"
    sys.modules.pop(MARKER, None)


@pytest.fixture
def password_redis(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", aof=False, password=PASSWORD)
    server.start()
    yield server
    server.stop()


def _job(**rollout) -> dict:
    data = load_config(ROOT / "configs" / "demo.yaml", ["control.run_name=trust"]).to_dict()
    data["rollout"].update(rollout)
    return data


def _publish(url: str, run: str, data: dict, model_path: str = "/models/tiny") -> RunState:
    """Publish the job the way the trainer does (RunState.set_state signs it under the password)."""
    rs = RunState.connect(url, run)
    rs.set_state(status="running", config=json.dumps(data), model_path=model_path)
    return rs


def _tamper(url: str, run: str, **fields: str | bytes) -> None:
    client = redis.Redis.from_url(url)
    client.hset(keys.state(run), mapping=fields)
    client.close()


def _generate(url: str, run: str, mods: Path, *options: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(mods), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = elastic_generator_argv(url, run, "elastic-trust", *options)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_signed_config_is_accepted_and_any_change_to_it_is_refused(password_redis, marker):
    allow = ImportAllowList.build([MARKER_ENV, "subprocess:Popen"])
    # Published as the trainer does, over its queue's connection (password as an argument);
    # read back over a connection whose password is in the URL.
    plain_url = password_redis.url.replace(f":{PASSWORD}@", "")
    queue = RolloutQueue.connect(plain_url, "signed", password=PASSWORD)
    RunState.of(queue).set_state(status="running", config=json.dumps(_job(env=MARKER_ENV)), model_path="/models/tiny")
    queue.close()
    rs = RunState.connect(password_redis.url, "signed")
    cfg, model_path = job_config(rs, allow, redis_url=password_redis.url, password=None)
    assert (cfg.rollout.env, model_path) == (MARKER_ENV, "/models/tiny")
    assert MARKER not in sys.modules and not marker.exists()  # parsing looks the module up only

    signed = rs.published_job()
    assert signed is not None and signed.signature is not None
    tampered = {
        "config": json.dumps(_job(env="subprocess:Popen", env_kwargs={"args": ["touch", "/tmp/x"]})),
        "model_path": "/elsewhere",
    }
    original = {"config": signed.config, "model_path": signed.model_path}
    for field, value in tampered.items():
        _tamper(password_redis.url, "signed", **{**original, field: value})
        with pytest.raises(ConfigError, match="signature that does not match"):
            job_config(
                rs, allow, redis_url=password_redis.url, password=None
            )  # even with subprocess:Popen allowed: the trainer did not write it

    # A job signed for another run, copied over whole, is refused too; so is a missing signature.
    _tamper(password_redis.url, "copy", config=signed.config, model_path=signed.model_path, config_sig=signed.signature)
    copy = RunState.connect(password_redis.url, "copy")
    with pytest.raises(ConfigError, match="signature that does not match"):
        job_config(copy, allow, redis_url=password_redis.url, password=None)
    copy.close()
    redis.Redis.from_url(password_redis.url).hdel(keys.state("signed"), "config_sig")
    with pytest.raises(ConfigError, match="carries no signature"):
        job_config(rs, allow, redis_url=password_redis.url, password=None)
    rs.close()


def test_asyncrl_generate_refuses_a_tampered_config_before_importing_it(password_redis, marker):
    """The command itself: one line, exit code 2, and the module named in Redis never imported
    (the marker file is not there), though this host allows that path."""
    rs = _publish(password_redis.url, "cli", _job())
    _tamper(password_redis.url, "cli", config=json.dumps(_job(env=MARKER_ENV)))
    plain_url = password_redis.url.replace(f":{PASSWORD}@", "")
    done = _generate(plain_url, "cli", marker.parent, "--password", PASSWORD, "--allow-import", MARKER_ENV)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "asyncrl generate: config error: run 'cli': the job's config in Redis has a signature that does not"
    )
    assert "Traceback" not in done.stderr and not marker.exists()
    rs.close()


def test_without_a_password_only_allow_listed_import_paths_are_loaded(redis_url, marker, tmp_path):
    rs = _publish(redis_url, "open", _job(env=MARKER_ENV))
    assert rs.state().get("config_sig") is None  # nothing to sign with
    with pytest.raises(ConfigError) as refused:
        job_config(rs, ImportAllowList.build(["my_pkg.rewards:other"]), redis_url=redis_url, password=None)
    assert f"rollout.env={MARKER_ENV!r}" in str(refused.value)
    assert f"--allow-import {MARKER_ENV}" in str(refused.value)
    assert MARKER not in sys.modules and not marker.exists()

    cfg, _ = job_config(rs, ImportAllowList.build([MARKER_ENV]), redis_url=redis_url, password=None)
    assert cfg.rollout.env == MARKER_ENV
    own = tmp_path / "job.yaml"
    own.write_text(f"rollout:\n  env: {MARKER_ENV}\n")
    assert (
        job_config(rs, ImportAllowList.build(config_files=[own]), redis_url=redis_url, password=None)[0].rollout.env
        == MARKER_ENV
    )

    # Built-in names need no allow-list.
    rs.set_state(config=json.dumps(_job(env="copy")), model_path="/models/tiny")
    assert job_config(rs, ImportAllowList(), redis_url=redis_url, password=None)[0].rollout.env == "copy"
    rs.close()


def test_asyncrl_generate_without_a_password_names_the_path_and_the_flag(redis_url, marker):
    rs = _publish(redis_url, "open-cli", _job(env=MARKER_ENV))
    done = _generate(redis_url, "open-cli", marker.parent)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert MARKER_ENV in last and f"--allow-import {MARKER_ENV}" in last, last
    assert "Traceback" not in done.stderr and not marker.exists()
    rs.close()


def test_every_field_that_names_code_is_found_before_and_after_parsing():
    data = _job(
        env="pkg.envs:MyEnv",
        rewards=[{"fn": "pkg.rewards:exact", "weight": 1.0}],
        engine_kwargs={"worker_extension_cls": "pkg.ext.Ext", "logits_processors": ["pkg.lp.A"], "max_num_seqs": 4},
    )
    data["algo"]["advantage_estimator"] = "pkg.adv:mine"
    data["algo"]["policy_loss"] = {"type": "pkg.losses:mine", "kwargs": {"beta": 0.1}}
    expected = [
        ImportPath("rollout.env", "pkg.envs:MyEnv"),
        ImportPath("rollout.rewards[0].fn", "pkg.rewards:exact"),
        ImportPath("algo.advantage_estimator", "pkg.adv:mine"),
        ImportPath("algo.policy_loss", "pkg.losses:mine"),
        ImportPath("rollout.engine_kwargs.worker_extension_cls", "pkg.ext.Ext"),
        ImportPath("rollout.engine_kwargs.logits_processors[0]", "pkg.lp.A"),
    ]
    assert named_imports(data) == expected
    builtins = load_config(ROOT / "configs" / "demo.yaml")
    assert typed_imports(builtins) == [] and named_imports(builtins.to_dict()) == []

    remote = _job(engine_kwargs={"trust_remote_code": True})
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        ImportAllowList().check([], remote_code=True)
    ImportAllowList.build(remote_code=True).check(named_imports(remote), remote_code=True)
