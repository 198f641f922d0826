"""Acquire+release cycles per second: fenced.Lock beside redis-py's Lock it replaces.

Starts its own redis-server (TCP on a free port; the system binary when there is one)
and measures, in one run and interleaved (short rounds taken in turn, median of the
rounds), one single-threaded client doing ``acquire(blocking=False)`` + ``release()``
on one name per contender:

* redis-py ``Lock`` (``r.lock(name, timeout=...)``), the baseline;
* ``fenced.Lock`` through the same call (``lock_class=fenced.Lock``): the fence is
  minted in the acquire script;
* ``fenced.Lock`` with ``auto_renew=True`` (each acquire joins the process heartbeat);
* ``fenced.Lock`` with redis-py's own token maker (``uuid.uuid1()``), to show where
  the time goes.

Run: ``python benchmarks/lock_cycle.py`` (about half a minute), ``--quick`` (about
five seconds), ``--fresh`` for a new lock object per cycle, ``--json`` for
machine-readable output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis
from _common import (
    Rates,
    interleave,
    machine_info,
    machine_line,
    paired_ratio,
    start_server,
    table,
)

import fenced
from fenced.testing import RedisServer

TIMEOUT = 30.0
BASELINE = "redis_py_lock"
#: fenced.Lock against redis-py's Lock, fence and all.
GOAL = 1.0


@dataclass
class Contender:
    """One measured acquire+release cycle."""

    key: str
    label: str
    op: Callable[[], object]


class BenchError(RuntimeError):
    """A contender did not do what it is measured doing (a bug in the benchmark)."""


class _Uuid1Lock(fenced.Lock):
    """fenced.Lock making its tokens as redis-py does, with ``uuid.uuid1()``."""

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        # Passed as a chosen token: only the retry branch of the acquire script, which
        # an uncontended cycle never reaches, tells the two apart.
        made = uuid.uuid1().hex.encode() if token is None else token
        return super().acquire(sleep, blocking, blocking_timeout, made)


def _cycle(client: Any, name: str, lock_class: Any, fresh: bool, **kwargs: Any) -> Any:
    def make() -> Any:
        if kwargs:  # options r.lock() does not pass on
            return lock_class(client, name, timeout=TIMEOUT, **kwargs)
        return client.lock(name, timeout=TIMEOUT, lock_class=lock_class)

    lock = make()

    def op() -> None:
        lk = make() if fresh else lock
        if not lk.acquire(blocking=False):
            raise BenchError(f"{name}: acquire failed")
        lk.release()

    return op


def build(url: str, fresh: bool) -> list[Contender]:
    """The contenders, each on its own client and name."""

    def client() -> Any:
        return redis.Redis.from_url(url)

    return [
        Contender(
            BASELINE,
            "redis-py Lock",
            _cycle(client(), "bench:redis-py", redis.lock.Lock, fresh),
        ),
        Contender(
            "fenced_lock",
            "fenced.Lock (fence minted)",
            _cycle(client(), "bench:fenced", fenced.Lock, fresh),
        ),
        Contender(
            "fenced_lock_renew",
            "fenced.Lock, auto_renew=True",
            _cycle(client(), "bench:fenced-renew", fenced.Lock, fresh, auto_renew=True),
        ),
        Contender(
            "fenced_lock_uuid1",
            "fenced.Lock with uuid.uuid1() tokens",
            _cycle(client(), "bench:fenced-uuid1", _Uuid1Lock, fresh),
        ),
    ]


def calibrate(server: RedisServer, op: Callable[[], object], n: int) -> dict[str, float]:
    """Round trips per cycle and the server's CPU seconds per cycle (an untimed pass)."""
    from redis.connection import AbstractConnection

    probe = server.client()
    sent = [0]
    original = AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        original(self, command, check_health)  # type: ignore[no-untyped-call]

    def server_cpu() -> float:
        info = probe.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    before = server_cpu()
    AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        for _ in range(n):
            op()
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
    used = server_cpu() - before
    probe.close()
    return {"round_trips_per_op": sent[0] / n, "server_cpu_s_per_op": used / n}


