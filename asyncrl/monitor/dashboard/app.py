"""The live staleness/drift dashboard: a Starlette app over the run's Redis keys.

    python -m asyncrl.monitor.dashboard --redis redis://127.0.0.1:6379 [--run demo] [--port 8470]
    # or: asyncrl dashboard --redis URL;  or in code: serve(redis_url, run="demo")
    # then open http://127.0.0.1:8470/  (add ?token=... once when a token is configured)

Pages: ``/`` lists the runs in this Redis, ``/run/{run}`` is one run's live page (plotly charts,
updated once a second over server-sent events). JSON per panel: ``/api/runs``,
``/api/run/{run}/summary|generators|alerts|series?names=a,b&since=ID|stream``; ``/metrics`` is
Prometheus text. Read-only: the app never writes to Redis and never unpickles anything.

Security: binds 127.0.0.1 by default; a non-loopback host needs a token. With a token every
route needs it (``?token=``, ``Authorization: Bearer``, or the cookie set after the first visit):
none -> 401, wrong -> 403.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from asyncrl.monitor import metrics as M
from asyncrl.monitor.dashboard import data

STATIC_DIR = Path(__file__).parent / "static"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
TOKEN_COOKIE = "asyncrl_dashboard_token"
STREAM_INTERVAL_S = 1.0


def plotly_js_path() -> Path:
    """plotly.min.js from the installed plotly package: the page works offline, no CDN."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the 'plotly' package")
    return path


# ----------------------------------------------------------------------------- errors


def _wants_html(request: Request) -> bool:
    return not (request.url.path.startswith("/api/") or request.url.path == "/metrics")


def _error(request: Request, status: int, title: str, message: str) -> Response:
    if not _wants_html(request):
        return JSONResponse({"error": title, "message": message}, status_code=status)
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>asyncrl: {t}</title>"
        "<link rel='stylesheet' href='/static/style.css'></head><body class='error-page'>"
        "<main><h1>{t}</h1><p class='error-message'>{m}</p><p><a href='/'>All runs</a></p></main></body></html>"
    ).format(t=html.escape(title), m=html.escape(message))
    return HTMLResponse(page, status_code=status)


async def _unknown_run(request: Request, exc: Exception) -> Response:
    return _error(request, 404, "Unknown run", str(exc))


