"""What the embedded redis-server lets its clients do: the lines of redis.conf that lock it down.

    lockdown_lines()                             # rename-command CONFIG "" ... (nobody may run them)
    generator_password(queue_password, run)      # the generator user's password, derived
    generator_user_lines(run, password)          # user asyncrl-generator on #<sha256> ~asyncrl:run:* ...

Every client of the embedded server, authenticated or not, is kept from the commands that
write files where it chooses (CONFIG SET dir + SAVE), load code (MODULE LOAD), reconfigure or
replicate the server, or stop it: they are renamed to nothing, so no user and no password
brings them back while the server runs. A run needs none of them (the AOF is rewritten by the
server itself, the server is stopped by its PID). Redis >= 6.2 (ACL selectors of channels).

With a queue password, generators get a user of their own (``asyncrl-generator``), limited to
the run's keys and to data commands; the trainer keeps the default user, which holds the queue
password. The generator's password is derived from the queue password and the run name with a
slow KDF, so it is the same across a resume, and holding it tells nothing about the queue
password; redis.conf holds only its SHA-256, as Redis stores ACL passwords.
"""

from __future__ import annotations

import hashlib

from asyncrl.queue import keys

DISABLED_COMMANDS = (
    "CONFIG",  # CONFIG SET dir/dbfilename + SAVE writes any file the server's user can
    "MODULE",  # MODULE LOAD runs a shared object inside the server
    "DEBUG",  # DEBUG RELOAD / SET-ACTIVE-EXPIRE / SEGFAULT ...
    "SAVE",
    "BGSAVE",
    "BGREWRITEAOF",  # an automatic rewrite does not need the command
    "REPLICAOF",  # turns the server into a replica of an attacker's server (its data replaced)
    "SLAVEOF",
    "SYNC",  # full copies of the data set to whoever asks, as a replica
    "PSYNC",
    "MIGRATE",  # sends keys to another server
    "RESTORE",  # crafted payloads have been a way into the server's memory
    "ACL",  # the users are fixed by redis.conf
    "SHUTDOWN",  # the run stops its server by PID
)
"""Commands nobody may run on the embedded server (rename-command NAME "")."""

GENERATOR_USER = "asyncrl-generator"
KDF_CONTEXT = b"asyncrl generator credential v1"
KDF_ROUNDS = 100_000
"""PBKDF2 rounds: the generator credential travels to every generator host, so a fast
derivation would make it a cheap offline test of guesses of the queue password."""


def lockdown_lines() -> list[str]:
    return [f'rename-command {name} ""' for name in DISABLED_COMMANDS]


def generator_password(queue_password: str, run: str) -> str:
    """The generator user's password for `run`: PBKDF2-HMAC-SHA256 of the queue password,
    salted with the run name (hex, 64 characters)."""
    salt = KDF_CONTEXT + b"\0" + run.encode()
    return hashlib.pbkdf2_hmac("sha256", queue_password.encode(), salt, KDF_ROUNDS).hex()


def generator_user_lines(run: str, password: str) -> list[str]:
    """The generator user: the run's keys (and the run list the dashboard reads, which every
    client adds its run to), every command but Redis's @dangerous ones (admin, KEYS, FLUSHALL,
    SORT, CLIENT, INFO, ...), no pub/sub channels. Scripts run with the caller's rights, so a
    script cannot reach past them either."""
    if any(c in run for c in "\r\n\0"):
        raise ValueError(f"run name {run!r}: no line breaks or NUL bytes")
    digest = hashlib.sha256(password.encode()).hexdigest()
    run_keys = _glob_escape(keys.state(run).removesuffix(":state")) + ":*"  # asyncrl:{run}:*
    return [
        f"user {GENERATOR_USER} on #{digest} resetkeys {_quoted('~' + run_keys)} "
        f"{_quoted('~' + _glob_escape(keys.RUNS))} resetchannels +@all -@dangerous -@pubsub"
    ]


def _glob_escape(text: str) -> str:
    """`text` as a Redis glob pattern that matches it alone (a run named `a*` must not reach
    the keys of every run whose name starts with `a`)."""
    # ACL patterns cannot hold whitespace: "?" stands for it (the embedded server holds one run).
    return "".join("\\" + c if c in "*?[]\\" else "?" if c.isspace() else c for c in text)


def _quoted(text: str) -> str:
    """One redis.conf argument, double-quoted (a run name may hold spaces or quotes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