def report(
    contenders: list[Contender], rates: dict[str, Rates], calib: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    """One row per contender, with its ratio to redis-py's Lock."""
    base = rates[BASELINE]
    rows = []
    for c in contenders:
        rt = rates[c.key]
        ratio, q1, q3 = paired_ratio(rt, base)
        rows.append(
            {
                "key": c.key,
                "label": c.label,
                "ops_per_s": rt.median,
                "low": rt.low,
                "high": rt.high,
                "us_per_op": 1e6 / rt.median if rt.median else None,
                "ratio_to_redis_py_lock": ratio,
                "ratio_to_redis_py_lock_iqr": [q1, q3],
                "client_cpu_us_per_op": rt.cpu * 1e6,
                "server_cpu_us_per_op": calib[c.key]["server_cpu_s_per_op"] * 1e6,
                "round_trips_per_op": calib[c.key]["round_trips_per_op"],
                "per_round": rt.per_round,
            }
        )
    return rows


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    info, settings = result["info"], result["settings"]
    lines = [
        machine_line("lock_cycle", info),
        f"{settings['rounds']} interleaved rounds x {settings['seconds']} s per contender, "
        f"medians shown; one client, one name per contender; timeout {TIMEOUT:g} s; "
        + ("a new lock object per cycle" if settings["fresh"] else "one lock object reused"),
        "",
    ]
    rows = []
    for r in result["rows"]:
        q1, q3 = r["ratio_to_redis_py_lock_iqr"]
        rows.append(
            [
                r["label"],
                f"{r['ops_per_s']:,.0f}",
                f"{r['low']:,.0f}-{r['high']:,.0f}",
                f"{r['us_per_op']:.0f}",
                f"{r['ratio_to_redis_py_lock']:.2f}x",
                f"{q1:.2f}-{q3:.2f}",
                f"{r['round_trips_per_op']:.0f}",
                f"{r['client_cpu_us_per_op']:.0f}",
                f"{r['server_cpu_us_per_op']:.0f}",
            ]
        )
    headers = ["contender", "ops/s", "rounds min-max", "µs/op", "vs redis-py", "(quartiles)"]
    lines.append(
        table(
            [*headers, "trips", "cpu µs", "srv µs"],
            rows,
            right={1, 2, 3, 4, 5, 6, 7, 8},
        )
    )
    lines.append(
        "vs redis-py: median over rounds of the round's ratio, with its quartiles; trips: "
        "round trips per cycle;\ncpu µs: this process's CPU per cycle; srv µs: redis-server "
        "CPU per cycle"
    )
    t = result["target"]
    lines += [
        "",
        f"target: [{'met' if t['met'] else 'MISSED'}] fenced.Lock vs redis-py Lock: "
        f"{t['value']:.2f}x (>= {t['goal']}x)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per contender")
    ap.add_argument("--seconds", type=float, help="length of one round")
    ap.add_argument("--fresh", action="store_true", help="construct a new lock object per cycle")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)

    rounds = args.rounds or (10 if args.quick else 60)
    seconds = args.seconds or (0.05 if args.quick else 0.1)

    def say(msg: str) -> None:
        if not args.json:
            print(f"  {msg}", file=sys.stderr, flush=True)

    server = start_server()
    try:
        info = machine_info(server)
        contenders = build(server.url, args.fresh)
        say(f"redis-server {info['redis_server']} on {server.url}; measuring {len(contenders)}")
        calib = {c.key: calibrate(server, c.op, 200 if args.quick else 1000) for c in contenders}
        gc.collect()
        rates = interleave(
            {c.key: c.op for c in contenders},
            rounds=rounds,
            seconds=seconds,
            warmup=0.05 if args.quick else 0.1,
            progress=say if rounds <= 20 or args.quick else None,
        )
        info["loadavg_end"] = list(os.getloadavg())
        rows = report(contenders, rates, calib)
        value = next(r["ratio_to_redis_py_lock"] for r in rows if r["key"] == "fenced_lock")
        result = {
            "info": info,
            "settings": {
                "rounds": rounds,
                "seconds": seconds,
                "timeout_s": TIMEOUT,
                "fresh": args.fresh,
            },
            "rows": rows,
            "target": {"value": value, "goal": GOAL, "met": value >= GOAL},
        }
    finally:
        server.stop()
    print(json.dumps(result, indent=2) if args.json else render(result))
    # A missed target is a failed run, for `make bench` and CI alike.
    return 0 if result["target"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
