"""Fenced upsert: repeated ingestion converges, and a stale holder overwrites nothing.

One statement, never a select-then-insert per row:

- SQLite, PostgreSQL: ``INSERT … VALUES (…) ON CONFLICT (key) DO UPDATE SET …
  WHERE stored.fence IS NULL OR stored.fence <= excluded.fence``, compiled once and
  sent with pages of ``batch_size`` rows through the driver's executemany (sqlite3
  runs it prepared in C, psycopg pipelines it prepared); the driver counts the rows
  written;
- MariaDB, MySQL: ``INSERT … VALUES (…) ON DUPLICATE KEY UPDATE col =
  IF(fence IS NULL OR fence <= VALUES(fence), VALUES(col), col), …`` with the fence
  assigned last, so every condition reads the stored fence (MySQL applies the
  assignments left to right), compiled once and sent with pages of ``batch_size`` rows
  through the driver's executemany (pymysql and mysqlclient fold them into multi-row
  statements). ON DUPLICATE KEY fires on *any* unique key of the table.

Every row is written with the caller's fence. A row whose stored fence is higher (a
newer holder already wrote it) is left as it is; an equal fence overwrites, so the same
holder may run its ingestion again. Fences are microsecond-sized integers (~1.8e15):
the fence column must be a BIGINT.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:
    import sqlalchemy as sa
    from sqlalchemy.dialects import mysql as _mysql
    from sqlalchemy.dialects import postgresql as _postgresql
    from sqlalchemy.dialects import sqlite as _sqlite
    from sqlalchemy.engine import Connection, Engine
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("fenced.store.upsert needs SQLAlchemy 2: pip install 'fenced[sql]'") from exc

from .._errors import ConfigError
from ._durable import check_fence

__all__ = ["UpsertResult", "upsert"]

_SQLITE = ("sqlite",)
_ON_CONFLICT = ("sqlite", "postgresql")
_DUPLICATE_KEY = ("mysql", "mariadb")
#: Keep the driver's count of rows changed by an executemany INSERT (SQLAlchemy 2.0.28).
_COUNTED = {"preserve_rowcount": True}
#: From this many rows on, the fence is written into the statement instead of each row:
#: its compile (about 0.5 ms per new fence) costs less than stamping the rows.
_INLINE_FROM = 500


@dataclass(frozen=True)
class UpsertResult:
    """What an upsert sent, and what the database reports it wrote."""

    rows: int
    written: int | None
    """Rows inserted or updated (SQLite, PostgreSQL); None where the driver's count is
    ambiguous (MySQL counts an update twice and may count untouched rows)."""

    @property
    def skipped(self) -> int | None:
        """Rows left alone because a higher fence was stored, where the count is known."""
        return None if self.written is None else self.rows - self.written


def upsert(
    conn: Connection | Engine,
    table: sa.Table | str,
    rows: Iterable[Mapping[str, object]],
    key: Sequence[str] | str,
    fence_column: str = "fence",
    *,
    fence: int,
    batch_size: int = 1000,
) -> UpsertResult:
    """Insert or update ``rows`` by ``key``, never over a row stored with a higher fence.

    On a Connection the statements join its transaction (commit it); on an Engine they
    run in a transaction of their own. Every row is checked before the first statement,
    so bad input writes nothing. Rows repeating a key: the last one wins.
    """
    fence = check_fence(fence)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive int")
    if isinstance(conn, Engine):
        with conn.begin() as c:
            return upsert(c, table, rows, key, fence_column, fence=fence, batch_size=batch_size)
    if not isinstance(conn, Connection):
        raise ConfigError(
            f"upsert needs a SQLAlchemy Connection or Engine, not {type(conn).__name__}: "
            "pass engine.connect() or the engine; for a Session, pass session.connection()"
        )
    dialect = conn.dialect.name
    if dialect not in _ON_CONFLICT + _DUPLICATE_KEY:
        raise ConfigError(
            f"upsert supports sqlite, postgresql, mysql and mariadb, not {dialect}: "
            "use one of them, or write the dialect's upsert by hand"
        )
    keys = [key] if isinstance(key, str) else list(key)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"key={key!r} must name the key columns, e.g. key=['url']")
    tbl = _table(conn, table)
    _check_table(conn, tbl, keys, fence_column)
    batches = _prepare(tbl, rows, keys, fence_column, fence)

    written: int | None = 0
    for columns, group in batches:
        if dialect in _ON_CONFLICT:
            # One statement, compiled once, sent with pages of batch_size rows as the
            # driver's executemany: sqlite3 runs it prepared in C, psycopg pipelines it
            # prepared. The count of rows changed is the driver's (an update the fence
            # rule refused changes none); preserve_rowcount keeps it for an INSERT.
            stmt = _statement(dialect, tbl, columns, keys, fence_column)
            stamped = fence_column in group[0]
            if not stamped and len(group) >= _INLINE_FROM:
                # The fence as a constant of the statement (a checked int): rows are sent
                # as given, a parameter less each, for one compile per fence.
                stmt = stmt.values({fence_column: sa.literal_column(str(fence), sa.BigInteger)})
                stamped = True
            for start in range(0, len(group), batch_size):
                page = group[start : start + batch_size]
                if not stamped:
                    page = [{**row, fence_column: fence} for row in page]
                count = conn.execute(stmt, page, execution_options=_COUNTED).rowcount
                written = None if written is None or count < 0 else written + count
            continue
        # One statement compiled per set of columns, sent with pages of batch_size rows as
        # the driver's executemany: pymysql and mysqlclient fold an INSERT … VALUES (…) ON
        # DUPLICATE KEY UPDATE into multi-row statements (a driver that does not runs it
        # per row). The fence is a parameter of each row: a constant in the VALUES list
        # would keep those drivers from folding, and one bound value of the statement costs
        # SQLAlchemy more per row (it maps the cached statement's value for each) than the
        # copy that stamps it.
        stmt = _statement(dialect, tbl, columns, keys, fence_column)
        stamped = fence_column in group[0]
        for start in range(0, len(group), batch_size):
            page = group[start : start + batch_size]
            if not stamped:
                page = [{**row, fence_column: fence} for row in page]
            conn.execute(stmt, page)
    total = sum(len(group) for _cols, group in batches)
    return UpsertResult(total, written if dialect in _ON_CONFLICT else None)


def _table(conn: Connection, table: sa.Table | str) -> sa.Table:
    if isinstance(table, sa.Table):
        return table
    if not isinstance(table, str) or not table:
        raise ConfigError(f"table={table!r}: pass a sqlalchemy.Table or a table name")
    schema, _, name = table.rpartition(".")
    try:
        return sa.Table(name, sa.MetaData(), schema=schema or None, autoload_with=conn)
    except sa.exc.NoSuchTableError:
        raise ConfigError(
            f"no table {table!r} in the database: create it first (with a unique key and "
            "a BIGINT fence column)"
        ) from None


def _check_table(conn: Connection, tbl: sa.Table, keys: list[str], fence_column: str) -> None:
    missing = [k for k in keys if k not in tbl.c]
    if missing:
        raise ConfigError(
            f"table {tbl.name!r} has no column {', '.join(map(repr, missing))} to key on: "
            f"pass key= the columns that identify a row (it has: {', '.join(tbl.c.keys())})"
        )
    if fence_column in keys:
        raise ConfigError(f"the fence column {fence_column!r} cannot be part of the key")
    if fence_column not in tbl.c:
        raise ConfigError(
            f"table {tbl.name!r} has no fence column {fence_column!r}: add one, e.g. "
            f"ALTER TABLE {tbl.name} ADD COLUMN {fence_column} BIGINT, or pass "
            "fence_column= the column that holds it"
        )
    col_type = tbl.c[fence_column].type
    wide_enough = isinstance(col_type, sa.BigInteger) or (
        conn.dialect.name in _SQLITE and isinstance(col_type, sa.Integer)
    )
    if not wide_enough:
        raise ConfigError(
            f"fence column {tbl.name}.{fence_column} is {col_type}, but fences are 64-bit "
            f"integers (~1.8e15): make it BIGINT (ALTER TABLE {tbl.name} ALTER COLUMN "
            f"{fence_column} TYPE BIGINT, or MODIFY {fence_column} BIGINT on MySQL)"
        )
    if not _has_unique(conn, tbl, set(keys)):
        raise ConfigError(
            f"table {tbl.name!r} has no primary key or unique constraint on exactly "
            f"({', '.join(keys)}), so conflicts cannot be detected: add one, e.g. "
            f"CREATE UNIQUE INDEX {tbl.name}_{'_'.join(keys)} ON {tbl.name} ({', '.join(keys)})"
        )


def _has_unique(conn: Connection, tbl: sa.Table, keys: set[str]) -> bool:
    declared: list[Any] = [tbl.primary_key.columns]
    declared += [c.columns for c in tbl.constraints if isinstance(c, sa.UniqueConstraint)]
    declared += [index.columns for index in tbl.indexes if index.unique]
    if any({c.name for c in cols if isinstance(c, sa.Column)} == keys for cols in declared):
        return True
    # A Table declared in Python may omit a constraint the database has: ask the database.
    insp = sa.inspect(conn)
    if not insp.has_table(tbl.name, schema=tbl.schema):
        raise ConfigError(f"no table {tbl.name!r} in the database: create it first")
    found: list[Sequence[str | None]] = [
        insp.get_pk_constraint(tbl.name, schema=tbl.schema).get("constrained_columns") or []
    ]
    found += [u["column_names"] for u in insp.get_unique_constraints(tbl.name, schema=tbl.schema)]
    found += [
        i["column_names"] for i in insp.get_indexes(tbl.name, schema=tbl.schema) if i["unique"]
    ]
    if conn.dialect.name in _SQLITE:
        found += _sqlite_auto_unique(conn, tbl)
    return any(set(cols) == keys for cols in found)


def _sqlite_auto_unique(conn: Connection, tbl: sa.Table) -> list[list[str]]:
    """Columns of SQLite's automatic unique indexes, which SQLAlchemy does not reflect.

    A column declared ``UNIQUE`` inline (``url TEXT NOT NULL UNIQUE``, which is what
    Django creates for ``unique=True``) is backed by a ``sqlite_autoindex_*`` index
    and appears neither as a unique constraint nor as an index to the inspector.
    """
    quote = conn.dialect.identifier_preparer.quote
    schema = f"{quote(tbl.schema)}." if tbl.schema else ""
    found: list[list[str]] = []
    for row in conn.exec_driver_sql(f"PRAGMA {schema}index_list({quote(tbl.name)})").all():
        # (seq, name, unique, origin, partial): a partial index is no conflict target.
        if row[2] and str(row[1]).startswith("sqlite_autoindex") and not row[4]:
            info = conn.exec_driver_sql(f"PRAGMA {schema}index_info({quote(row[1])})").all()
            found.append([str(r[2]) for r in info])
    return found


def _prepare(
    tbl: sa.Table,
    rows: Iterable[Mapping[str, object]],
    keys: list[str],
    fence_column: str,
    fence: int,
) -> list[tuple[tuple[str, ...], list[Mapping[str, Any]]]]:
    """Check every row, keep the last row per key, group by columns (the fence last).

    Rows are not copied: a row that carries the fence column must carry this upsert's
    fence, and the statements add the fence to the rows that do not.
    """
    if isinstance(rows, (Mapping, str, bytes)):
        raise ConfigError("rows must be an iterable of mappings (a list of dicts), not one row")
    rows = rows if type(rows) is list else list(rows)
    known = frozenset(tbl.c.keys())
    # Rows mostly share one set of columns: each set met is checked once, and a row
    # pays a comparison of its keys with the last set's.
    groups: dict[frozenset[str], list[Mapping[str, Any]]] = {}
    if _alike(rows) and fence_column not in rows[0]:
        # Dicts with one set of columns and no fence, checked in C: the usual call.
        _check_columns(tbl.name, known, rows[0].keys(), keys, 0)
        groups[frozenset(rows[0])] = rows
    names: Any = None
    group: list[Mapping[str, Any]] = []
    carries = False
    for n, row in enumerate(rows if not groups else ()):
        if type(row) is not dict and not isinstance(row, Mapping):
            raise ConfigError(f"row {n} is a {type(row).__name__}, not a mapping: pass dicts")
        if row.keys() != names:
            names = row.keys()
            carries = fence_column in names
            group = groups.setdefault(frozenset(names), [])
            if not group:
                _check_columns(tbl.name, known, names, keys, n)
        if carries and row[fence_column] != fence:
            raise ConfigError(
                f"row {n} carries {fence_column}={row[fence_column]!r}, not the fence={fence} "
                f"of this upsert: leave {fence_column!r} out of the rows, upsert stamps it"
            )
        group.append(row)
    one = keys[0] if len(keys) == 1 else None
    by_key: dict[Any, tuple[frozenset[str], Mapping[str, Any]]] = {}
    for names, group in groups.items():
        if one is not None:
            unique = dict(zip(map(operator.itemgetter(one), group), group))
        else:
            unique = {tuple([row[c] for c in keys]): row for row in group}
        if None in unique or (one is None and any(None in k for k in unique)):
            n, row = next((n, r) for n, r in enumerate(rows) if any(r.get(c) is None for c in keys))
            absent = [c for c in keys if row.get(c) is None]
            raise ConfigError(f"row {n} has no value for key column(s) {', '.join(absent)}")
        if len(groups) == 1:
            if len(unique) < len(group):  # a repeated key: the last row wins
                groups[names] = list(unique.values())
            break
        for k, row in unique.items():
            by_key.pop(k, None)  # the last row of a key wins, whatever its columns
            by_key[k] = (names, row)
    if len(groups) > 1:
        groups = {}
        for names, row in by_key.values():
            groups.setdefault(names, []).append(row)
    # The fence goes last: MySQL assigns left to right (see the module docstring).
    return [
        ((*sorted(c for c in names if c != fence_column), fence_column), group)
        for names, group in groups.items()
        if group
    ]


def _alike(rows: list[Any]) -> bool:
    """Whether ``rows`` are dicts that all have the first one's keys."""
    if not rows or type(rows[0]) is not dict:
        return False
    width = len(rows[0])
    # As many keys in each row as in the first, and no other key among them all: each row
    # has the first one's keys (two passes in C, cheaper than comparing the keys per row).
    return (
        set(map(type, rows)) == {dict}
        and set(map(len, rows)) == {width}
        and len(set().union(*rows)) == width
    )


