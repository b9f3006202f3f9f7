"""A queue reachable from another machine is locked: a Redis bind beyond loopback needs
queue.password, and a client from another address gets nothing without it.

"Another machine" is a network namespace the test creates (``ip netns add``) joined to this
one by a veth pair on a private /30: the embedded redis-server binds 0.0.0.0 here and a
client runs inside the namespace against this side's veth address, never an outside one.
Needs root (CI and the dev box run as root); skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from asyncrl.config import ConfigError, load_config
from asyncrl.queue.server import EmbeddedRedis

PASSWORD = "queue-pw-" + uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class PeerNamespace:
    name: str
    host_addr: str  # this namespace's end of the veth pair
    peer_addr: str  # the other namespace's end


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def peer_ns() -> Iterator[PeerNamespace]:
    tag = uuid.uuid4().hex[:6]
    name, here, there = f"asyncrl-t{tag}", f"ar{tag}a", f"ar{tag}b"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace (`ip netns add`): {made.stderr.strip()}")
    # A /30 in 10.213.0.0/16 picked per run, so concurrent runs do not collide.
    base = int(tag, 16) % 16000 * 4
    net = f"10.213.{base // 256}"
    host_addr, peer_addr = f"{net}.{base % 256 + 1}", f"{net}.{base % 256 + 2}"
    try:
        for cmd in (
            ["link", "add", here, "type", "veth", "peer", "name", there],
            ["link", "set", there, "netns", name],
            ["addr", "add", f"{host_addr}/30", "dev", here],
            ["link", "set", here, "up"],
            ["-n", name, "addr", "add", f"{peer_addr}/30", "dev", there],
            ["-n", name, "link", "set", there, "up"],
            ["-n", name, "link", "set", "lo", "up"],
        ):
            done = _ip(*cmd)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the test network (`ip {' '.join(cmd)}`): {done.stderr.strip()}")
        yield PeerNamespace(name, host_addr, peer_addr)
    finally:
        _ip("link", "del", here)  # takes its peer in the namespace with it
        _ip("netns", "del", name)


# Runs inside the peer namespace: what one unauthenticated and one authenticated client get.
CLIENT = """
import json, socket, sys, redis
host, port, password = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def raw(*lines):
    # Plain inline RESP, as an attacker would type it: one reply line per command.
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall("".join(line + "\\r\\n" for line in lines).encode())
        reply = b""
        while reply.count(b"\\r\\n") < len(lines):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.decode().splitlines()

out = {
    "anonymous": raw("PING", "SET asyncrl:probe anonymous"),
    "wrong": raw("AUTH not-the-password", "SET asyncrl:probe wrong"),
}
with redis.Redis(host=host, port=port, password=password, socket_timeout=5) as c:
    out["with_password"] = [c.get("asyncrl:probe"), c.set("asyncrl:probe", "with_password")]
print(json.dumps(out))
"""


def test_wildcard_bind_needs_a_password_and_a_remote_client_needs_it(peer_ns, tmp_path):
    # At config load: a bind beyond loopback without a password names both keys.
    for bind in ("0.0.0.0", "::", peer_ns.host_addr, "127.0.0.1 0.0.0.0"):
        with pytest.raises(ConfigError, match=r"queue\.bind=.*queue\.password"):
            load_config(None, [f"queue.bind='{bind}'"])
    assert load_config(None, ["queue.bind=0.0.0.0", f"queue.password={PASSWORD}"]).queue.bind == "0.0.0.0"
    assert load_config(None, ["queue.bind=127.0.0.1 ::1"]).queue.password is None
    # And in the server code itself, for callers that skip the config.
    with pytest.raises(ValueError, match="give a password"):
        EmbeddedRedis(tmp_path / "open", bind="0.0.0.0")

    with EmbeddedRedis(tmp_path / "redis", bind="0.0.0.0", password=PASSWORD) as server:
        client_args = [peer_ns.host_addr, str(server.port), PASSWORD]
        got = subprocess.run(
            ["ip", "netns", "exec", peer_ns.name, sys.executable, "-c", CLIENT, *client_args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert got.returncode == 0, got.stderr
        out = json.loads(got.stdout)
        assert out["anonymous"] == ["-NOAUTH Authentication required."] * 2, out
        assert out["wrong"][0].startswith("-WRONGPASS") and out["wrong"][1].startswith("-NOAUTH"), out
        # The other clients wrote nothing; this one, from the same address, may.
        assert out["with_password"] == [None, True], out
        with redis.Redis.from_url(server.url) as local:
            assert local.get("asyncrl:probe") == b"with_password"
            assert "protected-mode yes" in (server.dir / "redis.conf").read_text().splitlines()
