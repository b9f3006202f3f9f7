"""Host and Ray helpers every layer may use: a free port, a Ray actor's state.

Imports nothing from asyncrl (and Ray only inside ``actor_state``), so the queue, the weight
sync, the learner and the driver all take them from here instead of from each other.
"""

from __future__ import annotations

import socket


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
