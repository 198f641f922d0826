"""Acquire+release cycles per second: fenced's Claim beside the Redis locks people use.

Starts its own redis-server (TCP on a free port; the system binary when there is one)
and measures, in one run and interleaved (short rounds taken in turn, median of the
rounds), one single-threaded client doing acquire+release on one name per contender:

* a raw floor: ``SET NX PX`` then a compare-and-delete script by EVALSHA (redis-py);
* redis-py ``Lock``; python-redis-lock, with and without ``auto_renewal``;
  pottery ``Redlock`` with one master; sherlock ``RedisLock``;
* fenced ``Claim`` with the heartbeat off and on (the fence is minted either way);
* with ``--metrics``: fenced ``Claim`` (heartbeat off) while ``fenced.metrics`` counts
  its events, and while a subscriber that does nothing receives them (what the events
  cost alone), beside the same cycle with nobody subscribed (rounds interleaved with
  the others; each subscriber is on for its own rounds only);
* the skipped path: an acquire that fails because another holder has the name
  (fenced and redis-py ``Lock``);
* the heartbeat's cost for many claims held by one process: pipelined round trips,
  CPU seconds of the process and of the server per refresh interval.

Run: ``python benchmarks/claim_cycle.py`` (about a minute), ``--quick`` (about ten
seconds), ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
from _common import (
    Rates,
    evalsha_calls,
    interleave,
    machine_info,
    machine_line,
    paired_ratio,
    server_cpu,
    start_server,
    table,
)

from fenced import Claim
from fenced._heartbeat import heartbeat
from fenced.testing import RedisServer

TTL = 30.0
BASELINE = "redis_py_lock"
#: fenced.metrics may cost at most 3% of a cycle.
METRICS_GOAL = 0.97

# Compare-and-delete: the least a safe release can do.
_RELEASE_SRC = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class Contender:
    """One measured operation."""

    key: str
    label: str
    kind: str  # "cycle" (acquire+release) or "skip" (an acquire that must fail)
    op: Callable[[], object]
    #: For a skipped path: the key of the same library's acquire+release cycle (with
    #: metrics: of the same cycle without them).
    cycle: str | None = None
    #: Called before each of its rounds; returns what undoes it after the round.
    around: Callable[[], Callable[[], object]] | None = None


class BenchError(RuntimeError):
    """A contender did not do what it is measured doing (a bug in the benchmark)."""


def _client(url: str) -> Any:
    return redis.Redis.from_url(url)


# -- contenders -------------------------------------------------------------------------


def raw_floor(url: str, fresh: bool) -> Contender:
    """SET NX PX with a random token, then compare-and-delete by EVALSHA."""
    r = _client(url)
    sha = r.script_load(_RELEASE_SRC)
    key = "bench:raw"
    px = int(TTL * 1000)

    def op() -> None:
        token = secrets.token_hex(16)
        if not r.set(key, token, nx=True, px=px):
            raise BenchError("raw floor: SET NX failed")
        if r.evalsha(sha, 1, key, token) != 1:
            raise BenchError("raw floor: compare-and-delete failed")

    return Contender("raw_floor", "raw floor (SET NX PX + EVALSHA del)", "cycle", op)


def redis_py_lock(url: str, fresh: bool) -> Contender:
    """redis-py's own Lock."""
    r = _client(url)
    name = "bench:redis-py"
    lock = r.lock(name, timeout=TTL)

    def op() -> None:
        lk = r.lock(name, timeout=TTL) if fresh else lock
        if not lk.acquire(blocking=False):
            raise BenchError("redis-py Lock: acquire failed")
        lk.release()

    return Contender(BASELINE, "redis-py Lock", "cycle", op)


def python_redis_lock(url: str, fresh: bool, auto_renewal: bool) -> Contender:
    """python-redis-lock's Lock, optionally with its per-lock renewal thread."""
    import redis_lock  # type: ignore[import-untyped]

    r = _client(url)
    name = f"bench:prl:{int(auto_renewal)}"

    def make() -> Any:
        return redis_lock.Lock(r, name, expire=int(TTL), auto_renewal=auto_renewal)

    lock = make()

    def op() -> None:
        lk = make() if fresh else lock
        if not lk.acquire(blocking=False):
            raise BenchError("python-redis-lock: acquire failed")
        lk.release()

    if auto_renewal:
        return Contender("python_redis_lock_renew", "python-redis-lock auto_renewal", "cycle", op)
    return Contender("python_redis_lock", "python-redis-lock", "cycle", op)


