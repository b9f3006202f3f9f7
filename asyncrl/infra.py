"""Host and Ray helpers every layer may use: a free port, a Ray actor's state, stopping
processes, a URL with its password removed, and the one base class of the failures a command reports as one line
(`ExpectedFailure`).

Imports nothing from asyncrl (and Ray only inside ``actor_state``), so the queue, the weight
sync, the learner and the driver all take them from here instead of from each other.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now on `host` ("" = every interface, for a port other
    nodes must reach); another process may still take it before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shm_segments_of(pids: Iterable[int]) -> set[str]:
    """The /dev/shm/psm_* segments (vLLM's) these processes map, from /proc/PID/maps. A maps
    line's path is its sixth field, which may hold spaces and a " (deleted)" suffix."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/psm_"):
                    found.add(path.removesuffix(" (deleted)"))
    return found


def stop_processes(procs: list, grace_s: float) -> None:
    """SIGTERM each psutil.Process, then SIGKILL those still alive after `grace_s`.

    SIGTERM first: vLLM's engine processes unlink their /dev/shm segments when terminated,
    not when killed. SIGCONT after it: a stopped (hung, SIGSTOPped) process would otherwise
    hold the SIGTERM pending until the SIGKILL."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)
    _, still = psutil.wait_procs(procs, timeout=grace_s)
    for p in still:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(still, timeout=grace_s)


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


SECRET_QUERY_KEYS = frozenset({"password", "ssl_password"})
"""Query parameters of a Redis URL that hold a secret (redis-py reads both)."""


def redact_url(url: str) -> str:
    """The URL with any password removed, for logs, error messages and the dashboard: the one
    in the user info (the user name stays, it tells which account) and the ``password=`` and
    ``ssl_password=`` query parameters. A password is often written unescaped: the user info
    ends at the last "@" of the URL, so "@", "/", "?" and "#" inside it (base64 passwords hold
    "/") do not leak the rest of it. A URL that cannot be told apart from one whose query
    password holds an "@" is shown as ``scheme://<redacted>``."""
    head, sep, rest = url.partition("://")
    if not sep:
        return _redact_parts(url)
    userinfo, at, hostpart = rest.rpartition("@")
    if at:
        # Read the usual way, the "@" might sit inside a query password: then no reading is safe.
        query = urlsplit(url).query
        if any(k in SECRET_QUERY_KEYS and "@" in v for k, v in parse_qsl(query, keep_blank_values=True)):
            return f"{head}://<redacted>"
        user = userinfo.partition(":")[0] if ":" in userinfo else userinfo
        if "/" in user or "?" in user or "#" in user:  # not a user name: the "@" is past the host
            return f"{head}://<redacted>"
        return _redact_parts(f"{head}://{user + '@' if user else ''}{hostpart}")
    return _redact_parts(url)


def _redact_parts(url: str) -> str:
    """`url` (whose user info, if any, holds no password) without its secret query parameters."""
    parts = urlsplit(url)
    query = parts.query
    if query:
        fields = parse_qsl(query, keep_blank_values=True)
        kept = [(k, v) for k, v in fields if k not in SECRET_QUERY_KEYS]
        if len(kept) != len(fields):
            query = urlencode(kept)
    if query == parts.query:
        return url
    # Not urlunsplit: it drops the empty host of unix:///path URLs.
    head = f"{parts.scheme}://" if "://" in url else f"{parts.scheme}:" if parts.scheme else ""
    return (
        head
        + parts.netloc
        + parts.path
        + (f"?{query}" if query else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )
