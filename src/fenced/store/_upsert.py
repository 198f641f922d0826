"""Fenced upsert: repeated ingestion converges, and a stale holder overwrites nothing.

One statement, never a select-then-insert per row:

- SQLite, PostgreSQL: ``INSERT … VALUES (…) ON CONFLICT (key) DO UPDATE SET …
  WHERE stored.fence IS NULL OR stored.fence <= excluded.fence``, compiled once and
  sent with pages of ``batch_size`` rows through the driver's executemany (sqlite3
  runs it prepared in C, psycopg pipelines it prepared); the driver counts the rows
  written;
- MariaDB, MySQL: ``INSERT … VALUES (…), (…) ON DUPLICATE KEY UPDATE col =
  IF(fence IS NULL OR fence <= VALUES(fence), VALUES(col), col), …`` with the fence
  assigned last, so every condition reads the stored fence (MySQL applies the
  assignments left to right). ON DUPLICATE KEY fires on *any* unique key of the table.

Every row is written with the caller's fence. A row whose stored fence is higher (a
newer holder already wrote it) is left as it is; an equal fence overwrites, so the same
holder may run its ingestion again. Fences are microsecond-sized integers (~1.8e15):
the fence column must be a BIGINT.
"""

from __future__ import annotations

import sqlite3
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
#: Bound parameters one statement may carry (the lowest limit of the supported databases).
_MAX_PARAMS = 32766 if sqlite3.sqlite_version_info >= (3, 32) else 999


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
            stmt = _statement(dialect, tbl, None, columns, keys, fence_column)
            for start in range(0, len(group), batch_size):
                page = group[start : start + batch_size]
                count = conn.execute(stmt, page, execution_options=_COUNTED).rowcount
                written = None if written is None or count < 0 else written + count
            continue
        # One explicit multi-row VALUES per batch: the MySQL drivers' executemany
        # rewriting is theirs to change, so the batch is not left to it.
        per_statement = max(1, min(batch_size, _MAX_PARAMS // len(columns)))
        for start in range(0, len(group), per_statement):
            chunk = group[start : start + per_statement]
            conn.execute(_statement(dialect, tbl, chunk, columns, keys, fence_column))
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
) -> list[tuple[tuple[str, ...], list[dict[str, Any]]]]:
    """Check every row, stamp the fence, keep the last row per key, group by columns."""
    if isinstance(rows, (Mapping, str, bytes)):
        raise ConfigError("rows must be an iterable of mappings (a list of dicts), not one row")
    known = frozenset(tbl.c.keys())
    # The row's key: its one key column's value, or a tuple of them.
    one = keys[0] if len(keys) == 1 else None
    by_key: dict[Any, dict[str, Any]] = {}
    # Rows mostly share one set of columns in one order: each order met is checked and
    # sorted once, and a row pays a dict lookup for it.
    orders: dict[tuple[str, ...], tuple[str, ...]] = {}
    cols_of: dict[Any, tuple[str, ...]] = {}
    for n, row in enumerate(rows):
        if type(row) is not dict and not isinstance(row, Mapping):
            raise ConfigError(f"row {n} is a {type(row).__name__}, not a mapping: pass dicts")
        order = tuple(row)
        cols = orders.get(order)
        if cols is None:
            unknown = [c for c in order if c not in known]
            if unknown:
                raise ConfigError(
                    f"row {n} has column(s) {', '.join(map(repr, unknown))} that table "
                    f"{tbl.name!r} lacks: drop them or add the columns"
                )
            # The fence goes last: MySQL assigns left to right (see the module docstring).
            cols = orders[order] = (*sorted(c for c in order if c != fence_column), fence_column)
        if fence_column in row and row[fence_column] != fence:
            raise ConfigError(
                f"row {n} carries {fence_column}={row[fence_column]!r}, not the fence={fence} "
                f"of this upsert: leave {fence_column!r} out of the rows, upsert stamps it"
            )
        stamped: dict[str, Any] = {**row, fence_column: fence}
        k: Any = stamped.get(one) if one is not None else tuple([stamped.get(c) for c in keys])
        if k is None or (one is None and None in k):
            absent = [c for c in keys if stamped.get(c) is None]
            raise ConfigError(f"row {n} has no value for key column(s) {', '.join(absent)}")
        by_key[k] = stamped  # a repeated key: the last row wins
        if len(orders) > 1:
            cols_of[k] = cols
    if not by_key:
        return []
    first = next(iter(orders.values()))
    if len(orders) == 1:  # one set of columns: one group, no second pass
        return [(first, list(by_key.values()))]
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for k, row in by_key.items():
        groups.setdefault(cols_of.get(k, first), []).append(row)
    return list(groups.items())


def _statement(
    dialect: str,
    tbl: sa.Table,
    chunk: list[dict[str, Any]] | None,
    columns: tuple[str, ...],
    keys: list[str],
    fence_column: str,
) -> Any:
    stored = tbl.c[fence_column]
    updated = [c for c in columns if c not in keys]
    if dialect in _ON_CONFLICT:
        ins = (_sqlite.insert if dialect == "sqlite" else _postgresql.insert)(tbl)
        if chunk is not None:
            ins = ins.values(chunk)
        newer = sa.or_(stored.is_(None), stored <= ins.excluded[fence_column])
        return ins.on_conflict_do_update(
            index_elements=[tbl.c[k] for k in keys],
            set_={c: ins.excluded[c] for c in updated},
            where=newer,
        )
    my = _mysql.insert(tbl).values(chunk or [])
    newer = sa.or_(stored.is_(None), stored <= my.inserted[fence_column])
    # Ordered pairs, fence last: every IF() above it still compares the stored fence.
    assignments = [(c, sa.func.IF(newer, my.inserted[c], tbl.c[c])) for c in updated]
    return my.on_duplicate_key_update(assignments)
