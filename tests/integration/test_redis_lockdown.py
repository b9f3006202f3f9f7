"""The embedded redis-server as a run starts it: no client can write files, load code or
reconfigure it, and the run's generators have a Redis user limited to the run's keys.

    .venv/bin/python -m pytest tests/integration/test_redis_lockdown.py -q
"""

from __future__ import annotations

import contextlib
import os
import stat

import numpy as np
import pytest
import redis

from asyncrl.config import load_config
from asyncrl.control.bringup import generator_connection, start_redis
from asyncrl.queue import RolloutQueue, RunState, keys
from asyncrl.queue.acl import DISABLED_COMMANDS, GENERATOR_USER
from asyncrl.queue.server import EmbeddedRedis
from tests.integration.test_queue import random_group

RUN = "locked"
PASSWORD = "trainer-only-pw"


@contextlib.contextmanager
def run_server(tmp_path, *overrides: str):
    """The embedded server exactly as `asyncrl train` starts it for this config."""
    cfg = load_config(None, [f"control.run_name={RUN}", *overrides])
    with contextlib.ExitStack() as stack:
        url, server = start_redis(cfg, tmp_path / "run", stack)
        assert server is not None
        yield cfg, url, server


def test_a_default_runs_server_refuses_config_module_save_and_friends(tmp_path):
    """Against a default run's server (loopback, no password, AOF), a plain local client can
    neither point the server's dump at another directory and save it, nor load a module, nor
    replicate, reconfigure or stop it; the run's own commands (streams, scripts) still work."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    module = tmp_path / "evil.so"
    module.write_bytes(b"\x7fELF")
    with run_server(tmp_path, "queue.aof=true") as (_, url, server):
        assert server.password is None and server.bind == "127.0.0.1"
        anyone = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        anyone.set("payload", "ssh-ed25519 AAAA attacker")
        refused = [
            ("CONFIG", "SET", "dir", str(target)),
            ("CONFIG", "SET", "dbfilename", "authorized_keys"),
            ("CONFIG", "GET", "*"),
            ("MODULE", "LOAD", str(module)),
            ("SAVE",),
            ("BGSAVE",),
            ("BGREWRITEAOF",),
            ("DEBUG", "SLEEP", "0"),
            ("REPLICAOF", "127.0.0.1", "1"),
            ("SLAVEOF", "127.0.0.1", "1"),
            ("ACL", "SETUSER", "evil", "on", "nopass", "+@all", "~*"),
            ("SHUTDOWN", "NOSAVE"),
            ("MIGRATE", "127.0.0.1", "1", "payload", "0", "1000"),
            ("RESTORE", "k", "0", b"\x00"),
        ]
        for command in refused:
            with pytest.raises(redis.ResponseError, match=r"(?i)unknown command"):
                anyone.execute_command(*command)
        assert os.listdir(target) == []
        assert anyone.ping() and server._proc is not None and server._proc.poll() is None  # still up
        # The run's own traffic: the consumer group, a scripted put, a read.
        queue = RolloutQueue.connect(url, RUN, consumer="learner-0")
        group = random_group(np.random.default_rng(0), "g-1", version=0)
        queue.put(group)
        assert [g.group_id for _, g in queue.get_batch(1, min_version=0, timeout=5)] == ["g-1"]
        queue.close()
        anyone.close()
        conf = (server.dir / "redis.conf").read_text()
        assert all(f'rename-command {name} ""' in conf for name in DISABLED_COMMANDS)


def test_generators_get_a_user_limited_to_the_runs_keys(tmp_path):
    """With a queue password the run's generators connect as their own user: a generator's
    whole producer path works with it (connect, admission, put, heartbeat), while other runs'
    keys, other keys of the server and every dangerous command are refused."""
    with run_server(tmp_path, f"queue.password={PASSWORD}") as (cfg, url, server):
        gen_url, gen_password = generator_connection(cfg, url, server)
        assert gen_password is None and gen_url.startswith(f"redis://{GENERATOR_USER}:")
        assert PASSWORD not in gen_url
        # The generator's password sits in redis.conf only as its SHA-256.
        assert server.generator_password is not None
        assert server.generator_password not in (server.dir / "redis.conf").read_text()

        trainer = RolloutQueue.connect(url, RUN, password=PASSWORD, consumer="learner-0")
        trainer_state = RunState.of(trainer)
        trainer_state.configure_admission(max_staleness=4, groups_per_step=2)
        admin = redis.Redis.from_url(url)
        admin.set("asyncrl:other:state", "other run")
        admin.set("unrelated", "x")

        gen = RolloutQueue.connect(gen_url, RUN, consumer="g0")
        gen_state = RunState.of(gen)
        assert gen_state.try_admit()
        gen.put(random_group(np.random.default_rng(1), "g-1", version=0))
        gen_state.heartbeat("g0", {"version": 0})
        assert [g.group_id for _, g in trainer.get_batch(1, min_version=0, timeout=5)] == ["g-1"]
        assert set(trainer_state.generators()) == {"g0"}

        raw = redis.Redis.from_url(gen_url, socket_timeout=5)
        for command in (
            ("GET", "asyncrl:other:state"),
            ("SET", "asyncrl:other:state", "forged"),
            ("DEL", "unrelated"),
            ("KEYS", "*"),
            ("FLUSHALL",),
            ("INFO",),
            ("CLIENT", "LIST"),
            ("SORT", keys.reissue(RUN)),
            ("EVAL", "return redis.call('GET', 'unrelated')", "0"),
        ):
            with pytest.raises(redis.ResponseError, match=r"NOPERM|can.t access|permission"):
                raw.execute_command(*command)
        assert admin.get("asyncrl:other:state") == b"other run" and admin.get("unrelated") == b"x"
        raw.close()
        gen.close()
        trainer.close()
        admin.close()


@pytest.mark.parametrize("run", ["a*", 'a "quoted" [b]\\ ?'])
def test_a_run_name_with_glob_characters_matches_only_itself(tmp_path, run):
    """The generator user's key pattern is the run's name escaped (and quoted in redis.conf):
    a run named `a*` does not reach the run `abc`."""
    with EmbeddedRedis(tmp_path / "r", password=PASSWORD, generator_run=run) as server:
        admin = redis.Redis.from_url(server.url)
        admin.set("asyncrl:abc:state", "another run")
        gen = redis.Redis.from_url(server.generator_url, socket_timeout=5)
        gen.set(keys.state(run), "mine")
        assert admin.get(keys.state(run)) == b"mine"
        with pytest.raises(redis.ResponseError, match=r"NOPERM|permission"):
            gen.get("asyncrl:abc:state")
        gen.close()
        admin.close()


def test_an_existing_redis_conf_is_made_0600_before_the_password_goes_in(tmp_path):
    """A redis.conf an older version left world-readable must not keep its mode once
    `requirepass` is written into it."""
    (tmp_path / "r").mkdir()
    conf = tmp_path / "r" / "redis.conf"
    conf.write_text("bind 127.0.0.1\n")
    conf.chmod(0o644)
    with EmbeddedRedis(tmp_path / "r", password=PASSWORD):
        assert "requirepass" in conf.read_text()
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
