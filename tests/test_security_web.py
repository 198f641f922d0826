"""What the dashboard, the audit line and the command line hold against: a chunked body
past the cap, a forged X-Forwarded-For, control characters in a reason, a record nested
hundreds deep, a crash's traceback, half-sent requests, token guesses, huge fields.

Real redis-servers, `fenced web` as a subprocess (or uvicorn in a thread where a timeout
is shortened), raw sockets where HTTP itself is the attack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from starlette.testclient import TestClient

import fenced.web.app
from _wait import wait_for
from fenced import Claim
from fenced._audit import force_released, unqueued
from fenced.testing import RedisServer, free_port
from fenced.web import create_app

PASSWORD = "Web-Pw-77x"
TOKEN = "web-token-1234"


class PasswordServer(RedisServer):
    """A redis-server that wants a password: its URL carries it."""

    def __init__(self) -> None:
        super().__init__(extra=["--requirepass", PASSWORD])

    @property
    def url(self) -> str:
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def pw_server() -> Iterator[RedisServer]:
    with PasswordServer() as server:
        yield server


@pytest.fixture
def r(pw_server: RedisServer) -> Iterator[Any]:
    client = pw_server.client()
    client.flushall()
    yield client
    client.close()


def pw_url(server: RedisServer) -> str:
    return server.url


def clean_env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FENCED_", "TYPER_"))}
    env.update(more)
    return env


class Web:
    """`fenced web` as a subprocess, with its stderr collected."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "fenced.cli", "web", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.lines: list[str] = []

        def started() -> bool:
            assert self.proc.stderr is not None
            self.lines.append(self.proc.stderr.readline())
            return "shows the claims" in self.lines[-1]

        wait_for("fenced web to start", started, timeout=30, proc=self.proc)

    def stop(self) -> str:
        """Stop it; all it said on stderr."""
        self.proc.terminate()
        self.proc.wait(timeout=30)
        assert self.proc.stderr is not None
        return "".join(self.lines) + self.proc.stderr.read()

    def post(self, path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return int(answer.status), json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


# -- a chunked body is counted as it streams -----------------------------------------------


def test_a_chunked_body_past_the_cap_is_answered_413_before_it_is_all_sent(
    pw_server: RedisServer,
) -> None:
    env = clean_env(FENCED_REDIS_URL=pw_url(pw_server), FENCED_WEB_TOKEN=TOKEN)
    web = Web("--allow-release", env=env)
    total = 64 * 1024 * 1024  # what the sender means to send: 1000 times the cap
    sent = 0
    try:
        with socket.create_connection(("127.0.0.1", web.port), timeout=60) as sock:
            sock.sendall(
                b"POST /api/claims/x/release HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"4000\r\n" + b"a" * 0x4000 + b"\r\n"
            try:
                while sent < total and not select.select([sock], [], [], 0)[0]:
                    sock.sendall(chunk)
                    sent += 0x4000
            except OSError:  # the server closed: it stopped reading
                pass
            answer = b""
            while b"\r\n\r\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
    finally:
        web.stop()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"x-frame-options: DENY" in answer.lower().replace(b"deny", b"DENY")
    assert sent < total // 2, sent  # answered while the sender was still sending


# -- X-Forwarded-For is not believed unless asked ------------------------------------------


def test_the_recorded_client_address_ignores_x_forwarded_for(
    pw_server: RedisServer, r: Any
) -> None:
    env = clean_env(FENCED_REDIS_URL=pw_url(pw_server), FENCED_WEB_TOKEN=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "203.0.113.9"}
    for name, args, seen in (
        ("plain", (), "127.0.0.1"),
        ("proxied", ("--forwarded-allow-ips", "127.0.0.1"), "203.0.113.9"),
    ):
        claim = Claim(r, name, ttl=60, heartbeat=False, records=True)
        assert claim.acquire()
        web = Web("--allow-release", *args, env=env)
        try:
            aimed = {"reason": "gone", "token": str(claim.token)[:8]}
            status, body = web.post(f"/api/claims/{name}/release", aimed, **auth)
        finally:
            said = web.stop()
        assert status == 200 and body["released"], body
        assert body["by"].endswith(f"(fenced web, for {seen})"), body
        newest = r.lindex(f"fenced:{{{name}}}:records", 0)
        assert f"for {seen})".encode() in newest.split(b"\n", 1)[1]
        audit = [line for line in said.splitlines() if "force release" in line]
        assert len(audit) == 1 and f"for {seen})" in audit[0], said
        if seen == "127.0.0.1":
            assert "203.0.113.9" not in said + json.dumps(body)


# -- the audit line is one line, whatever the reason holds ---------------------------------


def test_the_audit_line_escapes_control_characters(caplog: pytest.LogCaptureFixture) -> None:
    forged = "gone\nfenced: force release of 'db': released (by admin)\x1b[2J\x9b\u202e"
    with caplog.at_level(logging.INFO, logger="fenced.audit"):
        force_released(
            "db", token_prefix="ab\ncd", fence=7, by="ops\x1b]0;x\x07", reason=forged,
            outcome="released",
        )  # fmt: skip
        unqueued("db", task_id="t\n1", by="ops", reason=forged, outcome="cleared")
    assert len(caplog.records) == 2
    for record in caplog.records:
        line = record.getMessage()
        assert "\n" not in line and "\r" not in line, line
        assert not any(ch in line for ch in "\x1b\x07\x9b\u202e"), line
        assert "gone\\x0afenced: force release" in line and "\\x1b[2J" in line
        # The structured field keeps the reason as given.
        assert record.fenced_reason == forged  # type: ignore[attr-defined]


# -- a record nested hundreds deep ---------------------------------------------------------


def plant_deep(client: Any, name: str) -> None:
    deep = "[" * 600 + "]" * 600
    client.xadd(
        f"fenced:{{{name}}}:runs", {"event": "started", "token": "t1", "r": f'{{"n": {deep}}}'}
    )
    client.set(f"fenced:{{{name}}}:lock", "abcd:host:1:", px=60_000)


def test_a_deep_record_is_shown_as_malformed_not_a_crash(pw_server: RedisServer, r: Any) -> None:
    plant_deep(r, "deep")
    for args in (["show", "deep", "--json"], ["show", "deep"], ["ls", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "fenced.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(FENCED_REDIS_URL=pw_url(pw_server)),
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and PASSWORD not in done.stdout + done.stderr
    shown = json.loads(
        subprocess.run(
            [sys.executable, "-m", "fenced.cli", "show", "deep", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(FENCED_REDIS_URL=pw_url(pw_server)),
        ).stdout
    )
    assert "nested deeper than" in shown["runs"][0]["unreadable"]

    web = TestClient(create_app(r), raise_server_exceptions=False)
    for path in ("/api/claims", "/api/claims/deep", "/api/claims/deep/runs"):
        answer = web.get(path)
        assert answer.status_code == 200, (path, answer.text)


class Broken(redis.Redis):
    """A real client whose pipelines hit a bug (anything but a Redis error)."""

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")


def test_a_500_carries_the_security_headers(pw_server: RedisServer, r: Any) -> None:
    r.set("fenced:{job}:lock", "abcd:host:1:", px=60_000)
    broken = Broken.from_url(pw_server.url)
    web = TestClient(create_app(broken), raise_server_exceptions=False)
    answer = web.get("/api/claims/job")
    assert answer.status_code == 500
    assert answer.json()["error"].startswith("internal error")
    for header, value in fenced.web.app.HEADERS.items():
        assert answer.headers.get(header) == value, header


# -- a crash does not print the Redis password ---------------------------------------------


CRASH = """
import sys
import fenced._inspect

def crash(*args, **kwargs):
    raise RuntimeError("a bug")

fenced._inspect.list_claims = crash
sys.argv = ["fenced", "ls", "--redis", sys.argv[1]]
from fenced.cli import main
main()
"""


def test_a_crash_of_the_command_does_not_print_the_password(pw_server: RedisServer) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASH, pw_url(pw_server)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(COLUMNS="200"),
    )
    assert done.returncode != 0 and "a bug" in done.stderr  # it did crash
    assert PASSWORD not in done.stdout + done.stderr, done.stderr
    from fenced.cli import app

    assert app is not None and app.pretty_exceptions_show_locals is False


@pytest.mark.parametrize(
    "query, named",
    [
        ("ssl_cert_reqs=bogus", "ssl_cert_reqs='bogus' is not a valid value: give one of none"),
        ("ssl_min_version=TLSv9", "ssl_min_version='TLSv9' is not a valid value: give one of"),
    ],
)
def test_a_url_option_redis_py_refuses_is_a_one_line_usage_error(
    pw_server: RedisServer, query: str, named: str
) -> None:
    url = f"rediss://:{PASSWORD}@127.0.0.1:{pw_server.port}/0?{query}"
    for args in (["ls"], ["show", "x", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "fenced.cli", *args, "--redis", url],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and named in done.stderr, done.stderr
        assert PASSWORD not in done.stderr


def test_fenced_web_warns_of_a_password_on_the_command_line(pw_server: RedisServer) -> None:
    web = Web("--redis", pw_url(pw_server), env=clean_env())
    said = web.stop()
    assert "WARNING: the --redis URL holds a password" in said and "FENCED_REDIS_URL" in said
    assert PASSWORD not in said
    web = Web(env=clean_env(FENCED_REDIS_URL=pw_url(pw_server)))
    assert "holds a password" not in web.stop()


# -- half-sent requests, token guesses, huge fields -----------------------------------------


@pytest.fixture
def served(r: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The dashboard on uvicorn in a thread, as `fenced web` configures it, with a request
    head given 1 second."""
    import uvicorn

    monkeypatch.setattr(fenced.web.app, "HEAD_TIMEOUT", 1.0)
    sock = fenced.web.app.listen("127.0.0.1", 0)
    server = uvicorn.Server(fenced.web.app.server_config(create_app(r)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for("uvicorn to start", lambda: server.started, timeout=30)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def test_a_connection_that_sends_half_a_request_is_closed(served: int) -> None:
    quiet = socket.create_connection(("127.0.0.1", served), timeout=60)
    half = socket.create_connection(("127.0.0.1", served), timeout=60)
    half.sendall(b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    with quiet, half:
        assert quiet.recv(1024) == b""  # closed by the server, not by the timeout here
        assert half.recv(1024) == b""
    # A whole request is still answered.
    with urllib.request.urlopen(f"http://127.0.0.1:{served}/api/config", timeout=30) as answer:
        assert answer.status == 200


def test_token_guesses_are_limited_per_client(r: Any) -> None:
    web = TestClient(create_app(r, allow_release=True, token=TOKEN))
    path = "/api/claims/x/release"

    def release(token: str) -> Any:
        return web.post(path, json={"reason": "r"}, headers={"Authorization": f"Bearer {token}"})

    assert [release(f"guess-{i}").status_code for i in range(fenced.web.app.MAX_GUESSES)] == [
        403
    ] * fenced.web.app.MAX_GUESSES
    refused = release(TOKEN)  # the right one too, while the window lasts
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0
    assert "too many wrong tokens" in refused.json()["error"]


def test_a_huge_record_field_is_cut_with_a_note(r: Any) -> None:
    huge = "x" * 5_000_000
    r.xadd(
        "fenced:{big}:runs", {"event": "started", "token": "t1", "r": json.dumps({"blob": huge})}
    )
    web = TestClient(create_app(r))
    answer = web.get("/api/claims/big")
    assert answer.status_code == 200
    assert len(answer.content) < 64 * 1024
    blob = answer.json()["runs"][0]["extra"]["blob"]
    assert blob.startswith("xxx") and blob.endswith(
        f"({5_000_000 - 4096} more characters not shown)"
    )


def test_a_body_that_never_ends_is_answered_408(r: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fenced.web.app, "BODY_TIMEOUT", 0.5)
    app = create_app(r, allow_release=True, token=TOKEN)
    sent: list[Any] = []
    chunks = [{"type": "http.request", "body": b'{"rea', "more_body": True}]

    async def receive() -> Any:
        if chunks:
            return chunks.pop()
        await asyncio.sleep(3600)  # the rest never comes

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/claims/x/release",
        "raw_path": b"/api/claims/x/release",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {TOKEN}".encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    assert sent[0]["status"] == 408
