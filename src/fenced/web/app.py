"""The dashboard's Starlette app: the page, its three static files, and the JSON API.

Everything is read through the operator tools (``fenced._inspect``, ``fenced.records``),
as ``fenced ls`` and ``fenced show`` read it, and every string that came from Redis is
escaped by :func:`fenced._printable.printable` before it is sent (the page then shows it
as text, never as markup). A release goes through ``fenced._inspect.force_release``,
as ``fenced release --token`` does: it names the holder it clears (the one the page
showed), and is recorded in the claim's run records and on ``fenced.audit``.

A claim name is one path segment of the API, percent-encoded (``/`` as ``%2F``), so
that a name holding ``/`` is never read as a route.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import math
import signal
import socket
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import unquote

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._beat import as_dict as beat_dict
from .._errors import ClaimUnavailable, ConfigError
from .._inspect import (
    beat_status,
    force_release,
    list_claims,
    operator,
    read_slots,
    release_slot,
    show_claim,
)
from .._lease import MAX_RECORDS, UNREACHABLE, describe_client, why_unreachable
from .._printable import printable
from ..records import history

__all__ = ["HEADERS", "create_app", "listen", "serve", "server_config"]

#: Sent with every response: nothing but the app's own files runs or loads in the page.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: The page's files, by the name the page asks for them (served from the package).
STATIC = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
#: The length of a holder's token as the API shows it (``fenced._lease.short_token``):
#: the shortest prefix a release takes, unless a holder's whole shown token is shorter.
SHOWN = 8
#: The largest release request read (a reason, a token prefix).
MAX_BODY = 64 * 1024
#: Seconds a request's body may take to arrive.
BODY_TIMEOUT = 30.0
#: Seconds a request's head may take to arrive (from the connection, or the last answer).
HEAD_TIMEOUT = 30.0
#: Connections served at once; the page needs two or three per viewer.
MAX_CONNECTIONS = 64
#: Wrong release tokens a client may send in GUESS_WINDOW seconds; then it gets 429.
MAX_GUESSES = 5
GUESS_WINDOW = 60.0
#: How deep the data of a run record is shown (anyone may write a record).
DEPTH = 32
#: The longest text sent of one value (a record's field may be megabytes, and the page
#: asks again every few seconds).
MAX_TEXT = 4096
#: Runs the timeline shows by default.
RUNS = 50
#: The fields of a run the timeline takes as they are (after start, end, outcome, holder).
TIMELINE = ("worker", "task_id", "token", "fence", "duration", "reason", "unreadable")


class _Anything(PathConvertor):
    """A path parameter of any characters: a claim name may hold a newline (``%0A``),
    which Starlette's ``path`` (``.*``) does not match."""

    regex = r"[\s\S]*"


register_url_convertor("fenced_any", _Anything())


def _safe(value: Any, depth: int = 0) -> Any:
    """JSON-ready data with every string escaped for display (keys too).

    What JSON cannot carry (NaN and infinities, which a record's JSON may hold) is sent as
    text, a record nested deeper than :data:`DEPTH` is cut there, and a text longer than
    :data:`MAX_TEXT` is cut, saying so.
    """
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            more = len(value) - MAX_TEXT
            return printable(value[:MAX_TEXT]) + f"… ({more} more characters not shown)"
        return printable(value)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= DEPTH and isinstance(value, (dict, list, tuple)):
        return "… (nested too deep to show)"
    if isinstance(value, dict):
        return {_safe(k, depth): _safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v, depth + 1) for v in value]
    return printable(value)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_safe(data), status_code=status, headers=headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return _json({"error": message}, status, headers)


