"""The staleness/drift dashboard: a Starlette app over a live run's Redis keys or a finished run's directory.

    python -m asyncrl.monitor.dashboard --redis redis://127.0.0.1:6379 [--run demo] [--port 8470]
    # or: asyncrl dashboard --redis URL;  or in code: serve(redis_url, run="demo")
    asyncrl dashboard runs/demo        # a finished run: metrics.jsonl + summary.json, no Redis
    # then open http://127.0.0.1:8470/  (add ?token=... once when a token is configured)

Pages: ``/`` lists the runs in this Redis, ``/run/{run}`` is one run's live page (plotly charts,
updated once a second over server-sent events). JSON per panel: ``/api/runs``,
``/api/run/{run}/summary|generators|alerts|series?names=a,b&since=ID|stream``; ``/metrics`` is
Prometheus text. The data comes through one `Source` (sources.py): RedisSource for a live run,
RunDirSource (rundir.py) for a finished one, whose summary says ``"mode": "finished"`` and the
page then loads once instead of following the stream. Read-only: the app never writes to Redis
or the run dir, and never unpickles anything.

Security (guard.py): binds 127.0.0.1 by default; a non-loopback host needs a token. With a token every
route needs it (``?token=``, ``Authorization: Bearer``, or the cookie set after the first visit):
none -> 401, wrong -> 403.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from asyncrl.monitor.dashboard import data
from asyncrl.monitor.dashboard.guard import LoopbackHostOnly, TokenAuth, check_host, error_response
from asyncrl.monitor.dashboard.prometheus import prometheus_text
from asyncrl.monitor.dashboard.rundir import RunDirSource
from asyncrl.monitor.dashboard.sources import RedisSource, Source
from asyncrl.queue.connection import QueueUnavailable, Retrier, redact_url

STATIC_DIR = Path(__file__).parent / "static"
STREAM_INTERVAL_S = 1.0
CONNECT_TIMEOUT_S = 5.0
"""How long `serve` retries a live run's Redis before refusing to start: long enough for a
dashboard started just before its trainer's redis-server."""


