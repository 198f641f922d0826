"""Memory of a lock Redis over many distinct names: does it stay flat?

Names built from arguments (one per user, per feed, per file) are used once or a few
times and never again. What each leaves behind in a Redis that must not evict
(``maxmemory-policy noeviction``) decides whether that Redis fills up. This runs
N distinct names through one acquire and release each, with run records (as Celery
tasks and ``fenced run`` keep them), and samples ``used_memory`` as it goes:

- fenced, keys of idle names expiring (``idle_ttl``: the default is a week; here two
  seconds, so a short run shows the plateau a week shows in production);
- fenced, keys kept forever (``idle_ttl=None``: fenced 0.1's behaviour);
- redis-py's ``Lock``, which keeps nothing after release (and has no fence, records
  or skip counts to keep).

Usage::

    .venv/bin/python benchmarks/idle_names.py              # 1,000,000 names, a few minutes
    .venv/bin/python benchmarks/idle_names.py --names 100000

The memory figures are the server's own (``INFO memory``), taken after each step;
the last column is the ratio against redis-py's ``Lock``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from _common import machine_info, start_server

from fenced import Claim

STEPS = 10


def used(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def fenced_cycle(client: Any, idle_ttl: float | None) -> Callable[[str], None]:
    def cycle(name: str) -> None:
        claim = Claim(client, name, ttl=1.0, heartbeat=False, records=True, idle_ttl=idle_ttl)
        claim.acquire()
        claim.release()

    return cycle


def redis_lock_cycle(client: Any) -> Callable[[str], None]:
    def cycle(name: str) -> None:
        lock = client.lock(f"lock:{name}", timeout=1.0)
        lock.acquire(blocking=False)
        lock.release()

    return cycle


def run(label: str, make: Callable[[Any], Callable[[str], None]], names: int) -> list[int]:
    server = start_server()
    try:
        client = server.client()
        client.config_set("maxmemory-policy", "noeviction")
        cycle = make(client)
        base = used(client)
        samples = []
        step = max(1, names // STEPS)
        start = time.monotonic()
        for i in range(names):
            cycle(f"user:{i}")
            if (i + 1) % step == 0:
                samples.append(used(client) - base)
        rate = names / (time.monotonic() - start)
        print(f"  {label:<34} {rate:8.0f} names/s", flush=True)
        return samples
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=1_000_000)
    args = parser.parse_args()
    probe = start_server()
    print(machine_info(probe))
    probe.stop()
    print(f"{args.names:,} distinct names, one acquire and release each, with run records")
    results = {
        "fenced, idle keys expire (2 s)": run(
            "fenced, idle keys expire (2 s)", lambda c: fenced_cycle(c, 2.0), args.names
        ),
        "fenced, keys kept forever": run(
            "fenced, keys kept forever", lambda c: fenced_cycle(c, None), args.names
        ),
        "redis-py Lock": run("redis-py Lock", redis_lock_cycle, args.names),
    }
    step = max(1, args.names // STEPS)
    print()
    header = f"{'names':>10} " + " ".join(f"{k:>32}" for k in results)
    print("used_memory above the empty server, in MiB")
    print(header)
    for n in range(STEPS):
        row = " ".join(f"{results[k][n] / 2**20:32.1f}" for k in results)
        print(f"{(n + 1) * step:>10,} {row}")
    lock_last = max(1, results["redis-py Lock"][-1])
    print()
    for k, samples in results.items():
        print(
            f"{k:<34} last/first sample {samples[-1] / max(1, samples[0]):6.2f}   "
            f"vs redis-py Lock {samples[-1] / lock_last:8.1f}x"
        )


if __name__ == "__main__":
    main()
