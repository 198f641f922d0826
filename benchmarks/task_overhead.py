"""What one protected Celery task costs, producer and worker: fenced beside its peers.

In one process, against a redis-server this script starts (the broker too), each
contender's task is sent the way a producer sends it (``apply_async``, published to the
Redis broker) and then run the way a prefork pool child runs it (Celery's own tracer,
``build_tracer``, with the request the worker builds from the delivered message:
signals, the request pushed, ``on_success``/``after_return``). The messages are taken
off the broker's list between the two (by one ``RPOP``, outside what is measured).

Every task's body is one INCR. Contenders (the task ``i`` is protected under a name of
its own, so nothing is refused: what the protection costs when there is no conflict):

    plain              no protection: the floor
    fenced             ClaimedTask, ``claim="bench:{i}"``: ACQUIRE and RELEASE in the
                       worker
    fenced enqueue     the same with ``claim_enqueue="until_started"``: the marker set in
                       ``apply_async`` (one ``SET NX PX GET``), deleted by the run's ACQUIRE
    redis-py Lock      the body wrapped by hand in ``client.lock(f"bench:{i}",
                       timeout=30, blocking=False)``: SET NX PX and a release script
    celery-once        ``QueueOnce`` (graceful): its lock taken in ``apply_async``,
                       deleted after return
    celery-singleton   ``Singleton``: its lock taken in ``apply_async``, deleted on success

Default: contenders take turns in short chunks (interleaved, so a noisy neighbour hurts
all of them alike) and the figures are medians over the chunks: producer and worker CPU
µs per task of this process (``time.process_time``), and redis-server CPU µs per task
(its ``used_cpu_sys + used_cpu_user`` from ``INFO cpu`` before and after the chunk's
sends and runs, over the chunk's tasks; the broker's publish and the RPOP included).

    python benchmarks/task_overhead.py [--tasks 200] [--rounds 20] [--json]

``--callgrind`` counts instructions instead (deterministic where timings on a shared
machine are not). It runs this script twice under ``valgrind --tool=callgrind``, with
``--tasks`` (300) and ``--base`` (100) tasks per contender; in each run every
contender's sends, then its runs, go through ``functools.reduce`` (the collection is
toggled on that function only, ``--toggle-collect=functools_reduce``, and dumped after
each, ``--dump-after=functools_reduce``). A phase's instructions per task are its count
for 300 tasks less its count for 100, over 200: what the setup costs goes away.
``--callgrind fenced,celery-once`` limits the contenders (plain always runs);
``--keep DIR`` keeps the callgrind files (``DIR/cg.<tasks>.<part>``, the parts in the
order printed in ``DIR/parts.<tasks>.json``) for ``callgrind_annotate``.

    python benchmarks/task_overhead.py --callgrind [--tasks 300] [--base 100] [--json]

``--profile FILE`` runs one contender's tasks alone (``--contender``, default fenced;
the worker side) under cProfile and writes its stats.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _common import machine_info, machine_line, server_cpu, start_server, table  # noqa: E402

HOST = "bench@here"
#: The contenders fenced's ClaimedTask is set against (targets: its total instructions
#: per task at most each one's, its redis-server CPU per task at most 1.2x each one's).
PEERS = ("redis-py Lock", "celery-once", "celery-singleton")
SERVER_GOAL = 1.2
#: Chunks whose task numbers start here belong to the warm-up.
WARM = 10_000_000


def make_app(url: str) -> tuple[Any, dict[str, Any]]:
    """The app (its broker on the benchmark's server) and its tasks by contender."""
    import redis
    from celery import Celery

    from fenced.celery import ClaimedTask

    app = Celery("overhead", broker=f"{url}/0", set_as_current=False)
    app.conf.update(
        fenced_redis_url=f"{url}/2",
        task_ignore_result=True,
        task_acks_late=True,
        task_serializer="json",
        accept_content=["json"],
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": f"{url}/3"}},
        singleton_backend_url=f"{url}/4",
        broker_connection_retry_on_startup=True,
    )
    counter = redis.Redis.from_url(f"{url}/5")
    locks = redis.Redis.from_url(f"{url}/6")
    tasks: dict[str, Any] = {}

    @app.task(name="bench.plain")
    def plain(i: int) -> None:
        counter.incr("done:plain")

    @app.task(base=ClaimedTask, bind=True, name="bench.fenced", claim="bench:{i}", claim_ttl=30)
    def fenced_task(self: Any, i: int) -> None:
        counter.incr("done:fenced")

    @app.task(
        base=ClaimedTask,
        bind=True,
        name="bench.fenced_enqueue",
        claim="bench-enqueue:{i}",
        claim_ttl=30,
        claim_enqueue="until_started",
    )
    def fenced_enqueue(self: Any, i: int) -> None:
        counter.incr("done:fenced_enqueue")

    @app.task(name="bench.redis_lock")
    def redis_lock(i: int) -> None:
        with locks.lock(f"bench:{i}", timeout=30, blocking=False) as held:
            if held:
                counter.incr("done:redis_lock")

    tasks.update(plain=plain, fenced=fenced_task)
    tasks["fenced enqueue"] = fenced_enqueue
    tasks["redis-py Lock"] = redis_lock
    try:
        from celery_once import QueueOnce

        @app.task(base=QueueOnce, name="bench.once", once={"graceful": True})
        def once_task(i: int) -> None:
            counter.incr("done:once")

        tasks["celery-once"] = once_task
    except ImportError:  # pragma: no cover - the bench group installs it
        pass
    try:
        from celery_singleton import Singleton

        @app.task(base=Singleton, name="bench.singleton")
        def singleton_task(i: int) -> None:
            counter.incr("done:singleton")

        tasks["celery-singleton"] = singleton_task
    except ImportError:  # pragma: no cover
        pass
    app.finalize()
    return app, tasks


class Lane:
    """One contender: its task, its tracer, and its messages taken off the broker."""

    def __init__(self, app: Any, name: str, task: Any, broker: Any) -> None:
        from celery.app.trace import build_tracer

        self.name, self.task, self.broker = name, task, broker
        # as a prefork pool child builds it
        self.trace = build_tracer(task.name, app.tasks[task.name], app=app, hostname=HOST)
        self.runs: list[tuple[str, Any, Any, dict[str, Any]]] = []

    def send(self, first: int, n: int) -> None:
        """``apply_async`` of tasks ``first`` .. ``first + n - 1``."""
        apply = self.task.apply_async
        for i in range(first, first + n):
            apply((i,))

    def take(self, n: int) -> None:
        """Take the ``n`` messages just sent off the broker and build each one's request
        as the worker does (Celery's ``Request``, then the pool child's update)."""
        raw = self.broker.rpop("celery", n) or []
        if len(raw) != n:
            raise RuntimeError(f"{self.name}: {len(raw)} of {n} messages on the broker")
        self.runs = []
        for payload in raw:
            message = json.loads(payload)
            headers, props = message["headers"], message["properties"]
            if headers["task"] != self.task.name:
                raise RuntimeError(f"{self.name}: a message of {headers['task']} came")
            args, kwargs, embed = json.loads(base64.b64decode(message["body"]))
            info = props.get("delivery_info") or {}
            request = dict(headers)
            request.update(
                properties=props,
                reply_to=props.get("reply_to"),
                correlation_id=props.get("correlation_id"),
                hostname=HOST,
                delivery_info={
                    "exchange": info.get("exchange"),
                    "routing_key": info.get("routing_key"),
                    "priority": props.get("priority"),
                    "redelivered": False,
                },
            )
            request.update({"args": args, "kwargs": kwargs, "is_eager": False}, **embed)
            self.runs.append((headers["id"], args, kwargs, request))

    def run(self) -> None:
        """Run the messages taken, through the tracer."""
        trace = self.trace
        for task_id, args, kwargs, request in self.runs:
            trace(task_id, args, kwargs, request)

    def reduce_send(self, first: int, n: int) -> None:
        """:meth:`send` inside ``functools.reduce`` (what callgrind counts)."""
        apply = self.task.apply_async
        functools.reduce(lambda _, i: apply((i,)), range(first, first + n), None)

    def reduce_run(self) -> None:
        """:meth:`run` inside ``functools.reduce``."""
        trace, runs = self.trace, self.runs
        functools.reduce(lambda _, k: trace(*runs[k]), range(len(runs)), None)


def lanes_of(app: Any, tasks: dict[str, Any], url: str, only: list[str] | None) -> list[Lane]:
    import redis

    unknown = set(only or ()) - set(tasks)
    if unknown:
        sys.exit(f"unknown contender(s) {sorted(unknown)}: choose from {list(tasks)}")
    broker = redis.Redis.from_url(f"{url}/0")
    names = [n for n in tasks if only is None or n == "plain" or n in only]
    return [Lane(app, n, tasks[n], broker) for n in names]


def warm(lanes: list[Lane], n: int = 100) -> None:
    """Imports, connections, scripts, the broker's queue declared: 2 chunks each."""
    for r in range(2):
        for k, lane in enumerate(lanes):
            lane.send(WARM + (r * len(lanes) + k) * n, n)
            lane.take(n)
            lane.run()


# -- instructions (callgrind) ----------------------------------------------------------


def callgrind_child(lanes: list[Lane], n: int) -> list[str]:
    """Under valgrind: each lane's sends, then its runs, each one ``functools.reduce``
    call (collected and dumped alone). The parts' labels, in order."""
    parts: list[str] = []
    for k, lane in enumerate(lanes):
        lane.reduce_send(k * 1_000_000, n)
        parts.append(f"{lane.name}/producer")
        lane.take(n)
        lane.reduce_run()
        parts.append(f"{lane.name}/worker")
    return parts


def _part_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no summary line")


def versions() -> str:
    """What the instructions were counted with."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = [f"Python {platform.python_version()}"]
    for name in ("celery", "kombu", "redis", "hiredis", "celery_once", "celery-singleton"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    found = subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return ", ".join([*out, found.stdout.strip()])


def callgrind(args: argparse.Namespace) -> dict[str, Any]:
    """Two runs under callgrind (``--tasks`` and ``--base`` tasks); per lane and phase,
    the instructions per task."""
    if shutil.which("valgrind") is None:
        sys.exit("--callgrind needs valgrind")
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="task-overhead-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONHASHSEED="0")
    procs = {}
    for n in (args.tasks, args.base):
        for old in out.glob(f"cg.{n}*"):
            old.unlink()
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            "--dump-after=functools_reduce",
            f"--callgrind-out-file={out}/cg.{n}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--callgrind-child",
            str(n),
            "--parts",
            str(out / f"parts.{n}.json"),
        ]
        if args.only:
            cmd += ["--only", ",".join(args.only)]
        procs[n] = (cmd, subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    counts: dict[int, dict[str, int]] = {}
    for n, (cmd, proc) in procs.items():
        _, err = proc.communicate()
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
        labels = json.loads((out / f"parts.{n}.json").read_text())
        files = sorted(out.glob(f"cg.{n}.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        # Parts before the phases' own are reduce calls made at import (a few thousand
        # instructions each); more than that, or a part too many, means a reduce inside
        # a phase, which would have toggled the collection off within it.
        early, files = files[: len(files) - len(labels)], files[len(files) - len(labels) :]
        if len(files) < len(labels) or any(_part_total(f) > 100_000 for f in early):
            sys.exit(f"{len(files)} callgrind parts for {len(labels)} phases: a nested reduce?")
        counts[n] = {label: _part_total(f) for label, f in zip(labels, files, strict=True)}
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    span = args.tasks - args.base
    per: dict[str, dict[str, float]] = {}
    for label in counts[args.tasks]:
        name, phase = label.split("/")
        value = (counts[args.tasks][label] - counts[args.base][label]) / span
        per.setdefault(name, {})[phase] = value
    return {
        "tasks": args.tasks,
        "base": args.base,
        "raw": {str(n): c for n, c in counts.items()},
        "per_task": per,
        "commands": [" ".join(cmd) for cmd, _ in procs.values()],
        "versions": versions(),
        "kept": str(out) if args.keep else None,
    }


def report_callgrind(result: dict[str, Any]) -> tuple[str, list[str]]:
    """The table of instructions per task, and the targets' lines."""
    per = result["per_task"]
    rows = []
    floor = per["plain"]["producer"] + per["plain"]["worker"]
    for name, p in per.items():
        total = p["producer"] + p["worker"]
        p["total"] = total
        p["over_plain"] = total - floor
        rows.append(
            [
                name,
                f"{p['producer']:,.0f}",
                f"{p['worker']:,.0f}",
                f"{total:,.0f}",
                "" if name == "plain" else f"{total - floor:+,.0f}",
            ]
        )
    head = ["contender", "producer", "worker", "total", "over plain"]
    text = table(head, rows, {1, 2, 3, 4})
    lines = []
    for fenced in ("fenced", "fenced enqueue"):
        for peer in PEERS:
            if fenced in per and peer in per:
                ratio = per[fenced]["total"] / per[peer]["total"]
                over = per[fenced]["over_plain"] / per[peer]["over_plain"]
                result.setdefault("ratios", {})[f"{fenced} / {peer}"] = {
                    "total": round(ratio, 3),
                    "over_plain": round(over, 3),
                }
                mark = "met" if ratio <= 1.0 else "MISSED"
                lines.append(
                    f"{fenced} / {peer}: total {ratio:.3f}x, over plain {over:.3f}x"
                    f"  (target total <= 1.0x: {mark})"
                )
    return text, lines


# -- timings and redis-server CPU ------------------------------------------------------


def timed(lanes: list[Lane], n: int, rounds: int, r: Any) -> dict[str, dict[str, float]]:
    """Interleaved chunks; per lane, medians of producer and worker CPU µs per task
    (this process) and of redis-server CPU µs per task (``INFO cpu``)."""
    seen: dict[str, dict[str, list[float]]] = {
        lane.name: {"producer_us": [], "worker_us": [], "server_us": [], "commands": [], "load": []}
        for lane in lanes
    }
    first = 0
    for i in range(rounds):
        turn = lanes[i % len(lanes) :] + lanes[: i % len(lanes)]
        for lane in turn:
            k0 = _commands(r)
            s0 = server_cpu(r)
            c0 = time.process_time()
            lane.send(first, n)
            c1 = time.process_time()
            lane.take(n)
            c2 = time.process_time()
            lane.run()
            c3 = time.process_time()
            s1 = server_cpu(r)
            k1 = _commands(r)
            first += n
            got = seen[lane.name]
            got["producer_us"].append((c1 - c0) / n * 1e6)
            got["worker_us"].append((c3 - c2) / n * 1e6)
            got["server_us"].append((s1 - s0) / n * 1e6)
            got["commands"].append((k1 - k0 - 4) / n)  # less 3 INFO and the RPOP
            got["load"].append(os.getloadavg()[0])
    return {
        name: {k: round(statistics.median(v), 1) for k, v in got.items()}
        for name, got in seen.items()
    }


def _commands(r: Any) -> int:
    """Commands redis-server has served (``INFO commandstats``: those scripts call
    included, and each EVALSHA itself)."""
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def report_timed(rows: dict[str, dict[str, float]], result: dict[str, Any]) -> tuple[str, list]:
    body = [
        [
            name,
            f"{row['producer_us']:.0f}",
            f"{row['worker_us']:.0f}",
            f"{row['producer_us'] + row['worker_us']:.0f}",
            f"{row['server_us']:.0f}",
            f"{row['commands']:.2f}",
        ]
        for name, row in rows.items()
    ]
    head = ["contender", "producer µs", "worker µs", "client µs", "redis-server µs", "commands"]
    lines = []
    for fenced in ("fenced", "fenced enqueue"):
        for peer in PEERS:
            if fenced in rows and peer in rows:
                ratio = rows[fenced]["server_us"] / rows[peer]["server_us"]
                result.setdefault("server_ratios", {})[f"{fenced} / {peer}"] = round(ratio, 3)
                mark = "met" if ratio <= SERVER_GOAL else "MISSED"
                lines.append(
                    f"{fenced} / {peer}: redis-server CPU {ratio:.2f}x"
                    f"  (target <= {SERVER_GOAL}x: {mark})"
                )
    return table(head, body, {1, 2, 3, 4, 5}), lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, help="tasks per chunk (200; --callgrind: 300)")
    parser.add_argument("--base", type=int, default=100, help="--callgrind: the lesser run")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--callgrind",
        nargs="?",
        const="",
        metavar="NAMES",
        help="count instructions (see above); NAMES limits the contenders",
    )
    parser.add_argument("--keep", metavar="DIR", help="--callgrind: keep its files here")
    parser.add_argument("--only", help="comma-separated contenders (plain always runs)")
    parser.add_argument("--profile", help="profile one contender's runs alone into this file")
    parser.add_argument("--contender", default="fenced", help="the one --profile runs")
    parser.add_argument("--callgrind-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = args.only or args.callgrind
    args.only = [x.strip() for x in only.split(",") if x.strip()] if only else None
    if args.callgrind is not None:
        args.tasks = args.tasks or 300
        if args.tasks <= args.base:
            sys.exit("--tasks must be more than --base")
        load0 = os.getloadavg()
        started = time.monotonic()
        result = callgrind(args)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["loadavg"] = [list(load0), list(os.getloadavg())]
        text, lines = report_callgrind(result)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(
                f"instructions per task (callgrind, {args.tasks} tasks less {args.base}, "
                f"over {args.tasks - args.base}); {result['seconds']} s, "
                f"load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}"
            )
            print(result["versions"])
            print(text)
            print("\n".join(lines))
        return 1 if any("MISSED" in x for x in lines) else 0
    args.tasks = args.tasks or 200
    server = start_server()
    try:
        url = server.url.rsplit("/", 1)[0]
        app, tasks = make_app(url)
        lanes = lanes_of(app, tasks, url, args.only)
        warm(lanes, 20 if args.callgrind_child else 100)
        if args.callgrind_child:
            parts = callgrind_child(lanes, args.callgrind_child)
            Path(args.parts).write_text(json.dumps(parts))
            return 0
        if args.profile:
            import cProfile

            lane = next(x for x in lanes if x.name == args.contender)
            n = args.tasks * args.rounds
            lane.send(0, n)
            lane.take(n)
            profile = cProfile.Profile()
            profile.enable()
            lane.run()
            profile.disable()
            profile.dump_stats(args.profile)
            print(f"profile of {n} {lane.name} runs: {args.profile}")
            return 0
        info = machine_info(server)
        rows = timed(lanes, args.tasks, args.rounds, server.client())
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        server.stop()
    result: dict[str, Any] = {"tasks": args.tasks, "rounds": args.rounds, "rows": rows}
    text, lines = report_timed(rows, result)
    result["machine"] = info
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(machine_line("task_overhead.py", info))
        print(
            f"per task, medians of {args.rounds} interleaved chunks of {args.tasks}: "
            "this process's CPU (producer, worker), redis-server's CPU (INFO cpu)"
        )
        print(text)
        print("\n".join(lines))
    return 1 if any("MISSED" in x for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
