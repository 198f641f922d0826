"""Tasks per second through one real Celery worker, fenced beside its peers.

One ``celery worker`` (prefork, concurrency 2) on a redis-server this script starts;
contenders take turns in short rounds (interleaved, so a noisy neighbour hurts all of
them alike) and the median rate of each is reported as a ratio to the plain task.
Every task's body is one INCR; what each contender adds, in round trips per task:

    plain            none (the body's INCR is the worker's one round trip)
    fenced           ClaimedTask, 2 in the worker: ACQUIRE (lease, fence, "started"
                     run record) and RELEASE (compare-token delete, "finished" run
                     record with the outcome, done marker of the task id); heartbeat
                     registration in process, no round trip for a run this short
    fenced enqueue   the same with claim_enqueue="until_finished" (deduplicated at
                     enqueue, as celery-once): 1 in the producer (the marker, set in
                     apply_async) and still 2 in the worker, ACQUIRE and RELEASE
                     handling the marker too (it restarts its expiry, then clears it)
    celery-once      QueueOnce, 1 in the producer (its lock, taken in apply_async) and
                     1 in the worker (the lock deleted after return)
    celery-singleton Singleton, 1 in the producer (SET NX in apply_async) and 1 in the
                     worker (the lock deleted on success)
    redis-py Lock    a task wrapped by hand in redis-py's Lock, 2 in the worker (SET NX
                     PX, compare-and-delete script)

A round's rate is its tasks over the time from its first ``apply_async`` to its last
task counted done. The producer (this process) enqueues while the worker runs, so work
done at enqueue (where celery-once and celery-singleton take their locks) is inside
that time but overlaps the worker's: it counts as far as it slows the round down (the
machine's cores are shared by the producer, the worker and redis-server).

Each contender's claims are distinct (one per task), so nothing is skipped: this
measures what the protection costs when there is no conflict.

``--metrics`` adds ``fenced+metrics``: the same ClaimedTask on the same worker, whose
runs first subscribe :mod:`fenced.metrics` in their pool child (``fenced``'s runs take
it away again), so each child counts its claims in prometheus_client's multiprocess
files (``PROMETHEUS_MULTIPROC_DIR``, set for the whole worker); its rounds interleave
with the others and its rate is compared with ``fenced``'s, round by round. Two
workers would not do: the same task on two identical workers differed by up to 27%.
``--control`` runs ``fenced+metrics`` without subscribing (the method's own noise).

    python benchmarks/celery_throughput.py [--tasks 400] [--rounds 5] [--metrics] [--json]

``BENCH_PROFILE=DIR`` profiles each pool child of the worker (cProfile, one file per
child in DIR; see celery_bench_app.py).
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from fenced.testing import CeleryWorker, RedisServer  # noqa: E402

CONTENDERS = {
    "plain": "bench.plain",
    "fenced": "bench.fenced",
    "fenced enqueue": "bench.fenced_enqueue",
    "celery-once": "bench.once",
    "celery-singleton": "bench.singleton",
    "redis-py Lock": "bench.redis_lock",
}
#: With --metrics: the fenced task that subscribes fenced.metrics in its pool child.
METRICS = "fenced+metrics"
#: fenced.metrics may cost at most 3% of the tasks per second.
METRICS_GOAL = 0.97
#: fenced's ClaimedTask runs at least as fast as the same task under each of these, and
#: its worker CPU per task is at most the redis-py Lock's.
PEERS = ("redis-py Lock", "celery-once", "celery-singleton")
CPU_PEER = "redis-py Lock"
COUNTER = {
    "plain": "plain",
    "fenced": "fenced",
    "fenced enqueue": "fenced_enqueue",
    METRICS: "fenced_metrics",
    "celery-once": "once",
    "celery-singleton": "singleton",
    "redis-py Lock": "redis_lock",
}


def start_worker(url: str, metrics_dir: str | None = None) -> CeleryWorker:
    """The benchmark's worker; with ``metrics_dir``, its pool children count the
    ``fenced+metrics`` runs' claims there (``BENCH_METRICS``, inherited, says whether)."""
    env = dict(os.environ, BENCH_REDIS=url, PYTHONPATH=f"{HERE}:{HERE.parent / 'src'}")
    for name in ("FENCED_METRICS", "FENCED_METRICS_PORT", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    if metrics_dir is not None:
        env.update(PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    worker = CeleryWorker("celery_bench_app", name="bench", concurrency=2, cwd=HERE, env=env)
    return worker.start().ready(timeout=60)


def counted(metrics_dir: str) -> float:
    """Claims the metrics worker's children counted as acquired (read from their files)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=metrics_dir)
    return registry.get_sample_value("fenced_claims_acquired_total", {"label": "bench:{i}"}) or 0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_of(pid: int) -> float:
    """CPU seconds (user and system) a process has used, from /proc (0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _tree(pid: int) -> list[int]:
    """A process and its children (the worker's main process and its pool)."""
    pids = [pid]
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        pids.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def _server_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def one_round(
    app_mod: object, name: str, n: int, offset: int, worker_pids: Sequence[int] = ()
) -> tuple[float, dict[str, float]]:
    """One round: tasks per second, and CPU µs per task of the enqueue, worker and Redis."""
    import celery_bench_app as bench  # type: ignore[import-not-found]

    task = bench.app.tasks[CONTENDERS.get(name) or "bench.fenced_metrics"]
    key = f"done:{COUNTER[name]}"
    bench.counter.delete(key)
    worker_before = sum(_cpu_of(p) for p in worker_pids)
    server_before = _server_cpu(bench.counter)
    start = time.perf_counter()
    enqueue_before = time.process_time()
    for i in range(n):
        task.apply_async((offset + i,))
    enqueue = time.process_time() - enqueue_before
    deadline = time.monotonic() + 120
    while int(bench.counter.get(key) or 0) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: only {bench.counter.get(key)} of {n} finished")
        time.sleep(0.002)
    rate = n / (time.perf_counter() - start)
    cpu = {
        "enqueue": enqueue,
        "worker": sum(_cpu_of(p) for p in worker_pids) - worker_before,
        "redis": _server_cpu(bench.counter) - server_before,
    }
    return rate, {k: v / n * 1e6 for k, v in cpu.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400, help="tasks per contender per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="--tasks 150 --rounds 3")
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="also fenced with fenced.metrics on (same worker), against fenced (ratio)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="with --metrics: fenced+metrics without subscribing (the method's own noise)",
    )
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.rounds = 150, 3

    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        os.environ["BENCH_REDIS"] = url
        sys.path.insert(0, str(HERE))
        if args.metrics:  # the app (here and in the worker) defines fenced+metrics's task
            os.environ["BENCH_METRICS"] = "control" if args.control else "on"
        import celery_bench_app as bench

        available = [n for n in CONTENDERS if CONTENDERS[n] in bench.app.tasks]
        metrics_dir = tempfile.mkdtemp(prefix="fenced-bench-metrics-") if args.metrics else None
        worker = start_worker(url, metrics_dir)
        assert worker.proc is not None
        if args.metrics:
            available.insert(available.index("fenced") + 1, METRICS)
        pids = _tree(worker.proc.pid)  # prefork: the pool's children live as long as it
        tree = dict.fromkeys(available, pids)
        rates: dict[str, list[float]] = {n: [] for n in available}
        cpus: dict[str, list[dict[str, float]]] = {n: [] for n in available}
        try:
            for name in available:  # warm-up: imports, script loading, connections
                one_round(bench, name, 50, 10_000_000)
            offset = 0
            for r in range(args.rounds):
                order = available[r % len(available) :] + available[: r % len(available)]
                for name in order:
                    offset += args.tasks
                    rate, cpu = one_round(bench, name, args.tasks, offset, tree[name])
                    rates[name].append(rate)
                    cpus[name].append(cpu)
            if metrics_dir is not None and not args.control:
                # Every task the metrics worker ran was counted (the warm-up's too); each
                # pool child writes its counts to the files at least once a second.
                from fenced.metrics import FLUSH_SECONDS

                deadline = time.monotonic() + 5 * FLUSH_SECONDS
                while (seen := counted(metrics_dir)) < args.tasks * args.rounds:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fenced.metrics counted only {seen:.0f} claims")
                    time.sleep(0.1)
        finally:
            worker.stop(timeout=15)
            if metrics_dir is not None:
                shutil.rmtree(metrics_dir, ignore_errors=True)

    median = {n: statistics.median(v) for n, v in rates.items()}
    base = median["plain"]
    rows = [
        {
            "contender": n,
            "tasks_per_s": round(median[n], 1),
            "ratio_to_plain": round(median[n] / base, 3),
            "spread": [round(min(v), 1), round(max(v), 1)],
            "cpu_us_per_task": {
                part: round(statistics.median(c[part] for c in cpus[n]))
                for part in ("enqueue", "worker", "redis")
            },
        }
        for n, v in rates.items()
    ]
    targets = goals(rows)
    versus = None
    if args.metrics:
        ratios = sorted(a / b for a, b in zip(rates[METRICS], rates["fenced"]))
        versus = {
            "ratio": round(statistics.median(ratios), 3),
            "spread": [round(ratios[0], 3), round(ratios[-1], 3)],
            "goal": METRICS_GOAL,
        }
    targets_met = all(t["met"] for t in targets)
    if args.json:
        out = {
            "tasks": args.tasks,
            "rounds": args.rounds,
            "rows": rows,
            "targets": targets,
            "metrics": versus,
        }
        print(json.dumps(out, indent=2))
        metrics_met = versus is None or versus["ratio"] >= METRICS_GOAL
        return 0 if targets_met and metrics_met else 1
    print(f"one worker, prefork -c 2; {args.tasks} tasks x {args.rounds} interleaved rounds")
    print(
        f"{'contender':<18}{'tasks/s':>10}{'x plain':>10}   {'min..max':<11}"
        f"{'enqueue':>8}{'worker':>8}{'redis':>7}  cpu µs/task"
    )
    for row in rows:
        lo, hi = row["spread"]
        cpu = row["cpu_us_per_task"]
        print(
            f"{row['contender']:<18}{row['tasks_per_s']:>10.1f}"
            f"{row['ratio_to_plain']:>10.3f}   {f'{lo:.0f}..{hi:.0f}':<11}"
            f"{cpu['enqueue']:>8}{cpu['worker']:>8}{cpu['redis']:>7}"
        )
    print(
        "cpu µs/task, medians: enqueue = this process during apply_async; worker = the "
        "worker's processes over the round (/proc, in clock ticks); redis = redis-server"
    )
    for t in targets:
        print(f"[{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']} ({t['goal']})")
    if versus is not None:
        met = versus["ratio"] >= METRICS_GOAL
        lo, hi = versus["spread"]
        what = (
            "control: fenced+metrics's task without subscribing, vs fenced"
            if args.control
            else "fenced with fenced.metrics vs without"
        )
        print(
            f"[{'met' if met else 'MISSED'}] {what}: "
            f"{versus['ratio']:.3f}x (rounds {lo:.3f}..{hi:.3f}; >= {METRICS_GOAL}x)"
        )
        return 0 if met and targets_met else 1
    return 0 if targets_met else 1


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """fenced's targets against its peers of the same run (the medians of its rounds):
    its rate at least each peer's, its worker CPU per task at most the Lock's."""
    by = {row["contender"]: row for row in rows}
    fenced = by.get("fenced")
    if fenced is None:
        return []
    targets = []
    for peer in PEERS:
        if peer in by:
            mine, theirs = fenced["ratio_to_plain"], by[peer]["ratio_to_plain"]
            targets.append(
                {
                    "target": f"fenced as fast as {peer}",
                    "value": f"{mine:.3f}x plain",
                    "goal": f">= {theirs:.3f}x",
                    "met": mine >= theirs,
                }
            )
    if CPU_PEER in by:
        mine, theirs = (r["cpu_us_per_task"]["worker"] for r in (fenced, by[CPU_PEER]))
        targets.append(
            {
                "target": f"fenced's worker CPU per task at most {CPU_PEER}'s",
                "value": f"{mine} µs",
                "goal": f"<= {theirs} µs",
                "met": mine <= theirs,
            }
        )
    return targets


if __name__ == "__main__":
    sys.exit(main())