def host_name(header: str) -> str:
    """The name in a ``Host`` (or ``Origin`` netloc) value, without its port: ``[::1]:80``
    is ``::1``, ``Localhost:8377`` is ``localhost``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") > 1:  # an IPv6 address as it is (an allowed name)
        return header
    return header.partition(":")[0]


class _Headers:
    """ASGI middleware: the security headers on every response, and only the allowed
    ``Host`` names answered (a page elsewhere that rebinds its DNS to this address sends
    its own name)."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str] | None = None) -> None:
        self.app = app
        self.allowed = {host_name(h) for h in allowed_hosts} if allowed_hosts else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed is not None:
            host = Request(scope).headers.get("host", "")
            if host_name(host) not in self.allowed:
                names = ", ".join(sorted(self.allowed))
                send_to = _error(
                    400,
                    f"Host {host!r} is not a name this server answers to ({names}): "
                    "open the page by one of them, or start fenced web with --allow-host "
                    "NAME",
                )
                await self._with_headers(send_to, scope, receive, send)
                return
        await self._with_headers(self.app, scope, receive, send)

    @staticmethod
    async def _with_headers(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_with(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                have = {k.lower() for k, _v in message.get("headers", [])}
                extra = [
                    (k.lower().encode(), v.encode())
                    for k, v in HEADERS.items()
                    if k.lower().encode() not in have
                ]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            await app(scope, receive, send_with)
        except Exception:
            # Starlette answers a crash outside this middleware, without the headers:
            # answer here, and let the error go on to the server's log.
            if not started:
                await _crash_answer(scope, receive, send_with)
            raise


class _Guesses:
    """Wrong tokens per client address: enough for a typo, too few to guess one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}  # address: (window start, wrong)

    def wait(self, peer: str) -> float:
        """Seconds until ``peer`` may send a token again (0: now)."""
        with self._lock:
            start, wrong = self._seen.get(peer, (0.0, 0))
            left = start + GUESS_WINDOW - time.monotonic()
            return left if wrong >= MAX_GUESSES and left > 0 else 0.0

    def wrong(self, peer: str) -> None:
        now = time.monotonic()
        with self._lock:
            start, wrong = self._seen.get(peer, (now, 0))
            if now - start >= GUESS_WINDOW:
                start, wrong = now, 0
            self._seen[peer] = (start, wrong + 1)
            if len(self._seen) > 10_000:  # many addresses: forget the windows that ended
                self._seen = {p: v for p, v in self._seen.items() if now - v[0] < GUESS_WINDOW}


def _server_now(client: Any) -> float:
    """Now on the Redis server's clock (the one run records are stamped with)."""
    try:
        secs, micros = client.time()
        return int(secs) + int(micros) / 1e6
    except Exception:  # a cluster client without a node to ask: this host's clock
        return time.time()


def _name_and_action(request: Request, under: str = "/api/claims/") -> tuple[str, str]:
    """The claim (or beat) name (one percent-encoded segment) and what follows it ("" for
    none)."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    path = raw.decode("latin-1").split("?", 1)[0]
    rest = path[len(under) :]
    segment, _slash, action = rest.partition("/")
    return unquote(segment), action


def create_app(
    client: Any,
    namespace: str = "fenced",
    allow_release: bool = False,
    token: str | None = None,
    *,
    refresh: float = 2.0,
    alert_after_skips: int = 5,
    redis_label: str | None = None,
    allowed_hosts: list[str] | None = None,
) -> Starlette:
    """The dashboard of the claims under ``namespace`` on ``client``, as an ASGI app.

    ``allow_release`` turns on ``POST /api/claims/{name}/release``, which then needs
    ``Authorization: Bearer <token>``. ``alert_after_skips`` marks claims whose
    consecutive skips reach it (0: never). ``redis_label`` is shown on the page as it
    is: give a redacted URL (``fenced._client.redact``), never one with a password.
    ``allowed_hosts`` are the Host headers answered (None: any); on loopback, naming
    them keeps a page of another site that rebinds its DNS to 127.0.0.1 out.
    """
    from .._lease import check_namespace

    check_namespace(namespace)
    if allow_release and not token:
        raise ConfigError(
            "allow_release=True needs a token: pass token=..., the secret clients send "
            "as 'Authorization: Bearer <token>'"
        )
    if refresh <= 0:
        raise ConfigError(f"refresh={refresh!r} must be a positive number of seconds, e.g. 2")
    if alert_after_skips < 0:
        raise ConfigError(
            f"alert_after_skips={alert_after_skips!r} must be 0 (no alert) or a whole "
            "number of skips, e.g. 5"
        )
    files = resources.files(__package__) / "static"
    page = (files / "index.html").read_bytes()
    static = {name: (files / name).read_bytes() for name in STATIC}
    where = redis_label if redis_label is not None else describe_client(client)
    guesses = _Guesses()

    def alerting(skips: int) -> bool:
        return alert_after_skips > 0 and skips >= alert_after_skips

    def talking(
        handler: Callable[[Request, bytes], Response], request: Request, body: bytes
    ) -> Response:
        """``handler``'s answer; Redis unreachable or answering an error: a 503 naming it."""
        try:
            return handler(request, body)
        except UNREACHABLE as exc:
            return _error(503, f"cannot reach Redis at {where}: {why_unreachable(exc)}")
        except ClaimUnavailable as exc:
            return _error(503, str(exc))
        except redis.ResponseError as exc:
            return _error(503, f"Redis at {where} answered with an error: {exc}")
        except ConfigError as exc:
            return _error(400, exc.message)

    def index(request: Request, body: bytes) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    def static_file(request: Request, body: bytes) -> Response:
        name = request.path_params["file"]
        if name not in static:
            return _error(404, f"no such file: {name}")
        return Response(static[name], media_type=STATIC[name])

    def config(request: Request, body: bytes) -> Response:
        return _json(
            {
                "namespace": namespace,
                "redis": where,
                "refresh": refresh,
                "alert_after_skips": alert_after_skips,
                "allow_release": allow_release,
            }
        )

    def claims(request: Request, body: bytes) -> Response:
        infos = list_claims(client, namespace)
        rows = [{**info.as_dict(), "alert": alerting(info.skips)} for info in infos]
        return _json(
            {
                "namespace": namespace,
                "now": _server_now(client),
                "alert_after_skips": alert_after_skips,
                "claims": rows,
            }
        )

    def claim(request: Request, body: bytes) -> Response:
        name, action = _name_and_action(request)
        if not name:
            return _error(404, "no claim named: use /api/claims/NAME")
        if request.method == "POST":
            if action != "release":
                return _error(405, f"POST goes to /api/claims/{{name}}/release, not {action!r}")
            return release(request, name, body)
        if action == "runs":
            return runs(request, name)
        if action:
            return _error(404, f"no such view {action!r}: use /api/claims/{{name}}/runs")
        report = show_claim(client, name, namespace=namespace, limit=_limit(request))
        now = _server_now(client)
        return _json(report.as_dict() | {"alert": alerting(report.skips), "now": now})

    def beat(request: Request, body: bytes) -> Response:
        name, action = _name_and_action(request, "/api/beats/")
        if not name or action:
            return _error(404, "no beat named: use /api/beats/NAME (its fenced_beat_name)")
        report = beat_status(client, name, namespace=namespace)
        return _json(beat_dict(report) | {"now": _server_now(client)})

    def runs(request: Request, name: str) -> Response:
        records = history(client, name, limit=_limit(request), namespace=namespace)
        now = _server_now(client)
        out = [
            {
                "start": run.started,
                "end": run.finished,
                "outcome": run.outcome,
                # Who held the claim: a skip's and a release's holder is the one found
                # there; any other run's, the process that ran it.
                "holder": run.holder or run.worker,
                **{field: getattr(run, field) for field in TIMELINE},
            }
            for run in records
        ]
        skips = [r.started for r in records if r.outcome == "skipped"]
        losses = [r.finished or r.started for r in records if r.outcome == "lost"]
        return _json(
            {
                "name": records[0].name if records else name,
                "now": now,
                "runs": out,
                "skips": skips,
                "losses": losses,
            }
        )

    def release(request: Request, name: str, raw: bytes) -> Response:
        if not allow_release:
            return _error(
                403,
                "releasing is off: start fenced web with --allow-release (and --token-file "
                "or FENCED_WEB_TOKEN) to release claims from the dashboard",
            )
        foreign = _cross_site(request)
        if foreign:
            return _error(403, foreign)
        peer = request.client.host if request.client else "?"
        wait = guesses.wait(peer)
        if wait:
            return _error(
                429,
                f"too many wrong tokens from {peer}: wait {math.ceil(wait)} seconds",
                {"Retry-After": str(math.ceil(wait))},
            )
        auth = request.headers.get("authorization", "")
        scheme, _sp, given = auth.partition(" ")
        if not auth or scheme.lower() != "bearer" or not given.strip():
            return _error(
                401,
                "no token: send 'Authorization: Bearer <token>' with the token fenced web "
                "was started with",
                {"WWW-Authenticate": 'Bearer realm="fenced"'},
            )
        assert token is not None  # checked when the app was made
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            guesses.wrong(peer)
            return _error(403, "wrong token: not the one fenced web was started with")
        body = _body(request, raw)
        if isinstance(body, Response):
            return body
        reason = body.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return _error(400, 'give a reason: {"reason": "..."}; the run records keep it')
        prefix = _holder_named(body)
        if isinstance(prefix, Response):
            return prefix
        held = read_slots(client, name, namespace=namespace)
        if len(prefix) < SHOWN and prefix not in {h.token for _i, h in held}:
            return _error(
                400,
                f'"token": {prefix!r} is too short to name one holder: send its "token" as '
                f"GET /api/claims/{{name}} shows it ({SHOWN} characters)",
            )
        by = f"{operator()} (fenced web, for {peer})"
        # The prefix is compared with the lease in the script that deletes it: a holder
        # that came after the one aimed at is never cleared.
        holder = force_release(
            client,
            name,
            reason=reason.strip(),
            namespace=namespace,
            by=by,
            token_prefix=prefix,
            slot=release_slot(held, prefix),
        )
        if holder is None:
            now = read_slots(client, name, namespace=namespace)
            if now:
                who = "; ".join(f"slot {i}: token {h.token}, {h}" for i, h in now)
                return _json(
                    {
                        "error": f"the holder changed: token {prefix} no longer holds "
                        f"{name!r}, which is held by {who} now; nothing released (check "
                        "the new holder before releasing it)",
                        "holder": now[0][1].as_dict(),
                        "slots": [{"slot": i, **h.as_dict()} for i, h in now],
                    },
                    409,
                )
        message = (
            f"released {name!r}, was held by {holder}"
            if holder
            else f"nothing held under {name!r} in namespace {namespace!r} (token {prefix} is gone)"
        )
        return _json(
            {
                "name": name,
                "released": holder is not None,
                "holder": holder.as_dict() if holder else None,
                "by": by,
                "reason": reason.strip(),
                "message": message,
            }
        )

    def sync(handler: Callable[[Request, bytes], Response], blocking: bool = True) -> Any:
        """An endpoint running ``handler``: in the thread pool if it talks to Redis (the
        page and its files never wait behind requests a hung Redis holds there)."""

        async def endpoint(request: Request) -> Response:
            size = request.headers.get("content-length", "0")
            if not size.isdigit() or int(size) > MAX_BODY:
                return _error(413, f"send at most {MAX_BODY} bytes, with a Content-Length")
            body = await _read_body(request) if request.method == "POST" else b""
            if isinstance(body, Response):
                return body
            if not blocking:
                return handler(request, body)
            return await run_in_threadpool(talking, handler, request, body)

        return endpoint

    return Starlette(
        routes=[
            Route("/", sync(index, blocking=False)),
            Route("/favicon.ico", lambda request: Response(status_code=204)),
            Route("/static/{file}", sync(static_file, blocking=False)),
            Route("/api/config", sync(config, blocking=False)),
            Route("/api/claims", sync(claims)),
            Route("/api/claims/{rest:fenced_any}", sync(claim), methods=["GET", "POST"]),
            Route("/api/beats/{rest:fenced_any}", sync(beat)),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _crash},
        middleware=[Middleware(_Headers, allowed_hosts=allowed_hosts)],
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """A route that is not there, or a method it does not take: JSON, as every answer."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 405:
        return _error(405, f"{request.method} is not taken here: see docs/web.md for the API")
    if status == 404:
        return _error(
            404,
            "no such page: the API is /api/config, /api/claims[/NAME[/runs]] and /api/beats/NAME",
        )
    return _error(status, exc.detail if isinstance(exc, HTTPException) else "error")


async def _crash(request: Request, exc: Exception) -> Response:
    """A bug: the server's log has the traceback; the answer names nothing of it."""
    return _error(500, "internal error: fenced web's log (its stderr) has the details")


async def _crash_answer(scope: Scope, receive: Receive, send: Send) -> None:
    await (await _crash(Request(scope), RuntimeError()))(scope, receive, send)


async def _read_body(request: Request) -> bytes | Response:
    """The request's body, counted as it arrives: a 413 at :data:`MAX_BODY` bytes, whatever
    ``Content-Length`` says (a chunked body has none), and a 408 when it has not all
    come within :data:`BODY_TIMEOUT` seconds; what is past the cap is never read."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + BODY_TIMEOUT
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(
                stream.__anext__(), max(0.0, deadline - time.monotonic())
            )
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            return _error(408, f"the body did not come within {BODY_TIMEOUT:g} seconds")
        size += len(chunk)
        if size > MAX_BODY:
            return _error(413, f"send at most {MAX_BODY} bytes")
        chunks.append(chunk)


def _limit(request: Request) -> int:
    """The ``limit`` query parameter: runs to read, 1 to MAX_RECORDS (default RUNS)."""
    text = request.query_params.get("limit")
    if text is None:
        return RUNS
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"limit={text!r} is not a whole number of runs, e.g. 50") from None
    return max(1, min(value, MAX_RECORDS))


def _cross_site(request: Request) -> str | None:
    """Why a release comes from a page of another site, or None when it does not.

    A browser names the page that sends a POST in ``Origin`` (and ``Sec-Fetch-Site``):
    it must be this server, as the browser reached it (``Host``, or the
    ``X-Forwarded-Host`` a proxy in front sets; a page elsewhere cannot set either).
    Without ``Origin`` (curl, scripts) the token alone decides.
    """
    site = request.headers.get("sec-fetch-site", "").lower()
    if site in ("cross-site", "same-site"):
        return f"refused: a {site} request; release from the dashboard's own page or with curl"
    origin = request.headers.get("origin")
    if origin is None:
        return None
    scheme, _sep, netloc = origin.partition("://")
    served = {request.headers.get("host", "").strip().lower()}
    forwarded = request.headers.get("x-forwarded-host")
    if forwarded:
        served.add(forwarded.split(",", 1)[0].strip().lower())
    if scheme.lower() in ("http", "https") and netloc.strip().lower() in served:
        return None
    return (
        f"refused: a request from the page {origin!r}, not this server's; release from "
        "the dashboard's own page or with curl"
    )


def _body(request: Request, raw: bytes) -> dict[str, Any] | Response:
    """The request's JSON object, or the 400/415 that says what is wrong with it."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        # Also what keeps a cross-site form from posting: JSON needs a CORS preflight.
        return _error(415, 'send JSON: Content-Type: application/json, {"reason": "..."}')
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        return _error(400, 'the body is not JSON: send {"reason": "..."}')
    if not isinstance(data, dict):
        return _error(400, 'the body is not a JSON object: send {"reason": "..."}')
    return data


def _holder_named(body: dict[str, Any]) -> str | Response:
    """The ``token`` prefix of the holder a release is aimed at, or the 400 naming it.

    Required whatever the holders: without it, a release clears whoever holds the name
    when it lands, which may be the run that started after the one the operator saw.
    """
    prefix = body.get("token")
    if prefix is not None and not isinstance(prefix, str):
        return _error(400, '"token" is the start of the holder\'s token, as text')
    prefix = (prefix or "").strip()
    if not prefix:
        return _error(
            400,
            'name the holder to clear: {"reason": "...", "token": PREFIX}, the "token" of '
            "the holder as GET /api/claims/{name} shows it; only that holder is released",
        )
    return prefix


def listen(host: str, port: int, *, option: str = "--port") -> socket.socket:
    """A socket bound to host:port and listening, or a ConfigError naming the fix
    (``option`` is the flag that sets the port, for the message)."""
    address = host.strip("[]")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(128)
    except socket.gaierror as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}: {exc.strerror}; pass --host with an address, e.g. 127.0.0.1"
        ) from None
    except OSError as exc:
        sock.close()
        fix = {
            errno.EADDRINUSE: f"another program listens there: pass {option} with a free "
            f"port ({option} 0 lets the system choose)",
            errno.EACCES: f"ports below 1024 need root: pass {option} 1024 or above",
            errno.EADDRNOTAVAIL: "not an address of this machine: pass --host 127.0.0.1 "
            "(or an address it has)",
        }.get(exc.errno or 0, f"pass another --host or {option}")
        raise ConfigError(f"cannot listen on {host} port {port}: {exc.strerror}; {fix}") from None
    return sock


def _timely_protocol() -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's head: uvicorn waits for
    one as long as a connection stays open, so connections that send nothing or half a
    request would pile up. Each is closed :data:`HEAD_TIMEOUT` seconds after it opened, or
    after its last answer, unless a whole request head came in the meantime."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Timely(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _wait_for_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self._head_late)

        def _head_late(self) -> None:
            # No request since the timer was set: the cycle is the answered one, or none.
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return Timely


def server_config(app: ASGIApp, *, forwarded_allow_ips: str | None = None) -> Any:
    """The uvicorn configuration ``fenced web`` serves ``app`` with.

    ``X-Forwarded-For`` (the client address a release is recorded for) is believed only
    from the proxies named in ``forwarded_allow_ips`` (None: from nobody); a request head
    has :data:`HEAD_TIMEOUT` seconds to come, and at most :data:`MAX_CONNECTIONS`
    connections are served at once (those beyond are answered 503).
    """
    import uvicorn

    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        server_header=False,
        http=_timely_protocol(),
        proxy_headers=bool(forwarded_allow_ips),
        forwarded_allow_ips=forwarded_allow_ips or "",
        timeout_keep_alive=5,
        limit_concurrency=MAX_CONNECTIONS,
        h11_max_incomplete_event_size=16 * 1024,
    )


def serve(
    app: ASGIApp,
    sock: socket.socket,
    started: Callable[[], None] | None = None,
    *,
    forwarded_allow_ips: str | None = None,
) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until Ctrl-C or SIGTERM, then return;
    ``started`` is called once a stop is sure to be caught (to say the server is up).
    ``forwarded_allow_ips``: see :func:`server_config`."""
    import uvicorn

    config = server_config(app, forwarded_allow_ips=forwarded_allow_ips)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            # Said once uvicorn's own handlers are in place: a stop asked for when the
            # server says it is up sets its should_exit, never a signal between the two.
            if started is not None and not self.should_exit:
                started()

    # uvicorn stops on SIGINT or SIGTERM, then raises it again: a stop asked for returns
    # (exit 0), not a KeyboardInterrupt (130) or a death by signal, even one that comes
    # before uvicorn's own handlers are in place.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
