"""Weight sync from the learner back to the generators' engines. See ``weight_sync.py``."""

from asyncrl.sync.weight_sync import PublishResult, WeightSync, build_weight_sync, resolve_backend

__all__ = ["PublishResult", "WeightSync", "build_weight_sync", "resolve_backend"]
