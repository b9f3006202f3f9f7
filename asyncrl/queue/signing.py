"""The signatures on the job a trainer publishes for `asyncrl generate`.

    signer = JobSigner.for_run_dir(run_dir)       # the trainer: its run's Ed25519 key pair
    fields = signature_fields(run, config, model_path, password=pw, signer=signer)   # as it publishes
    job = PublishedJob(...)                        # an elastic generator, from the state hash
    job.signed_for(run, pw); job.trainer_key_ok(run, fingerprint)

An elastic generator builds its config from Redis, and that config names code and settings. Two
signatures let it tell a config its trainer wrote from one written by anything else:

- The trainer key (Ed25519): a key pair the trainer makes for its run and keeps in its run
  directory (0600); the private half never leaves that host. A generator given the public key's
  fingerprint (``asyncrl generate --trust-key FINGERPRINT``, printed by the trainer) refuses a
  config the trainer did not sign, even one written by a holder of the queue password.
- The password signature (HMAC-SHA256): keyed by the queue password through PBKDF2 with a
  fresh salt per publish. Every generator holds the password, so this proves only that a holder
  wrote it: it stops writers that reached Redis without the password (an edited append-only
  file, an unauthenticated replica), and it covers the public key that is published with it.

Neither makes the config's code trusted: the generator's own allow-list
(asyncrl.control.allowlist) decides what it may import, which engine settings it takes and which
prompt sources it reads.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from asyncrl.rundir.store import RunPath, write_atomic

CONTEXT = b"asyncrl elastic config v2"
"""Fixed context of the key derivation and the signed messages: a key or signature made for
anything else never verifies here, and a future format changes it."""
KDF_ROUNDS = 100_000
"""PBKDF2 rounds (about 50 ms, paid once per publish or join). The signature sits in Redis and
its append-only file, so a fast derivation would make it a cheap offline test of password
guesses; the per-publish salt makes each such test good for one publish only."""
KEY_FILE = "job_signing_key"
"""The trainer's private key in its run directory (hex, 0600): a resumed run keeps its
fingerprint, so generators pinned to it keep joining."""
FINGERPRINT_HEX = 64

JOB_FIELDS = ("config", "model_path", "config_sig", "config_salt", "trainer_key", "trainer_sig")
"""The state hash's published job: the trainer's config (JSON) and model path, the password
signature and its salt (absent when the queue has no password), the trainer's public key and
its signature."""
SIGNATURE_FIELDS = JOB_FIELDS[2:]


def fingerprint(public_key: bytes) -> str:
    """What a user pins: SHA-256 of the raw 32-byte Ed25519 public key, hex."""
    return hashlib.sha256(CONTEXT + public_key).hexdigest()


def _message(run: str, config: bytes, model_path: bytes, *extra: bytes) -> bytes:
    # Length-prefixed, so no two field tuples share a message; the run name is in it so that one
    # run's published job cannot be copied into another run's state.
    parts = (CONTEXT, run.encode(), config, model_path, *extra)
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _password_key(password: str, salt: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password.encode(), CONTEXT + salt, KDF_ROUNDS)


def password_signature(password: str, salt: bytes, run: str, config: bytes, model_path: bytes, pub: bytes) -> str:
    """HMAC-SHA256 (hex) over the exact bytes published for `run`, the trainer key among them."""
    return hmac.new(_password_key(password, salt), _message(run, config, model_path, pub), hashlib.sha256).hexdigest()


class JobSigner:
    """The trainer's Ed25519 key pair for one run."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        self.public_key = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.fingerprint = fingerprint(self.public_key)

    @classmethod
    def generate(cls) -> JobSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def for_run_dir(cls, run_dir: RunPath) -> JobSigner:
        """The run's key pair: read from `run_dir/job_signing_key`, or made and written there
        (0600) on the run's first start."""
        path = run_dir / KEY_FILE
        if path.exists():
            try:
                return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(path.read_text().strip())))
            except ValueError as e:
                raise ValueError(f"{path}: not a job signing key ({e}); delete it to make a new one") from None
        signer = cls.generate()
        raw = signer._private.private_bytes_raw()
        write_atomic(path, raw.hex().encode(), private=True)
        return signer

    def sign(self, run: str, config: bytes, model_path: bytes) -> str:
        return self._private.sign(_message(run, config, model_path)).hex()


def signature_fields(
    run: str, config: str, model_path: str, *, password: str | None, signer: JobSigner | None
) -> dict[str, str]:
    """The signature fields written with a published job (a subset of SIGNATURE_FIELDS; the
    others are deleted, so an earlier trainer's signature never outlives its config)."""
    out: dict[str, str] = {}
    pub = b""
    if signer is not None:
        pub = signer.public_key
        out.update(trainer_key=pub.hex(), trainer_sig=signer.sign(run, config.encode(), model_path.encode()))
    if password is not None:
        salt = secrets.token_bytes(16)
        out.update(
            config_salt=salt.hex(),
            config_sig=password_signature(password, salt, run, config.encode(), model_path.encode(), pub),
        )
    return out


def _hex(value: bytes | None) -> bytes | None:
    try:
        return bytes.fromhex(value.decode("ascii")) if value is not None else None
    except (UnicodeDecodeError, ValueError):
        return None


@dataclass(frozen=True)
class PublishedJob:
    """The job as its trainer published it: the exact bytes read from Redis, unverified."""

    config: bytes
    model_path: bytes
    signature: bytes | None = None
    salt: bytes | None = None
    trainer_key: bytes | None = None
    trainer_sig: bytes | None = None

    @property
    def trainer_fingerprint(self) -> str | None:
        """The fingerprint of the public key published with the job (None if none, or malformed)."""
        pub = _hex(self.trainer_key)
        return fingerprint(pub) if pub is not None and len(pub) == 32 else None

    def signed_for(self, run: str, password: str) -> bool:
        """Whether a holder of `password` signed exactly these bytes (and this trainer key) for `run`."""
        salt = _hex(self.salt)
        if self.signature is None or salt is None:
            return False
        pub = _hex(self.trainer_key) if self.trainer_key is not None else b""
        if pub is None:
            return False
        expected = password_signature(password, salt, run, self.config, self.model_path, pub).encode()
        return hmac.compare_digest(expected, self.signature)

    def trainer_signed(self, run: str) -> bool:
        """Whether the published trainer key signed exactly these bytes for `run`."""
        pub, sig = _hex(self.trainer_key), _hex(self.trainer_sig)
        if pub is None or sig is None or len(pub) != 32:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(pub).verify(sig, _message(run, self.config, self.model_path))
        except (InvalidSignature, ValueError):
            return False
        return True


def normalise_fingerprint(text: str) -> str:
    """A --trust-key value as given (hex, any case, ':' or spaces between groups) -> 64 hex digits;
    ValueError otherwise."""
    digits = "".join(ch for ch in text.strip().lower() if ch not in ": ")
    if len(digits) != FINGERPRINT_HEX or any(ch not in "0123456789abcdef" for ch in digits):
        raise ValueError(f"--trust-key {text!r}: a trainer key fingerprint is {FINGERPRINT_HEX} hex digits")
    return digits
