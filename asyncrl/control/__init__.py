"""The driver: staleness accounting, the async loop (and a synchronous mode), resume, shutdown.

It wires the components together and owns no math: advantages and reduction weights come
from `asyncrl.data.batch`, the loss from `asyncrl.learner`, the queue from `asyncrl.queue`.
"""
