"""Redis-backed replay queue (streams + consumer group, dead-letter stream, ack-at-checkpoint)
and the embedded redis-server launcher.

    from asyncrl.queue import RolloutQueue
    q = RolloutQueue.connect(url, run="demo")

See replay.py (delivery, backpressure, filtering), runstate.py (versions, counters,
admission, heartbeats, metrics), server.py (EmbeddedRedis), keys.py (key layout).
"""

from asyncrl.queue.connection import QueueAuthError, QueueUnavailable
from asyncrl.queue.replay import QueueFull, RolloutQueue

__all__ = ["QueueAuthError", "QueueFull", "QueueUnavailable", "RolloutQueue"]