def _check_columns(table: str, known: frozenset[str], names: Any, keys: list[str], n: int) -> None:
    unknown = [c for c in names if c not in known]
    if unknown:
        raise ConfigError(
            f"row {n} has column(s) {', '.join(map(repr, unknown))} that table "
            f"{table!r} lacks: drop them or add the columns"
        )
    absent = [c for c in keys if c not in names]
    if absent:
        raise ConfigError(f"row {n} has no value for key column(s) {', '.join(absent)}")


def _statement(
    dialect: str,
    tbl: sa.Table,
    columns: tuple[str, ...],
    keys: list[str],
    fence_column: str,
) -> Any:
    stored = tbl.c[fence_column]
    updated = [c for c in columns if c not in keys]
    if dialect in _ON_CONFLICT:
        ins = (_sqlite.insert if dialect == "sqlite" else _postgresql.insert)(tbl)
        newer = sa.or_(stored.is_(None), stored <= ins.excluded[fence_column])
        return ins.on_conflict_do_update(
            index_elements=[tbl.c[k] for k in keys],
            set_={c: ins.excluded[c] for c in updated},
            where=newer,
        )
    my = _mysql.insert(tbl)
    newer = sa.or_(stored.is_(None), stored <= my.inserted[fence_column])
    # Ordered pairs, fence last: every IF() above it still compares the stored fence.
    assignments = [(c, sa.func.IF(newer, my.inserted[c], tbl.c[c])) for c in updated]
    return my.on_duplicate_key_update(assignments)
