"""Redis work per claim lifecycle: fenced's Claim beside redis-py's Lock, from the server.

Starts its own redis-server and runs acquire+release cycles, one single-threaded client,
in interleaved rounds (each lane in turn, the first lane rotating), for eight lanes:

* redis-py ``Lock`` on one reused name, and on a new name per cycle;
* fenced ``Claim`` (heartbeat off) with run records off and on, each on one reused name
  and on a new name per cycle (a name built from arguments: one per user, per file);
* two floors, for what no script can go under: the Lock with its SET sent by a script,
  and a script that adds the least a fence takes (``TIME``, and the last fence read and
  written in one ``SET ... GET``); both release with the Lock's script.

Per lane, from the server's own ``INFO commandstats`` summed over the lane's rounds:

* ``cmds``: Redis commands per lifecycle, those a script runs included and the
  EVAL/EVALSHA that runs it not (redis-py's ``Lock``: SET, then GET and DEL in its
  release script: 3);
* ``srv µs``: the server's µs per lifecycle in the calls the client sent (a script's
  EVALSHA with what it ran, a plain command by itself). Which calls a client sends and
  which a script runs is read once per lane from ``MONITOR``, in a short pass before the
  timed rounds (a command name that is both is shared out by those counts);
* ``x Lock``: ``srv µs`` over the Lock's on the same kind of name, in this run.

Targets (exit 1 when one is missed): with records on, at most 10 commands and at most
3x the Lock's server time; with records off, at most 2x.

Run: ``python benchmarks/lifecycle_cost.py`` (about 30 s), ``--quick`` (about 8 s),
``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, machine_line, start_server, table

from fenced import Claim

#: The calls that only run a script: their own µs include what the script ran.
SCRIPT_CALLS = {"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"}
#: Commands the benchmark itself sends between rounds.
OWN = {"info", "monitor", "ping", "client", "hello", "config", "script"}

MAX_COMMANDS = 10

# The floors: the fewest a fenced lifecycle could cost with its acquire in a script. The
# Lock's own SET, sent by a script; then that SET and the least a fence takes (the
# server's clock and the last fence, read and written in one SET). Both release with the
# Lock's compare-and-delete script.
FLOOR_LOCK = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])"
FLOOR_FENCE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
  redis.call('SET', KEYS[2], now, 'PX', ARGV[3], 'GET')
  return now
end
return 0
"""
FLOOR_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
MAX_RATIO_RECORDS = 3.0
MAX_RATIO_PLAIN = 2.0

#: A MONITOR line: `<time> [<db> <client or "lua">] "<COMMAND>" ...`.
_MONITOR = re.compile(r'^\S+ \[\d+ (?P<source>\S+)\] "(?P<cmd>[^"]+)"')


def _stats(r: Any) -> dict[str, tuple[int, float]]:
    """Calls and µs per command name served so far (``INFO commandstats``)."""
    out: dict[str, tuple[int, float]] = {}
    for key, v in r.info("commandstats").items():
        name = key.removeprefix("cmdstat_").split("|")[0].lower()
        calls, usec = out.get(name, (0, 0.0))
        out[name] = (calls + int(v["calls"]), usec + float(v["usec"]))
    return out


def _delta(
    after: dict[str, tuple[int, float]], before: dict[str, tuple[int, float]]
) -> Counter[str]:
    """Calls per command name between two readings, and ``name:usec`` for their µs."""
    out: Counter[str] = Counter()
    for name, (calls, usec) in after.items():
        if name in OWN:
            continue
        c0, u0 = before.get(name, (0, 0.0))
        if calls > c0:
            out[name] += calls - c0
            out[name + ":usec"] += round(usec - u0)
    return out


