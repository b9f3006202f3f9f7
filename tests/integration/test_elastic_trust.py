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

from asyncrl.cli import main as cli_main
from asyncrl.config import ConfigError, load_config
from asyncrl.control.allowlist import ImportAllowList, ImportPath, named_imports, typed_imports
from asyncrl.control.elastic import job_config
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.queue.server import EmbeddedRedis
from asyncrl.queue.signing import JobSigner, password_signature, signature_fields
from tests.support.job import elastic_generator_argv
from tests.support.leaks import assert_no_secret, redis_values

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


def _publish_raw(url: str, run: str, config: str | bytes, model_path: str = "/models/tiny") -> None:
    """A config written into the state hash as it is (by a writer that holds the credentials)."""
    _tamper(url, run, config=config, model_path=model_path)


def _cli_generate(capsys, url: str, run: str, *options: str) -> tuple[int, str]:
    """`asyncrl generate` in this process: (exit code, stderr)."""
    rc = cli_main(["generate", "--redis", url, "--run", run, "--connect-timeout", "5", *options])
    return rc, capsys.readouterr().err


def test_engine_settings_that_can_name_code_need_the_hosts_allow(redis_url, tmp_path, capsys):
    """vLLM executes a reasoning-parser plugin file at engine start, and imports the classes and
    module paths other settings name: an elastic generator takes from the published config only
    the engine settings that are plain numbers, switches or fixed words."""
    ran = tmp_path / "plugin-ran"
    plugin = tmp_path / "plugin.py"
    plugin.write_text(f"from pathlib import Path\nPath({str(ran)!r}).touch()\n")
    rs = _publish(redis_url, "engine", _job(engine_kwargs={"max_num_seqs": 4, "reasoning_parser_plugin": str(plugin)}))
    with pytest.raises(ConfigError) as refused:
        job_config(rs, ImportAllowList(), redis_url=redis_url, password=None)
    assert "rollout.engine_kwargs.reasoning_parser_plugin" in str(refused.value)
    assert "--allow-engine-key reasoning_parser_plugin" in str(refused.value)
    rc, err = _cli_generate(capsys, redis_url, "engine")
    assert rc == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and "--allow-engine-key reasoning_parser_plugin" in err, err
    assert not ran.exists()

    hostile = {
        "scheduler_cls": "pkg.sched:Evil",
        "distributed_executor_backend": "pkg.executors.Evil",  # a qualified name vLLM would import
        "compilation_config": {"backend": "pkg.compile:evil"},
        "kv_transfer_config": {"kv_connector_module_path": "pkg.kv"},
        "tokenizer": "/etc",  # a directory vLLM would read
        "max_num_seqs": "4",  # a listed key, but not of its shape
        "some_key_vllm_adds_later": 1,
    }
    for key, value in hostile.items():
        rs.set_state(config=json.dumps(_job(engine_kwargs={key: value})), model_path="/models/tiny")
        with pytest.raises(ConfigError, match=f"rollout.engine_kwargs.{key}, which"):
            job_config(rs, ImportAllowList(), redis_url=redis_url, password=None)

    # A worker class needs its import path allowed, as before, and nothing more.
    rs.set_state(config=json.dumps(_job(engine_kwargs={"worker_extension_cls": "pkg.ext.Ext"})), model_path="/m")
    assert job_config(rs, ImportAllowList.build(["pkg.ext.Ext"]), redis_url=redis_url, password=None)[0]

    # The host's allow: a key with any value, or the exact setting in its own config file.
    safe = {"max_num_seqs": 4, "enable_prefix_caching": True, "distributed_executor_backend": "mp", "dtype": "auto"}
    nested = {**safe, "compilation_config": {"mode": 0}}
    rs.set_state(config=json.dumps(_job(engine_kwargs=nested)), model_path="/models/tiny")
    with pytest.raises(ConfigError, match="compilation_config"):
        job_config(rs, ImportAllowList(), redis_url=redis_url, password=None)
    cfg, _ = job_config(
        rs, ImportAllowList.build(engine_keys=["compilation_config"]), redis_url=redis_url, password=None
    )
    assert cfg.rollout.engine_kwargs == nested
    own = tmp_path / "job.yaml"
    own.write_text("rollout:\n  engine_kwargs:\n    compilation_config: {mode: 0}\n")
    assert job_config(rs, ImportAllowList.build(config_files=[own]), redis_url=redis_url, password=None)[0]
    own.write_text("rollout:\n  engine_kwargs:\n    compilation_config: {mode: 3}\n")  # another value
    with pytest.raises(ConfigError, match="compilation_config"):
        job_config(rs, ImportAllowList.build(config_files=[own]), redis_url=redis_url, password=None)
    rs.close()


