"""What one Celery task run costs in its worker process: fenced against redis-py's Lock.

In one process, each contender's task is run the way a prefork pool child runs it
(Celery's own tracer, ``build_tracer``, with a delivered message's request: signals,
the request pushed, ``after_return``), with no broker in between, against a
redis-server this script starts. Contenders take turns in short chunks (interleaved, so
a noisy neighbour hurts all of them alike); the figures are medians over the chunks:

    wall µs/task   the run's time, round trips to Redis included
    cpu µs/task    this process's CPU (``time.process_time``): what the worker pays
    over plain     the same, less the plain task's (what the protection adds)

Every task's body is one INCR. Contenders: ``plain``, ``fenced`` (ClaimedTask,
``claim="bench:{i}"``) and ``redis-py Lock`` (the body wrapped by hand in
``client.lock(f"bench:{i}", timeout=30, blocking=False)``), as celery_bench_app.py
defines them.

    python benchmarks/task_overhead.py [--tasks 200] [--rounds 30] [--json]

``--profile FILE`` runs one contender's tasks alone (``--contender``, default fenced)
under cProfile and writes its stats.

``--callgrind NAME`` runs one contender's tasks alone inside ``functools.reduce``, for
counting the instructions they execute (deterministic where timings on a shared machine
are not), e.g. for 300 tasks, less the same for 100 (what the setup costs goes away)::

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \
        --callgrind-out-file=/tmp/cg.fenced.300 \
        python benchmarks/task_overhead.py --callgrind fenced --tasks 300
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

from fenced.testing import RedisServer  # noqa: E402


def make_app(url: str) -> tuple[Any, dict[str, Any]]:
    """The app and its tasks by contender."""
    import redis
    from celery import Celery

    from fenced.celery import ClaimedTask

    app = Celery("overhead", broker="memory://", set_as_current=False)
    app.conf.update(
        fenced_redis_url=f"{url}/2",
        task_ignore_result=True,
        task_acks_late=True,
        task_serializer="json",
        accept_content=["json"],
    )
    counter = redis.Redis.from_url(f"{url}/5")
    locks = redis.Redis.from_url(f"{url}/6")

    @app.task(name="bench.plain")
    def plain(i: int) -> None:
        counter.incr("done:plain")

    @app.task(base=ClaimedTask, bind=True, name="bench.fenced", claim="bench:{i}", claim_ttl=30)
    def fenced_task(self: Any, i: int) -> None:
        counter.incr("done:fenced")

    @app.task(name="bench.redis_lock")
    def redis_lock(i: int) -> None:
        with locks.lock(f"bench:{i}", timeout=30, blocking=False) as held:
            if held:
                counter.incr("done:redis_lock")

    app.finalize()
    tasks = {"plain": plain, "fenced": fenced_task, "redis-py Lock": redis_lock}
    return app, tasks


def tracers(app: Any, tasks: dict[str, Any]) -> dict[str, Any]:
    """Each task's tracer, built as a prefork pool child builds it."""
    from celery.app.trace import build_tracer

    return {
        name: build_tracer(task.name, app.tasks[task.name], app=app, hostname="bench@here")
        for name, task in tasks.items()
    }


def request_of(task: Any, task_id: str, i: int) -> dict[str, Any]:
    """A delivered message's request, as the worker hands it to the tracer."""
    return {
        "id": task_id,
        "task": task.name,
        "args": (i,),
        "kwargs": {},
        "retries": 0,
        "hostname": "bench@here",
        "is_eager": False,
        "delivery_info": {
            "exchange": "",
            "routing_key": "celery",
            "priority": 0,
            "redelivered": False,
        },
        "reply_to": None,
        "correlation_id": task_id,
    }


def chunk(trace: Any, task: Any, n: int, offset: int) -> tuple[float, float]:
    """Run ``n`` tasks; (wall, cpu) seconds."""
    ids = [str(uuid.uuid4()) for _ in range(n)]
    requests = [request_of(task, ids[k], offset + k) for k in range(n)]
    wall, cpu = time.perf_counter(), time.process_time()
    for k in range(n):
        args = requests[k]["args"]
        trace(ids[k], args, {}, requests[k])
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=200, help="tasks per chunk")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", help="profile one contender alone into this file")
    parser.add_argument("--contender", default="fenced", help="the one --profile runs")
    parser.add_argument("--callgrind", metavar="NAME", help="run one contender alone (see above)")
    args = parser.parse_args()
    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        app, tasks = make_app(url)
        traces = tracers(app, tasks)
        offset = 0
        for name in traces:  # warm-up: imports, scripts, connections
            chunk(traces[name], tasks[name], 100, 10_000_000 + offset)
            offset += 100
        if args.callgrind:
            import functools

            trace, task = traces[args.callgrind], tasks[args.callgrind]
            ids = [str(uuid.uuid4()) for _ in range(args.tasks)]
            requests = [request_of(task, ids[k], k) for k in range(args.tasks)]

            def one(_: Any, k: int) -> None:
                trace(ids[k], requests[k]["args"], {}, requests[k])

            functools.reduce(one, range(args.tasks), None)
            return 0
        if args.profile:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
            n, name = args.tasks * args.rounds, args.contender
            chunk(traces[name], tasks[name], n, 0)
            profile.disable()
            profile.dump_stats(args.profile)
            print(f"profile of {n} {name} tasks: {args.profile}")
            return 0
        wall: dict[str, list[float]] = {n: [] for n in traces}
        cpu: dict[str, list[float]] = {n: [] for n in traces}
        names = list(traces)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                w, c = chunk(traces[name], tasks[name], args.tasks, offset)
                offset += args.tasks
                wall[name].append(w / args.tasks * 1e6)
                cpu[name].append(c / args.tasks * 1e6)
    rows = {
        n: {
            "wall_us": round(statistics.median(wall[n]), 1),
            "cpu_us": round(statistics.median(cpu[n]), 1),
        }
        for n in traces
    }
    for n, row in rows.items():
        # Paired by round: the chunks of one round ran milliseconds apart.
        row["wall_over_plain"] = round(
            statistics.median(a - b for a, b in zip(wall[n], wall["plain"])), 1
        )
        row["cpu_over_plain"] = round(
            statistics.median(a - b for a, b in zip(cpu[n], cpu["plain"])), 1
        )
    if args.json:
        print(json.dumps({"tasks": args.tasks, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    print(f"in process, Celery's tracer; {args.tasks} tasks x {args.rounds} interleaved chunks")
    print(f"{'contender':<16}{'wall µs':>10}{'cpu µs':>10}{'wall +plain':>13}{'cpu +plain':>12}")
    for n, row in rows.items():
        print(
            f"{n:<16}{row['wall_us']:>10.1f}{row['cpu_us']:>10.1f}"
            f"{row['wall_over_plain']:>13.1f}{row['cpu_over_plain']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
