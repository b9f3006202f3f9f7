"""The staleness/drift dashboard (Starlette + plotly): a live run's Redis, or a finished run's directory.

python -m asyncrl.monitor.dashboard --redis redis://127.0.0.1:6379 --run demo
python -m asyncrl.monitor.dashboard runs/demo
from asyncrl.monitor.dashboard import create_app, create_run_dir_app, serve
"""

from asyncrl.monitor.dashboard.app import create_app, create_run_dir_app, serve

__all__ = ["create_app", "create_run_dir_app", "serve"]