def plotly_js_path() -> Path:
    """plotly.min.js from the installed plotly package: the page works offline, no CDN."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the 'plotly' package")
    return path


# ----------------------------------------------------------------------------- errors


async def _unknown_run(request: Request, exc: Exception) -> Response:
    return error_response(request, 404, "Unknown run", str(exc))


async def _unreadable(request: Request, exc: Exception) -> Response:
    source = _source(request)
    return error_response(
        request,
        503,
        _down_title(source),
        f"cannot read run data from {source.display}: {type(exc).__name__}: {str(exc).rstrip('.')}. "
        f"{source.unreachable_hint()}",
    )


def _down_title(source: Source) -> str:
    return "Redis unreachable" if source.mode == "live" else "Run directory unreadable"


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(
        request, exc.status_code, "Bad request" if exc.status_code == 400 else "Not found", exc.detail
    )


# ----------------------------------------------------------------------------- endpoints


def _source(request: Request) -> Source:
    return request.app.state.source


def _run_param(request: Request) -> str:
    return request.path_params["run"]


async def index(request: Request) -> Response:
    fixed = request.app.state.default_run
    await run_in_threadpool(_source(request).check)  # an unreachable store gets the 503 page, not a blank one
    if fixed is not None:
        return RedirectResponse(f"/run/{fixed}", status_code=307)
    return FileResponse(STATIC_DIR / "index.html")


async def run_page(request: Request) -> Response:
    await run_in_threadpool(_source(request).require, _run_param(request))
    return FileResponse(STATIC_DIR / "index.html")


async def plotly_js(request: Request) -> Response:
    return FileResponse(request.app.state.plotly_path, media_type="application/javascript")


def _runs_listing(source: Source) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    for run in source.runs():
        snap = source.snapshot(run, now)
        s = snap["summary"]
        out.append(
            {
                "run": run,
                "status": s["status"],
                "policy_version": s["policy_version"],
                "step": s["step"],
                "started_at": s["started_at"],
                "generators": len(snap["generators"]),
                "alerts": len(snap["alerts"]),
                "reward_mean": s["latest"].get("reward/mean"),
            }
        )
    return out


async def api_runs(request: Request) -> Response:
    return JSONResponse({"runs": await run_in_threadpool(_runs_listing, _source(request))})


async def _snapshot(request: Request) -> dict[str, Any]:
    return await run_in_threadpool(_source(request).snapshot, _run_param(request))


async def api_summary(request: Request) -> Response:
    return JSONResponse((await _snapshot(request))["summary"])


async def api_generators(request: Request) -> Response:
    snap = await _snapshot(request)
    return JSONResponse(
        {
            "policy_version": snap["summary"]["policy_version"],
            "max_staleness": snap["summary"]["max_staleness"],
            "generators": snap["generators"],
        }
    )


async def api_alerts(request: Request) -> Response:
    snap = await _snapshot(request)
    return JSONResponse({"alerts": snap["alerts"], "thresholds": snap["summary"]["thresholds"]})


def _series_args(request: Request) -> tuple[list[str] | None, str | None]:
    raw = request.query_params.get("names")
    names = [n.strip() for n in raw.split(",") if n.strip()] if raw else None
    since = request.query_params.get("since")
    if since is not None and not _valid_stream_id(since):
        raise HTTPException(400, f"since={since!r}: expected a stream id like '1700000000000-0'")
    return names, since


def _valid_stream_id(text: str) -> bool:
    ms, _, seq = text.partition("-")
    return ms.isdigit() and (seq == "" or seq.isdigit())


async def api_series(request: Request) -> Response:
    names, since = _series_args(request)
    return JSONResponse(await run_in_threadpool(_source(request).series, _run_param(request), names, since))


async def api_stream(request: Request) -> Response:
    """Server-sent events: one `update` event per interval with new series points + the snapshot."""
    names, since = _series_args(request)
    source, run = _source(request), _run_param(request)
    await run_in_threadpool(source.require, run)  # 404 before the stream starts
    interval = request.app.state.stream_interval

    async def events():
        last_id = since
        while True:
            try:
                update = await run_in_threadpool(source.snapshot, run)
                update["summary"].pop("config", None)  # static for a run: /summary has it, no need every second
                series = await run_in_threadpool(source.series, run, names, last_id)
                last_id = series["last_id"]
                update.update(series)
                yield f"event: update\ndata: {json.dumps(update)}\n\n"
            except source.read_errors as e:
                # Keep the stream open: the page shows the error and recovers when the store is back.
                yield f"event: failure\ndata: {json.dumps({'error': f'{_down_title(source)}: {e}'})}\n\n"
            except data.UnknownRun as e:  # the run's keys were deleted while the page was open
                yield f"event: failure\ndata: {json.dumps({'error': str(e)})}\n\n"
            if await request.is_disconnected():
                return
            await asyncio.sleep(interval)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def prometheus(request: Request) -> Response:
    text = await run_in_threadpool(prometheus_text, _source(request))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ----------------------------------------------------------------------------- app


def create_app(
    redis_url: str,
    *,
    run: str | None,
    password: str | None = None,
    token: str | None = None,
    stream_interval: float = STREAM_INTERVAL_S,
) -> Starlette:
    """The live dashboard. `password` is the Redis password (if not in the URL); `token` guards the app."""
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis_url={redact_url(redis_url)!r}: must start with redis://, rediss:// or unix://")
    from asyncrl.queue.connection import client_from_url

    client = client_from_url(redis_url, password=password, socket_connect_timeout=2, socket_timeout=5)
    source = RedisSource(client, redact_url(redis_url))
    return build_app(source, run=run, token=token, stream_interval=stream_interval)


def create_run_dir_app(run_dir: str | Path, *, token: str | None = None) -> Starlette:
    """The finished-run dashboard of `run_dir` (rundir.NotARunDir if it has no metrics.jsonl)."""
    source = RunDirSource(run_dir)
    return build_app(source, run=source.run, token=token)


def build_app(
    source: Source, *, run: str | None, token: str | None = None, stream_interval: float = STREAM_INTERVAL_S
) -> Starlette:
    """The dashboard over any Source; `run` opens that run directly, `token` guards every route."""
    if token is not None and not token:
        raise ValueError("token='': give a non-empty token or None")
    routes = [
        Route("/", index),
        Route("/run/{run}", run_page),
        Route("/plotly.min.js", plotly_js),
        Route("/metrics", prometheus),
        Route("/api/runs", api_runs),
        Route("/api/run/{run}/summary", api_summary),
        Route("/api/run/{run}/generators", api_generators),
        Route("/api/run/{run}/alerts", api_alerts),
        Route("/api/run/{run}/series", api_series),
        Route("/api/run/{run}/stream", api_stream),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    handlers: dict[Any, Callable] = {data.UnknownRun: _unknown_run, HTTPException: _http_error}
    handlers.update({kind: _unreadable for kind in source.read_errors})
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.source = source
    app.state.default_run = run
    app.state.stream_interval = stream_interval
    app.state.plotly_path = plotly_js_path()
    if token is not None:
        app.add_middleware(TokenAuth, token=token)
    return app


def serve(
    redis_url: str | None = None,
    run: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    password: str | None = None,
    *,
    run_dir: str | Path | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> None:
    """Run the dashboard with uvicorn until interrupted: a live run's Redis (`redis_url`) or a
    finished run's directory (`run_dir`), exactly one. Refuses a non-loopback host without a token,
    and a Redis that does not answer within `connect_timeout_s` (QueueUnavailable, QueueAuthError)."""
    if (redis_url is None) == (run_dir is None):
        raise ValueError("give exactly one of a Redis URL (a live run) or a run directory (a finished run)")
    check_host(host, token)
    if run_dir is not None:
        app = create_run_dir_app(run_dir, token=token)
        what = f" (finished run {app.state.source.run!r} from {app.state.source.display})"
    else:
        assert redis_url is not None  # exactly one of the two, checked above
        app = create_app(redis_url, run=run, password=password, token=token)
        _wait_for_redis(app.state.source, connect_timeout_s)
        what = ""
    print(f"asyncrl dashboard: http://{host}:{port}/{what}" + (" (token required)" if token else ""), flush=True)
    uvicorn.run(app if token else LoopbackHostOnly(app), host=host, port=port, log_level="warning")


def _wait_for_redis(source: Source, timeout_s: float) -> None:
    """Refuse to serve a page over a Redis that is not there: each page would only say so."""
    try:
        Retrier(source.display, deadline_s=timeout_s)(source.check)
    except QueueUnavailable as e:
        raise QueueUnavailable(f"{str(e).rstrip('.')}. {source.unreachable_hint()}") from e


class DashboardServer(uvicorn.Server):
    """A uvicorn Server that knows the port its socket is bound to (port 0 picks one)."""

    def __init__(self, config: uvicorn.Config, bound_port: int):
        super().__init__(config)
        self.bound_port = bound_port


def serve_in_thread(
    redis_url: str,
    run: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    password: str | None = None,
) -> DashboardServer:
    """Start the dashboard on a daemon thread (the trainer's own copy); returns the uvicorn
    Server, whose `should_exit = True` stops it. Port 0 picks a free port. Off the main
    thread uvicorn leaves signal handling to the caller (the trainer owns SIGINT/SIGTERM)."""
    import socket
    import threading

    check_host(host, token)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = create_app(redis_url, run=run, password=password, token=token)
    served = app if token else LoopbackHostOnly(app)  # token-less: loopback only, so Host must say so
    server = DashboardServer(uvicorn.Config(served, log_level="warning"), bound_port=sock.getsockname()[1])
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="dashboard")
    thread.start()
    return server
