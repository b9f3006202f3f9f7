"""Host and Ray helpers every layer may use: a free port, a Ray actor's state, a URL with its
password removed, and the one base class of the failures a command reports as one line
(`ExpectedFailure`).

Imports nothing from asyncrl (and Ray only inside ``actor_state``), so the queue, the weight
sync, the learner and the driver all take them from here instead of from each other.
"""

from __future__ import annotations

import socket
import sys
import traceback
from collections.abc import Callable
from typing import ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on `host` ("" = every interface, for a port other
    nodes must reach); another process may still take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


STARTING = ("RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY")
"""Actor states in which Ray is (re)creating the actor: it is coming back, not hung or lost."""


def actor_state(handle) -> tuple[str, str]:
    """(state, node id) of a Ray actor as the GCS has it: ALIVE, RESTARTING, PENDING_CREATION,
    DEAD... Read from the GCS directly (``ray.util.state`` would need the dashboard)."""
    from ray._private import state  # Ray only where an actor is asked about: importing this module stays light

    info = state.actors(actor_id=handle._actor_id.hex())
    return info.get("State", "UNKNOWN"), info.get("Address", {}).get("NodeID", "")


class ExpectedFailure(Exception):
    """A failure the user can act on (a wrong config value, a missing file, a server that does
    not answer), as opposed to a bug. A command prints its message as one line and exits with
    `exit_code`; the traceback is shown only with --verbose. The errors of each layer derive
    from it (ConfigError, PromptSourceError, QueueUnavailable...) next to their builtin base."""

    exit_code: ClassVar[int] = 2
    """2: bad input (fix the command, config or files); 3: something the command needs is not
    reachable (try again once it is)."""
    label: ClassVar[str] = ""
    """Put before the message ("config error"), where the message alone would not say what failed."""


class UsageError(ExpectedFailure):
    """A command's arguments or the files they name are not usable."""


class Unreachable(ExpectedFailure):
    """A server the command needs (Redis, a Ray cluster) did not answer in the time given."""

    exit_code = 3


def failure_line(e: BaseException) -> tuple[str, int] | None:
    """(one line, exit code) for an expected failure, or None for anything else (a bug keeps
    its traceback). Besides ExpectedFailure, a file-system error that names its path (missing,
    not a directory, permission denied) is the user's to fix. An error a Ray task raised comes
    wrapped in a class that derives from it and holds the original as ``cause``."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ExpectedFailure):
        e = cause
    if isinstance(e, ExpectedFailure):
        message = f"{e.label}: {e}" if e.label else str(e)
        code = e.exit_code
    elif isinstance(e, OSError) and e.filename is not None:
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        message, code = f"{paths}: {e.strerror or type(e).__name__}", 2
    else:
        return None
    return " ".join(message.split()) or type(e).__name__, code


def run_command(prog: str, command: Callable[[], int], *, verbose: bool = False) -> int:
    """`command()`'s exit code; an expected failure (see `failure_line`) becomes one line on
    stderr, ``PROG: message``, and its exit code (the traceback before it with `verbose`).
    Anything else propagates with its traceback."""
    try:
        return command()
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        failure = failure_line(e)
        if failure is None:
            raise
        if verbose:
            traceback.print_exc()
        line, code = failure
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        return code


def redact_url(url: str) -> str:
    """The URL with any password removed, for logs, error messages and the dashboard: the one
    in the user info (the user name stays, it tells which account) and a ``password=`` query
    parameter (redis-py reads one there too, e.g. for unix:// sockets). The user info ends at
    the last "@", so an unescaped "@" in a password does not leak the rest of it."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        user = userinfo.partition(":")[0]
        netloc = f"{user}@{hostport}" if user else hostport
    query = parts.query
    if query:
        fields = parse_qsl(query, keep_blank_values=True)
        kept = [(k, v) for k, v in fields if k != "password"]
        if len(kept) != len(fields):
            query = urlencode(kept)
    if netloc == parts.netloc and query == parts.query:
        return url
    # Not urlunsplit: it drops the empty host of unix:///path URLs.
    head = f"{parts.scheme}://" if "://" in url else f"{parts.scheme}:" if parts.scheme else ""
    return (
        head + netloc + parts.path + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    )
