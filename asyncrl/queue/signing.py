"""The signature on the job a trainer publishes for `asyncrl generate`.

    key = config_key(password)                                  # the queue password's signing key
    sig = sign_job(key, run, config_bytes, model_path_bytes)    # the trainer, as it publishes
    job_signature_ok(key, run, config_bytes, model_path_bytes, sig)   # an elastic generator

An elastic generator builds its config from Redis, and that config names code (environments,
reward functions). The signature lets it tell a config its trainer wrote from one written by
anything else that reached Redis without the password: only a holder of the queue password
can make one. It proves nothing against someone who has the password: the generator's own
import allow-list (asyncrl.control.allowlist) is the guard that holds there.
"""

from __future__ import annotations

import hashlib
import hmac

CONTEXT = b"asyncrl elastic config v1"
"""Fixed context of the key derivation and the signed message: a key or signature made for
anything else never verifies here, and a future format changes it."""
KDF_ROUNDS = 100_000
"""PBKDF2 rounds (about 50 ms, paid once per publish or join). The signature sits in Redis and
its append-only file, so a fast derivation would make it a cheap offline test of password
guesses."""


def config_key(password: str) -> bytes:
    """The signing key derived from the queue password."""
    return hashlib.pbkdf2_hmac("sha256", password.encode(), CONTEXT, KDF_ROUNDS)


def _message(run: str, config: bytes, model_path: bytes) -> bytes:
    # Length-prefixed, so no two (run, config, model_path) share a message; the run name is in
    # it so that one run's published job cannot be copied into another run's state.
    parts = (CONTEXT, run.encode(), config, model_path)
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def sign_job(key: bytes, run: str, config: bytes, model_path: bytes) -> str:
    """HMAC-SHA256 (hex) over the exact bytes published for `run`."""
    return hmac.new(key, _message(run, config, model_path), hashlib.sha256).hexdigest()


def job_signature_ok(key: bytes, run: str, config: bytes, model_path: bytes, signature: bytes | None) -> bool:
    if signature is None:
        return False
    expected = sign_job(key, run, config, model_path).encode()
    return hmac.compare_digest(expected, signature)