def pottery_redlock(url: str, fresh: bool) -> Contender:
    """pottery's Redlock with a single master."""
    from pottery import Redlock

    r = _client(url)
    name = "bench:pottery"

    def make() -> Any:
        return Redlock(key=name, masters={r}, auto_release_time=TTL)

    lock = make()

    def op() -> None:
        lk = make() if fresh else lock
        if not lk.acquire(blocking=False):
            raise BenchError("pottery Redlock: acquire failed")
        lk.release()

    return Contender("pottery", "pottery Redlock (1 master)", "cycle", op)


def sherlock_lock(url: str, fresh: bool) -> Contender:
    """sherlock's RedisLock on a client for the same server."""
    import sherlock  # type: ignore[import-untyped]

    r = _client(url)
    name = "bench-sherlock"

    def make() -> Any:
        return sherlock.RedisLock(name, client=r, expire=int(TTL))

    lock = make()

    def op() -> None:
        lk = make() if fresh else lock
        if not lk.acquire(blocking=False):
            raise BenchError("sherlock: acquire failed")
        lk.release()

    return Contender("sherlock", "sherlock RedisLock", "cycle", op)


def fenced_claim(url: str, fresh: bool, beat: bool, name: str = "") -> Contender:
    """fenced's Claim: one acquire script (lease + fence), one release script."""
    r = _client(url)
    name = name or f"bench:fenced:{'hb' if beat else 'nohb'}"
    claim = Claim(r, name, ttl=TTL, heartbeat=beat)

    def op() -> None:
        c = Claim(r, name, ttl=TTL, heartbeat=beat) if fresh else claim
        if not c.acquire():
            raise BenchError("fenced: acquire failed")
        if not c.release():
            raise BenchError("fenced: release failed")

    if beat:
        return Contender("fenced_heartbeat", "fenced Claim, heartbeat on", "cycle", op)
    return Contender("fenced", "fenced Claim, heartbeat off", "cycle", op)


def fenced_metrics(url: str, fresh: bool) -> Contender:
    """fenced's Claim (heartbeat off) with fenced.metrics subscribed to its events."""
    from prometheus_client import CollectorRegistry

    from fenced import events
    from fenced.metrics import ClaimMetrics

    metrics = ClaimMetrics(CollectorRegistry())
    cycle = fenced_claim(url, fresh, False, name="bench:fenced:metrics")
    label = "fenced Claim, heartbeat off, fenced.metrics on"
    count = metrics.subscriber  # what fenced.metrics.install() subscribes
    return Contender(
        "fenced_metrics", label, "cycle", cycle.op, "fenced", lambda: events.subscribe(count)
    )


def fenced_events(url: str, fresh: bool) -> Contender:
    """fenced's Claim (heartbeat off) with a subscriber that does nothing: what building
    and sending the events costs, without metrics."""
    from fenced import events

    def nothing(event: object) -> None:
        pass

    cycle = fenced_claim(url, fresh, False, name="bench:fenced:events")
    label = "fenced Claim, heartbeat off, a no-op event subscriber"
    return Contender(
        "fenced_events", label, "cycle", cycle.op, "fenced", lambda: events.subscribe(nothing)
    )


def fenced_skip(url: str, fresh: bool) -> Contender:
    """fenced: an acquire that loses to a live holder (returns its holder and fence)."""
    name = "bench:fenced:skip"
    holder = Claim(_client(url), name, ttl=3600, heartbeat=False)
    if not holder.acquire():
        raise BenchError("fenced skip: holder could not acquire")
    r = _client(url)
    claim = Claim(r, name, ttl=TTL)

    def op() -> None:
        c = Claim(r, name, ttl=TTL) if fresh else claim
        if c.acquire():
            raise BenchError("fenced skip: acquire succeeded under a live holder")

    return Contender("fenced_skip", "fenced Claim, skipped (held elsewhere)", "skip", op, "fenced")


