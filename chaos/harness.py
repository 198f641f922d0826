"""The harness: servers, workers, the Celery and ``fenced run`` lanes, the nemesis.

``Harness(Config(...)).run()`` starts everything, lets the nemesis work for
``cfg.seconds``, stops the workload, reads the final stores and returns the checker's
:class:`~chaos.checker.Report`. Everything it starts, it stops (also on Ctrl-C).
"""

from __future__ import annotations

import os
import random
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import fenced
from fenced import read_holder
from fenced.testing import (
    AzuriteServer,
    CeleryWorker,
    RedisCluster,
    RedisServer,
    SentinelGroup,
    TcpProxy,
    find_azurite,
)

from . import checker
from .beat_lane import BeatLane
from .config import ENV, Config, Shared
from .events import EventLog, read_events
from .nemesis import Nemesis
from .runlane import RunLane, alive_commands, children, kill_quietly, read_lane, stop_processes
from .stores import CONTAINER, create_tables, drop_tables, read_final, stores_of

__all__ = ["ROOT", "Harness"]

ROOT = Path(__file__).resolve().parent.parent
NAME = "chaos:main"
RUN_NAME = "chaos:run"
QUEUE = "chaos"
DEDUP_QUEUE = "chaos-dedup"
#: The longest the dedup lane may take, after the faults, to account for every call.
DRAIN_SECONDS = 45.0


@dataclass
class Slot:
    """One worker process's place: restarted with a new pid when it dies."""

    id: str
    lane: str
    front: str
    lock_url: str
    proc: subprocess.Popen[bytes] | None = None


