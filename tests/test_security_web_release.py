"""A release from the dashboard clears the holder it was aimed at, and only it.

The operator sees X, X finishes, Y takes the name, then the release lands: it must not
clear Y. `fenced web` runs as a subprocess on a real redis-server and is spoken to over
HTTP, as the page speaks to it (the page itself: test_web_browser.py).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from fenced import Claim, records
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer
from test_security_web import Web, clean_env

TOKEN = "release-aim-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def web(redis_server: RedisServer) -> Iterator[Web]:
    env = clean_env(FENCED_REDIS_URL=redis_server.url, FENCED_WEB_TOKEN=TOKEN)
    server = Web("--allow-release", env=env)
    yield server
    server.stop()


def read(web: Web, name: str) -> Any:
    """The claim as the page reads it (GET /api/claims/NAME)."""
    url = f"http://127.0.0.1:{web.port}/api/claims/{quote(name, safe='')}"
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def release(web: Web, name: str, **body: Any) -> tuple[int, Any]:
    return web.post(f"/api/claims/{quote(name, safe='')}/release", body, **AUTH)


def claim(r: Any, name: str, **kw: Any) -> Claim:
    taken = Claim(r, name, ttl=60, heartbeat=False, records=True, **kw)
    assert taken.acquire()
    return taken


def released_tokens(r: Any, name: str) -> list[str | None]:
    return [run.token for run in records.history(r, name) if run.outcome == "released"]


def test_a_release_aimed_at_a_holder_that_finished_leaves_the_next_one(r: Any, web: Web) -> None:
    x = claim(r, "nightly")
    seen = read(web, "nightly")["holder"]
    assert str(x.token).startswith(seen["token"])
    # X finishes and Y takes the name before the operator's release lands.
    assert x.release()
    y = claim(r, "nightly")

    # A release that names no holder would clear whoever holds the name when it lands.
    status, answer = release(web, "nightly", reason="x is hung")
    assert status == 400 and '"token"' in answer["error"], answer
    assert y.refresh() and released_tokens(r, "nightly") == []

    status, answer = release(web, "nightly", reason="x is hung", token=seen["token"])
    assert status == 409, answer
    assert "the holder changed" in answer["error"] and seen["token"] in answer["error"]
    assert answer["holder"]["token"] == str(y.token)[:8]  # who holds it now
    assert [s["token"] for s in answer["slots"]] == [str(y.token)[:8]]
    assert r.get(ClaimKeys.of("nightly").lock) == str(y.token).encode()
    assert y.refresh() and released_tokens(r, "nightly") == []

    # Aimed at Y, seen now: Y is cleared.
    now = read(web, "nightly")["holder"]["token"]
    status, answer = release(web, "nightly", reason="y is hung", token=now)
    assert status == 200 and answer["released"] is True, answer
    assert answer["holder"]["token"] == now
    assert not r.exists(ClaimKeys.of("nightly").lock) and not y.refresh()
    assert released_tokens(r, "nightly") == [now]

    # Aimed at a holder that is gone, with nobody after it: nothing to clear.
    status, answer = release(web, "nightly", reason="again", token=now)
    assert status == 200 and answer["released"] is False, answer
    assert "nothing held" in answer["message"]


def test_a_prefix_too_short_to_name_one_holder_is_refused(r: Any, web: Web) -> None:
    held = claim(r, "export")
    for short in ("a", str(held.token)[:3]):
        status, answer = release(web, "export", reason="gone", token=short)
        assert status == 400 and "too short" in answer["error"], answer
    assert held.refresh()


def test_a_name_held_by_several_clears_only_the_holder_aimed_at(r: Any, web: Web) -> None:
    first, second = claim(r, "pool", limit=2), claim(r, "pool", limit=2)
    slots = {s["token"]: s["slot"] for s in read(web, "pool")["slots"]}
    aimed = str(second.token)[:8]
    assert set(slots) == {str(first.token)[:8], aimed}
    # The second holder finishes; a third takes its slot.
    assert second.release()
    third = claim(r, "pool", limit=2)

    status, answer = release(web, "pool", reason="second is hung", token=aimed)
    assert status == 409 and "the holder changed" in answer["error"], answer
    assert {s["token"] for s in answer["slots"]} == {str(first.token)[:8], str(third.token)[:8]}
    assert first.refresh() and third.refresh()
    status, answer = release(web, "pool", reason="second is hung")
    assert status == 400 and first.refresh() and third.refresh()

    status, answer = release(web, "pool", reason="third is hung", token=str(third.token)[:8])
    assert status == 200 and answer["released"] is True, answer
    assert first.refresh() and not third.refresh()
    assert released_tokens(r, "pool") == [str(third.token)[:8]]


def test_the_refusal_leaves_the_guess_limit_alone(r: Any, web: Web) -> None:
    # A holder that changed is not a wrong bearer token: many such refusals in a row
    # never lock the operator out.
    claim(r, "busy")
    for _ in range(8):
        status, answer = release(web, "busy", reason="gone", token="00000000")
        assert status == 409, answer
    shown = read(web, "busy")["holder"]["token"]
    status, answer = release(web, "busy", reason="gone", token=shown)
    assert status == 200 and answer["released"] is True
