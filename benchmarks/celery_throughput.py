"""Tasks per second through one real Celery worker, fenced beside its peers.

One ``celery worker`` (prefork, concurrency 2) on a redis-server this script starts;
contenders take turns in short rounds (interleaved, so a noisy neighbour hurts all of
them alike) and the median rate of each is reported as a ratio to the plain task:

    plain           no locking
    fenced          ClaimedTask: atomic fenced acquire, heartbeat, run records
    celery-once     QueueOnce (lock at enqueue, cleared after return)
    celery-singleton Singleton (lock at enqueue, cleared on success/failure)
    redis-py Lock   a task wrapped by hand in redis-py's Lock

Each contender's claims are distinct (one per task), so nothing is skipped: this
measures what the protection costs when there is no conflict.

    python benchmarks/celery_throughput.py [--tasks 400] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from fenced.testing import CeleryWorker, RedisServer  # noqa: E402

CONTENDERS = {
    "plain": "bench.plain",
    "fenced": "bench.fenced",
    "celery-once": "bench.once",
    "celery-singleton": "bench.singleton",
    "redis-py Lock": "bench.redis_lock",
}
COUNTER = {
    "plain": "plain",
    "fenced": "fenced",
    "celery-once": "once",
    "celery-singleton": "singleton",
    "redis-py Lock": "redis_lock",
}


def start_worker(url: str) -> CeleryWorker:
    env = dict(os.environ, BENCH_REDIS=url, PYTHONPATH=f"{HERE}:{HERE.parent / 'src'}")
    worker = CeleryWorker("celery_bench_app", name="bench", concurrency=2, cwd=HERE, env=env)
    return worker.start().ready(timeout=60)


def one_round(app_mod: object, name: str, n: int, offset: int) -> float:
    import celery_bench_app as bench  # type: ignore[import-not-found]

    task = bench.app.tasks[CONTENDERS[name]]
    key = f"done:{COUNTER[name]}"
    bench.counter.delete(key)
    start = time.perf_counter()
    for i in range(n):
        task.apply_async((offset + i,))
    deadline = time.monotonic() + 120
    while int(bench.counter.get(key) or 0) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: only {bench.counter.get(key)} of {n} finished")
        time.sleep(0.002)
    return n / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400, help="tasks per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="--tasks 150 --rounds 3")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.rounds = 150, 3

    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        os.environ["BENCH_REDIS"] = url
        sys.path.insert(0, str(HERE))
        import celery_bench_app as bench

        available = [n for n in CONTENDERS if CONTENDERS[n] in bench.app.tasks]
        worker = start_worker(url)
        rates: dict[str, list[float]] = {n: [] for n in available}
        try:
            for name in available:  # warm-up: imports, script loading, connections
                one_round(bench, name, 50, 10_000_000)
            offset = 0
            for r in range(args.rounds):
                order = available[r % len(available) :] + available[: r % len(available)]
                for name in order:
                    offset += args.tasks
                    rates[name].append(one_round(bench, name, args.tasks, offset))
        finally:
            worker.stop(timeout=15)

    median = {n: statistics.median(v) for n, v in rates.items()}
    base = median["plain"]
    rows = [
        {
            "contender": n,
            "tasks_per_s": round(median[n], 1),
            "ratio_to_plain": round(median[n] / base, 3),
            "spread": [round(min(v), 1), round(max(v), 1)],
        }
        for n, v in rates.items()
    ]
    if args.json:
        print(json.dumps({"tasks": args.tasks, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    print(f"one worker, prefork -c 2; {args.tasks} tasks x {args.rounds} interleaved rounds")
    print(f"{'contender':<18}{'tasks/s':>10}{'x plain':>10}   min..max")
    for row in rows:
        lo, hi = row["spread"]
        print(
            f"{row['contender']:<18}{row['tasks_per_s']:>10.1f}"
            f"{row['ratio_to_plain']:>10.3f}   {lo:.0f}..{hi:.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
