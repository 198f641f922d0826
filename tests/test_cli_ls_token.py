"""``fenced ls`` shows each holder's token as ``fenced release --token`` takes it back,
in the table and in the narrow list, so ``release --help``'s "as fenced ls shows it"
holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from fenced import Claim
from fenced._lease import short_token
from fenced.testing import RedisServer

FENCED = [sys.executable, "-m", "fenced.cli"]


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client(decode_responses=True)
    yield client
    client.close()


def fenced(url: str, *args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FENCED_REDIS_URL", "COLUMNS")}
    env |= {"FENCED_REDIS_URL": url, "FENCED_REDIS_RETRIES": "0"}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([*FENCED, *args], capture_output=True, text=True, env=env, timeout=60)


def held(r: Any, name: str, **kw: Any) -> Claim:
    claim = Claim(r, name, ttl=60, heartbeat=False, **kw)
    assert claim.acquire()
    return claim


def shown_token(listing: str, name: str) -> str:
    """The token the table (a pipe gets it) shows on the row of ``name``."""
    header, *rows = (line.split() for line in listing.splitlines() if line.strip())
    assert "token" in header, listing
    column = [row for row in rows if row[:1] == [name]]
    assert column, listing
    tokens = [word for word in column[0] if re.fullmatch(r"[0-9a-f]{8}", word)]
    assert len(tokens) == 1, column
    return tokens[0]


def test_ls_shows_the_token_release_takes(url: str, r: Any) -> None:
    claim = held(r, "backup:db")
    other = held(r, "report:acme", task_id="b41d0c33-8d47-4b1e-9c3a-7e6f1d2b4a58")
    listing = fenced(url, "ls")  # piped: the table
    assert listing.returncode == 0, listing.stderr
    token = shown_token(listing.stdout.split("\n", 1)[1], "backup:db")
    assert claim.token is not None and claim.token.startswith(token)
    assert token == short_token(claim.token)
    assert short_token(other.token) in listing.stdout
    # The narrow list (a terminal under 120 columns) shows it on the name's line.
    narrow = fenced(url, "ls", columns=80).stdout
    assert any(
        line.startswith("backup:db  fence ") and line.rstrip().endswith(f"token {token}")
        for line in narrow.splitlines()
    ), narrow

    done = fenced(url, "release", "backup:db", "--force", "--reason", "gone", "--token", token)
    assert done.returncode == 0, done.stderr
    assert "released 'backup:db'" in done.stdout
    assert not r.exists("fenced:{backup:db}:lock")
    assert r.exists("fenced:{report:acme}:lock")  # the other claim stays
    assert "backup:db" not in fenced(url, "ls").stdout


def test_ls_shows_each_token_of_a_name_held_by_several(url: str, r: Any) -> None:
    first, second = held(r, "pool", limit=2), held(r, "pool", limit=2)
    tokens = [short_token(c.token) for c in (first, second)]
    listing = fenced(url, "ls").stdout
    assert all(t in listing for t in tokens), listing
    narrow = fenced(url, "ls", columns=80).stdout
    a, b = tokens
    assert re.search(rf"  tokens ({a}, {b}|{b}, {a})", narrow), narrow
    done = fenced(url, "release", "pool", "--force", "--reason", "gone", "--token", tokens[1])
    assert done.returncode == 0, done.stderr
    assert first.refresh() and not second.refresh()
    after = fenced(url, "ls").stdout
    assert tokens[0] in after and tokens[1] not in after, after


def test_a_holder_whose_token_cannot_be_given_back_shows_none(url: str, r: Any) -> None:
    r.set("fenced:{foreign}:lock", "not a token: ours", ex=60)
    listing = fenced(url, "ls").stdout
    assert "foreign" in listing and "not a to" not in listing, listing
