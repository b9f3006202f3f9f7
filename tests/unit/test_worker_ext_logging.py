"""vLLM's per-reload warning for weightless rotary layers is dropped; every other layer's stays.

.venv/bin/python -m pytest tests/unit/test_worker_ext_logging.py -q
"""

from __future__ import annotations

import logging

from asyncrl.rollout.worker_ext import RELOAD_LOGGER, quiet_weightless_layer_warnings


def test_only_rotary_embedding_reload_warnings_are_dropped(caplog):
    quiet_weightless_layer_warnings()
    quiet_weightless_layer_warnings()  # idempotent: one filter
    logger = logging.getLogger(RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        logger.warning("reload of %s took %d ms", "RotaryEmbedding", 3)
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "reload of RotaryEmbedding took 3 ms",
    ]