async def _redis_down(request: Request, exc: Exception) -> Response:
    url = request.app.state.redis_display
    return _error(
        request,
        503,
        "Redis unreachable",
        f"cannot read run data from {url}: {type(exc).__name__}: {str(exc).rstrip('.')}. "
        f"Is the trainer's redis-server running, and is --redis right?",
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return _error(request, exc.status_code, "Bad request" if exc.status_code == 400 else "Not found", exc.detail)


# ----------------------------------------------------------------------------- auth


class TokenAuth:
    """ASGI middleware: every HTTP request must carry the token (query, bearer header or cookie)."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        query = request.query_params.get("token")
        header = request.headers.get("authorization", "")
        bearer = header[7:].strip() if header.lower().startswith("bearer ") else None
        given = query or bearer or request.cookies.get(TOKEN_COOKIE)
        if given is None:
            response = _error(
                request,
                401,
                "Token required",
                "this dashboard needs its access token: open it with ?token=... or send 'Authorization: Bearer ...'",
            )
            await response(scope, receive, send)
            return
        if not hmac.compare_digest(given.encode(), self.token):
            response = _error(request, 403, "Wrong token", "the access token given does not match this dashboard's")
            await response(scope, receive, send)
            return
        if query is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cookie(message: dict) -> None:
            # First visit by link: remember the token so the page's own requests carry it.
            if message["type"] == "http.response.start":
                cookie = f"{TOKEN_COOKIE}={query}; Path=/; HttpOnly; SameSite=Strict"
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)


# ----------------------------------------------------------------------------- endpoints


def _client(request: Request) -> redis.Redis:
    return request.app.state.redis


def _run_param(request: Request) -> str:
    return request.path_params["run"]


async def index(request: Request) -> Response:
    fixed = request.app.state.default_run
    await run_in_threadpool(_client(request).ping)  # an unreachable Redis gets the 503 page, not a blank one
    if fixed is not None:
        return RedirectResponse(f"/run/{fixed}", status_code=307)
    return FileResponse(STATIC_DIR / "index.html")


async def run_page(request: Request) -> Response:
    await run_in_threadpool(data.require_run, _client(request), _run_param(request))
    return FileResponse(STATIC_DIR / "index.html")


async def plotly_js(request: Request) -> Response:
    return FileResponse(request.app.state.plotly_path, media_type="application/javascript")


def _runs_listing(client: redis.Redis) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    for run in data.list_runs(client):
        snap = data.run_snapshot(client, run, now)
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
    return JSONResponse({"runs": await run_in_threadpool(_runs_listing, _client(request))})


async def _snapshot(request: Request) -> dict[str, Any]:
    return await run_in_threadpool(data.run_snapshot, _client(request), _run_param(request))


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


def _series(client: redis.Redis, run: str, names: list[str] | None, since: str | None) -> dict[str, Any]:
    data.require_run(client, run)
    return data.read_series(client, run, names, since=since)


async def api_series(request: Request) -> Response:
    names, since = _series_args(request)
    return JSONResponse(await run_in_threadpool(_series, _client(request), _run_param(request), names, since))


async def api_stream(request: Request) -> Response:
    """Server-sent events: one `update` event per interval with new series points + the snapshot."""
    names, since = _series_args(request)
    client, run = _client(request), _run_param(request)
    await run_in_threadpool(data.require_run, client, run)  # 404 before the stream starts
    interval = request.app.state.stream_interval

    async def events():
        last_id = since
        while True:
            try:
                update = await run_in_threadpool(data.run_snapshot, client, run)
                update["summary"].pop("config", None)  # static for a run: /summary has it, no need every second
                series = await run_in_threadpool(data.read_series, client, run, names, since=last_id)
                last_id = series["last_id"]
                update.update(series)
                yield f"event: update\ndata: {json.dumps(update)}\n\n"
            except redis.RedisError as e:
                # Keep the stream open: the page shows the error and recovers when Redis is back.
                yield f"event: failure\ndata: {json.dumps({'error': f'Redis unreachable: {e}'})}\n\n"
            except data.UnknownRun as e:  # the run's keys were deleted while the page was open
                yield f"event: failure\ndata: {json.dumps({'error': str(e)})}\n\n"
            if await request.is_disconnected():
                return
            await asyncio.sleep(interval)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


# ----------------------------------------------------------------------------- prometheus


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prom_value(value: float | None) -> str:
    if value is None:
        return "NaN"
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def prometheus_text(client: redis.Redis) -> str:
    """Latest value of every metric per run as gauges, the counters hash as counters, generators."""
    families: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, help_text: str, labels: dict[str, str], value: float | None) -> None:
        fam = families.setdefault(name, (kind, help_text, []))
        lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        fam[2].append(f"{name}{{{lab}}} {_prom_value(value)}")

    now = time.time()
    for run in data.list_runs(client):
        snap = data.run_snapshot(client, run, now)
        s, run_label = snap["summary"], {"run": run}
        for field in ("policy_version", "weights_version", "max_staleness"):
            if s[field] is not None:
                add(f"asyncrl_{field}", "gauge", f"run state: {field}", run_label, s[field])
        add("asyncrl_alerts", "gauge", "alerts currently raised", run_label, len(snap["alerts"]))
        for name, value in sorted(s["latest"].items()):
            doc = M.spec(name).doc if M.is_known(name) else "metric logged by the trainer"
            add(M.prometheus_name(name), "gauge", f"latest {name}: {doc}", run_label, value)
        for name, value in s["counters"].items():
            add(f"asyncrl_{name}_total", "counter", f"counters hash: {name}", run_label, value)
        for g in snap["generators"]:
            labels = {"run": run, "generator": g["id"]}
            add("asyncrl_generator_version", "gauge", "policy version a generator runs", labels, g["version"])
            add("asyncrl_generator_lag", "gauge", "policy_version - generator version", labels, g["lag"])
            add(
                "asyncrl_generator_heartbeat_age_seconds",
                "gauge",
                "seconds since the last heartbeat",
                labels,
                g["heartbeat_age_s"],
            )
            add(
                "asyncrl_generator_up",
                "gauge",
                "1 if the heartbeat is fresh",
                labels,
                0.0 if g["status"] == "gone" else 1.0,
            )
    lines = []
    for name, (kind, help_text, samples) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


async def prometheus(request: Request) -> Response:
    text = await run_in_threadpool(prometheus_text, _client(request))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


# ----------------------------------------------------------------------------- app


def _display_url(redis_url: str) -> str:
    """The Redis URL without a password, for error messages."""
    scheme, sep, rest = redis_url.partition("://")
    if sep and "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def create_app(
    redis_url: str,
    *,
    run: str | None,
    password: str | None = None,
    token: str | None = None,
    stream_interval: float = STREAM_INTERVAL_S,
) -> Starlette:
    """The dashboard app. `password` is the Redis password (if not in the URL); `token` guards the app."""
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis_url={redis_url!r}: must start with redis://, rediss:// or unix://")
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
    app = Starlette(
        routes=routes,
        exception_handlers={data.UnknownRun: _unknown_run, redis.RedisError: _redis_down, HTTPException: _http_error},
    )
    app.state.redis = redis.Redis.from_url(redis_url, password=password, socket_connect_timeout=2, socket_timeout=5)
    app.state.redis_display = _display_url(redis_url)
    app.state.default_run = run
    app.state.stream_interval = stream_interval
    app.state.plotly_path = plotly_js_path()
    if token is not None:
        app.add_middleware(TokenAuth, token=token)
    return app


def _check_host(host: str, token: str | None) -> None:
    if host not in LOOPBACK_HOSTS and not token:
        raise ValueError(f"host={host!r} is reachable from other machines: set a token (--token) to bind it")


def serve(
    redis_url: str,
    run: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    password: str | None = None,
) -> None:
    """Run the dashboard with uvicorn until interrupted. Refuses a non-loopback host without a token."""
    _check_host(host, token)
    import uvicorn

    app = create_app(redis_url, run=run, password=password, token=token)
    print(f"asyncrl dashboard: http://{host}:{port}/" + (" (token required)" if token else ""), flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def serve_in_thread(
    redis_url: str,
    run: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8470,
    token: str | None = None,
    password: str | None = None,
):
    """Start the dashboard on a daemon thread (the trainer's own copy); returns the uvicorn
    Server, whose `should_exit = True` stops it. Port 0 picks a free port. Off the main
    thread uvicorn leaves signal handling to the caller (the trainer owns SIGINT/SIGTERM)."""
    import socket
    import threading

    import uvicorn

    _check_host(host, token)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = create_app(redis_url, run=run, password=password, token=token)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="dashboard")
    thread.start()
    server.bound_port = sock.getsockname()[1]
    return server
