"""A flood of duplicate triggers while one long run holds their name, through one worker.

One ``celery worker`` (prefork, concurrency 2, prefetch 1) on a redis-server this script
starts. For each contender, one call starts a run that holds the name; then ``--triggers``
more calls with the same arguments arrive while it runs. Reported per contender:

    published    messages the broker received (LPUSH), the holder's included
    peak queue   the most messages waiting in the queue at once (LLEN, sampled)
    send         the sender's time for all the triggers
    dup work     the worker's time inside the duplicates it was handed (skips)
    drain        from the first trigger until every duplicate published was handled

Contenders:

    fenced run-time skip   ClaimedTask: each duplicate is delivered and skipped
    fenced until_finished  ClaimedTask with claim_enqueue="until_finished"
    celery-once            QueueOnce (graceful): a duplicate is not published
    celery-singleton       Singleton: a duplicate gets the queued task's AsyncResult

Exits 1 when fenced with claim_enqueue published more than one message per flood.

    python benchmarks/celery_flood.py [--triggers 1000] [--rounds 3] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _common import machine_info, machine_line, start_server, table  # noqa: E402

from fenced.testing import CeleryWorker  # noqa: E402

CONTENDERS = {
    "fenced run-time skip": "flood.fenced",
    "fenced until_finished": "flood.fenced_enqueue",
    "celery-once": "flood.once",
    "celery-singleton": "flood.singleton",
}
KEYS = {
    "fenced": "fenced run-time skip",
    "fenced_enqueue": "fenced until_finished",
    "once": "celery-once",
    "singleton": "celery-singleton",
}
#: The contender whose floods must publish one message each.
CHECKED = "fenced until_finished"
QUEUE = "celery"
#: The longest any wait of the benchmark lasts: past it, the run failed.
LIMIT = 300.0


def wait(what: str, check: Any) -> Any:
    deadline = time.monotonic() + LIMIT
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what}")
        time.sleep(0.002)


def lpushes(broker: Any) -> int:
    """LPUSH calls the server has served: Celery's Redis transport publishes with it."""
    return int(broker.info("commandstats").get("cmdstat_lpush", {}).get("calls", 0))


class Peak(threading.Thread):
    """The longest the queue got, sampled every millisecond until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        import redis

        self.client = redis.Redis.from_url(f"{url}/0")
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, int(self.client.llen(QUEUE)))
            time.sleep(0.001)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def flood(bench: Any, url: str, name: str, feed: str, triggers: int) -> dict[str, float]:
    """One holder, then the triggers; the figures of that flood."""
    import redis

    task = bench.app.tasks[CONTENDERS[name]]
    obs = bench.obs
    broker_client = redis.Redis.from_url(f"{url}/0")
    before = lpushes(broker_client)
    task.apply_async((feed,))
    wait("the holder to start", lambda: obs.get(f"holding:{feed}"))
    peak = Peak(url)
    peak.start()
    start = time.perf_counter()
    for _ in range(triggers):
        task.apply_async((feed,))
    sent = time.perf_counter() - start
    published = lpushes(broker_client) - before
    wait(
        "the duplicates to be handled",
        lambda: (
            int(obs.get(f"handled:{feed}") or 0) >= published - 1 and broker_client.llen(QUEUE) == 0
        ),
    )
    drain = time.perf_counter() - start
    top = peak.stop()
    busy = float(obs.get(f"dup_busy:{feed}") or 0.0)
    obs.set(f"go:{feed}", 1)
    wait("the holder to end", lambda: int(obs.get(f"handled:{feed}") or 0) >= published)
    broker_client.close()
    return {
        "published": published,
        "peak_queue": top,
        "send_s": sent,
        "dup_work_s": busy,
        "drain_s": drain,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--triggers", type=int, default=1000, help="duplicates per flood")
    parser.add_argument("--rounds", type=int, default=3, help="floods per contender")
    parser.add_argument("--quick", action="store_true", help="--triggers 200 --rounds 1")
    parser.add_argument("--only", help="contenders, comma-separated: " + ", ".join(KEYS))
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.quick:
        args.triggers, args.rounds = 200, 1
    args.names = list(CONTENDERS)
    if args.only:
        wanted = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in wanted if k not in KEYS]
        if unknown:
            parser.error(f"no contender {', '.join(unknown)}: choose from {', '.join(KEYS)}")
        args.names = [KEYS[k] for k in wanted]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    server = start_server()
    try:
        info = machine_info(server)
        url = f"redis://127.0.0.1:{server.port}"
        os.environ["BENCH_REDIS"] = url
        import celery_flood_app as bench  # type: ignore[import-not-found]

        names = [n for n in args.names if CONTENDERS[n] in bench.app.tasks]
        env = dict(os.environ, PYTHONPATH=f"{HERE}:{HERE.parent / 'src'}")
        worker = CeleryWorker("celery_flood_app", name="flood", concurrency=2, cwd=HERE, env=env)
        worker.start().ready(timeout=90)
        figures: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        try:
            for n, name in enumerate(names):  # warm-up: imports, scripts, connections
                flood(bench, url, name, f"warm-{n}", 5)
            for r in range(args.rounds):
                shift = r % len(names)
                for n, name in enumerate(names[shift:] + names[:shift]):
                    figures[name].append(flood(bench, url, name, f"r{r}-{n}", args.triggers))
        finally:
            worker.kill()
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        server.stop()
    rows = {
        name: {key: statistics.median(f[key] for f in runs) for key in runs[0]}
        | {"published_max": max(f["published"] for f in runs)}
        for name, runs in figures.items()
    }
    failed = CHECKED in rows and rows[CHECKED]["published_max"] > 1
    if args.json:
        out = {"info": info, "triggers": args.triggers, "rounds": args.rounds, "rows": rows}
        print(json.dumps(out | {"failed": failed}, indent=2))
    else:
        print(machine_line("celery_flood", info))
        print(
            f"one worker, prefork -c 2, prefetch 1; a holder, then {args.triggers} duplicate "
            f"triggers; median of {args.rounds} floods per contender"
        )
        print()
        headers = ["contender", "published", "peak queue", "send ms", "dup work ms", "drain s"]
        print(
            table(
                headers,
                [
                    [
                        name,
                        f"{row['published']:.0f}",
                        f"{row['peak_queue']:.0f}",
                        f"{row['send_s'] * 1000:.0f}",
                        f"{row['dup_work_s'] * 1000:.0f}",
                        f"{row['drain_s']:.2f}",
                    ]
                    for name, row in rows.items()
                ],
                right={1, 2, 3, 4, 5},
            )
        )
        if failed:
            print(f"\nMISSED: {CHECKED} published more than one message per flood")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