def redis_py_skip(url: str, fresh: bool) -> Contender:
    """redis-py Lock: an acquire that loses to a live holder."""
    name = "bench:redis-py:skip"
    holder = _client(url).lock(name, timeout=3600)
    if not holder.acquire(blocking=False):
        raise BenchError("redis-py skip: holder could not acquire")
    r = _client(url)
    lock = r.lock(name, timeout=TTL)

    def op() -> None:
        lk = r.lock(name, timeout=TTL) if fresh else lock
        if lk.acquire(blocking=False):
            raise BenchError("redis-py skip: acquire succeeded under a live holder")

    label = "redis-py Lock, skipped (held elsewhere)"
    return Contender("redis_py_lock_skip", label, "skip", op, BASELINE)


def _makers(url: str, fresh: bool) -> list[tuple[str, Callable[[], Contender]]]:
    """Every contender's key, and how to set it up (nothing is set up until called)."""
    return [
        ("raw_floor", lambda: raw_floor(url, fresh)),
        (BASELINE, lambda: redis_py_lock(url, fresh)),
        ("python_redis_lock", lambda: python_redis_lock(url, fresh, False)),
        ("python_redis_lock_renew", lambda: python_redis_lock(url, fresh, True)),
        ("pottery", lambda: pottery_redlock(url, fresh)),
        ("sherlock", lambda: sherlock_lock(url, fresh)),
        ("fenced", lambda: fenced_claim(url, fresh, False)),
        ("fenced_heartbeat", lambda: fenced_claim(url, fresh, True)),
        ("fenced_metrics", lambda: fenced_metrics(url, fresh)),
        ("fenced_events", lambda: fenced_events(url, fresh)),
        ("fenced_skip", lambda: fenced_skip(url, fresh)),
        ("redis_py_lock_skip", lambda: redis_py_skip(url, fresh)),
    ]


#: The keys ``--only`` takes.
CONTENDERS = tuple(key for key, _make in _makers("", False))


def build(
    url: str, fresh: bool, only: set[str] | None = None, metrics: bool = False
) -> tuple[list[Contender], dict[str, str]]:
    """Every contender that can run here (of ``only``, and the baseline), and why not the others.

    The metrics contender runs with ``metrics`` (or when ``only`` names it).
    """
    out: list[Contender] = []
    missing: dict[str, str] = {}
    for key, make in _makers(url, fresh):
        if only is not None and key not in only | {BASELINE}:
            continue
        if key in ("fenced_metrics", "fenced_events") and not metrics and only is None:
            continue
        try:
            out.append(make())
        except ImportError as exc:
            extra = "metrics" if key == "fenced_metrics" else "bench"
            missing[key] = f"not installed ({exc.name}): make install adds the {extra} extra"
    return out, missing


