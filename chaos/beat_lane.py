"""The beat lane: several ``celery beat`` processes under fenced's scheduler, their
worker, the proxy in front of one beat's Redis, and each beat's clock.

:class:`BeatLane` starts ``count`` beats (each through :mod:`chaos.beat_main`, its
clock offset read from a file of its own), restarts one that dies (the nemesis kills
the leader), and stops them all at the end, letting the worker run what was sent.
Beat ``b0`` reaches the claims' Redis through a :class:`DispatchProxy`, which drops the
reply of one ``BEAT_DISPATCH`` call when armed; beat ``b{count-1}`` runs
:data:`CLOCK_AHEAD` seconds ahead of the others (and of Redis) all the time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import redis

from fenced._scripts import BEAT_DISPATCH
from fenced.celery.beat import status
from fenced.testing import CeleryWorker, RedisServer, TcpProxy

from .beat_schedule import BEAT_NAME
from .events import EventLog
from .runlane import kill_quietly

__all__ = ["CLOCK_AHEAD", "BeatLane", "DispatchProxy"]

#: How far ahead of the others the last beat's clock runs, always (seconds).
CLOCK_AHEAD = 4.0
BEAT_QUEUE = "chaos-beat"


class DispatchProxy(TcpProxy):
    """A TCP proxy in front of Redis that, when armed, holds the reply of the next
    ``BEAT_DISPATCH`` call (an ``EVALSHA`` of its script) that passes through it: the
    call reaches Redis and runs; nothing comes back on that connection any more (the
    client gives up on it after its socket timeout and sends the call again)."""

    def __init__(self, target_port: int, log: EventLog) -> None:
        super().__init__(target_port)
        self.log = log
        self.dropped = threading.Event()

    def arm(self) -> None:
        """Drop the reply of the next BEAT_DISPATCH call."""
        self.dropped.clear()
        self.hold_reply_to(str(BEAT_DISPATCH.sha).encode(), self._held)

    def _held(self) -> None:
        self.log.emit("beat-reply-dropped")
        self.dropped.set()


class BeatLane:
    """The beat processes and their worker."""

    def __init__(self, *, count: int, server: RedisServer, log: EventLog, env: dict[str, str],
                 out_dir: Path, root: Path, broken: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.count = count
        self.broken = broken
        self.server = server
        self.log = log
        self.out_dir = out_dir
        self.root = root
        base = server.url.rsplit("/", 1)[0]
        self.claims_url = f"{base}/0"
        self.broker_url = f"{base}/1"
        self.env = {**env, "CHAOS_BEAT_BROKER_URL": self.broker_url, "CHAOS_BEAT_QUEUE": BEAT_QUEUE}
        self.ids = [f"b{i}" for i in range(count)]
        if "beat-sender" in broken:
            # Deliberately broken: one more beat, Celery's own scheduler (it sends
            # every tick again, under task ids of its own).
            self.ids.append("stock")
        self.procs: dict[str, subprocess.Popen[bytes] | None] = dict.fromkeys(self.ids)
        self.clock_files = {b: out_dir / f"clock-{b}.txt" for b in self.ids}
        self.proxy = DispatchProxy(server.port, log)
        self.proxied = self.ids[0]
        self.skewed = self.ids[count - 1]
        self.worker = CeleryWorker(
            "chaos.beat_app", name="chaos-beat", log=out_dir / "beat-worker.out",
            queues=BEAT_QUEUE, concurrency=1, pool="solo", cwd=root, env=self.env,
        )  # fmt: skip
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._admin: Any = None

    # -- what the nemesis asks -------------------------------------------------------

    def admin(self) -> Any:
        if self._admin is None:
            self._admin = redis.Redis.from_url(self.claims_url, socket_timeout=2)
        return self._admin

    def leader(self) -> tuple[str, int] | None:
        """(beat id, pid) of the leader now, or None."""
        try:
            held = status(self.admin(), BEAT_NAME).leader
        except redis.RedisError:
            return None
        if held is None:
            return None
        for b, pid in self.pids().items():
            if pid == held.pid:
                return b, pid
        return None

    def pids(self) -> dict[str, int]:
        """The live beats: id -> pid."""
        with self._lock:
            return {b: p.pid for b, p in self.procs.items() if p is not None and p.poll() is None}

    def set_clock(self, beat: str, ahead: float) -> None:
        """Run ``beat``'s clock ``ahead`` seconds ahead of the real one."""
        path = self.clock_files[beat]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{ahead}\n")
        os.replace(tmp, path)

    def base_clock(self, beat: str) -> float:
        return CLOCK_AHEAD if beat == self.skewed else 0.0

    # -- running ---------------------------------------------------------------------

    def start(self) -> None:
        self.worker.start()
        for b in self.ids:
            self.set_clock(b, self.base_clock(b))
            self._spawn(b)
        self.worker.ready()
        threading.Thread(target=self._supervise, daemon=True).start()

    def wait_leader(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.leader()
            if found is not None:
                self.log.emit("beat-leading", beat=found[0], beat_pid=found[1])
                return
            time.sleep(0.1)
        raise RuntimeError(f"no beat leads after {timeout:g}s: see {self.out_dir}/beat-*.out")

    def _spawn(self, b: str) -> None:
        env = {
            **self.env,
            "CHAOS_CLOCK_FILE": str(self.clock_files[b]),
            "CHAOS_BEAT_CLAIMS": self.proxy.url if b == self.proxied else self.claims_url,
        }
        scheduler = "fenced.celery.beat:Scheduler"
        if b == "stock":
            scheduler = "celery.beat:PersistentScheduler"
        elif b == self.skewed and "beat-clock" in self.broken:
            scheduler = "chaos.beat_app:BlindScheduler"
        argv = [
            sys.executable, "-m", "chaos.beat_main", "-A", "chaos.beat_app", "beat",
            "-S", scheduler, "-l", "info",
            "-s", str(self.out_dir / f"beat-{b}.schedule"),
        ]  # fmt: skip
        with open(self.out_dir / f"beat-{b}.out", "ab") as out:
            proc = subprocess.Popen(argv, cwd=self.root, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        with self._lock:
            self.procs[b] = proc
        self.log.emit("beat-start", beat=b, beat_pid=proc.pid, proxied=b == self.proxied,
                      ahead=self.base_clock(b))  # fmt: skip

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            for b in self.ids:
                with self._lock:
                    proc = self.procs[b]
                if self.stopping.is_set() or proc is None or proc.poll() is None:
                    continue
                self.log.emit("beat-exit", beat=b, beat_pid=proc.pid, code=proc.returncode)
                self._spawn(b)
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the beats (what was sent still runs), then the worker."""
        self.stopping.set()
        with self._lock:
            procs = [p for p in self.procs.values() if p is not None]
        for p in procs:
            kill_quietly(p.pid, signal.SIGCONT)
            kill_quietly(p.pid)
        for p in procs:
            with suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.log.emit("beat-stopped")
        broker = redis.Redis.from_url(self.broker_url, socket_timeout=2)
        deadline = time.monotonic() + 10
        with suppress(redis.RedisError):
            while int(broker.llen(BEAT_QUEUE)) and time.monotonic() < deadline:
                time.sleep(0.1)
        time.sleep(0.5)  # the last message taken is noted by its run
        self.worker.stop()

    def kill(self) -> None:
        """Tear down whatever is left."""
        self.stopping.set()
        with self._lock:
            procs = [p for p in self.procs.values() if p is not None]
        for p in procs:
            if p.poll() is None:
                kill_quietly(p.pid, signal.SIGCONT)
                kill_quietly(p.pid)
                with suppress(subprocess.TimeoutExpired):
                    p.wait(5)
        self.worker.kill()
        self.proxy.close()
