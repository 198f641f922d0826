"""A debounced flood: the cost of one call as the burst grows (``claim_debounce``).

One sending process, a redis-server this script starts (broker in database 0, claims
in database 1), no worker: the burst never closes. For each burst size N, N calls of
one claim name (``task.delay(name, i)``) with a debounce of an hour. Reported per size:

    published   messages delivered to the worker: one per burst
    trips/call  round trips to the claims' Redis per call (EVALSHA calls)
    cmds/call   Redis commands served per call, those the script runs included
    µs/call     the sender's wall time per call, median of the calls of the burst
    p99 µs      its 99th percentile

Targets: one message per burst, one round trip and the same commands per call at every
size (exit 1 when one is missed). The µs are reported, not judged: on a shared machine
they follow its load more than the burst's size (the calls do the same work whatever
the size: the table's other columns say so).

Then, beside celery-once (``_once.py``), one Celery worker and a flood of ``--flood``
calls of one name 10 ms apart: fenced's task with ``claim_debounce="0.3s"`` and
celery-once's ``QueueOnce``, each call carrying its number. Per contender: calls,
messages published, calls refused when sent (celery-once's dropped triggers), runs,
whose arguments ran and whether the last call's did. Target: fenced runs once, with the
last call's arguments.

    python benchmarks/debounce_flood.py [--sizes 10,100,1000,10000] [--quick] [--json]
                                        [--flood 50] (--flood 0: no worker)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    evalsha_calls,
    load_once,
    machine_info,
    machine_line,
    start_server,
    table,
)

#: The Celery flood beside celery-once: its contenders (label: task), and the calls' gap.
FENCED = "fenced debounce"
FLOOD = {FENCED: "beside.fenced_debounce", "celery-once": "beside.once"}
GAP = 0.01


def commands(r: Any) -> int:
    """Commands a redis-server has served (every database), from INFO commandstats."""
    return sum(int(v.get("calls", 0)) for v in r.info("commandstats").values())


def lpushes(r: Any) -> int:
    return int(r.info("commandstats").get("cmdstat_lpush", {}).get("calls", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--quick", action="store_true", help="sizes 10,100,1000")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--flood", type=int, default=50, help="calls of the Celery flood")
    ns = parser.parse_args()
    sizes = [10, 100, 1000] if ns.quick else [int(s) for s in ns.sizes.split(",")]

    import redis
    from celery import Celery

    from fenced.celery import ClaimedTask

    server = start_server()
    try:
        base = server.url.rsplit("/", 1)[0]
        app = Celery("debounce_bench", broker=f"{base}/0", set_as_current=False)
        app.conf.update(
            fenced_redis_url=f"{base}/1",
            fenced_secret_key="debounce-benchmark-secret-0123456789",
            broker_connection_retry_on_startup=True,
        )

        @app.task(base=ClaimedTask, claim="doc:{doc}", claim_debounce="1h", shared=False)
        def reindex(doc: str, version: int) -> None: ...

        info = machine_info(server)
        stats = redis.Redis.from_url(f"{base}/0")
        reindex.delay("warm-up", 0)  # connections and scripts loaded
        rows: list[dict[str, Any]] = []
        for size in sizes:
            doc = uuid.uuid4().hex
            before, pushed, trips = commands(stats), lpushes(stats), evalsha_calls(stats)
            times = []
            for i in range(size):
                start = time.perf_counter()
                reindex.delay(doc, i)
                times.append(time.perf_counter() - start)
            # INFO itself is a command: the two reads are taken off.
            served = commands(stats) - before - 1
            trips = evalsha_calls(stats) - trips
            rows.append(
                {
                    "size": size,
                    "published": lpushes(stats) - pushed,
                    "trips_per_call": trips / size,
                    "cmds_per_call": (served - 1) / size,  # LPUSH of the one message aside
                    "us_per_call": statistics.median(times) * 1e6,
                    "p99_us": sorted(times)[int(len(times) * 0.99) - (size >= 100)] * 1e6,
                }
            )
        once = load_once(server) if ns.flood else None
        figures = once.beside(FLOOD, ns.flood, GAP, {FENCED: 1}) if once else {}
        info["loadavg_end"] = list(__import__("os").getloadavg())
    finally:
        server.stop()
    checks = {
        "one message per burst": all(r["published"] == 1 for r in rows),
        "one round trip per call": all(r["trips_per_call"] == 1 for r in rows),
        "commands per call flat": max(r["cmds_per_call"] for r in rows)
        - min(r["cmds_per_call"] for r in rows)
        < 0.5,
    }
    if FENCED in figures:
        fenced = figures[FENCED]
        checks["fenced runs once, with the last call"] = (
            fenced["runs"] == 1 and fenced["last_call_ran"]
        )
    if ns.json:
        out = {"machine": info, "rows": rows, "flood": figures, "targets": checks}
        print(json.dumps(out, indent=2))
    else:
        print(machine_line("debounce_flood.py", info))
        print(
            table(
                ["burst", "published", "trips/call", "cmds/call", "µs/call", "p99 µs"],
                [
                    [
                        str(r["size"]),
                        str(r["published"]),
                        f"{r['trips_per_call']:.2f}",
                        f"{r['cmds_per_call']:.2f}",
                        f"{r['us_per_call']:.0f}",
                        f"{r['p99_us']:.0f}",
                    ]
                    for r in rows
                ],
                {0, 1, 2, 3, 4, 5},
            )
        )
        if figures:
            print("\n" + once.report(figures, ns.flood, GAP, rate=False))
        for what, ok in checks.items():
            print(f"{'met' if ok else 'MISSED'}: {what}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
