"""``python -m chaos``: run the fault-injection suite and print the verdict.

Exit status: 0 when no invariant of the fenced lane broke, 1 when one did, 2 on bad
arguments. ``CHAOS_SECONDS`` sets the default duration (``make chaos`` passes it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .config import BROKEN, FAULTS, Config


def parse(argv: list[str] | None = None) -> Config | str:
    p = argparse.ArgumentParser(
        prog="python -m chaos",
        description="Many holders of one claim, a nemesis injecting faults, and a checker.",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=float(os.environ.get("CHAOS_SECONDS") or 300),
        help="how long faults are injected (default: CHAOS_SECONDS or 300)",
    )
    p.add_argument("--workers", type=int, default=6, help="fenced lane worker processes")
    p.add_argument(
        "--baseline-workers", type=int, default=None, help="Lock lane workers (default: same)"
    )
    p.add_argument("--ttl", type=float, default=1.0, help="claim ttl in seconds")
    p.add_argument("--steps", type=int, default=4, help="steps per holding")
    p.add_argument("--no-celery", action="store_true", help="no ClaimedTask lane")
    p.add_argument("--celery-children", type=int, default=2, help="prefork children")
    p.add_argument("--no-run-lane", action="store_true", help="no fenced run lane")
    p.add_argument("--runners", type=int, default=2, help="fenced run runners")
    p.add_argument("--no-baseline", action="store_true", help="no redis-py Lock lane")
    p.add_argument(
        "--no-dedup", action="store_true", help="no dedup lane (fenced's Celery options)"
    )
    p.add_argument(
        "--dedup-children", type=int, default=5, help="dedup lane prefork children (>= 3)"
    )
    p.add_argument(
        "--no-beat", action="store_true", help="no beat lane (celery beat, fenced's scheduler)"
    )
    p.add_argument("--beats", type=int, default=3, help="beat lane: celery beat processes")
    objects = p.add_mutually_exclusive_group()
    objects.add_argument(
        "--objects", action="store_true", default=None,
        help="the object-store pointer among the stores, on Azurite (default: where Azurite "
        "is installed: tests/npm or PATH)",
    )  # fmt: skip
    objects.add_argument(
        "--no-objects", dest="objects", action="store_false", help="no object-store pointer"
    )
    p.add_argument(
        "--sentinel",
        action="store_true",
        help="the dedup lane's claims on a Sentinel group, with the failover faults "
        "(its master killed, or paused until a replica is promoted)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="the dedup lane's claims on a Redis Cluster (3 masters, a replica each), with "
        "the cluster failover faults (the master of the lane's busiest slots killed, or "
        "paused until its replica is promoted)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="claim_replicas of the dedup lane's tasks (default: 1 with --sentinel or "
        "--cluster, else 0)",
    )
    p.add_argument(
        "--broken",
        default="",
        help="break the dedup lane on purpose, to see the checker fail: comma-separated "
        f"from {','.join(BROKEN)}",
    )
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated faults to inject (default: all of {','.join(FAULTS)})",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the nemesis")
    p.add_argument(
        "--sql-url", default=None, help="SQLAlchemy URL (default: FENCED_TEST_POSTGRES_URL, "
        "else SQLite in the run directory)"
    )  # fmt: skip
    p.add_argument("--out", default=None, help="run directory (default: chaos/runs/<time>)")
    p.add_argument("--keep-tables", action="store_true", help="leave the SQL tables")
    p.add_argument(
        "--check", metavar="RUN_DIR", default=None, help="check a finished run's directory again"
    )
    a = p.parse_args(argv)
    if a.check:
        return a.check  # type: ignore[no-any-return]
    cfg = Config(
        seconds=a.seconds,
        workers=a.workers,
        baseline_workers=a.baseline_workers,
        ttl=a.ttl,
        steps=a.steps,
        celery=not a.no_celery,
        celery_children=a.celery_children,
        run_lane=not a.no_run_lane,
        runners=a.runners,
        baseline=not a.no_baseline,
        seed=a.seed,
        sql_url=a.sql_url,
        out=a.out,
        faults=tuple(f for f in a.faults.split(",") if f),
        keep_tables=a.keep_tables,
        dedup=not a.no_dedup,
        dedup_children=a.dedup_children,
        broken=tuple(b for b in a.broken.split(",") if b),
        sentinel=a.sentinel,
        cluster=a.cluster,
        replicas=a.replicas,
        beat=not a.no_beat,
        beats=a.beats,
        objects=a.objects,
    )
    try:
        cfg.check()
    except ValueError as exc:
        p.error(str(exc))
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if isinstance(cfg, str):
        from pathlib import Path

        from .checker import recheck

        report = recheck(Path(cfg))
        print(report.tables())
        return 0 if report.ok else 1
    from .harness import Harness  # after the arguments: --help needs no Redis

    # As Ctrl-C does: unwind, so that the harness stops every process and server it started.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    harness = Harness(cfg)
    print(f"chaos: {cfg.seconds:g} s of faults; logs in {harness.out}", flush=True)
    report = harness.run()
    print(report.tables())
    print(f"\nfull report: {harness.out / 'report.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
