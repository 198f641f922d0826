"""Fenced upsert versus a naive select-then-insert loop, 10,000 rows, as rows/s and a ratio.

    python benchmarks/upsert_rows.py [--rows 10000] [--repeat 3]

SQLite always; PostgreSQL when FENCED_TEST_POSTGRES_URL is set and MariaDB/MySQL when
FENCED_TEST_MYSQL_URL is set. Two phases per database: "insert" (empty table) and
"update" (every key exists; a newer fence rewrites it). Both sides run in one
transaction per phase and apply the same fence rule; the naive loop is what a
hand-written ingestion usually does: SELECT the row, then INSERT or UPDATE it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from fenced.store import upsert

FENCE = 1_790_000_000_000_000


def make_table(engine: sa.Engine) -> sa.Table:
    md = sa.MetaData()
    table = sa.Table(
        f"bench_items_{uuid.uuid4().hex[:8]}",
        md,
        sa.Column("url", sa.String(255), primary_key=True),
        sa.Column("title", sa.String(255)),
        sa.Column("body", sa.Text),
        sa.Column("fence", sa.BigInteger),
    )
    md.create_all(engine)
    return table


def make_rows(n: int, version: str) -> list[dict[str, Any]]:
    return [
        {
            "url": f"https://example.com/feed/{i}",
            "title": f"{version} title {i}",
            "body": f"{version} body {i} " * 4,
        }
        for i in range(n)
    ]


def naive(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]], fence: int) -> None:
    """One SELECT and then one INSERT or UPDATE per row, with the same fence rule."""
    for row in rows:
        stored = conn.execute(
            sa.select(table.c.fence).where(table.c.url == row["url"])
        ).one_or_none()
        if stored is None:
            conn.execute(sa.insert(table).values(**row, fence=fence))
        elif stored.fence is None or stored.fence <= fence:
            conn.execute(
                sa.update(table).where(table.c.url == row["url"]).values(**row, fence=fence)
            )


def fenced(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]], fence: int) -> None:
    upsert(conn, table, rows, key=["url"], fence=fence)


Loader = Callable[[sa.Connection, sa.Table, list[dict[str, Any]], int], None]


def timed(engine: sa.Engine, loader: Loader, n: int, repeat: int) -> dict[str, float]:
    """Best seconds per phase over ``repeat`` fresh tables."""
    best = {"insert": float("inf"), "update": float("inf")}
    for _ in range(repeat):
        table = make_table(engine)
        try:
            for phase, version, fence in (("insert", "v1", FENCE), ("update", "v2", FENCE + 1)):
                rows = make_rows(n, version)
                start = time.perf_counter()
                with engine.begin() as conn:
                    loader(conn, table, rows, fence)
                best[phase] = min(best[phase], time.perf_counter() - start)
            with engine.connect() as conn:
                count = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar()
                assert count == n, f"{count} rows, expected {n}"
        finally:
            table.metadata.drop_all(engine)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        targets = {"sqlite (file)": f"sqlite:///{os.path.join(tmp, 'bench.db')}"}
        for label, env in (
            ("postgresql", "FENCED_TEST_POSTGRES_URL"),
            ("mariadb/mysql", "FENCED_TEST_MYSQL_URL"),
        ):
            if os.environ.get(env):
                targets[label] = os.environ[env]
            else:
                print(f"({label}: skipped, {env} is not set)")
        print(f"{args.rows} rows, best of {args.repeat}")
        print(f"{'database':<16}{'phase':<8}{'fenced rows/s':>15}{'naive rows/s':>15}{'ratio':>8}")
        for label, url in targets.items():
            engine = sa.create_engine(url)
            try:
                ours = timed(engine, fenced, args.rows, args.repeat)
                theirs = timed(engine, naive, args.rows, args.repeat)
            finally:
                engine.dispose()
            for phase in ("insert", "update"):
                fast, slow = args.rows / ours[phase], args.rows / theirs[phase]
                print(f"{label:<16}{phase:<8}{fast:>15,.0f}{slow:>15,.0f}{fast / slow:>7.1f}x")


if __name__ == "__main__":
    main()
