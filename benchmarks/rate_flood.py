"""The cost of a rate (``rate="10/m"``) per call: a flood of calls over the rate.

Starts its own redis-server and measures, interleaved (short rounds taken in turn,
median of the rounds), one single-threaded client on one name per lane:

* ``throttled``: an acquire of a free name whose rate allows no start yet (a call of
  the flood): one ACQUIRE that answers "rate limited" and writes nothing;
* ``busy``: an acquire of a name another holder has, without a rate (the skip path);
* ``cycle``, ``rate_cycle`` and ``window_cycle``: acquire+release without a rate,
  with one spread too fast to ever limit it (100000/s, ``rate_spread``), and with a
  window of 10000/s (a round of cycles stays under it): what counting a start adds.

Columns: ``ops/s`` (median over rounds), ``cpu µs`` (this process per operation),
``cmds`` (Redis commands per operation, from ``INFO commandstats``) and ``srv µs``
(the server's µs per operation in those commands, their ``usec`` summed).

Then, beside celery-once (``_once.py``), one Celery worker and a flood of ``--flood``
calls of one name 10 ms apart: fenced's task with ``claim_rate="10/s"`` (``delay``) and
celery-once's ``QueueOnce``. Per contender: calls, messages ``published`` (put-backs
included), calls ``refused`` when sent (celery-once's dropped triggers), ``runs``, whose
arguments ran, whether the last call's did, the least gap between two starts and the
runs' span. Targets: fenced runs every call, each put back once at most (exit 1 when
missed).

Run: ``python benchmarks/rate_flood.py`` (about 30 s), ``--quick`` (about 15 s),
``--json`` for machine-readable output, ``--flood 0`` for no worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import interleave, load_once, machine_info, machine_line, start_server, table

from fenced import Claim

#: The Celery flood beside celery-once: its contenders (label: task), and the calls' gap.
FENCED = "fenced rate/delay"
FLOOD = {FENCED: "beside.fenced_rate", "celery-once": "beside.once"}
GAP = 0.01


def _commands(r: Any) -> tuple[int, float]:
    """Commands served and their µs, summed over every command (INFO commandstats)."""
    stats = r.info("commandstats")
    return (
        sum(int(v["calls"]) for v in stats.values()),
        sum(float(v["usec"]) for v in stats.values()),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter, rougher")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--flood", type=int, default=20, help="calls of the Celery flood")
    args = parser.parse_args()
    rounds, seconds = (3, 0.3) if args.quick else (9, 0.5)
    server = start_server()
    try:
        r = server.client()
        held = Claim(r, "bench:busy", ttl=3600, heartbeat=False)
        held.acquire()
        first = Claim(r, "bench:throttled", rate="1/h", heartbeat=False)
        first.acquire()
        first.release()
        busy = Claim(r, "bench:busy", ttl=30, heartbeat=False)
        throttled = Claim(r, "bench:throttled", rate="1/h", heartbeat=False)
        plain = Claim(r, "bench:cycle", ttl=30, heartbeat=False)
        rated = Claim(
            r, "bench:rate_cycle", ttl=30, rate="100000/s", rate_spread=True, heartbeat=False
        )
        windowed = Claim(r, "bench:window_cycle", ttl=30, rate="10000/s", heartbeat=False)

        def cycle(claim: Claim) -> Callable[[], object]:
            def op() -> object:
                if claim.acquire():
                    claim.release()
                return None

            return op

        ops: dict[str, Callable[[], object]] = {
            "throttled": throttled.acquire,
            "busy": busy.acquire,
            "cycle": cycle(plain),
            "rate_cycle": cycle(rated),
            "window_cycle": cycle(windowed),
        }
        spent = {name: [0, 0.0, 0] for name in ops}  # commands, µs, operations

        def counting(name: str) -> Callable[[], Callable[[], object]]:
            op = ops[name]

            def counted() -> object:
                spent[name][2] += 1
                return op()

            ops[name] = counted

            def before() -> Callable[[], object]:
                calls, usec = _commands(r)

                def after() -> object:
                    now_calls, now_usec = _commands(r)
                    spent[name][0] += now_calls - calls - 1  # less the INFO itself
                    spent[name][1] += now_usec - usec
                    return None

                return after

            return before

        around = {name: counting(name) for name in list(ops)}
        info = machine_info(server)
        results = interleave(ops, rounds=rounds, seconds=seconds, around=around)
        info["loadavg_end"] = list(os.getloadavg())
        rows, out = [], {}
        for name, rates in results.items():
            calls, usec, n = spent[name]
            n = max(n, 1)
            figures = {
                "ops_per_s": statistics.median(rates.per_round),
                "cpu_us": statistics.median(rates.cpu_per_op) * 1e6,
                "commands": calls / n,
                "server_us": usec / n,
            }
            out[name] = figures
            rows.append(
                [
                    name,
                    f"{figures['ops_per_s']:,.0f}",
                    f"{figures['cpu_us']:.1f}",
                    f"{figures['commands']:.2f}",
                    f"{figures['server_us']:.1f}",
                ]
            )
        held.release()
        once = load_once(server) if args.flood else None
        figures = once.beside(FLOOD, args.flood, GAP, {FENCED: args.flood}) if once else {}
        checks = {}
        if FENCED in figures:
            fenced = figures[FENCED]
            checks = {
                "fenced ran every call": fenced["calls_run"] == fenced["calls"] == fenced["runs"],
                "each call put back once at most": fenced["published"] <= 2 * fenced["calls"],
            }
        if args.json:
            print(
                json.dumps(
                    {"machine": info, "lanes": out, "flood": figures, "targets": checks}, indent=2
                )
            )
        else:
            print(machine_line("rate_flood", info))
            print(table(["lane", "ops/s", "cpu µs", "cmds", "srv µs"], rows, {1, 2, 3, 4}))
            if figures:
                print("\n" + once.report(figures, args.flood, GAP, rate=True))
            for what, ok in checks.items():
                print(f"{'met' if ok else 'MISSED'}: {what}")
        return 0 if all(checks.values()) else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