def _sources(
    server: Any, op: Callable[[], object], cycles: int
) -> tuple[Counter[str], Counter[str]]:
    """Commands a client sent and commands a script ran during ``cycles`` runs of ``op``."""
    import redis

    conn = redis.Redis.from_url(server.url)
    sent: Counter[str] = Counter()
    inner: Counter[str] = Counter()
    done = threading.Event()
    with conn.monitor() as mon:
        # the monitor is attached once its connection answered; then the pass runs
        mon.connection.send_command("PING")

        def run() -> None:
            time.sleep(0.05)
            for _ in range(cycles):
                op()
            conn.set("fenced:bench:monitor:end", "1")
            done.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        while True:
            line = mon.connection.read_response()
            text = line.decode() if isinstance(line, bytes) else str(line)
            m = _MONITOR.match(text)
            if not m:
                continue
            cmd = m.group("cmd").lower()
            if "fenced:bench:monitor:end" in text:
                break
            if cmd in OWN:
                continue
            (inner if m.group("source") == "lua" else sent)[cmd] += 1
        t.join()
    conn.close()
    return sent, inner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter, rougher")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args()
    rounds, cycles = (3, 300) if args.quick else (9, 1000)
    server = start_server()
    try:
        r = server.client()
        info = machine_info(server)
        fresh = itertools.count()

        def lock_cycle(lock: Any) -> Callable[[], object]:
            def op() -> None:
                lock.acquire(blocking=False)
                lock.release()

            return op

        def new_lock() -> None:
            lock = r.lock(f"bench:lock:{next(fresh)}", timeout=30)
            lock.acquire(blocking=False)
            lock.release()

        def claim_cycle(records: bool, new: bool) -> Callable[[], object]:
            reused = Claim(r, f"bench:claim:{records}", ttl=30, heartbeat=False, records=records)

            def op() -> None:
                claim = (
                    Claim(
                        r,
                        f"bench:claim:{records}:{next(fresh)}",
                        ttl=30,
                        heartbeat=False,
                        records=records,
                    )
                    if new
                    else reused
                )
                claim.acquire()
                claim.release()

            return op

        def floor_cycle(acquire: str) -> Callable[[], object]:
            # the Lock's release script, after an acquire that is a script too
            take, give = r.script_load(acquire), r.script_load(FLOOR_RELEASE)
            keys = ("bench:floor:{x}:lock", "bench:floor:{x}:fence")

            def op() -> None:
                r.evalsha(take, 2, *keys, "token", "30000", "604800000")
                r.evalsha(give, 1, keys[0], "token")

            return op

        lanes: dict[str, tuple[str, Callable[[], object]]] = {
            "redis-py Lock": ("Lock", lock_cycle(r.lock("bench:lock", timeout=30))),
            "redis-py Lock, new names": ("Lock new", new_lock),
            "floor: the Lock, SET in a script": ("Lock", floor_cycle(FLOOR_LOCK)),
            "floor: SET and a fence in a script": ("Lock", floor_cycle(FLOOR_FENCE)),
            "fenced, records off": ("Lock", claim_cycle(False, False)),
            "fenced, records off, new names": ("Lock new", claim_cycle(False, True)),
            "fenced, records on": ("Lock", claim_cycle(True, False)),
            "fenced, records on, new names": ("Lock new", claim_cycle(True, True)),
        }
        base = {"Lock": "redis-py Lock", "Lock new": "redis-py Lock, new names"}
        shares: dict[str, dict[str, float]] = {}
        for name, (_, op) in lanes.items():
            for _ in range(20):  # scripts loaded, connections open
                op()
            sent, inner = _sources(server, op, 50)
            shares[name] = {
                cmd: sent[cmd] / (sent[cmd] + inner[cmd]) for cmd in set(sent) | set(inner)
            }
        totals: dict[str, Counter[str]] = {name: Counter() for name in lanes}
        done: Counter[str] = Counter()
        names = list(lanes)
        for i in range(rounds):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                op = lanes[name][1]
                before = _stats(r)
                for _ in range(cycles):
                    op()
                totals[name] += _delta(_stats(r), before)
                done[name] += cycles
        info["loadavg_end"] = list(os.getloadavg())
    finally:
        server.stop()

    results: dict[str, dict[str, Any]] = {}
    for name, total in totals.items():
        n = done[name]
        commands = sum(v for k, v in total.items() if ":" not in k and k not in SCRIPT_CALLS)
        usec = sum(total[k + ":usec"] * shares[name].get(k, 1.0) for k in total if ":" not in k)
        results[name] = {
            "cycles": n,
            "commands": commands / n,
            "server_us": usec / n,
            "by_command": {k: round(v / n, 2) for k, v in sorted(total.items()) if ":" not in k},
        }
    missed: list[str] = []
    for name, res in results.items():
        against = results[base[lanes[name][0]]]["server_us"]
        res["x_lock"] = res["server_us"] / against if against else float("nan")
        if not name.startswith("fenced"):
            continue
        records = "records on" in name
        limit = MAX_RATIO_RECORDS if records else MAX_RATIO_PLAIN
        if res["x_lock"] > limit:
            missed.append(
                f"{name}: {res['x_lock']:.2f}x the Lock's server time (target <= {limit}x)"
            )
        if records and res["commands"] > MAX_COMMANDS:
            missed.append(f"{name}: {res['commands']:.2f} commands (target <= {MAX_COMMANDS})")

    if args.json:
        print(json.dumps({"machine": info, "lanes": results, "missed": missed}, indent=2))
    else:
        print(machine_line("lifecycle_cost", info))
        rows = [
            [
                name,
                f"{res['commands']:.2f}",
                f"{res['server_us']:.1f}",
                f"{res['x_lock']:.2f}x",
                " ".join(f"{k}={v:g}" for k, v in res["by_command"].items()),
            ]
            for name, res in results.items()
        ]
        print(
            table(["per acquire+release", "cmds", "srv µs", "x Lock", "commands"], rows, {1, 2, 3})
        )
        for line in missed:
            print("missed:", line)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