class Harness:
    """One chaos run."""

    def __init__(self, cfg: Config) -> None:
        cfg.check()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(cfg.out) if cfg.out else ROOT / "chaos" / "runs" / stamp
        self.log_dir = self.out / "logs"
        self.proc_dir = self.out / "processes"
        self.lane_file = self.out / "run-lane.txt"
        self.stopping = threading.Event()
        self.lock_server = RedisServer()
        if _major(self.lock_server.version()) >= 7:
            # DEBUG SLEEP is a fault the nemesis injects; Redis 7 refuses DEBUG by default.
            self.lock_server.extra = ["--enable-debug-command", "yes"]
        self.store_server = RedisServer()
        self.broker_server = RedisServer() if cfg.celery or cfg.dedup else None
        # The beat lane's claims and broker: a Redis of its own, out of the lock Redis's
        # faults (a restart would forget the schedule's due times).
        self.beat_server = RedisServer() if cfg.beat else None
        self.beat: BeatLane | None = None
        self.azurite = self._azurite(cfg)
        self.proxy: TcpProxy | None = None
        self.sentinel: SentinelGroup | None = None
        self.cluster: RedisCluster | None = None
        self.run_lane: RunLane | None = None
        self.celery: CeleryWorker | None = None
        self.dedup: CeleryWorker | None = None
        self.feeder: subprocess.Popen[bytes] | None = None
        self.debounce_sender: subprocess.Popen[bytes] | None = None
        self._sender_lock = threading.Lock()
        self.drain: dict[str, Any] = {}
        self._celery_restarting = threading.Lock()
        self._dedup_restarting = threading.Lock()
        self.slots: list[Slot] = []
        self._slots_lock = threading.Lock()
        self._admin: Any = None
        self.sql_url = (
            cfg.sql_url
            or os.environ.get("FENCED_TEST_POSTGRES_URL")
            or f"sqlite:///{self.out / 'chaos.db'}"
        )
        self.sql_prefix = f"chaos_{secrets.token_hex(4)}"
        self.log: EventLog
        self.shared: Shared
        self.env: dict[str, str] = {}

    @staticmethod
    def _azurite(cfg: Config) -> AzuriteServer | None:
        """The object store's server: Azurite from tests/npm (``make test`` installs it)
        or PATH; None when the run leaves the object store out."""
        if cfg.objects is False:
            return None
        binary = find_azurite(ROOT / "tests" / "npm" / "node_modules" / ".bin")
        if binary is None:
            if cfg.objects:
                raise SystemExit(
                    "--objects needs Azurite: `cd tests/npm && npm ci` (make test does it), "
                    "or `npm install -g azurite`"
                )
            return None
        # In memory: faster, and its lookups do not slow down as a long run's blobs pile up.
        return AzuriteServer(binary, memory=True)

    # -- what the nemesis asks ------------------------------------------------------------

    def admin(self) -> Any:
        """A client on the lock Redis for the harness's own reads and faults."""
        if self._admin is None:
            self._admin = redis.Redis.from_url(
                self.lock_server.url, socket_timeout=5, socket_connect_timeout=2
            )
        return self._admin

    def holder_pid(self, name: str) -> int | None:
        """The pid in the token of the claim's holder, or None."""
        try:
            holder = read_holder(self.admin(), name)
        except fenced.FencedError:
            return None
        return holder.pid if holder is not None else None

    def lock_holder_pid(self) -> int | None:
        """The pid in the token of the redis-py Lock's holder (the Lock lane's tokens)."""
        try:
            token = self.admin().get(self.shared.lock_name)
        except redis.RedisError:
            return None
        if not token:
            return None
        tail = token.decode().rsplit(":", 1)[-1]
        return int(tail) if tail.isdigit() else None

    def lane_pids(self, lane: str) -> dict[int, str]:
        """The live worker processes of a lane: pid -> worker id."""
        with self._slots_lock:
            pids = {
                s.proc.pid: s.id
                for s in self.slots
                if s.lane == lane and s.proc is not None and s.proc.poll() is None
            }
        if lane == "fenced" and self.celery is not None and self.celery.proc is not None:
            for pid in children(self.celery.proc.pid):
                pids[pid] = f"celery-{pid}"
        if lane == "dedup" and self.dedup is not None and self.dedup.proc is not None:
            for pid in children(self.dedup.proc.pid):
                pids[pid] = f"dedup-{pid}"
        return pids

    def holders(self, wait: bool = True) -> list[dict[str, Any]]:
        """The current holder of each lane (waiting up to 2 ttl for them to appear)."""
        found: dict[str, dict[str, Any]] = {}
        lanes = ["fenced"] + (["lock"] if self.cfg.baseline else [])
        deadline = time.monotonic() + (2 * self.cfg.ttl if wait else 0)
        first = True
        while (first or time.monotonic() < deadline) and len(found) < len(lanes):
            first = False
            for lane in lanes:
                if lane in found:
                    continue
                pid = self.holder_pid(NAME) if lane == "fenced" else self.lock_holder_pid()
                ours = self.lane_pids(lane)
                if pid is not None and pid in ours:
                    found[lane] = {"lane": lane, "pid": pid, "w": ours[pid]}
            time.sleep(0.02)
        return list(found.values())

    def proxied_workers(self) -> list[str]:
        """The workers that reach the lock Redis through the proxy."""
        proxy = self.proxy
        return [s.id for s in self.slots if proxy is not None and s.lock_url == proxy.url]

    def pick_victims(self, rng: random.Random) -> list[dict[str, Any]]:
        """A worker of each lane to kill: its current holder half the time."""
        victims: list[dict[str, Any]] = []
        holders = {h["lane"]: h for h in self.holders()} if rng.random() < 0.5 else {}
        lanes = ["fenced"] + (["lock"] if self.cfg.baseline else [])
        for lane in lanes + (["dedup"] if self.dedup is not None else []):
            pids = self.lane_pids(lane)
            if not pids:
                continue
            if lane in holders:
                pid, is_holder = holders[lane]["pid"], True
            else:
                pid, is_holder = rng.choice(sorted(pids)), False
            victim: dict[str, Any] = {"lane": lane, "pid": pid, "w": pids[pid], "holder": is_holder}
            worker = {"celery": self.celery, "dedup": self.dedup}.get(pids[pid].split("-")[0])
            if worker is not None and worker.proc is not None and rng.random() < 0.25:
                # Now and then the whole worker, as a deploy's hard restart does.
                victim["whole_celery"] = True
                victim["pids"] = [worker.proc.pid, *children(worker.proc.pid)]
            victims.append(victim)
        return victims

    def restart_celery_in_background(self, lane: str = "fenced") -> None:
        worker = self.dedup if lane == "dedup" else self.celery
        guard = self._dedup_restarting if lane == "dedup" else self._celery_restarting

        def restart() -> None:
            if not guard.acquire(blocking=False):
                return
            try:
                assert worker is not None
                worker.kill()
                if self.stopping.is_set():
                    return
                worker.start()
                worker.ready()
                self.log.emit("celery-restarted", lane=lane)
            except Exception as exc:
                self.log.emit("celery-restart-failed", lane=lane, error=repr(exc)[:300])
            finally:
                guard.release()

        threading.Thread(target=restart, daemon=True).start()

    # -- the run --------------------------------------------------------------------------

    def run(self) -> checker.Report:
        """Start, inject faults for cfg.seconds, stop, check."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.log_dir / "harness.jsonl", w="harness", pid=os.getpid())
        finals = {}
        try:
            self._start()
            nemesis = Nemesis(self, self.rng)  # after the start: it looks at what runs
            self.log.emit("phase", phase="faults")
            until = time.monotonic() + self.cfg.seconds
            thread = threading.Thread(target=nemesis.run, args=(until,), daemon=True)
            thread.start()
            while time.monotonic() < until and thread.is_alive():
                time.sleep(0.2)
            nemesis.stopping.set()
            thread.join(30)
            self.log.emit("phase", phase="stop")
            self._stop_workload()
            for lane in ("fenced", "lock") if self.cfg.baseline else ("fenced",):
                finals[lane] = read_final(self.shared, lane)
        finally:
            self.stopping.set()
            self._teardown()
        setup = checker.Setup.of(
            self.cfg, self.sql_url, self.celery is not None, self.drain, stores_of(self.shared)
        )
        checker.save_inputs(self.out, finals, setup)
        report = checker.check(read_events(self.log_dir), read_lane(self.lane_file), finals, setup)
        report.write(self.out / "report.json")
        return report

    def _start(self) -> None:
        cfg = self.cfg
        self.lock_server.start()
        self.store_server.start()
        if self.broker_server is not None:
            self.broker_server.start()
        if self.beat_server is not None:
            self.beat_server.start()
        if self.azurite is not None:
            self.azurite.start()
            self.azurite.create_container(CONTAINER)
        self.proc_dir.mkdir(parents=True, exist_ok=True)
        if cfg.sentinel:
            self.sentinel = SentinelGroup(down_after_ms=1000, failover_timeout_ms=3000).start()
        if cfg.cluster:
            # Three masters: a failover needs a majority of them to vote.
            self.cluster = RedisCluster(masters=3, replicas=1, node_timeout_ms=1000).start()
        create_tables(self.sql_url, self.sql_prefix)
        self.shared = Shared(
            name=NAME,
            ttl=cfg.ttl,
            steps=cfg.steps,
            step_min=cfg.step_min,
            step_max=cfg.step_max,
            lock_url=self.lock_server.url,
            store_url=self.store_server.url,
            sql_url=self.sql_url,
            sql_prefix=self.sql_prefix,
            files_dir=str(self.out / "files"),
            log_dir=str(self.log_dir),
            extra={
                "dedup_ttl": str(cfg.dedup_ttl),
                "dedup_cooldown": str(cfg.dedup_cooldown),
                "broken": ",".join(cfg.broken),
                "dedup_url": self._dedup_url(),
                "replicas": str(cfg.dedup_replicas),
                "object_endpoint": self.azurite.endpoint if self.azurite else "",
            },
        )
        src = str(Path(fenced.__file__).resolve().parent.parent)
        path = [str(ROOT), src, *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), ENV: self.shared.to_env()}
        if self.broker_server is not None:
            self.env["CHAOS_BROKER_URL"] = self.broker_server.url
            self.env["CHAOS_QUEUE"] = QUEUE
            self.env["CHAOS_DEDUP_QUEUE"] = DEDUP_QUEUE
            # The dedup lane's chords need a result backend: another database of the broker.
            self.env["CHAOS_RESULT_URL"] = f"redis://127.0.0.1:{self.broker_server.port}/1"
        if "partition" in cfg.faults:
            self.proxy = TcpProxy(self.lock_server.port)
        for i in range(cfg.workers):
            front = ("claim", "exclusive")[i % 2]
            self.slots.append(Slot(f"w{i}", "fenced", front, self._url_for(i)))
        for i in range(cfg.n_baseline):
            self.slots.append(Slot(f"b{i}", "lock", "lock", self._url_for(i)))
        for slot in self.slots:
            self._spawn(slot)
        threading.Thread(target=self._supervise, daemon=True).start()
        if cfg.celery:
            self.celery = CeleryWorker(
                "chaos.celery_app",
                name="chaos",
                log=self.proc_dir / "celery.out",
                concurrency=cfg.celery_children,
                pool="prefork",
                cwd=ROOT,
                env=self.env,
            ).start()
            self.celery.ready()
            threading.Thread(target=self._feed, daemon=True).start()
        if cfg.dedup:
            self.dedup = CeleryWorker(
                "chaos.dedup_app",
                name="chaos-dedup",
                log=self.proc_dir / "dedup.out",
                queues=DEDUP_QUEUE,
                concurrency=cfg.dedup_children,
                pool="prefork",
                cwd=ROOT,
                env=self.env,
            ).start()
        if cfg.run_lane:
            self.run_lane = RunLane(
                name=RUN_NAME,
                lock_url=self.lock_server.url,
                ttl=cfg.ttl,
                runners=cfg.runners,
                file=self.lane_file,
                log=self.log,
                env=self.env,
                out_dir=self.proc_dir,
            )
            self.run_lane.start()
        if self.beat_server is not None:
            self.beat = BeatLane(count=cfg.beats, server=self.beat_server, log=self.log,
                                 env=self.env, out_dir=self.proc_dir, root=ROOT,
                                 broken=cfg.broken)  # fmt: skip
            self.beat.start()
        if self.dedup is not None:
            self.dedup.ready()
            with open(self.proc_dir / "feeder.out", "ab") as out:
                self.feeder = subprocess.Popen(
                    [sys.executable, "-m", "chaos.feeder"], cwd=ROOT, env=self.env,
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            self.start_debounce_sender()
        self._warm_up()
        if self.beat is not None:
            self.beat.wait_leader()

    def start_debounce_sender(self) -> subprocess.Popen[bytes] | None:
        """Start the debounce sender (again, after the nemesis killed it)."""
        with self._sender_lock:
            if self.stopping.is_set():
                return None
            with open(self.proc_dir / "debounce.out", "ab") as out:
                self.debounce_sender = subprocess.Popen(
                    [sys.executable, "-m", "chaos.debounce_sender"], cwd=ROOT, env=self.env,
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            return self.debounce_sender

    def _dedup_url(self) -> str:
        """The dedup lane's claims: a Sentinel or Cluster URL, else the lock Redis ("")."""
        if self.sentinel is not None:
            return self.sentinel.url
        if self.cluster is not None:
            return self.cluster.startup_url
        return ""

    def _url_for(self, i: int) -> str:
        # The first worker of each lane reaches the lock Redis through the proxy.
        if i == 0 and self.proxy is not None:
            return self.proxy.url
        return self.lock_server.url

    def _spawn(self, slot: Slot) -> None:
        argv = [
            sys.executable, "-m", "chaos.worker", "--id", slot.id, "--lane", slot.lane,
            "--front", slot.front, "--lock-url", slot.lock_url,
        ]  # fmt: skip
        with open(self.proc_dir / f"{slot.id}.out", "ab") as out:
            slot.proc = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.log.emit("worker-start", worker=slot.id, worker_pid=slot.proc.pid, lane=slot.lane)

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            for slot in self.slots:
                with self._slots_lock:
                    proc = slot.proc
                    if self.stopping.is_set() or proc is None or proc.poll() is None:
                        continue
                    self.log.emit(
                        "worker-exit", worker=slot.id, worker_pid=proc.pid, code=proc.returncode
                    )
                    self._spawn(slot)
            time.sleep(0.1)

    def _feed(self) -> None:
        """Keep a task waiting in the Celery queue."""
        from celery import Celery

        assert self.broker_server is not None
        client = Celery("chaos-feeder", broker=self.broker_server.url)
        client.conf.broker_connection_retry_on_startup = True
        broker = self.broker_server.client()
        while not self.stopping.is_set():
            try:
                if not int(broker.llen(QUEUE)):
                    client.send_task("chaos.work", queue=QUEUE)
            except Exception as exc:
                self.log.emit("feeder-error", error=repr(exc)[:200])
            # A busy claim makes each task a quick skip: a few tries a second compete
            # like a worker does, without flooding two cores with skipped tasks.
            self.stopping.wait(0.15)

    def _warm_up(self, timeout: float = 90.0) -> None:
        """Wait until each lane has had a holder: every process has started."""
        lanes = {"fenced": NAME}
        if self.cfg.baseline:
            lanes["lock"] = self.shared.lock_name
        seen: set[str] = set()
        deadline = time.monotonic() + timeout
        while seen != set(lanes) and time.monotonic() < deadline:
            for lane, name in lanes.items():
                pid = self.holder_pid(name) if lane == "fenced" else self.lock_holder_pid()
                if pid is not None:
                    seen.add(lane)
            time.sleep(0.05)
        if seen != set(lanes):
            raise RuntimeError(
                f"no holder in lane(s) {set(lanes) - seen} after {timeout:g}s: see "
                f"{self.proc_dir} for the workers' output"
            )

    def _stop_workload(self) -> None:
        self.stopping.set()
        if self.run_lane is not None:
            self.run_lane.stop()
        with self._slots_lock:
            procs = [s.proc for s in self.slots if s.proc is not None]
        stop_processes(procs)
        if self.celery is not None:
            with self._celery_restarting:
                self.celery.stop()
        if self.beat is not None:
            self.beat.stop()
        if self.dedup is not None:
            self._drain_dedup()
        # A command whose runner was killed may still run: it belongs to this run.
        deadline = time.monotonic() + 10
        while alive_commands(read_lane(self.lane_file)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in alive_commands(read_lane(self.lane_file)):
            kill_quietly(pid)

    def _drain_dedup(self) -> None:
        """Stop the feeder (it sends its closing calls), then let the dedup worker run
        until every call is accounted for, DRAIN_SECONDS at most."""
        from .dedup_check import pending

        assert self.dedup is not None
        start = time.monotonic()
        with self._sender_lock:
            senders = [p for p in (self.feeder, self.debounce_sender) if p is not None]
            stop_processes(senders, timeout=30)
        with self._dedup_restarting:
            if self.dedup.proc is None or self.dedup.proc.poll() is not None:
                self.dedup.start()
                self.dedup.ready()
        left: list[str] = []
        quiet_since = time.monotonic()
        seen = 0
        while time.monotonic() - start < DRAIN_SECONDS:
            # Only the dedup lane's logs and the harness's (its faults): the other lanes'
            # are large after a long run, and say nothing here.
            runs = read_events(self.log_dir, "dedup.*.jsonl")
            if len(runs) != seen:
                seen, quiet_since = len(runs), time.monotonic()
            others = [*read_events(self.log_dir, "feeder.jsonl"),
                      *read_events(self.log_dir, "debounce.jsonl"),
                      *read_events(self.log_dir, "harness.jsonl")]  # fmt: skip
            left = pending(sorted([*runs, *others], key=lambda e: float(e["t"])))
            # Every call accounted for, and nothing new for a moment (reruns sent by the
            # last runs have arrived): done. Also when nothing has run for longer than a
            # killed worker's messages take to come back: what is left will not come.
            quiet = time.monotonic() - quiet_since
            if (not left and quiet > 1.5) or quiet > (3.0 if self.cfg.broken else 12.0):
                break
            time.sleep(0.5)
        self.drain = {"seconds": round(time.monotonic() - start, 1), "pending": len(left)}
        self.log.emit("dedup-drained", **self.drain)
        with self._dedup_restarting:
            self.dedup.stop()

    def _teardown(self) -> None:
        for p in [s.proc for s in self.slots if s.proc is not None]:
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.run_lane is not None:
            self.run_lane.stop(timeout=2)
        if self.celery is not None:
            self.celery.kill()
        for sender in (self.feeder, self.debounce_sender):
            if sender is not None and sender.poll() is None:
                sender.kill()
                sender.wait()
        if self.dedup is not None:
            self.dedup.kill()
        if self.proxy is not None:
            self.proxy.close()
        if self.beat is not None:
            self.beat.kill()
        for server in (self.lock_server, self.store_server, self.broker_server,
                       self.beat_server):  # fmt: skip
            if server is not None:
                server.stop()
        if self.azurite is not None:
            self.azurite.stop()
        if self.sentinel is not None:
            self.sentinel.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if not self.cfg.keep_tables:
            try:
                drop_tables(self.sql_url, self.sql_prefix)
            except Exception as exc:
                print(f"chaos: could not drop tables {self.sql_prefix}_*: {exc}", file=sys.stderr)


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0