def test_prompts_are_read_only_from_a_source_the_host_allowed(redis_url, tmp_path, capsys):
    """rollout.prompts from Redis naming a credentials file of the generator's host: refused
    before anything is read, and nothing of it reaches Redis."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    secret = private / "credentials.jsonl"
    secret.write_text(json.dumps({"prompt": "hello", "answer": "x", "token": "SECRET-7f3a9c"}) + "\n")
    secret.chmod(0o600)
    rs = _publish(redis_url, "prompts", _job(prompts=str(secret), prompt_field="token"))
    rc, err = _cli_generate(capsys, redis_url, "prompts")
    assert rc == 2 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert f"rollout.prompts={str(secret)!r}" in last and f"--allow-prompts {secret}" in last, last
    with redis.Redis.from_url(redis_url) as client:
        values = redis_values(client)
    assert any(b"credentials.jsonl" in v for v in values)  # the scan saw the published config
    assert_no_secret(b"\n".join(values), "Redis", ("SECRET-7f3a9c",))
    with pytest.raises(ConfigError, match="--allow-prompts"):
        job_config(
            rs,
            ImportAllowList.build(prompt_sources=[str(tmp_path / "other.jsonl")]),
            redis_url=redis_url,
            password=None,
        )

    # Allowed by the host, under any spelling of the same file, or by its own config file.
    linked = tmp_path / "link.jsonl"
    linked.symlink_to(secret)
    cfg, _ = job_config(rs, ImportAllowList.build(prompt_sources=[str(linked)]), redis_url=redis_url, password=None)
    assert cfg.rollout.prompts == str(secret)
    own = tmp_path / "job.yaml"
    own.write_text(f"rollout:\n  prompts: {secret}\n")
    assert job_config(rs, ImportAllowList.build(config_files=[own]), redis_url=redis_url, password=None)[0]
    # The environment's own prompts read no file: no allow needed.
    rs.set_state(config=json.dumps(_job()), model_path="/models/tiny")
    assert job_config(rs, ImportAllowList(), redis_url=redis_url, password=None)[0].rollout.prompts is None
    rs.close()


def test_a_password_holder_cannot_forge_the_trainers_config(password_redis, marker, capsys):
    """Every generator holds the queue password, so the password signature proves nothing about
    who wrote the config: a generator given the trainer key's fingerprint refuses any config
    that key did not sign, however it was re-signed."""
    trainer_key = JobSigner.generate()
    trainer = RunState.connect(password_redis.url, "pinned")
    trainer.set_state(signer=trainer_key, config=json.dumps(_job()), model_path="/models/tiny")
    fp = trainer_key.fingerprint
    allow = ImportAllowList.build([MARKER_ENV])
    cfg, _ = job_config(trainer, allow, redis_url=password_redis.url, password=None, trust_key=fp)
    assert cfg.rollout.env == "copy"
    signed = trainer.published_job()
    assert signed is not None and signed.trainer_fingerprint == fp

    forged = json.dumps(_job(env=MARKER_ENV))
    forger = RunState.connect(password_redis.url, "pinned")  # the generator credential: the password
    forger.set_state(config=forged, model_path="/models/tiny")  # re-signed with the password HMAC
    assert forger.published_job().signed_for("pinned", PASSWORD)
    with pytest.raises(ConfigError, match="carries no trainer signature"):
        job_config(forger, allow, redis_url=password_redis.url, password=None, trust_key=fp)
    forger.set_state(signer=JobSigner.generate(), config=forged, model_path="/models/tiny")  # its own key
    with pytest.raises(ConfigError, match=r"is signed by trainer key [0-9a-f]{64}, not by the trainer key"):
        job_config(forger, allow, redis_url=password_redis.url, password=None, trust_key=fp)
    # The trainer's key and signature kept, the config changed and the password HMAC made anew.
    fields = signature_fields("pinned", forged, "/models/tiny", password=PASSWORD, signer=None)
    salt = bytes.fromhex(fields["config_salt"])
    hmac_sig = password_signature(PASSWORD, salt, "pinned", forged.encode(), b"/models/tiny", trainer_key.public_key)
    assert signed.trainer_key is not None and signed.trainer_sig is not None
    _tamper(
        password_redis.url,
        "pinned",
        config=forged,
        config_salt=salt.hex(),
        config_sig=hmac_sig,
        trainer_key=signed.trainer_key,
        trainer_sig=signed.trainer_sig,
    )
    assert forger.published_job().signed_for("pinned", PASSWORD)
    with pytest.raises(ConfigError, match="has a trainer signature that does not match it"):
        job_config(forger, allow, redis_url=password_redis.url, password=None, trust_key=fp)

    plain_url = password_redis.url.replace(f":{PASSWORD}@", "")
    rc, err = _cli_generate(
        capsys, plain_url, "pinned", "--password", PASSWORD, "--allow-import", MARKER_ENV, "--trust-key", fp
    )
    assert rc == 2 and "Traceback" not in err and "--trust-key" in err.strip().splitlines()[-1], err
    assert not marker.exists()
    rc, err = _cli_generate(capsys, plain_url, "pinned", "--password", PASSWORD, "--trust-key", "abc")
    assert rc == 2 and "64 hex digits" in err, err
    trainer.close()
    forger.close()


def _nested(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


@pytest.mark.parametrize(
    "config",
    ["42", '"abc"', "null", "[1, 2]", "[" * 100_000 + "]" * 100_000, json.dumps({"rollout": _nested(40)})],
    ids=["int", "string", "null", "list", "deep-list", "deep-object"],
)
def test_asyncrl_generate_refuses_a_config_of_the_wrong_shape(redis_url, config, capsys):
    _publish_raw(redis_url, "shape", config)
    rc, err = _cli_generate(capsys, redis_url, "shape")
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip()
    assert "\n" not in line and line.startswith("asyncrl generate: config error: run 'shape': the job's config"), line


def test_an_elastic_generator_joins_as_the_runs_generator_user_with_the_trainer_key_pinned(tmp_path):
    """The generator credential (a Redis user limited to the run's keys) cannot check the
    password signature; with the trainer key pinned it needs to, and it never holds the password."""
    server = EmbeddedRedis(tmp_path / "redis", aof=False, password=PASSWORD, generator_run="gen-user")
    server.start()
    try:
        trainer_key = JobSigner.generate()
        trainer = RunState.connect(server.url, "gen-user")
        trainer.set_state(signer=trainer_key, config=json.dumps(_job()), model_path="/models/tiny")
        url = server.generator_url
        assert url is not None and PASSWORD not in url
        gen = RunState.connect(url, "gen-user")
        allow = ImportAllowList()
        cfg, _ = job_config(gen, allow, redis_url=url, password=None, trust_key=trainer_key.fingerprint)
        assert cfg.rollout.env == "copy"
        with pytest.raises(ConfigError, match=r"pins the trainer key instead \(--trust-key"):
            job_config(gen, allow, redis_url=url, password=None)
        gen.close()
        client = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):  # and it cannot reach another run
            client.hset(keys.state("other-run"), "config", "{}")
        client.close()
        trainer.close()
    finally:
        server.stop()
