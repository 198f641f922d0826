"""Acquire+release cycles per second on asyncio: fenced.aio beside redis.asyncio's Lock.

Starts its own redis-server (TCP on a free port; the system binary when there is one)
and measures, in one run and on one event loop, interleaved (short rounds taken in
turn, median of the rounds), one task doing acquire+release on one name per contender:

* a raw floor: ``SET NX PX`` then a compare-and-delete script by EVALSHA;
* ``redis.asyncio.lock.Lock`` (the baseline);
* ``fenced.aio.Lock`` (the drop-in, minting a fence);
* ``fenced.aio.Claim`` with the renewer off and on (the fence and, with ``--records``,
  the run records are written either way), and as ``async with claim:``;
* the renewer's cost for many claims held on one loop: pipelined round trips and CPU
  per refresh interval.

Run: ``python benchmarks/aio_cycle.py`` (about half a minute), ``--quick`` (about ten
seconds), ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis.asyncio as aredis
from _common import Rates, machine_info, machine_line, paired_ratio, start_server, table

from fenced import aio

TTL = 30.0
BASELINE = "redis_py_lock"
Op = Callable[[], Awaitable[object]]

_RELEASE_SRC = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class BenchError(RuntimeError):
    """A contender did not do what it is measured doing (a bug in the benchmark)."""


async def contenders(r: Any, records: bool) -> dict[str, tuple[str, Op]]:
    """Every measured cycle: key -> (label, one acquire+release)."""
    sha = await r.script_load(_RELEASE_SRC)
    px = int(TTL * 1000)

    async def raw_floor() -> None:
        token = secrets.token_hex(16)
        if not await r.set("bench:raw", token, nx=True, px=px):
            raise BenchError("raw floor: SET NX failed")
        if await r.evalsha(sha, 1, "bench:raw", token) != 1:
            raise BenchError("raw floor: compare-and-delete failed")

    redis_lock = r.lock("bench:redis-py", timeout=TTL)

    async def redis_py_lock() -> None:
        if not await redis_lock.acquire(blocking=False):
            raise BenchError("redis-py Lock: acquire failed")
        await redis_lock.release()

    fenced_lock = aio.Lock(r, "bench:fenced-lock", timeout=TTL)

    async def fenced_aio_lock() -> None:
        if not await fenced_lock.acquire(blocking=False):
            raise BenchError("fenced.aio.Lock: acquire failed")
        await fenced_lock.release()

    def claim_cycle(name: str, heartbeat: bool) -> Op:
        claim = aio.Claim(r, name, ttl=TTL, heartbeat=heartbeat, records=records)

        async def op() -> None:
            if not await claim.acquire():
                raise BenchError(f"{name}: acquire failed")
            if not await claim.release():
                raise BenchError(f"{name}: release failed")

        return op

    block_claim = aio.Claim(r, "bench:claim-block", ttl=TTL, records=records)

    async def claim_block() -> None:
        async with block_claim:
            pass

    return {
        "raw_floor": ("raw floor (SET NX PX + EVALSHA del)", raw_floor),
        BASELINE: ("redis.asyncio Lock", redis_py_lock),
        "fenced_aio_lock": ("fenced.aio.Lock", fenced_aio_lock),
        "claim": ("fenced.aio.Claim, renewer off", claim_cycle("bench:claim", False)),
        "claim_hb": ("fenced.aio.Claim, renewer on", claim_cycle("bench:claim-hb", True)),
        "claim_block": ("async with fenced.aio.Claim", claim_block),
    }


async def timed(op: Op, seconds: float, chunk: int = 16) -> tuple[float, float]:
    """Run ``op`` for about ``seconds``; operations per second, CPU seconds per operation."""
    n = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(chunk):
            await op()
        n += chunk
        now = time.perf_counter()
        if now >= deadline:
            return n / (now - start), (time.process_time() - cpu) / n


async def interleave(
    ops: dict[str, Op], rounds: int, seconds: float, say: Callable[[str], None]
) -> dict[str, Rates]:
    """Measure every op in turn, ``rounds`` times for ``seconds`` each (as _common does)."""
    names = list(ops)
    results = {name: Rates(name) for name in names}
    for name in names:  # connections open, scripts cached, code paths warm
        await timed(ops[name], 0.05)
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            rate, cpu = await timed(ops[name], seconds)
            results[name].per_round.append(rate)
            results[name].cpu_per_op.append(cpu)
        say(f"round {i + 1}/{rounds}")
    return results


async def renewer_cost(r: Any, held: int, ttl: float, intervals: int) -> dict[str, Any]:
    """Hold ``held`` claims on this loop; what renewing them costs per refresh interval."""
    claims = [aio.Claim(r, f"bench:held:{i}", ttl=ttl) for i in range(held)]
    started = time.perf_counter()
    for c in claims:
        if not await c.acquire():
            raise BenchError("held claims: acquire failed")
    acquire_s = time.perf_counter() - started
    rn = aio.renewer()
    await asyncio.sleep(ttl / 3)  # settle into shared rounds
    trips, cpu, wall = rn.round_trips, time.process_time(), time.perf_counter()
    worst = 0.0
    end = wall + intervals * ttl / 3
    while time.perf_counter() < end:  # how late another task of the loop wakes
        before = time.perf_counter()
        await asyncio.sleep(0.01)
        worst = max(worst, time.perf_counter() - before - 0.01)
    wall = time.perf_counter() - wall
    per = wall / (ttl / 3)
    result = {
        "claims": held,
        "ttl_s": ttl,
        "refresh_every_s": ttl / 3,
        "intervals": per,
        "round_trips_per_interval": (rn.round_trips - trips) / per,
        "process_cpu_s_per_interval": (time.process_time() - cpu) / per,
        "worst_stall_ms": worst * 1000,
        "lost": sum(1 for c in claims if not c.held),
        "renewer_tasks": sum(1 for t in asyncio.all_tasks() if t.get_name() == "fenced-renewer"),
        "acquire_per_s": held / acquire_s,
    }
    for c in claims:
        await c.release()
    return result


def render(result: dict[str, Any]) -> str:
    """The report as text."""
    info = result["info"]
    lines = [
        machine_line("aio_cycle", info),
        f"{result['settings']['rounds']} interleaved rounds of "
        f"{result['settings']['seconds']:g} s, one task, one event loop, "
        f"records {'on' if result['settings']['records'] else 'off'}",
        "",
    ]
    rows = []
    for r in result["rows"]:
        ratio, iqr = r["ratio_to_redis_py_lock"], r["ratio_to_redis_py_lock_iqr"]
        rows.append(
            [
                r["label"],
                f"{r['ops_per_s']:,.0f}",
                f"{r['low']:,.0f}-{r['high']:,.0f}",
                f"{r['us_per_op']:.0f}",
                f"{ratio:.2f}x",
                f"{iqr[0]:.2f}-{iqr[1]:.2f}",
                f"{r['client_cpu_us_per_op']:.0f}",
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
                "cpu µs",
            ],
            rows,
            right={1, 2, 3, 4, 5, 6},
        )
    )
    lines.append(
        "vs redis-py: median over rounds of the round's ratio to redis.asyncio Lock, with "
        "its quartiles;\ncpu µs: this process's CPU per op"
    )
    cost = result.get("renewer")
    if cost:
        lines += [
            "",
            f"renewer: {cost['claims']:,} claims held on one loop, ttl {cost['ttl_s']:g} s, "
            f"refresh every {cost['refresh_every_s']:.2f} s, over {cost['intervals']:.1f} "
            "intervals",
            f"  per interval: {cost['round_trips_per_interval']:.1f} pipelined round trips, "
            f"process CPU {cost['process_cpu_s_per_interval'] * 1000:.0f} ms; worst wake-up "
            f"delay of another task {cost['worst_stall_ms']:.1f} ms; claims lost: "
            f"{cost['lost']}; renewer tasks: {cost['renewer_tasks']}",
            f"  (acquiring them: {cost['acquire_per_s']:,.0f}/s)",
        ]
    lines += ["", "targets:"]
    for t in result["targets"]:
        lines.append(
            f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f}x "
            f"(>= {t['goal']}x)"
        )
    return "\n".join(lines)


async def measure(args: argparse.Namespace, url: str, say: Callable[[str], None]) -> Any:
    r = aredis.from_url(url)
    try:
        ops = await contenders(r, args.records)
        gc.collect()
        rates = await interleave(
            {k: op for k, (_l, op) in ops.items()}, args.rounds, args.seconds, say
        )
        cost = None
        if args.held > 0:
            say(f"holding {args.held:,} claims for the renewer's cost")
            cost = await renewer_cost(r, args.held, args.held_ttl, 3)
        base = rates[BASELINE]
        rows = []
        for key, (label, _op) in ops.items():
            rt = rates[key]
            ratio = paired_ratio(rt, base)
            rows.append(
                {
                    "key": key,
                    "label": label,
                    "ops_per_s": rt.median,
                    "low": rt.low,
                    "high": rt.high,
                    "us_per_op": 1e6 / rt.median if rt.median else None,
                    "ratio_to_redis_py_lock": ratio[0],
                    "ratio_to_redis_py_lock_iqr": list(ratio[1:]),
                    "client_cpu_us_per_op": rt.cpu * 1e6,
                    "per_round": rt.per_round,
                }
            )
        return rows, cost
    finally:
        await r.aclose()


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals: the async claim and Lock cycles at least as fast as redis.asyncio's Lock."""
    by = {r["key"]: r for r in rows}
    out = []
    for key, goal in (("claim", 1.0), ("claim_hb", 1.0), ("fenced_aio_lock", 1.0)):
        value = by[key]["ratio_to_redis_py_lock"]
        out.append(
            {
                "target": f"{by[key]['label']} vs redis.asyncio Lock",
                "value": value,
                "goal": goal,
                "met": value >= goal,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about ten seconds")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per contender")
    ap.add_argument("--seconds", type=float, help="length of one round")
    ap.add_argument("--held", type=int, default=5000, help="claims held for the renewer cost")
    ap.add_argument("--records", action="store_true", help="claims write run records")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 30)
    args.seconds = args.seconds or (0.05 if args.quick else 0.1)
    args.held_ttl = 1.5 if args.quick else 3.0

    def say(msg: str) -> None:
        if not args.json:
            print(f"  {msg}", file=sys.stderr, flush=True)

    server = start_server()
    try:
        info = machine_info(server)
        say(f"redis-server {info['redis_server']} on {server.url}")
        rows, cost = asyncio.run(measure(args, server.url, say))
        info["loadavg_end"] = list(os.getloadavg())
        result = {
            "info": info,
            "settings": {"rounds": args.rounds, "seconds": args.seconds, "records": args.records},
            "rows": rows,
            "renewer": cost,
            "targets": targets(rows),
        }
    finally:
        server.stop()
    print(json.dumps(result, indent=2) if args.json else render(result))
    # A missed target is a failed run, for `make bench` and CI alike.
    return 0 if all(t["met"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