def calibrate(
    server: RedisServer,
    op: Callable[[], object],
    n: int = 300,
    around: Callable[[], Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Round trips the client makes and server CPU seconds, per operation (untimed pass)."""
    from redis.connection import AbstractConnection

    undo = around() if around is not None else None

    probe = server.client()
    sent = [0]
    original = AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        original(self, command, check_health)  # type: ignore[no-untyped-call]

    before = server_cpu(probe)
    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        for _ in range(n):
            op()
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
        if undo is not None:
            undo()
    used = server_cpu(probe) - before
    probe.close()
    return {"round_trips_per_op": sent[0] / n, "server_cpu_s_per_op": used / n}


# -- the heartbeat under many claims ------------------------------------------------------


def heartbeat_cost(
    server: RedisServer, n: int, ttl: float, intervals: int, settle: int = 2
) -> dict[str, Any]:
    """Hold ``n`` claims in this process and measure what renewing them costs."""
    r = server.client()
    probe = server.client()
    hb = heartbeat()
    claims = [Claim(r, f"bench:held:{i}", ttl=ttl) for i in range(n)]
    every = claims[0].refresh_every

    t0 = time.perf_counter()
    for c in claims:
        if not c.acquire():
            raise BenchError("heartbeat: a held claim could not be acquired")
    acquire_s = time.perf_counter() - t0
    # The claims were acquired over a second or more, so their renewals start out in
    # several groups; give the groups a few intervals to merge into their steady state.
    time.sleep(settle * every)

    # Meanwhile tick: how late a 2 ms sleep wakes shows how long a renewal round keeps
    # the application's own threads waiting; a PING every ~10 ms (a small load on the
    # server, counted in its CPU) shows how long Redis makes them wait.
    worst = worst_ping = 0.0
    ticks = 0

    def tick() -> None:
        nonlocal worst, worst_ping, ticks
        before = time.monotonic()
        time.sleep(0.002)
        woke = time.monotonic()
        worst = max(worst, woke - before - 0.002)
        ticks += 1
        if ticks % 5 == 0:
            probe.ping()
            worst_ping = max(worst_ping, time.monotonic() - woke)

    def after_next_round() -> None:
        # Wait for a round to start, then a while for it to finish: windows that begin
        # and end between rounds count whole rounds only.
        seen = hb.rounds
        while hb.rounds == seen:
            tick()
        until = time.monotonic() + every * 0.3
        while time.monotonic() < until:
            tick()

    after_next_round()
    rounds0, trips0 = hb.rounds, hb.round_trips
    evalsha0 = evalsha_calls(probe)
    srv0 = server_cpu(probe)
    cpu0 = time.process_time()
    me0 = resource.getrusage(resource.RUSAGE_THREAD)
    wall0 = time.monotonic()
    worst = worst_ping = 0.0
    while time.monotonic() < wall0 + (intervals - 0.5) * every:
        tick()
    after_next_round()
    wall = time.monotonic() - wall0
    me1 = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = time.process_time() - cpu0
    srv = server_cpu(probe) - srv0
    evalsha = evalsha_calls(probe) - evalsha0
    rounds, trips = hb.rounds - rounds0, hb.round_trips - trips0
    # This thread's own CPU (the ticks) is not the heartbeat's.
    ticker = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)

    lost = sum(1 for c in claims if c.lost)
    t0 = time.perf_counter()
    for c in claims:
        c.release()
    release_s = time.perf_counter() - t0
    r.close()
    probe.close()
    per = wall / every
    return {
        "claims": n,
        "ttl_s": ttl,
        "refresh_every_s": every,
        "intervals": round(per, 2),
        "rounds_per_interval": rounds / per,
        "round_trips_per_interval": trips / per,
        "refreshes_per_claim_per_interval": evalsha / n / per,
        "process_cpu_s_per_interval": max(0.0, cpu - ticker) / per,
        "server_cpu_s_per_interval": srv / per,
        "worst_stall_ms": worst * 1000,
        "worst_ping_ms": worst_ping * 1000,
        "lost": lost,
        "acquire_per_s": n / acquire_s,
        "release_per_s": n / release_s,
        "heartbeat_threads": sum(1 for t in threading.enumerate() if t.name == "fenced-heartbeat"),
    }


# -- report -------------------------------------------------------------------------------


def report(
    contenders: list[Contender],
    rates: dict[str, Rates],
    calib: dict[str, dict[str, float]],
    missing: dict[str, str],
) -> list[dict[str, Any]]:
    """One row per contender, with ratios."""
    base = rates.get(BASELINE)
    rows: list[dict[str, Any]] = []
    for c in contenders:
        rt = rates[c.key]
        vs_base = paired_ratio(rt, base) if base else None
        own = rates.get(c.cycle) if c.cycle else None
        vs_own = paired_ratio(rt, own) if own else None
        rows.append(
            {
                "key": c.key,
                "label": c.label,
                "kind": c.kind,
                "ops_per_s": rt.median,
                "low": rt.low,
                "high": rt.high,
                "us_per_op": 1e6 / rt.median if rt.median else None,
                # Median of the per-round ratios, with its quartiles.
                "ratio_to_redis_py_lock": vs_base[0] if vs_base else None,
                "ratio_to_redis_py_lock_iqr": list(vs_base[1:]) if vs_base else None,
                # A skipped path against its own library's full cycle.
                "ratio_to_own_cycle": vs_own[0] if vs_own else None,
                "ratio_to_own_cycle_iqr": list(vs_own[1:]) if vs_own else None,
                "client_cpu_us_per_op": rt.cpu * 1e6,
                "server_cpu_us_per_op": calib[c.key]["server_cpu_s_per_op"] * 1e6,
                "round_trips_per_op": calib[c.key]["round_trips_per_op"],
                "per_round": rt.per_round,
            }
        )
    for key, why in missing.items():
        rows.append({"key": key, "label": key, "kind": "missing", "note": why})
    return rows


def targets(rows: list[dict[str, Any]], beat: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The performance targets, each with the measured value."""
    by = {r["key"]: r for r in rows if r["kind"] != "missing"}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, unit: str = "x") -> None:
        if value is not None:
            out.append(
                {"target": name, "value": value, "goal": goal, "unit": unit, "met": value >= goal}
            )

    if "fenced" in by:
        add("fenced (heartbeat off) vs redis-py Lock", by["fenced"]["ratio_to_redis_py_lock"], 1.0)
    if "fenced_heartbeat" in by:
        add(
            "fenced (heartbeat on) vs redis-py Lock",
            by["fenced_heartbeat"]["ratio_to_redis_py_lock"],
            0.95,
        )
    if "fenced_skip" in by:
        add("fenced skipped path vs fenced cycle", by["fenced_skip"]["ratio_to_own_cycle"], 1.8)
    if "fenced_metrics" in by:
        add(
            "fenced with fenced.metrics vs without",
            by["fenced_metrics"]["ratio_to_own_cycle"],
            METRICS_GOAL,
        )
    if beat is not None:
        trips = beat["round_trips_per_interval"]
        out.append(
            {
                "target": f"{beat['claims']:,} held claims: round trips per interval",
                "value": trips,
                "goal": "a few (≤ claims/1000 + 4)",
                "unit": "",
                "met": trips <= beat["claims"] / 1000 + 4 and beat["lost"] == 0,
            }
        )
    return out


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    info, settings = result["info"], result["settings"]
    lines = [
        machine_line("claim_cycle", info),
        f"{settings['rounds']} interleaved rounds x {settings['seconds']} s per contender, "
        f"medians shown; one client, one name per contender; ttl {TTL:g} s; "
        + ("a new lock object per cycle" if settings["fresh"] else "one lock object reused"),
        "",
    ]
    rows = []
    for r in result["rows"]:
        if r["kind"] == "missing":
            rows.append([r["label"], "-", "-", "-", "-", "-", "-", "-", "-", r["note"]])
            continue
        ratio, iqr = r["ratio_to_redis_py_lock"], r["ratio_to_redis_py_lock_iqr"]
        note = ""
        if r["ratio_to_own_cycle"] is not None:
            lo, hi = r["ratio_to_own_cycle_iqr"]
            versus = "its own cycle"
            if r["key"] in ("fenced_metrics", "fenced_events"):
                versus = "no subscriber"
            note = f"{r['ratio_to_own_cycle']:.2f}x {versus} ({lo:.2f}-{hi:.2f})"
        rows.append(
            [
                r["label"],
                f"{r['ops_per_s']:,.0f}",
                f"{r['low']:,.0f}-{r['high']:,.0f}",
                f"{r['us_per_op']:.0f}",
                f"{ratio:.2f}x" if ratio is not None else "-",
                f"{iqr[0]:.2f}-{iqr[1]:.2f}" if iqr else "-",
                f"{r['round_trips_per_op']:.0f}",
                f"{r['client_cpu_us_per_op']:.0f}",
                f"{r['server_cpu_us_per_op']:.0f}",
                note,
            ]
        )
    lines.append(
        table(
            [
                "contender",
                "ops/s",
                "rounds min-max",
                "µs/op",
                "vs redis-py",
                "(quartiles)",
                "trips",
                "cpu µs",
                "srv µs",
                "",
            ],
            rows,
            right={1, 2, 3, 4, 5, 6, 7, 8},
        )
    )
    lines.append(
        "vs redis-py: median over rounds of the round's ratio, with its quartiles; trips: "
        "round trips per op;\ncpu µs: this process's CPU per op; srv µs: redis-server CPU "
        "per op (both include the kernel's network work)"
    )
    beat = result.get("heartbeat")
    if beat:
        lines += [
            "",
            f"heartbeat: {beat['claims']:,} claims held by one process, ttl {beat['ttl_s']:g} s, "
            f"refresh every {beat['refresh_every_s']:.2f} s, "
            f"measured over {beat['intervals']:.1f} intervals",
            f"  per refresh interval: {beat['round_trips_per_interval']:.1f} pipelined round trips "
            f"in {beat['rounds_per_interval']:.1f} rounds, "
            f"{beat['refreshes_per_claim_per_interval']:.2f} refreshes per claim",
            f"  CPU per interval: process {beat['process_cpu_s_per_interval'] * 1000:.0f} ms "
            f"({beat['process_cpu_s_per_interval'] / beat['refresh_every_s']:.1%} of a core), "
            f"redis-server {beat['server_cpu_s_per_interval'] * 1000:.0f} ms",
            f"  another thread of the process: worst wake-up delay "
            f"{beat['worst_stall_ms']:.1f} ms, worst PING {beat['worst_ping_ms']:.1f} ms; "
            f"claims lost: {beat['lost']}; heartbeat threads: {beat['heartbeat_threads']}",
            f"  (acquiring them: {beat['acquire_per_s']:,.0f}/s, "
            f"releasing: {beat['release_per_s']:,.0f}/s)",
        ]
    lines += ["", "targets:"]
    for t in result["targets"]:
        value = f"{t['value']:.2f}{t['unit']}"
        goal = f">= {t['goal']}{t['unit']}" if isinstance(t["goal"], float) else t["goal"]
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {value} ({goal})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="about fifteen seconds instead of a minute"
    )
    ap.add_argument("--rounds", type=int, help="interleaved rounds per contender")
    ap.add_argument("--seconds", type=float, help="length of one round")
    ap.add_argument("--held", type=int, default=10_000, help="claims held for the heartbeat cost")
    ap.add_argument("--no-heartbeat-cost", action="store_true", help="skip the held-claims part")
    ap.add_argument("--fresh", action="store_true", help="construct a new lock object per cycle")
    ap.add_argument("--only", help="comma-separated contender keys (the baseline is always run)")
    ap.add_argument(
        "--metrics",
        action="store_true",
        help="also fenced with fenced.metrics on, against fenced with it off (ratio)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    only = None
    if args.only is not None:
        only = {k.strip() for k in args.only.split(",") if k.strip()}
        unknown = sorted(only - set(CONTENDERS))
        if unknown or not only:
            ap.error(
                f"--only {args.only!r}: no contender {', '.join(unknown) or 'named'}; "
                f"choose from {', '.join(CONTENDERS)}"
            )
        if args.metrics or "fenced_metrics" in only:
            # The pair whose ratio is the point, and the events' own share of it.
            only |= {"fenced", "fenced_metrics", "fenced_events"}

    # Many short rounds: a neighbour's burst of CPU then spans several contenders of
    # one round instead of one contender's whole measurement.
    rounds = args.rounds or (10 if args.quick else 36)
    seconds = args.seconds or (0.04 if args.quick else 0.1)
    beat_ttl, beat_intervals, settle = (1.5, 3, 3) if args.quick else (6.0, 4, 3)
    calib_ops = 200 if args.quick else 1000

    # Peers log or warn on paths that are normal here (pottery logs each release).
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)

    def say(msg: str) -> None:
        if not args.json:
            print(f"  {msg}", file=sys.stderr, flush=True)

    server = start_server()
    try:
        info = machine_info(server)
        contenders, missing = build(server.url, args.fresh, only, args.metrics)
        say(f"redis-server {info['redis_server']} on {server.url}; measuring {len(contenders)}")
        calib = {c.key: calibrate(server, c.op, calib_ops, c.around) for c in contenders}
        gc.collect()
        rates = interleave(
            {c.key: c.op for c in contenders},
            around={c.key: c.around for c in contenders if c.around is not None},
            rounds=rounds,
            seconds=seconds,
            warmup=0.05 if args.quick else 0.1,
            progress=say,
        )
        beat = None
        if not args.no_heartbeat_cost and args.held > 0:
            say(f"holding {args.held:,} claims for the heartbeat cost")
            beat = heartbeat_cost(server, args.held, beat_ttl, beat_intervals, settle)
        info["loadavg_end"] = list(os.getloadavg())
        rows = report(contenders, rates, calib, missing)
        result = {
            "info": info,
            "settings": {
                "rounds": rounds,
                "seconds": seconds,
                "ttl_s": TTL,
                "fresh": args.fresh,
                "pid": os.getpid(),
            },
            "rows": rows,
            "heartbeat": beat,
            "targets": targets(rows, beat),
        }
    finally:
        server.stop()
    print(json.dumps(result, indent=2) if args.json else render(result))
    # A missed target is a failed run, for `make bench` and CI alike.
    return 0 if all(t["met"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
