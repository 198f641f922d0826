"""The nemesis: one fault at a time, at random, each logged with its start and end.

Faults come from a shuffled bag (every kind once, then again), separated by a random
quiet time, so that each violation the checker finds has one fault just before it.
Targeted faults hit both lanes at once (the holder of the fenced claim and the holder
of the redis-py Lock are paused together; a worker of each lane is killed), so the
two lanes see the same faults.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from redis.crc import key_slot

from fenced._lease import ClaimKeys

from .beat_schedule import BEAT_TTL
from .config import BEAT_FAULTS, CLUSTER_FAULTS, DEDUP_NAMES, FAILOVER_FAULTS
from .runlane import children, kill_quietly, process_age

if TYPE_CHECKING:
    from .harness import Harness

__all__ = ["Nemesis"]


class Nemesis:
    """Injects the configured faults into a running harness until stopped."""

    def __init__(self, harness: Harness, rng: random.Random) -> None:
        self.h = harness
        self.rng = rng
        self.ttl = harness.cfg.ttl
        self.stopping = threading.Event()
        self.kinds = [k for k in harness.cfg.faults if self.applies(k)]
        self.count = 0

    def applies(self, kind: str) -> bool:
        """Whether this run has what the fault needs."""
        if kind == "partition":
            return self.h.proxy is not None
        if kind == "kill_runner":
            return self.h.run_lane is not None
        if kind in FAILOVER_FAULTS:
            return self.h.sentinel is not None
        if kind in CLUSTER_FAULTS:
            return self.h.cluster is not None
        if kind in BEAT_FAULTS:
            return self.h.beat is not None
        if kind == "kill_debounce_sender":
            return self.h.dedup is not None
        return True

    def run(self, until: float) -> None:
        bag: list[str] = []
        low, high = self.h.cfg.gap
        # A quiet start: the first holders settle before the first fault.
        self.stopping.wait(self.rng.uniform(low, high) * self.ttl)
        while not self.stopping.is_set() and time.monotonic() < until and self.kinds:
            if not bag:
                bag = list(self.kinds)
                self.rng.shuffle(bag)
            kind = bag.pop()
            try:
                getattr(self, kind)()
            except Exception as exc:  # a fault that could not be made is logged, not fatal
                self.h.log.emit("fault-failed", kind=kind, error=repr(exc)[:300])
            self.stopping.wait(self.rng.uniform(low, high) * self.ttl)

    def record(self, kind: str, start: float, end: float | None = None, **details: Any) -> None:
        self.count += 1
        self.h.log.emit(
            "fault", t=start, kind=kind, n=self.count, end=start if end is None else end, **details
        )

    def skipped(self, kind: str, why: str) -> None:
        self.h.log.emit("fault-skipped", kind=kind, why=why)

    def _span(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high) * self.ttl

    # -- the faults ---------------------------------------------------------------------

    def pause_holder(self) -> None:
        """SIGSTOP the current holder of each lane for 1.5-3 ttl, then SIGCONT."""
        targets = self.h.holders()
        if not targets:
            self.skipped("pause_holder", "no holder")
            return
        pids = [t["pid"] for t in targets]
        start = time.monotonic()
        try:
            for pid in pids:
                kill_quietly(pid, signal.SIGSTOP)
            self.stopping.wait(self._span(1.5, 3.0))
        finally:
            for pid in pids:
                kill_quietly(pid, signal.SIGCONT)
        self.record("pause_holder", start, time.monotonic(), targets=targets)

    def restart_lock_redis(self) -> None:
        """kill -9 the lock Redis, leave it down a moment, start it empty on its port."""
        server = self.h.lock_server
        start = time.monotonic()
        server.kill()
        self.stopping.wait(self._span(0.1, 0.5))
        # Nothing can answer before the new process exists: the outage ends no earlier.
        down_until = time.monotonic()
        server.start()
        self.record("restart_lock_redis", start, time.monotonic(), down_until=down_until)

    def client_kill(self) -> None:
        """CLIENT KILL TYPE normal: every client's connection to the lock Redis drops."""
        admin = self.h.admin()
        start = time.monotonic()
        killed = admin.execute_command("CLIENT", "KILL", "TYPE", "normal")
        self.record("client_kill", start, connections=int(killed))

    def debug_sleep(self) -> None:
        """DEBUG SLEEP for 0.5-2 ttl: the lock Redis answers nobody meanwhile."""
        seconds = round(self._span(0.5, 2.0), 3)
        admin: Any = redis.Redis.from_url(self.h.lock_server.url, socket_timeout=seconds + 30)
        start = time.monotonic()
        try:
            admin.execute_command("DEBUG", "SLEEP", seconds)
        finally:
            admin.close()
        self.record("debug_sleep", start, time.monotonic(), seconds=seconds)

    def client_pause(self) -> None:
        """CLIENT PAUSE for 0.5-2 ttl: the lock Redis holds every client's commands."""
        ms = int(self._span(0.5, 2.0) * 1000)
        start = time.monotonic()
        self.h.admin().execute_command("CLIENT", "PAUSE", ms)
        self.stopping.wait(ms / 1000)
        self.record("client_pause", start, start + ms / 1000, ms=ms)

    def partition(self) -> None:
        """Black-hole the proxied workers' traffic to the lock Redis for 1.5-3 ttl.

        Preferably while a proxied worker holds its claim (waiting up to 4 ttl for one).
        """
        proxy = self.h.proxy
        assert proxy is not None
        proxied = set(self.h.proxied_workers())
        deadline = time.monotonic() + 4 * self.ttl
        while time.monotonic() < deadline and not self.stopping.is_set():
            if any(t["w"] in proxied for t in self.h.holders(wait=False)):
                break
            time.sleep(0.02)
        start = time.monotonic()
        proxy.blackhole()
        try:
            self.stopping.wait(self._span(1.5, 3.0))
        finally:
            proxy.heal()
        self.record(
            "partition", start, time.monotonic(), workers=self.h.proxied_workers(),
        )  # fmt: skip

    def kill_worker(self) -> None:
        """kill -9 a worker of each lane (its holder half the time); a new one starts."""
        victims = self.h.pick_victims(self.rng)
        if not victims:
            self.skipped("kill_worker", "no worker")
            return
        start = time.monotonic()
        for v in victims:
            if v.get("whole_celery"):
                self.h.restart_celery_in_background(v["lane"])
            else:
                kill_quietly(v["pid"])
        self.record("kill_worker", start, targets=victims)

    def failover_kill(self) -> None:
        """kill -9 the Sentinel group's master; once the sentinels have promoted the
        replica, start the old master again as its replica (empty: no persistence)."""
        group = self.h.sentinel
        assert group is not None
        start = time.monotonic()
        old = group.kill_master()
        _host, port = group.wait_promoted(timeout=30)
        promoted = time.monotonic()
        old.extra = _replica_of(old.extra, port)
        old.start()
        # Alive again: a later failover may promote it (wait_promoted skips the killed).
        group._killed.remove(old)
        _wait_synced(old)
        self.record("failover_kill", start, promoted, killed=old.port, promoted=port,
                    synced=time.monotonic())  # fmt: skip

    def failover_pause(self) -> None:
        """SIGSTOP the Sentinel group's master until the sentinels promote the replica,
        then SIGCONT it: for a moment two servers believe they are the master, until
        the sentinels make the old one a replica."""
        group = self.h.sentinel
        assert group is not None
        master = group.master()
        start = time.monotonic()
        master.pause()
        try:
            deadline = start + 30
            while time.monotonic() < deadline and not self.stopping.is_set():
                try:
                    if group.master_address()[1] != master.port:
                        break
                except Exception:
                    pass
                time.sleep(0.1)
        finally:
            master.resume()
        resumed = time.monotonic()
        _wait_synced(master)
        self.record("failover_pause", start, resumed, paused=master.port,
                    promoted=group.master_address()[1], synced=time.monotonic())  # fmt: skip

    def _busiest_master(self, kind: str) -> tuple[Any, list[str]] | None:
        """The cluster master that serves the most of the dedup lane's claim names (ties
        drawn at random), and those names; None (skipped) when it has no live replica."""
        cluster = self.h.cluster
        assert cluster is not None
        served: dict[int, list[str]] = {}
        for name in DEDUP_NAMES:
            port = cluster.master_for_key(ClaimKeys.of(name).lock).port
            served.setdefault(port, []).append(name)
        most = max(len(names) for names in served.values())
        port = self.rng.choice(sorted(p for p, names in served.items() if len(names) == most))
        master = next(n for n in cluster.nodes if n.port == port)
        if not cluster.replicas_of(master):
            self.skipped(kind, f"master {port} has no live replica")
            return None
        return master, served[port]

    def _settle(self, node: Any) -> float:
        """Wait until ``node`` is a replica in sync and every node agrees on the slot map
        again (a later failover has a replica to promote); when that was."""
        cluster = self.h.cluster
        assert cluster is not None
        _wait_synced(node)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self.stopping.is_set():
            try:
                if cluster._ready():
                    break
            except Exception:
                pass
            time.sleep(0.1)
        return time.monotonic()

    def cluster_failover_kill(self) -> None:
        """kill -9 the cluster master serving the dedup lane's busiest slots; once its
        replica is promoted, start the old node again: it rejoins (nodes.conf) as the
        promoted one's replica, empty, and syncs from it."""
        cluster = self.h.cluster
        assert cluster is not None
        found = self._busiest_master("cluster_failover_kill")
        if found is None:
            return
        master, names = found
        slots = _slots_of(cluster, master.port)
        start = time.monotonic()
        cluster._kill(master)
        try:
            cluster.wait_failover(timeout=30)
            promoted = time.monotonic()
            new = cluster.master_for_key(ClaimKeys.of(names[0]).lock).port
        finally:
            # Alive again, and a replica: a later failover may promote it.
            master.start()
            cluster._killed.remove(master)
        synced = self._settle(master)
        self.record("cluster_failover_kill", start, promoted, killed=master.port,
                    promoted=new, names=names, slots=slots, synced=synced)  # fmt: skip

    def cluster_failover_pause(self) -> None:
        """SIGSTOP the cluster master serving the dedup lane's busiest slots until its
        replica is promoted, then SIGCONT it: for a moment it still believes it serves
        the slots, until the cluster's gossip makes it the new master's replica."""
        cluster = self.h.cluster
        assert cluster is not None
        found = self._busiest_master("cluster_failover_pause")
        if found is None:
            return
        master, names = found
        replicas = cluster.replicas_of(master)
        slot = key_slot(ClaimKeys.of(names[0]).lock.encode())
        slots = _slots_of(cluster, master.port)
        new: int | None = None
        start = time.monotonic()
        master.pause()
        try:
            deadline = start + 30
            while new is None and time.monotonic() < deadline and not self.stopping.is_set():
                for replica in replicas:  # a replica knows first that it was promoted
                    try:
                        owner = _owner(cluster, replica, slot)
                    except Exception:
                        continue
                    if owner != master.port:
                        new = owner
                time.sleep(0.1)
        finally:
            master.resume()
        resumed = time.monotonic()
        synced = self._settle(master)
        self.record("cluster_failover_pause", start, resumed, paused=master.port,
                    promoted=new, names=names, slots=slots, synced=synced)  # fmt: skip

    def kill_runner(self) -> None:
        """kill -9 the ``fenced run`` runner that holds the lane's claim, early in a command."""
        lane = self.h.run_lane
        assert lane is not None
        deadline = time.monotonic() + 6 * self.ttl
        while time.monotonic() < deadline and not self.stopping.is_set():
            pid = self.h.holder_pid(lane.name)
            if pid is not None and pid in lane.runner_pids():
                commands = children(pid)
                # Early in its command, so that the command has well over a ttl to go.
                if commands and process_age(commands[0]) < 0.4 * self.ttl:
                    start = time.monotonic()
                    kill_quietly(pid)
                    self.record("kill_runner", start, runner_pid=pid, command_pids=commands)
                    return
            time.sleep(0.05)
        self.skipped("kill_runner", "no runner mid-command")

    def kill_debounce_sender(self) -> None:
        """kill -9 the debounce sender, mid-publish when it gets there within 4 s (the
        burst's record written, its message not yet published); start it again."""
        path = self.h.log_dir / "debounce.jsonl"
        proc = self.h.debounce_sender
        if proc is None or proc.poll() is not None:
            self.skipped("kill_debounce_sender", "no sender")
            return
        mid = False
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not self.stopping.is_set():
            last = _last_line(path)
            if '"dd-dpublish"' in last and f'"pid":{proc.pid}' in last:
                mid = True
                break
            time.sleep(0.02)
        start = time.monotonic()
        kill_quietly(proc.pid)
        proc.wait()
        new = self.h.start_debounce_sender()
        self.record("kill_debounce_sender", start, sender_pid=proc.pid, mid_publish=mid,
                    new_pid=None if new is None else new.pid)  # fmt: skip

    # -- the beat lane ----------------------------------------------------------------

    def _beat_leader(self, kind: str) -> tuple[str, int] | None:
        lane = self.h.beat
        assert lane is not None
        deadline = time.monotonic() + 2 * BEAT_TTL
        while time.monotonic() < deadline and not self.stopping.is_set():
            found = lane.leader()
            if found is not None:
                return found
            time.sleep(0.05)
        self.skipped(kind, "no beat leads")
        return None

    def beat_kill(self) -> None:
        """kill -9 the leading beat; the lane starts it again at once."""
        found = self._beat_leader("beat_kill")
        if found is None:
            return
        beat, pid = found
        start = time.monotonic()
        kill_quietly(pid)
        self.record("beat_kill", start, beat=beat, beat_pid=pid)

    def beat_pause(self) -> None:
        """SIGSTOP the leading beat for 1.5-3 of its leases, then SIGCONT: a stand-by
        leads meanwhile, and the paused one wakes as a stand-by."""
        found = self._beat_leader("beat_pause")
        if found is None:
            return
        beat, pid = found
        start = time.monotonic()
        try:
            kill_quietly(pid, signal.SIGSTOP)
            self.stopping.wait(self.rng.uniform(1.5, 3.0) * BEAT_TTL)
        finally:
            kill_quietly(pid, signal.SIGCONT)
        self.record("beat_pause", start, time.monotonic(), beat=beat, beat_pid=pid)

    def _hand_lead_to(self, target: str) -> float | None:
        """Make beat ``target`` lead: the others are paused until it does, then
        resumed (a paused leader wakes as a stand-by). When it led, or None."""
        lane = self.h.beat
        assert lane is not None
        pids = lane.pids()
        if target not in pids:
            return None
        found = lane.leader()
        if found is not None and found[0] == target:
            return time.monotonic()
        others = [pid for b, pid in pids.items() if b != target]
        led = None
        try:
            for pid in others:
                kill_quietly(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 3 * BEAT_TTL + 3
            while time.monotonic() < deadline and not self.stopping.is_set():
                found = lane.leader()
                if found is not None and found[0] == target:
                    led = time.monotonic()
                    break
                time.sleep(0.05)
        finally:
            for pid in others:
                kill_quietly(pid, signal.SIGCONT)
        return led

    def beat_drop_reply(self) -> None:
        """The beat behind the proxy made leader (the others paused until it leads),
        then the reply of one of its BEAT_DISPATCH calls dropped: the script ran, the
        answer never came back on that connection."""
        lane = self.h.beat
        assert lane is not None
        start = time.monotonic()
        led = self._hand_lead_to(lane.proxied)
        if led is None:
            self.skipped("beat_drop_reply", f"{lane.proxied} did not lead")
            return
        lane.proxy.arm()
        dropped = lane.proxy.dropped.wait(3.0)
        lane.proxy.hold_reply_to(None)  # not passed by then: no longer
        self.record("beat_drop_reply", start, time.monotonic(), beat=lane.proxied, led=led,
                    dropped=dropped)  # fmt: skip

    def beat_clock_ahead(self) -> None:
        """The beat whose clock runs ahead made leader, and its clock moved a further
        15-30 s ahead for 4-6 s, then back: due times follow Redis's clock, so its
        ticks go out on time all along."""
        lane = self.h.beat
        assert lane is not None
        start = time.monotonic()
        led = self._hand_lead_to(lane.skewed)
        if led is None:
            self.skipped("beat_clock_ahead", f"{lane.skewed} did not lead")
            return
        base = lane.base_clock(lane.skewed)
        ahead = round(base + self.rng.uniform(15, 30), 1)
        lane.set_clock(lane.skewed, ahead)
        try:
            self.stopping.wait(self.rng.uniform(4.0, 6.0))
        finally:
            lane.set_clock(lane.skewed, base)
        self.record("beat_clock_ahead", start, time.monotonic(), beat=lane.skewed, led=led,
                    ahead=ahead)  # fmt: skip


def _last_line(path: Any) -> str:
    """The last line of a file (empty when it has none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 400))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _slots_of(cluster: Any, port: int) -> list[list[int]]:
    """The slot ranges [first, last] that the master on ``port`` serves now (what its
    failover may forget: the checker excuses only the claim names there)."""
    view = cluster._slots_view(cluster._live()[0])
    return sorted([first, last] for first, last, owner, _ in view if owner == port)


def _owner(cluster: Any, node: Any, slot: int) -> int | None:
    """The port of the master that serves ``slot``, as ``node`` sees it."""
    for first, last, port, _ in cluster._slots_view(node):
        if first <= slot <= last:
            return int(port)
    return None


def _replica_of(extra: list[str], port: int) -> list[str]:
    """A server's arguments, made those of a replica of 127.0.0.1:port."""
    out: list[str] = []
    skip = 0
    for arg in extra:
        if skip:
            skip -= 1
            continue
        if arg == "--replicaof":
            skip = 2
            continue
        out.append(arg)
    return [*out, "--replicaof", "127.0.0.1", str(port)]


def _wait_synced(server: Any, timeout: float = 30.0) -> None:
    """Wait until ``server`` is a replica whose link to its master is up (the group can
    fail over again), or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client: Any = redis.Redis(port=server.port, socket_timeout=2)
            try:
                info = client.info("replication")
            finally:
                client.close()
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
