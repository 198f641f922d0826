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
from sqlalchemy.dialects import mysql, postgresql, sqlite

from fenced.store import upsert

FENCE = 1_790_000_000_000_000
PAGE = 1_000


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


def expert(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]], fence: int) -> None:
    """The bulk statement an expert writes by hand for the same rows and fence rule:
    SQLAlchemy Core's dialect insert, sent with pages of 1,000 row dicts."""
    stamped = [{**row, "fence": fence} for row in rows]
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        module = sqlite if dialect == "sqlite" else postgresql
        ins = module.insert(table)
        stmt = ins.on_conflict_do_update(
            index_elements=[table.c.url],
            set_={c: ins.excluded[c] for c in ("title", "body", "fence")},
            where=table.c.fence <= ins.excluded.fence,
        )
        for start in range(0, len(stamped), PAGE):
            conn.execute(stmt, stamped[start : start + PAGE])
        return
    for start in range(0, len(stamped), PAGE):
        my = mysql.insert(table).values(stamped[start : start + PAGE])
        newer = table.c.fence <= my.inserted.fence
        conn.execute(
            my.on_duplicate_key_update(
                [(c, sa.func.IF(newer, my.inserted[c], table.c[c])) for c in ("title", "body")]
                + [("fence", sa.func.IF(newer, my.inserted.fence, table.c.fence))]
            )
        )


def fenced(conn: sa.Connection, table: sa.Table, rows: list[dict[str, Any]], fence: int) -> None:
    upsert(conn, table, rows, key=["url"], fence=fence)


Loader = Callable[[sa.Connection, sa.Table, list[dict[str, Any]], int], None]


def timed(
    engine: sa.Engine, loaders: dict[str, Loader], n: int, repeat: int
) -> dict[str, dict[str, float]]:
    """Best seconds per loader and phase over ``repeat`` rounds, the loaders interleaved
    (each on a fresh table) so a slow minute of the machine falls on all of them."""
    best = {name: {"insert": float("inf"), "update": float("inf")} for name in loaders}
    for _ in range(repeat):
        for name, loader in loaders.items():
            table = make_table(engine)
            try:
                for phase, version, fence in (
                    ("insert", "v1", FENCE),
                    ("update", "v2", FENCE + 1),
                ):
                    rows = make_rows(n, version)
                    start = time.perf_counter()
                    with engine.begin() as conn:
                        loader(conn, table, rows, fence)
                    best[name][phase] = min(best[name][phase], time.perf_counter() - start)
                with engine.connect() as conn:
                    count = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar()
                    assert count == n, f"{name}: {count} rows, expected {n}"
                    stale = conn.execute(
                        sa.select(sa.func.count())
                        .select_from(table)
                        .where(table.c.fence != FENCE + 1)
                    ).scalar()
                    assert stale == 0, f"{name}: {stale} rows not rewritten by the newer fence"
            finally:
                table.metadata.drop_all(engine)
    return best


def refuses_stale(engine: sa.Engine, loader: Loader) -> bool:
    """Whether ``loader`` leaves a row alone that a higher fence wrote (its fence rule)."""
    table = make_table(engine)
    try:
        with engine.begin() as conn:
            loader(conn, table, make_rows(3, "new"), FENCE + 5)
        with engine.begin() as conn:
            loader(conn, table, make_rows(3, "old"), FENCE)
        with engine.connect() as conn:
            titles = conn.execute(sa.select(table.c.title)).scalars().all()
        return all(t.startswith("new") for t in titles)
    finally:
        table.metadata.drop_all(engine)


#: fenced's upsert against the hand-written bulk statement, in the same run (issue target).
TARGET = 0.95


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    missed = []
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
        print(f"{args.rows} rows, best of {args.repeat}, interleaved; rows/s and fenced's ratio")
        print(
            f"{'database':<16}{'phase':<8}{'fenced':>10}{'bulk':>10}{'naive':>10}"
            f"{'vs bulk':>9}{'vs naive':>10}"
        )
        for label, url in targets.items():
            engine = sa.create_engine(url)
            try:
                loaders: dict[str, Loader] = {"fenced": fenced, "bulk": expert, "naive": naive}
                for name, loader in loaders.items():
                    assert refuses_stale(engine, loader), (
                        f"{label}: {name} wrote over a newer fence"
                    )
                best = timed(engine, loaders, args.rows, args.repeat)
            finally:
                engine.dispose()
            for phase in ("insert", "update"):
                rate = {name: args.rows / best[name][phase] for name in loaders}
                vs_bulk = rate["fenced"] / rate["bulk"]
                vs_naive = rate["fenced"] / rate["naive"]
                print(
                    f"{label:<16}{phase:<8}{rate['fenced']:>10,.0f}{rate['bulk']:>10,.0f}"
                    f"{rate['naive']:>10,.0f}{vs_bulk:>8.2f}x{vs_naive:>9.1f}x"
                )
                if vs_bulk < TARGET:
                    missed.append(f"{label} {phase}: {vs_bulk:.2f}x the bulk statement")
    if missed:
        print(
            f"target missed (at least {TARGET}x the hand-written bulk statement): "
            + "; ".join(missed)
        )
        raise SystemExit(1)
    print(f"target met: at least {TARGET}x the hand-written bulk statement everywhere")


if __name__ == "__main__":
    main()
