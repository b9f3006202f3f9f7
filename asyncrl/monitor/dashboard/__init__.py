"""The live staleness/drift dashboard (Starlette + plotly, data read from Redis).

python -m asyncrl.monitor.dashboard --redis redis://127.0.0.1:6379 --run demo
from asyncrl.monitor.dashboard import create_app, serve
"""

from asyncrl.monitor.dashboard.app import create_app, serve

__all__ = ["create_app", "serve"]
