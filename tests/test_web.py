"""`fenced web`'s JSON API through Starlette's TestClient, on a real redis-server: claims
listed live, a claim's detail and runs, release refused and allowed, hostile data.

The command itself runs as a subprocess in the last tests here, and in a browser in
test_web_browser.py.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from starlette.testclient import TestClient

from _wait import wait_for
from fenced import Claim, ConfigError, records
from fenced._lease import ClaimKeys
from fenced.testing import RedisCluster, RedisServer, find_binary, free_port
from fenced.web import create_app
from test_hostile import CASES, EVIL_HOST, good_claim

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the module's server, emptied first (bytes: it writes anything)."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


def api(r: Any, base_url: str = "http://testserver", **options: Any) -> TestClient:
    return TestClient(create_app(r, **options), base_url=base_url)


def held(r: Any, name: str, **kw: Any) -> Claim:
    claim = Claim(r, name, ttl=30, heartbeat=False, records=True, **kw)
    assert claim.acquire()
    return claim


def no_controls(data: Any) -> None:
    """Nothing a terminal or a page would act on, anywhere in a decoded JSON answer."""
    if isinstance(data, dict):
        for k, v in data.items():
            no_controls(k)
            no_controls(v)
    elif isinstance(data, list):
        for v in data:
            no_controls(v)
    elif isinstance(data, str):
        assert not any(c in data for c in "\x1b\x07\x9b\u202e\u202c"), data


# -- reading --------------------------------------------------------------------------------


def test_claims_are_listed_live_with_holder_age_time_left_fence_and_skips(r: Any) -> None:
    with Claim(r, "report:daily", ttl=30, heartbeat=False, records=True):
        pass
    claim = held(r, "report:daily")
    assert not Claim(r, "report:daily", ttl=30, records=True, heartbeat=False).acquire()
    slots = [held(r, "export", limit=3), held(r, "export", limit=3)]
    web = api(r)

    answer = web.get("/api/claims")
    assert answer.status_code == 200
    data = answer.json()
    assert data["namespace"] == "fenced" and data["alert_after_skips"] == 5
    by_name = {c["name"]: c for c in data["claims"]}
    assert set(by_name) == {"report:daily", "export"}
    daily = by_name["report:daily"]
    assert daily["holder"]["pid"] == os.getpid()
    assert daily["holder"]["token"] == str(claim.token).split(":")[0][:8]
    assert 0 <= daily["age"] < 10 and 20 < daily["expires_in"] <= 30
    assert daily["fence"] == claim.fence and daily["skips"] == 1
    assert daily["last_outcome"] == "ok" and daily["alert"] is False
    export = by_name["export"]
    assert export["limit"] == 3 and len(export["slots"]) == 2
    assert {s["fence"] for s in export["slots"]} == {c.fence for c in slots}

    claim.release()
    assert [c["name"] for c in web.get("/api/claims").json()["claims"]] == ["export"]


def test_a_name_marked_at_enqueue_is_listed_with_its_task_id(r: Any) -> None:
    from fenced.celery._enqueue import MARK

    keys = ClaimKeys.of("feed:acme")
    assert MARK(r, [keys.queued], ["task-1", 60_000, ""]) is None  # as apply_async marks
    web = api(r)
    (listed,) = web.get("/api/claims").json()["claims"]
    assert listed["name"] == "feed:acme" and listed["holder"] is None
    assert listed["queued"]["task_id"] == "task-1"
    assert 50 < listed["queued"]["expires_in"] <= 60
    assert web.get("/api/claims/feed:acme").json()["queued"]["task_id"] == "task-1"
    r.delete(keys.queued)
    assert web.get("/api/claims").json()["claims"] == []


def test_a_rate_and_a_pending_burst_are_listed_and_shown(r: Any) -> None:
    from test_cli import pending

    pending(r)
    web = api(r)
    listed = {c["name"]: c for c in web.get("/api/claims").json()["claims"]}
    assert 3500 < listed["sync:rated"]["rate"]["wait"] <= 3600
    assert listed["sync:rated"]["burst"] is None and listed["digest:acme"]["rate"] is None
    assert listed["digest:acme"]["burst"]["calls"] == 3
    burst = web.get("/api/claims/digest:acme").json()["burst"]
    assert burst["task_id"] == "task-0" and 200 < burst["runs_in"] <= 300
    assert web.get("/api/claims/sync:rated").json()["rate"]["next_start"] > time.time()


def test_claims_whose_skips_reach_the_threshold_are_marked(r: Any) -> None:
    held(r, "sync")
    for _ in range(2):
        assert not Claim(r, "sync", ttl=30, records=True, heartbeat=False).acquire()
    assert api(r, alert_after_skips=2).get("/api/claims").json()["claims"][0]["alert"] is True
    assert api(r, alert_after_skips=3).get("/api/claims").json()["claims"][0]["alert"] is False
    assert api(r, alert_after_skips=0).get("/api/claims").json()["claims"][0]["alert"] is False
    detail = api(r, alert_after_skips=2).get("/api/claims/sync").json()
    assert detail["skips"] == 2 and detail["alert"] is True


def test_a_new_holder_is_shown_without_the_skips_of_one_released_by_hand(r: Any) -> None:
    stuck = held(r, "sync")
    for _ in range(2):
        assert not Claim(r, "sync", ttl=30, records=True, heartbeat=False).acquire()
    web = api(r, alert_after_skips=2, allow_release=True, token=TOKEN)
    (listed,) = web.get("/api/claims").json()["claims"]
    assert listed["skips"] == 2 and listed["alert"] is True
    prefix = listed["holder"]["token"]
    cleared = web.post(
        "/api/claims/sync/release", json={"reason": "hung", "token": prefix}, headers=AUTH
    )
    assert cleared.status_code == 200, cleared.text
    # While nobody holds it, no run started or ended ok: the count stands.
    assert web.get("/api/claims/sync").json()["skips"] == 2
    fresh = held(r, "sync")
    (listed,) = web.get("/api/claims").json()["claims"]
    assert listed["fence"] == fresh.fence
    assert listed["skips"] == 0 and listed["alert"] is False
    detail = web.get("/api/claims/sync").json()
    assert detail["skips"] == 0 and detail["alert"] is False
    assert stuck.release() is False  # it comes back: lost, its lease long gone
    assert not Claim(r, "sync", ttl=30, records=True, heartbeat=False).acquire()
    assert web.get("/api/claims").json()["claims"][0]["skips"] == 1
    assert web.get("/api/claims/sync").json()["skips"] == 1


def test_a_claims_detail_and_its_runs(r: Any) -> None:
    name = "reports/daily:acme"  # a '/' in a name is a %2F in the path, never a route
    with Claim(r, name, ttl=30, heartbeat=False, records=True):
        pass
    failed = held(r, name)
    failed.release(outcome="failed", reason="exit 3")
    claim = held(r, name)
    assert not Claim(r, name, ttl=30, records=True, heartbeat=False).acquire()
    web = api(r)

    detail = web.get("/api/claims/reports%2Fdaily:acme")
    assert detail.status_code == 200, detail.text
    data = detail.json()
    assert data["name"] == name and data["holder"]["fence"] == claim.fence
    assert [run["outcome"] for run in data["runs"]] == ["skipped", "running", "failed", "ok"]
    assert data["skips"] == 1 and data["now"] > 0

    runs = web.get("/api/claims/reports%2Fdaily:acme/runs").json()
    assert runs["name"] == name
    assert [run["outcome"] for run in runs["runs"]] == ["skipped", "running", "failed", "ok"]
    skip, running, fail, ok = runs["runs"]
    assert running["end"] is None and running["fence"] == claim.fence
    assert running["worker"] == f"{os.uname().nodename}:{os.getpid()}"
    assert fail["reason"] == "exit 3" and fail["end"] >= fail["start"]
    assert ok["start"] <= ok["end"] <= fail["start"] <= running["start"] <= runs["now"]
    assert runs["skips"] == [skip["start"]] and runs["losses"] == []
    assert skip["holder"] and "pid" in skip["holder"]  # who held it when it skipped

    assert len(web.get("/api/claims/reports%2Fdaily:acme/runs?limit=2").json()["runs"]) == 2
    bad = web.get("/api/claims/x/runs?limit=many")
    assert bad.status_code == 400 and "limit='many'" in bad.json()["error"]
    assert web.get("/api/claims/x/what").status_code == 404
    unknown = web.get("/api/claims/never-held").json()
    assert unknown["holder"] is None and unknown["runs"] == []


# -- release --------------------------------------------------------------------------------


def test_release_is_refused_unless_started_with_allow_release(r: Any) -> None:
    claim = held(r, "job")
    answer = api(r).post("/api/claims/job/release", json={"reason": "gone"}, headers=AUTH)
    assert answer.status_code == 403
    assert "--allow-release" in answer.json()["error"]
    assert claim.held and r.exists("fenced:{job}:lock")


@pytest.mark.parametrize(
    ("headers", "status", "says"),
    [
        ({}, 401, "no token"),
        ({"Authorization": "Bearer "}, 401, "no token"),
        ({"Authorization": f"Basic {TOKEN}"}, 401, "no token"),
        ({"Authorization": "Bearer wrong"}, 403, "wrong token"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403, "wrong token"),
    ],
)
def test_release_without_the_token_is_refused(
    r: Any, headers: dict[str, str], status: int, says: str
) -> None:
    held(r, "job")
    web = api(r, allow_release=True, token=TOKEN)
    answer = web.post("/api/claims/job/release", json={"reason": "gone"}, headers=headers)
    assert answer.status_code == status and says in answer.json()["error"]
    assert r.exists("fenced:{job}:lock")
    assert [run.outcome for run in records.history(r, "job")] == ["running"]


def test_release_with_the_token_is_recorded_with_reason_and_operator(
    r: Any, caplog: pytest.LogCaptureFixture
) -> None:
    claim = held(r, "job")
    web = api(r, allow_release=True, token=TOKEN)
    shown = web.get("/api/claims/job").json()["holder"]["token"]
    for body, status in (
        ({"token": shown}, 400),
        ({"reason": "  ", "token": shown}, 400),
        ({"reason": 5, "token": shown}, 400),
        ({"reason": "x"}, 400),  # no holder named
        ({"reason": "x", "token": " "}, 400),
        ({"reason": "x", "token": 5}, 400),
        ({"reason": "x", "token": shown[:3]}, 400),  # too short to name one holder
    ):
        assert web.post("/api/claims/job/release", json=body, headers=AUTH).status_code == status
    as_form = web.post("/api/claims/job/release", data={"reason": "x"}, headers=AUTH)
    assert as_form.status_code == 415  # a cross-site form cannot post JSON
    assert r.exists("fenced:{job}:lock")

    with caplog.at_level(logging.INFO, logger="fenced.audit"):
        body = {"reason": "host died", "token": shown}
        answer = web.post("/api/claims/job/release", json=body, headers=AUTH)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["released"] is True and data["holder"]["fence"] == claim.fence
    assert "fenced web" in data["by"] and data["reason"] == "host died"
    assert not r.exists("fenced:{job}:lock")
    run = records.history(r, "job")[0]
    assert run.outcome == "released" and run.reason == "host died"
    assert run.extra.get("by") == data["by"]
    audit = [rec for rec in caplog.records if rec.name == "fenced.audit"]
    assert audit and audit[-1].fenced_outcome == "released"  # type: ignore[attr-defined]
    assert audit[-1].fenced_by == data["by"]  # type: ignore[attr-defined]

    body = {"reason": "again", "token": shown}
    again = web.post("/api/claims/job/release", json=body, headers=AUTH).json()
    assert again["released"] is False and "nothing held" in again["message"]


def test_release_of_a_name_held_by_several_needs_the_holder(r: Any) -> None:
    first, second = held(r, "pool", limit=2), held(r, "pool", limit=2)
    web = api(r, allow_release=True, token=TOKEN)
    vague = web.post("/api/claims/pool/release", json={"reason": "x"}, headers=AUTH)
    assert vague.status_code == 400 and '"token"' in vague.json()["error"]
    prefix = str(second.token)[:8]
    named = web.post(
        "/api/claims/pool/release", json={"reason": "x", "token": prefix}, headers=AUTH
    )
    assert named.status_code == 200 and named.json()["holder"]["token"] == prefix
    assert first.held and second.lost is False  # no heartbeat: the loss is seen at release
    assert not second.release()


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({"Origin": "http://evil.example"}, "'http://evil.example'"),
        ({"Origin": "null"}, "'null'"),
        ({"Origin": "http://testserver.evil.example"}, "not this server's"),
        ({"Sec-Fetch-Site": "cross-site"}, "cross-site"),
        ({"Origin": "http://testserver", "Sec-Fetch-Site": "same-site"}, "same-site"),
    ],
)
def test_a_release_from_a_page_of_another_site_is_refused_even_with_the_token(
    r: Any, headers: dict[str, str], says: str
) -> None:
    held(r, "job")
    web = api(r, allow_release=True, token=TOKEN)
    answer = web.post(
        "/api/claims/job/release", json={"reason": "csrf"}, headers={**AUTH, **headers}
    )
    assert answer.status_code == 403 and says in answer.json()["error"]
    assert r.exists("fenced:{job}:lock")


def test_a_release_from_the_page_itself_and_a_token_only_in_the_url(r: Any) -> None:
    job = {"reason": "x", "token": str(held(r, "job").token)[:8]}
    other = {"reason": "x", "token": str(held(r, "other").token)[:8]}
    web = api(r, allow_release=True, token=TOKEN)
    in_url = web.post(f"/api/claims/job/release?token={TOKEN}", json=job)
    assert in_url.status_code == 401 and r.exists("fenced:{job}:lock")
    own = {"Origin": "http://testserver", "Sec-Fetch-Site": "same-origin"}
    answer = web.post("/api/claims/job/release", json=job, headers={**AUTH, **own})
    assert answer.status_code == 200 and answer.json()["released"] is True
    proxied = {"Origin": "https://dash.example", "X-Forwarded-Host": "dash.example"}
    answer = web.post("/api/claims/other/release", json=other, headers={**AUTH, **proxied})
    assert answer.status_code == 200 and answer.json()["released"] is True


def test_only_the_allowed_host_names_are_answered_ipv6_too(r: Any) -> None:
    web = api(r, allowed_hosts=["::1", "localhost"], base_url="http://[::1]:8377")
    assert web.get("/api/claims").status_code == 200
    assert web.get("/api/claims", headers={"Host": "LOCALHOST:8377"}).status_code == 200
    for rebound in ("evil.example:8377", "[::2]:8377", "", "localhost.evil.example"):
        answer = web.get("/api/claims", headers={"Host": rebound})
        assert answer.status_code == 400, rebound
        assert "not a name this server answers to (::1, localhost)" in answer.json()["error"]
        assert answer.headers["x-frame-options"] == "DENY"


def test_allow_release_needs_a_token_and_other_bad_options_are_named(r: Any) -> None:
    with pytest.raises(ConfigError, match="needs a token"):
        create_app(r, allow_release=True)
    with pytest.raises(ConfigError, match="refresh"):
        create_app(r, refresh=0)
    with pytest.raises(ConfigError, match="alert_after_skips"):
        create_app(r, alert_after_skips=-1)
    with pytest.raises(ConfigError, match="namespace"):
        create_app(r, namespace="a{b}")


# -- the page and its headers ---------------------------------------------------------------


def test_the_page_its_files_and_headers(r: Any) -> None:
    web = api(r, refresh=0.5)
    page = web.get("/", headers={"Origin": "http://evil.example"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "access-control-allow-origin" not in page.headers
    # Until the first answer arrives, the tables say they are loading, not empty.
    assert "Loading the claims" in page.text and "Loading the run records" in page.text
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        answer = web.get(f"/static/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(kind)
        assert answer.headers["x-content-type-options"] == "nosniff"
    assert web.get("/static/..%2Fapp.py").status_code == 404
    assert web.get("/static/index.html").status_code == 404  # the page is served at /
    config = web.get("/api/config").json()
    assert config == {
        "namespace": "fenced",
        "redis": config["redis"],
        "refresh": 0.5,
        "alert_after_skips": 5,
        "allow_release": False,
    }
    big = web.post("/api/claims/x/release", content=b"{}" * 40_000, headers=AUTH)
    assert big.status_code == 413
    own = api(r, allowed_hosts=["127.0.0.1"], base_url="http://127.0.0.1:8377")
    assert own.get("/api/claims").status_code == 200
    assert own.get("/api/claims", headers={"Host": "evil.example"}).status_code == 400
    preflight = web.options("/api/claims/x/release", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in preflight.headers


def test_nothing_is_loaded_from_elsewhere_and_no_data_is_parsed_as_markup() -> None:
    files = resources.files("fenced.web") / "static"
    html, js, css = ((files / n).read_text() for n in ("index.html", "app.js", "app.css"))
    for text in (html, css):
        assert "://" not in text and "@import" not in text and "url(" not in text
    assert "<script" not in html.replace('<script src="/static/app.js" defer></script>', "")
    # The SVG namespace is a name, not an address: the script fetches only this server.
    assert js.count("://") == 1 and "http://www.w3.org/2000/svg" in js
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js


def test_an_unreachable_redis_is_a_503_naming_it() -> None:
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    answer = api(down, redis_label="redis://127.0.0.1:1/0").get("/api/claims")
    assert answer.status_code == 503
    assert answer.json()["error"].startswith("cannot reach Redis at redis://127.0.0.1:1/0")


# -- hostile data ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_data_is_served_escaped_and_never_breaks_the_api(case: str, r: Any) -> None:
    seed, _says = CASES[case]
    good_claim(r)
    seed(r)
    web = api(r, allow_release=True, token=TOKEN)
    listed = web.get("/api/claims")
    assert listed.status_code == 200, listed.text
    assert {c["name"] for c in listed.json()["claims"]} == {"good", "bad"}
    no_controls(listed.json())
    for path in ("/api/claims/bad", "/api/claims/bad/runs", "/api/claims/good"):
        answer = web.get(path)
        assert answer.status_code == 200, (path, answer.text)
        no_controls(answer.json())
    shown = (web.get("/api/claims/bad").json()["holder"] or {}).get("token") or "00000000"
    body = {"reason": EVIL_HOST, "token": shown}
    released = web.post("/api/claims/bad/release", json=body, headers=AUTH)
    # 409: a value the shown token does not start (escaped); 503: a key of the wrong type
    assert released.status_code in (200, 409, 503), released.text
    no_controls(released.json())


def test_a_hostile_name_and_holder_are_escaped(r: Any) -> None:
    name = "evil\x1b]0;title\x07\u202e"
    r.set(f"fenced:{{{name}}}:lock", f"abcd:{EVIL_HOST}:1:task{EVIL_HOST}", px=60_000)
    r.set(b"fenced:{\xff\x1b[2J}:lock", "abcd:host:1:", px=60_000)
    data = api(r).get("/api/claims").json()
    no_controls(data)
    names = sorted(c["name"] for c in data["claims"])
    assert names == ["\\xff\\x1b[2J", "evil\\x1b]0;title\\x07\\u202e"]
    evil = next(c for c in data["claims"] if c["name"].startswith("evil"))
    assert evil["holder"]["host"].startswith("\\x1b[2J")


def test_record_data_json_cannot_carry_is_served_as_text(r: Any) -> None:
    deep = "[" * 200 + "]" * 200
    r.xadd("fenced:{odd}:runs", {"event": "started", "token": "t1", "r": '{"x": NaN}'})
    r.xadd(
        "fenced:{odd}:runs",
        {
            "event": "finished",
            "token": "t1",
            "outcome": "ok",
            "r": f'{{"duration": Infinity, "n": {deep}}}',
        },
    )
    r.set("fenced:{odd}:lock", "abcd:host:1:", px=60_000)
    web = api(r)
    for path in ("/api/claims", "/api/claims/odd", "/api/claims/odd/runs"):
        answer = web.get(path)
        assert answer.status_code == 200, (path, answer.text)
    detail = web.get("/api/claims/odd")
    run = detail.json()["runs"][0]
    assert run["extra"]["x"] == "nan" and run["duration"] != "inf"
    assert "duration is Infinity, out of range" in run["unreadable"]
    assert "nested too deep" in detail.text


# -- the command ----------------------------------------------------------------------------


def test_fenced_web_warns_when_release_is_allowed_beyond_loopback(
    redis_server: RedisServer,
) -> None:
    port = free_port()
    env = dict(os.environ, FENCED_WEB_TOKEN="env-token-1234")
    url = redis_server.url.replace("redis://", "redis://:hunter2@")  # a password to hide
    redis_server.client().config_set("requirepass", "hunter2")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "fenced.cli", "web", "--redis", url, "--host", "0.0.0.0",
            "--port", str(port), "--allow-release",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    lines: list[str] = []

    def started() -> bool:
        assert proc.stderr is not None
        lines.append(proc.stderr.readline())
        return "shows the claims" in lines[-1]

    try:
        wait_for("fenced web to start", started, timeout=30, proc=proc)
        proc.send_signal(signal.SIGTERM)  # a service manager stopping it (Ctrl-C alike)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        redis_server.client(password="hunter2").config_set("requirepass", "")
    assert proc.stderr is not None
    said = "".join(lines) + proc.stderr.read()
    assert "Traceback" not in said
    assert "WARNING: --allow-release on 0.0.0.0" in said
    assert "WARNING: on 0.0.0.0 it answers to any Host name" in said and "--allow-host" in said
    assert "env-token-1234" not in said
    assert "hunter2" not in said and ":***@" in said


def test_fenced_web_refuses_an_empty_token_file(redis_server: RedisServer, tmp_path: Any) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    done = subprocess.run(
        [
            sys.executable, "-m", "fenced.cli", "web", "--redis", redis_server.url,
            "--allow-release", "--token-file", str(empty),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "is empty: put the token in it" in done.stderr


def test_fenced_web_names_the_fix_for_a_port_in_use_and_warns_of_an_open_token_file(
    redis_server: RedisServer, tmp_path: Any
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable, "-m", "fenced.cli", "web", "--redis", redis_server.url,
                "--port", str(port), "--allow-release", "--token-file", str(token),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"is open to other users (mode 644): chmod 600 {token}" in done.stderr
    assert f"cannot listen on 127.0.0.1 port {port}" in done.stderr
    assert "pass --port with a free port" in done.stderr
    assert "shows the claims" not in done.stderr and "Traceback" not in done.stderr


def test_redis_stopped_and_started_again_is_a_503_then_the_claims_again(
    own_server: RedisServer,
) -> None:
    own_server.client().config_set("requirepass", "hunter2")
    url = own_server.url.replace("redis://", "redis://:hunter2@")
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    held(client, "job")
    web = api(client)  # the label made from the client itself
    seen = [web.get("/api/config"), web.get("/api/claims"), web.get("/api/claims/job")]
    assert [a.status_code for a in seen] == [200, 200, 200]

    own_server.kill()
    down = [web.get(p) for p in ("/api/claims", "/api/claims/job", "/api/claims/job/runs")]
    assert [a.status_code for a in down] == [503, 503, 503]
    assert all(a.json()["error"].startswith("cannot reach Redis at redis://") for a in down)

    own_server.start()  # empty
    own_server.client().config_set("requirepass", "hunter2")
    back = web.get("/api/claims")
    assert back.status_code == 200 and back.json()["claims"] == []
    for answer in (*seen, *down, back):
        assert "hunter2" not in answer.text and "Traceback" not in answer.text


def test_a_cluster_lists_the_claims_of_every_primary() -> None:
    from test_cluster_ops import names_on_every_master

    with RedisCluster(masters=3, replicas=0, binary=find_binary()) as cluster:
        client = cluster.client(decode_responses=True)
        names = names_on_every_master(cluster, client, per_master=1)
        claims = [held(client, name) for name in names]
        web = api(client, allow_release=True, token=TOKEN)
        listed = web.get("/api/claims").json()
        assert sorted(c["name"] for c in listed["claims"]) == sorted(names)
        assert abs(listed["now"] - time.time()) < 5
        for claim in claims:
            path = "/api/claims/" + quote(claim.name, safe="")
            detail = web.get(path).json()
            assert detail["holder"]["fence"] == claim.fence
            assert [run["outcome"] for run in web.get(path + "/runs").json()["runs"]] == ["running"]
        body = {"reason": "node test", "token": detail["holder"]["token"]}
        gone = web.post(path + "/release", json=body, headers=AUTH)
        assert gone.status_code == 200 and gone.json()["released"] is True
        assert len(web.get("/api/claims").json()["claims"]) == len(names) - 1
        client.close()


def test_any_name_is_one_path_segment_and_every_answer_is_json(r: Any) -> None:
    claim = held(r, "line\nbreak")  # fenced keeps such a name under a readable key
    web = api(r)
    detail = web.get("/api/claims/line%0Abreak")
    assert detail.status_code == 200, detail.text
    assert detail.json()["holder"]["fence"] == claim.fence
    assert web.get("/api/claims/line%0Abreak/runs").json()["runs"][0]["outcome"] == "running"
    for path, name in (("%2E%2E", ".."), ("%2F", "/"), ("a%2F..%2Fb", "a/../b"), ("%zz", "_zz")):
        answer = web.get("/api/claims/" + path)
        assert answer.status_code == 200 and answer.json()["name"].startswith(name), path
    long = web.get("/api/claims/" + "n" * 20_000)
    assert long.status_code == 200 and len(long.json()["name"]) < 300
    for method, path, status in (
        ("GET", "/nowhere", 404),
        ("GET", "/api", 404),
        ("POST", "/api/config", 405),
        ("DELETE", "/api/claims/x", 405),
    ):
        answer = web.request(method, path)
        assert answer.status_code == status, (method, path)
        assert answer.json()["error"] and answer.headers["x-content-type-options"] == "nosniff"


def keys(data: Any) -> Any:
    """The shape of a JSON answer: its keys, nested (a list by its first item)."""
    if isinstance(data, dict):
        return {k: keys(v) for k, v in data.items()}
    if isinstance(data, list):
        return [keys(data[0])] if data else []
    return None


def test_the_docs_examples_have_the_keys_of_the_real_answers(r: Any) -> None:
    text = (ROOT / "docs" / "web.md").read_text()
    shown = {}
    for section in text.split("\n### ")[1:]:
        title = section.split("\n", 1)[0].strip("`")
        blocks = re.findall(r"```json\n(.*?)```", section, re.S)
        if blocks:
            shown[title] = json.loads(blocks[-1])
    with Claim(r, "backup:db", ttl=30, heartbeat=False, records=True):
        pass
    held(r, "backup:db")
    assert not Claim(r, "backup:db", ttl=30, records=True, heartbeat=False).acquire()
    # A beat's leader claim and what its leader stored (fenced.celery.beat).
    leader = held(r, "beat:proj")
    r.hset(
        ClaimKeys.of("beat:proj").beat,
        mapping={
            "entry:nightly-report": f"1796090400000:{leader.fence}:sent",
            "next:nightly-report": "1796176800000",
            "tick": "1796121726000",
        },
    )
    web = api(r, allow_release=True, token=TOKEN)
    aimed = {"reason": "docs", "token": web.get("/api/claims/backup:db").json()["holder"]["token"]}
    real = {
        "GET /api/beats/{name}": web.get("/api/beats/proj"),
        "GET /api/config": web.get("/api/config"),
        "GET /api/claims": web.get("/api/claims"),
        "GET /api/claims/{name}": web.get("/api/claims/backup:db"),
        "GET /api/claims/{name}/runs": web.get("/api/claims/backup:db/runs"),
        "POST /api/claims/{name}/release": web.post(
            "/api/claims/backup:db/release", json=aimed, headers=AUTH
        ),
    }
    assert set(shown) == set(real)
    for title, answer in real.items():
        assert answer.status_code == 200, (title, answer.text)
        assert keys(shown[title]) == keys(answer.json()), title


def test_a_lost_run_a_retried_run_and_a_cooldown_skip_on_the_timeline(
    r: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = Claim(r, "sync", ttl=0.3, records=True, heartbeat=False)
    assert lost.acquire()
    time.sleep(0.4)
    retried = held(r, "sync")
    assert not lost.release()  # its lease ran out under it: recorded as lost
    retried.release(outcome="retried", reason="retry 1 of 3")
    with Claim(r, "sync", ttl=30, records=True, heartbeat=False, cooldown=60):
        pass
    assert not Claim(r, "sync", ttl=30, records=True, heartbeat=False, cooldown=60).acquire()
    # This host's clock an hour fast: ages and times left are the Redis server's.
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    web = api(r)

    runs = web.get("/api/claims/sync/runs").json()
    skip, ok, retry, loss = runs["runs"]
    assert [run["outcome"] for run in runs["runs"]] == ["skipped", "ok", "retried", "lost"]
    assert skip["reason"] == "ran recently" and runs["skips"] == [skip["start"]]
    assert retry["reason"] == "retry 1 of 3" and retry["fence"] == retried.fence
    assert loss["fence"] == lost.fence and runs["losses"] == [loss["end"]]
    assert loss["start"] <= retry["start"] <= ok["start"] <= runs["now"] < real() + 5
    row = web.get("/api/claims").json()["claims"][0]
    assert row["holder"] is None and 55 < row["cooldown_left"] <= 60
    assert row["last_outcome"] == "ok" and 0 <= row["age"] < 5


def test_fenced_demo_web_names_a_port_in_use_before_the_acts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "fenced.cli", "demo", "--web", "--web-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pass --web-port with a free port" in done.stderr
    assert "1. The same rebuild" not in done.stdout  # said before any act ran


def test_a_made_token_is_shown_on_a_terminal_only(redis_server: RedisServer) -> None:
    command = [
        sys.executable, "-m", "fenced.cli", "web", "--redis", redis_server.url,
        "--port", "0", "--allow-release",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "FENCED_WEB_TOKEN"}
    logged = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert logged.returncode == 2
    assert "needs a token: pass --token-file F (mode 600) or set FENCED_WEB_TOKEN" in (
        logged.stderr
    )

    main, terminal = pty.openpty()
    proc = subprocess.Popen(command, stderr=terminal, stdout=subprocess.DEVNULL, env=env)
    os.close(terminal)
    seen = b""

    def shown() -> bool:
        nonlocal seen
        seen += os.read(main, 4096)
        return b"shows the claims" in seen

    try:
        wait_for("fenced web to start", shown, timeout=30, proc=proc)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        os.close(main)
    assert re.search(rb"release token \(shown once[^)]*\): [\w-]{20,}", seen), seen
    assert proc.returncode == 0


def test_fenced_web_beyond_loopback_answers_the_names_it_is_given(
    redis_server: RedisServer,
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "fenced.cli", "web", "--redis", redis_server.url,
            "--host", "0.0.0.0", "--port", str(port), "--allow-host", "dash.example",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip

    def status(host: str) -> int:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/claims", headers={"Host": host}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        err = proc.stderr
        assert err is not None
        wait_for("fenced web", lambda: "shows the claims" in err.readline(), proc=proc)
        assert status(f"dash.example:{port}") == 200
        assert status(f"localhost:{port}") == 200
        assert status(f"rebound.evil.example:{port}") == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert proc.returncode == 0
