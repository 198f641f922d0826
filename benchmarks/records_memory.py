"""Memory of an idle name: what one acquire and release leaves behind, with and without
run records, beside redis-py's ``Lock``.

A name used once keeps its lasting keys (its fence, its run records) for ``idle_ttl``,
a week by default: a million names a week hold a million times this figure. Each
contender runs N distinct names through one acquire and release on a fresh server
(``maxmemory-policy noeviction``), and the figure is ``used_memory`` after the names
minus ``used_memory`` before them, per name: the keys, their expiry entries and the
keyspace's own tables, as the server counts them. The release's note (a key that
lets a retried release get its first answer) expires a minute after the release and
is deleted before the second sample: an idle name keeps only its lasting keys.

``MEMORY USAGE`` of each kind of key one name keeps is printed too (a key's own
figure, without the keyspace's share), and redis-server's own time per acquire and
release (``INFO commandstats``: the microseconds of the commands the client sent, the
scripts' inner commands inside them), on these distinct names.

Usage::

    .venv/bin/python benchmarks/records_memory.py               # 20,000 names
    .venv/bin/python benchmarks/records_memory.py --names 100000 --budget 1024

Exits 1 when an idle name with run records costs more than ``--budget`` bytes
(1,024 by default).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from typing import Any

from _common import machine_info, start_server

from fenced import Claim

Cycle = Callable[[Any, str], None]
#: The commands each contender sends (their time includes what a script calls).
SENT = {"fenced": ("evalsha", "eval"), "redis-py Lock": ("set", "evalsha", "eval")}


def used(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def fenced_cycle(records: bool, task_ids: bool = False) -> Cycle:
    def cycle(client: Any, name: str) -> None:
        # A Celery task's run carries its task id (a UUID) in its token and its record.
        task_id = str(uuid.uuid4()) if task_ids else None
        claim = Claim(client, name, ttl=10.0, heartbeat=False, records=records, task_id=task_id)
        claim.acquire()
        claim.release()

    return cycle


def redis_lock_cycle(client: Any, name: str) -> None:
    lock = client.lock(f"lock:{name}", timeout=10.0)
    lock.acquire(blocking=False)
    lock.release()


def drop_notes(client: Any) -> None:
    """Delete the releases' notes (each expires a minute after its release)."""
    batch: list[bytes] = []
    for key in client.scan_iter(match="fenced:{*}:released:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


def key_sizes(client: Any) -> dict[str, int]:
    """MEMORY USAGE of each key the first name keeps, by the key's last part."""
    sizes: dict[str, int] = {}
    for pattern in ("fenced:{user:0}:*", "lock:user:0"):
        for key in sorted(client.scan_iter(match=pattern, count=1000)):
            part = key.decode().rsplit(":", 1)[-1] if pattern.startswith("fenced") else "lock"
            sizes[part] = int(client.memory_usage(key, samples=0) or 0)
    return sizes


def server_usec(client: Any, sent: tuple[str, ...]) -> int:
    """Microseconds redis-server has spent in the commands named, from INFO commandstats."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in sent)


def run(
    cycle: Cycle, names: int, sent: tuple[str, ...]
) -> tuple[float, dict[str, int], int, float]:
    """Bytes per idle name, the first name's keys' MEMORY USAGE, keys per name, and the
    server's µs per acquire and release."""
    server = start_server()
    try:
        client = server.client()
        client.config_set("maxmemory-policy", "noeviction")
        cycle(client, "warm-up")  # scripts loaded, connection made: not per name
        drop_notes(client)
        client.delete(*client.keys("*warm-up*") or ["-"])
        before = used(client)
        usec = server_usec(client, sent)
        for i in range(names):
            cycle(client, f"user:{i}")
        usec = server_usec(client, sent) - usec
        drop_notes(client)
        after = used(client)
        keys = int(client.dbsize())
        return (after - before) / names, key_sizes(client), keys, usec / names
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, default=20_000)
    parser.add_argument(
        "--budget", type=int, default=1024, help="bytes per idle name with records (exit 1 above)"
    )
    args = parser.parse_args()
    if args.names < 1:
        parser.error(f"--names {args.names} must be 1 or more, e.g. --names 20000")
    probe = start_server()
    print(machine_info(probe))
    probe.stop()
    print(f"{args.names:,} distinct names, one acquire and release each, then idle")
    print()
    contenders: dict[str, Cycle] = {
        "fenced, records on": fenced_cycle(True),
        "fenced, records, task id": fenced_cycle(True, task_ids=True),
        "fenced, records off": fenced_cycle(False),
        "redis-py Lock": redis_lock_cycle,
    }
    print(
        f"{'':<24} {'bytes/name':>10} {'keys/name':>9} {'server µs':>9}"
        "   MEMORY USAGE of one name's keys"
    )
    results: dict[str, float] = {}
    for label, cycle in contenders.items():
        sent = SENT["redis-py Lock" if label == "redis-py Lock" else "fenced"]
        per_name, sizes, keys, usec = run(cycle, args.names, sent)
        results[label] = per_name
        shown = ", ".join(f"{part} {size} B" for part, size in sizes.items()) or "none"
        print(
            f"{label:<24} {per_name:>10,.0f} {keys / args.names:>9.2f} {usec:>9.1f}   {shown}",
            flush=True,
        )
    on = results["fenced, records on"]
    print()
    if on > args.budget:
        print(f"FAIL: an idle name with run records costs {on:,.0f} bytes > {args.budget:,}")
        return 1
    print(f"ok: an idle name with run records costs {on:,.0f} bytes <= {args.budget:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
