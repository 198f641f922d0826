"""Real ``celery worker`` processes for the tests: start, wait until ready, kill.

Each worker runs ``tests/celery_app.py`` in its own session (process group), so the
whole worker — main process and pool children — can be paused or killed at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from _wait import wait_for
from fenced.testing import CeleryWorker

ROOT = Path(__file__).resolve().parent.parent
#: Generous bounds: the machine is shared and busy; a test that waits this long failed.
READY_TIMEOUT = 90.0
WAIT = 60.0
AMQP_URL = os.environ.get("FENCED_TEST_AMQP_URL")


@dataclass
class Services:
    """Where a worker and the test meet: broker, results, claims, observations."""

    broker_url: str
    backend_url: str
    lock_url: str
    obs_url: str
    ttl: float = 3.0
    queue: str = field(default_factory=lambda: f"q-{uuid.uuid4().hex[:8]}")

    @classmethod
    def on(
        cls, server: Any, broker: str = "redis", lock_url: str | None = None, **kw: Any
    ) -> Services:
        """Databases 0-3 of a test-owned server; RabbitMQ as broker when asked (or skip)."""
        base = server.url.rsplit("/", 1)[0]
        broker_url = f"{base}/0"
        if broker == "amqp":
            if not AMQP_URL:
                pytest.skip("FENCED_TEST_AMQP_URL is not set: the RabbitMQ broker is not tested")
            broker_url = AMQP_URL
        return cls(
            broker_url=broker_url,
            backend_url=f"{base}/1",
            lock_url=lock_url or f"{base}/2",
            obs_url=f"{base}/3",
            **kw,
        )

    def client(self) -> Celery:
        """A Celery app for sending tasks and reading results (no tasks registered)."""
        app = Celery("fenced_test_client", broker=self.broker_url, backend=self.backend_url)
        app.conf.update(broker_connection_retry_on_startup=True, result_expires=600)
        return app

    def env(self, lock_url: str, **extra: str) -> dict[str, str]:
        """The environment of a worker or beat process of the test apps."""
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")]),
            FENCED_TEST_BROKER_URL=self.broker_url,
            FENCED_REDIS_URL=lock_url,
            FENCED_TEST_OBS_URL=self.obs_url,
            FENCED_TEST_QUEUE=self.queue,
            PYTHONUNBUFFERED="1",
            **extra,
        )
        return env

    def sender(self, make_app: Callable[..., Celery]) -> Celery:
        """The app a test sends from: a test app module's ``make_app`` on these servers
        (the tasks the worker runs)."""
        return make_app(self.broker_url, self.backend_url, self.lock_url, self.obs_url, self.queue)

    def queued(self) -> int:
        """Messages waiting in the test's queue (a Redis broker's list)."""
        return int(redis.Redis.from_url(self.broker_url).llen(self.queue))

    def unacked(self) -> set[str]:
        """Task ids of the messages a Redis broker holds for its workers, unacknowledged:
        what it brings back after the visibility timeout when the worker dies."""
        held = redis.Redis.from_url(self.broker_url).hvals("unacked")  # kombu's record
        return {str(json.loads(raw)[0]["headers"]["id"]) for raw in held}

    def obs(self) -> redis.Redis:
        """The observation Redis, decoded."""
        return redis.Redis.from_url(self.obs_url, decode_responses=True)

    def locks(self) -> redis.Redis:
        """The claims' Redis, decoded."""
        return redis.Redis.from_url(self.lock_url, decode_responses=True)


class Worker:
    """One ``celery worker`` process group."""

    def __init__(
        self,
        services: Services,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: list[str] | None = None,
        visibility: float | None = None,
        lock_url: str | None = None,
        name: str = "w",
        app: str = "tests.celery_app",
    ) -> None:
        self.services = services
        self.app = app
        self.pool = pool
        self.concurrency = concurrency
        self.queues = queues or [services.queue]
        self.visibility = visibility
        self.lock_url = lock_url or services.lock_url
        self.node = f"{name}-{uuid.uuid4().hex[:6]}@%h"
        fd, self.log_path = tempfile.mkstemp(prefix="fenced-worker-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen[bytes] | None = None
        self.worker: CeleryWorker | None = None

    def start(self) -> Worker:
        """Start and wait until the worker says it is ready."""
        env = self.services.env(
            self.lock_url,
            FENCED_TEST_BACKEND_URL=self.services.backend_url,
            FENCED_TEST_TTL=str(self.services.ttl),
        )
        if self.visibility is not None:
            env["FENCED_TEST_VISIBILITY"] = str(self.visibility)
        self.worker = CeleryWorker(
            self.app,
            name=self.node.split("@", 1)[0],
            log=self.log_path,
            queues=",".join(self.queues),
            concurrency=self.concurrency,
            pool=self.pool,
            cwd=ROOT,
            env=env,
        )
        self.proc = self.worker.start().proc
        try:
            wait_for(f"worker {self.node} to be ready", self._ready, READY_TIMEOUT, 0.1)
        except AssertionError:
            tail = self.log()[-3000:]
            self.stop()
            raise AssertionError(f"worker did not start:\n{tail}") from None
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
            )
        return " ready." in self.log()

    def log(self) -> str:
        """Everything the worker logged so far."""
        return Path(self.log_path).read_text(errors="replace")

    @property
    def pid(self) -> int:
        """The main process."""
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the whole worker: main process and pool children together."""
        if self.worker is not None:
            self.worker.kill()

    def stop(self) -> None:
        """Kill the worker."""
        self.kill()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """Kill the worker; keep its log when it failed (or FENCED_TEST_KEEP_LOGS is set)."""
        self.stop()
        if exc[0] is None and not os.environ.get("FENCED_TEST_KEEP_LOGS"):
            Path(self.log_path).unlink(missing_ok=True)
        else:
            sys.stderr.write(f"worker log: {self.log_path}\n{self.log()[-4000:]}\n")


def notes(obs: redis.Redis, key: str) -> list[dict[str, Any]]:
    """The JSON observations appended to a list."""
    return [json.loads(x) for x in obs.lrange(key, 0, -1)]


def key() -> str:
    """A fresh name, so tests sharing a worker never share a claim."""
    return uuid.uuid4().hex[:10]


class Beat:
    """One ``celery beat`` process of ``tests.celery_beat_app``, fenced's scheduler."""

    def __init__(
        self, services: Services, *, ttl: float, name: str = "b", env: dict[str, str] | None = None
    ) -> None:
        self.services = services
        self.ttl = ttl
        self.extra_env = env or {}
        self.dir = tempfile.mkdtemp(prefix=f"fenced-beat-{name}-")
        self.log_path = os.path.join(self.dir, "beat.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Beat:
        """Start the process (it stands by or leads on its own)."""
        env = self.services.env(
            self.services.lock_url, FENCED_TEST_BEAT_TTL=str(self.ttl), **self.extra_env
        )
        cmd = [
            sys.executable, "-m", "celery", "-A", "tests.celery_beat_app", "beat",
            "-S", "fenced.celery.beat:Scheduler", "-l", "info",
            "-s", os.path.join(self.dir, "schedule"),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        """The beat's process id (the leader's token carries it)."""
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send a signal to the beat process."""
        if self.alive():
            os.kill(self.pid, sig)

    def log(self) -> str:
        """Everything the beat logged so far."""
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> None:
        """Kill the process (it may be stopped)."""
        if self.alive():
            assert self.proc is not None
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
