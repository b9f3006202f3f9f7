"""Host and Ray helpers every layer may use: a free port, a Ray actor's state, a URL with its
password removed.

Imports nothing from asyncrl (and Ray only inside ``actor_state``), so the queue, the weight
sync, the learner and the driver all take them from here instead of from each other.
"""

from __future__ import annotations

import socket
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
