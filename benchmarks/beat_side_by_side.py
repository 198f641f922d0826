"""Three ``celery beat`` processes side by side: stock Celery, celery-redbeat, fenced.

For each contender, three beat processes of ``beat_bench_app.py`` (one entry every
second) run on a redis-server this script starts, through the same faults: the
publishing beat is stopped (SIGSTOP) for a few leases and continued, then killed
(SIGKILL). Every publish of every beat is noted (``before_task_publish``). Reported:

    sent        messages published for the entry
    expected    seconds from the first publish to the last (one tick each)
    close       publishes less than half a period after the previous one (stock beat
                x3: every tick three times; fenced: a late tick caught up after a
                failover, then the next one on time: two due times)
    same_id     task ids published more than once (fenced's ids name the due time;
                the others' are random)
    longest gap the longest time between two publishes
    beats up    beat processes still running at the end (of those not killed)

celery-redbeat is not a dependency of fenced (the ``bench`` group installs it): it runs
when importable, else its row says so. Exits 1 when fenced published a tick twice or a
fenced beat that was not killed stopped.

    python benchmarks/beat_side_by_side.py [--lease 3] [--phase 8] [--only fenced,redbeat]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _common import machine_info, machine_line, start_server, table  # noqa: E402

CONTENDERS = ("stock", "redbeat", "fenced")


def _beats(url: str, kind: str, lease: float, folder: str) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(
            [str(HERE), str(HERE.parent / "src"), env.get("PYTHONPATH", "")]
        ),
        BEAT_BENCH_REDIS=url,
        BEAT_BENCH_SCHEDULER=kind,
        BEAT_BENCH_LEASE=str(lease),
    )
    procs = []
    for i in range(3):
        log = open(os.path.join(folder, f"{kind}-{i}.log"), "wb")  # noqa: SIM115
        cmd = [
            sys.executable, "-m", "celery", "-A", "beat_bench_app", "beat", "-l", "info",
            "-s", os.path.join(folder, f"{kind}-{i}.schedule"),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _notes(client: Any) -> list[tuple[float, int, str]]:
    out = []
    for raw in client.lrange("sent", 0, -1):
        _entry, when, pid, task_id = raw.decode().split()
        out.append((float(when), int(pid), task_id))
    return out


def _publisher(client: Any, procs: list[subprocess.Popen[bytes]], after: float) -> Any:
    """The beat that published last (after ``after``), waiting a few seconds for one."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        recent = [pid for when, pid, _id in _notes(client) if when > after]
        live = {p.pid: p for p in procs if p.poll() is None}
        if recent and recent[-1] in live:
            return live[recent[-1]]
        time.sleep(0.2)
    return None


def run(kind: str, url: str, lease: float, phase: float, folder: str) -> dict[str, Any]:
    import redis

    notes = redis.Redis.from_url(f"{url}/3")
    for db in range(4):
        redis.Redis.from_url(f"{url}/{db}").flushdb()
    procs = _beats(url, kind, lease, folder)
    killed = None
    try:
        time.sleep(phase)
        leader = _publisher(notes, procs, time.time() - 2)
        if leader is not None:
            os.kill(leader.pid, signal.SIGSTOP)
            time.sleep(3 * lease)
            os.kill(leader.pid, signal.SIGCONT)
        time.sleep(phase)
        leader = _publisher(notes, procs, time.time() - 2)
        if leader is not None:
            leader.kill()
            killed = leader.pid
        time.sleep(phase)
    finally:
        if os.environ.get("BEAT_BENCH_DUMP"):
            print(*[x.decode() for x in notes.lrange("sent", 0, -1)], sep="\n")
        up = sum(1 for p in procs if p.poll() is None)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    noted = _notes(notes)
    times = sorted(when for when, _pid, _id in noted)
    ids = [task_id for _when, _pid, task_id in noted]
    steps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "contender": kind,
        "sent": len(times),
        "expected": round(times[-1] - times[0]) + 1 if times else 0,
        "close": sum(1 for s in steps if s < 0.5),
        "same_id": len(ids) - len(set(ids)),
        "longest_gap": round(max(steps, default=0.0), 2),
        "beats_up": f"{up}/{3 - (killed is not None)}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lease", type=float, default=3.0, help="lock timeout / lease, s")
    parser.add_argument("--phase", type=float, default=8.0, help="seconds between faults")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="contenders to run")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--logs", metavar="DIR", help="keep the beats' logs in DIR")
    args = parser.parse_args()
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONTENDERS]
    if unknown:  # refused before a server is started
        parser.error(f"no contender {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    server = start_server()
    url = server.url.rsplit("/", 1)[0]
    rows = []
    info = machine_info(server)
    try:
        with tempfile.TemporaryDirectory(prefix="fenced-beat-bench-") as tmp:
            folder = args.logs or tmp
            os.makedirs(folder, exist_ok=True)
            for kind in chosen:
                if kind == "redbeat" and importlib.util.find_spec("redbeat") is None:
                    rows.append({"contender": kind, "sent": "not installed"})
                    continue
                rows.append(run(kind, url, args.lease, args.phase, folder))
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        server.stop()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(machine_line("beat_side_by_side", info))
    print(f"three beats each, entry every 1 s, lease {args.lease:g} s, SIGSTOP then SIGKILL")
    cols = ["contender", "sent", "expected", "close", "same_id", "longest_gap", "beats_up"]
    print(table(cols, [[str(r.get(c, "")) for c in cols] for r in rows], set(range(1, 6))))
    missed = 0
    for row in rows:
        if row["contender"] != "fenced":
            continue
        for target, met in (
            ("fenced: no tick published twice", row["same_id"] == 0),
            ("fenced: every beat not killed still up", row["beats_up"] == "2/2"),
        ):
            print(f"{target}: {'met' if met else 'MISSED'}")
            missed += not met
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
