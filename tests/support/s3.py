"""A real S3-compatible server on loopback for the tests: moto's standalone server, run as
a subprocess bound to 127.0.0.1 (so Ray workers and a second node's namespace, which share
the loopback network, reach it too).

    with s3_server() as s3:
        bucket = s3.bucket()                      # a fresh, empty bucket
        run_dir = f"s3://{bucket}/runs/x"
        cfg overrides: s3.overrides()             # control.storage_options={endpoint_url, key, secret}
        monkeypatch.setenv(...) for k, v in s3.env.items()   # the standard AWS_* variables
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from asyncrl.infra import free_port

KEY = "testing"
"""moto takes any credentials; these only have to be present."""


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen = field(repr=False)

    @property
    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": KEY}

    @property
    def env(self) -> dict[str, str]:
        """What a process reading a run dir with the standard credentials needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def overrides(self) -> list[str]:
        return [f"control.storage_options={json.dumps(self.storage_options)}"]

    def bucket(self) -> str:
        """A new empty bucket (each test its own, so no test sees another's objects)."""
        import s3fs

        name = f"t-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True).mkdir(name)
        return name


@contextlib.contextmanager
def s3_server(timeout_s: float = 60.0) -> Iterator[S3Server]:
    port = free_port("127.0.0.1")
    # Its request log goes to a file: a pipe nobody drains fills after a few hundred requests
    # (64 KiB) and the server then blocks on its next log line, every client timing out.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        endpoint = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"moto server exited {proc.returncode}: {log.read().decode()[-2000:]}")
                try:
                    with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"moto server on {endpoint} did not answer in {timeout_s:.0f} s") from None
                    time.sleep(0.1)
            yield S3Server(endpoint, proc)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
