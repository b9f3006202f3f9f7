"""Who may see the dashboard, and what a refused or failed request gets back.

    check_host("0.0.0.0", token=None)     # ValueError: a non-loopback bind needs a token
    app.add_middleware(TokenAuth, token="...")
    app = LoopbackHostOnly(app)            # a token-less server: requests must name loopback
    error_response(request, 404, "Unknown run", "...")  # an HTML page, or JSON under /api/

With a token every route needs it (``?token=``, ``Authorization: Bearer``, or the cookie set
after the first visit): none -> 401, wrong -> 403. Tokens are at least 16 characters
(``monitor.dashboard_token: generate`` makes one: ``resolve_token``). The cookie is marked
``Secure`` when the request came over TLS (uvicorn's scheme: https behind a TLS proxy on
this host that sends ``X-Forwarded-Proto: https``, or were uvicorn to serve TLS itself).

Without a token the dashboard binds loopback only, and answers only requests whose Host
header names loopback (127.0.0.1, localhost, [::1]) and, with a port, the port it is bound
to: a web page elsewhere whose own name is made to resolve to 127.0.0.1 (DNS rebinding)
sends its own name there, so the browser on this machine cannot be made to read the
dashboard's API for it.
"""

from __future__ import annotations

import hmac
import html
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
TOKEN_COOKIE = "asyncrl_dashboard_token"
MIN_TOKEN_CHARS = 16
GENERATE = "generate"
"""monitor.dashboard_token's value asking for a random token (resolve_token)."""
TOKEN_FILE = "dashboard_token"

log = logging.getLogger(__name__)


def _wants_html(request: Request) -> bool:
    return not (request.url.path.startswith("/api/") or request.url.path == "/metrics")


def error_response(request: Request, status: int, title: str, message: str) -> Response:
    if not _wants_html(request):
        return JSONResponse({"error": title, "message": message}, status_code=status)
    t, m = html.escape(title), html.escape(message)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>asyncrl: {t}</title>"
        "<link rel='stylesheet' href='/static/style.css'></head><body class='error-page'>"
        f"<main><h1>{t}</h1><p class='error-message'>{m}</p><p><a href='/'>All runs</a></p></main></body></html>"
    )
    return HTMLResponse(page, status_code=status)


def check_host(host: str, token: str | None) -> None:
    if host not in LOOPBACK_HOSTS and not token:
        raise ValueError(f"host={host!r} is reachable from other machines: set a token (--token) to bind it")
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        # The length only: the token itself must not reach a log or a terminal.
        raise ValueError(f"token: {len(token)} characters; give at least {MIN_TOKEN_CHARS}")


def resolve_token(token: str | None, run_dir: Path) -> str | None:
    """The dashboard's token: `token` itself, or for "generate" a fresh random one written to
    run_dir/dashboard_token (0600, like config.yaml) and only its path logged."""
    if token != GENERATE:
        return token
    token = secrets.token_urlsafe(24)
    path = run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of a resumed run may have another mode
        f.write(token + "\n")
    log.info("dashboard token generated: %s (open the dashboard with ?token=<its contents>)", path)
    return token


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
        # An empty ?token= is no token: it must not replace a valid cookie (a logout by link).
        query = request.query_params.get("token") or None
        header = request.headers.get("authorization", "")
        bearer = header[7:].strip() if header.lower().startswith("bearer ") else None
        given = query or bearer or request.cookies.get(TOKEN_COOKIE)
        if given is None:
            response = error_response(
                request,
                401,
                "Token required",
                "this dashboard needs its access token: open it with ?token=... or send 'Authorization: Bearer ...'",
            )
            await response(scope, receive, send)
            return
        if not hmac.compare_digest(given.encode(), self.token):
            response = error_response(
                request, 403, "Wrong token", "the access token given does not match this dashboard's"
            )
            await response(scope, receive, send)
            return
        if query is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cookie(message: dict) -> None:
            # First visit by link: remember the token so the page's own requests carry it.
            if message["type"] == "http.response.start":
                cookie = f"{TOKEN_COOKIE}={query}; Path=/; HttpOnly; SameSite=Strict"
                if scope.get("scheme") == "https":
                    cookie += "; Secure"  # never sent back over plain HTTP, where it could be read
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cookie)


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def loopback_host_header(host: str, bound_port: int | None) -> bool:
    """Whether a Host header names this loopback server: a loopback name and, if it has a port,
    the bound one."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1] or [::1]:PORT
        inside, _, rest = host.partition("]")
        name, port = inside + "]", rest.removeprefix(":")
        if rest and not rest.startswith(":"):
            return False
    else:
        name, _, port = host.partition(":")
    if name not in LOOPBACK_NAMES:
        return False
    return not port or bound_port is None or port == str(bound_port)


class LoopbackHostOnly:
    """ASGI middleware for a token-less dashboard: 403 for a request whose Host header does not
    name loopback and the server's port (DNS rebinding)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        server = scope.get("server")
        if loopback_host_header(host, server[1] if server else None):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        response = error_response(
            request,
            403,
            "Host not allowed",
            "this dashboard has no token and answers only requests to 127.0.0.1, localhost or [::1] on its own port",
        )
        await response(scope, receive, send)
