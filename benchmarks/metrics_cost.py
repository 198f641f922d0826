"""What events and fenced.metrics cost a claim cycle, in paired chunks of one claim.

One fenced ``Claim`` (heartbeat off) on a redis-server the script starts is acquired and
released in chunks of 32 cycles. Each pair of chunks runs once with nobody subscribed to
``fenced.events`` and once with a subscriber, in alternating order, on the same claim,
client and connection: only the subscriber differs, and the two chunks of a pair are
measured within milliseconds of each other. The figure is the median over pairs of the
pair's rate with the subscriber over its rate without (with its quartiles), and this
process's CPU per cycle (``time.process_time``) either way.

Subscribers: a no-op (what building and sending a cycle's two events costs),
``fenced.metrics`` with this process's own numbers, and ``fenced.metrics`` in
prometheus_client's multiprocess mode (the script sets ``PROMETHEUS_MULTIPROC_DIR`` to
a directory of its own before prometheus_client is imported). Target: each metrics
subscriber at least 0.97x (it costs at most 3%); exit 1 when one is missed.

    .venv/bin/python benchmarks/metrics_cost.py            # about a minute
    .venv/bin/python benchmarks/metrics_cost.py --pairs 300 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

FOLDER = tempfile.mkdtemp(prefix="fenced-bench-multiproc-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = FOLDER  # before prometheus_client is imported

from _common import machine_info, machine_line, start_server  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from fenced import Claim, events  # noqa: E402
from fenced.metrics import ClaimMetrics  # noqa: E402

CHUNK = 32
TARGET = 0.97


def _chunk(claim: Claim) -> tuple[float, float]:
    """Wall and CPU seconds of CHUNK cycles."""
    cpu, start = time.process_time(), time.perf_counter()
    for _ in range(CHUNK):
        if not claim.acquire():
            raise RuntimeError("acquire failed")
        claim.release()
    return time.perf_counter() - start, time.process_time() - cpu


def measure(claim: Claim, subscriber: Callable[[Any], None], pairs: int) -> dict[str, float]:
    """The paired comparison of one subscriber with nobody subscribed."""
    ratios, cpu_off, cpu_on = [], 0.0, 0.0
    for i in range(pairs):
        timed = {}
        for on in (i % 2 == 0, i % 2 == 1):
            undo = events.subscribe(subscriber) if on else None
            try:
                timed[on] = _chunk(claim)
            finally:
                if undo is not None:
                    undo()
        ratios.append(timed[False][0] / timed[True][0])
        cpu_off += timed[False][1]
        cpu_on += timed[True][1]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    cycles = pairs * CHUNK
    return {
        "ratio": median,
        "q1": q1,
        "q3": q3,
        "cpu_us_off": cpu_off / cycles * 1e6,
        "cpu_us_on": cpu_on / cycles * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=600, help="pairs of chunks per subscriber")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.pairs < 4:
        parser.error("--pairs must be at least 4")
    server = start_server()
    try:
        info = machine_info(server)
        client = server.client()
        claim = Claim(client, "bench:metrics-cost", ttl=30, heartbeat=False)
        own = ClaimMetrics(CollectorRegistry(), in_files=False)
        files = ClaimMetrics(CollectorRegistry(), in_files=True)
        subscribers: dict[str, Callable[[Any], None]] = {
            "a no-op subscriber": lambda event: None,
            "fenced.metrics, own numbers": own.subscriber,
            "fenced.metrics, multiprocess files": files.subscriber,
        }
        for _ in range(50):  # connections open, scripts cached
            _chunk(claim)
        results = {name: measure(claim, sub, args.pairs) for name, sub in subscribers.items()}
        files.unregister()
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        server.stop()
        shutil.rmtree(FOLDER, ignore_errors=True)
    missed = [n for n, r in results.items() if "metrics" in n and r["ratio"] < TARGET]
    if args.json:
        print(json.dumps({"machine": info, "pairs": args.pairs, "results": results}, indent=2))
    else:
        print(machine_line("metrics_cost", info))
        print(f"{args.pairs} pairs of {CHUNK}-cycle chunks per subscriber, one claim\n")
        print(f"{'subscriber':36} {'vs none':>8} {'quartiles':>12} {'cpu µs none / on':>18}")
        for name, r in results.items():
            quartiles = f"{r['q1']:.3f}-{r['q3']:.3f}"
            cpu = f"{r['cpu_us_off']:.1f} / {r['cpu_us_on']:.1f}"
            print(f"{name:36} {r['ratio']:>7.3f}x {quartiles:>12} {cpu:>18}")
        print("\ntargets:")
        for name, r in results.items():
            if "metrics" in name:
                mark = "met" if r["ratio"] >= TARGET else "MISSED"
                print(f"  [{mark}] {name} vs none: {r['ratio']:.3f}x (>= {TARGET}x)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
