"""A real ``celery worker`` process that a demo or a test starts, pauses, kills and stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CeleryWorker"]

_BANNER = "-- fenced: worker started --"


class CeleryWorker:
    """One ``celery worker`` in its own process group, logging to a file."""

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
