"""Redis-backed replay queue (streams + consumer group, dead-letter stream, ack-at-checkpoint)
and the embedded redis-server launcher.

    from asyncrl.queue import RolloutQueue
    q = RolloutQueue.connect(url, run="demo")     # the rollout stream
    rs = RunState.of(q)                            # the run's state, over the same connection

See replay.py (delivery, backpressure, filtering), runstate.py (versions, counters,
admission, heartbeats, metrics), server.py (EmbeddedRedis), keys.py (key layout).
"""

from asyncrl.queue.connection import QueueAuthError, QueueUnavailable
from asyncrl.queue.replay import QueueFull, RolloutQueue
from asyncrl.queue.runstate import RunState

__all__ = ["QueueAuthError", "QueueFull", "QueueUnavailable", "RolloutQueue", "RunState"]
