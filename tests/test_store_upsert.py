"""Fenced upsert on real databases: SQLite always, PostgreSQL and MariaDB when given."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fenced import Claim, ConfigError, FencedError
from fenced.store import UpsertResult, _upsert, upsert
from fenced.testing import RedisServer

BIG = 1_790_000_000_000_000  # fences are microseconds: about this size

URLS = {
    "sqlite": None,
    "postgresql": os.environ.get("FENCED_TEST_POSTGRES_URL"),
    "mariadb": os.environ.get("FENCED_TEST_MYSQL_URL"),
}


@pytest.fixture(scope="module", params=list(URLS))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = request.param
    url: str | None
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'feeds.db'}"
    else:
        url = URLS[kind]
        if not url:
            env = "FENCED_TEST_POSTGRES_URL" if kind == "postgresql" else "FENCED_TEST_MYSQL_URL"
            pytest.skip(f"{env} is not set")
    eng = sa.create_engine(url)
    yield eng
    eng.dispose()


class Statements:
    """Counts the statements sent to the database (an executemany counts once)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.sent: list[str] = []

    def __enter__(self) -> Statements:
        sa.event.listen(self.engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._count)

    def _count(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.sent.append(statement)


@pytest.fixture
def feeds(engine: sa.Engine) -> Iterator[sa.Table]:
    """A feed-items table of its own, keyed by url, with a BIGINT fence."""
    md = sa.MetaData()
    table = sa.Table(
        f"feed_items_{uuid.uuid4().hex[:10]}",
        md,
        sa.Column("url", sa.String(255), primary_key=True),
        sa.Column("title", sa.String(255)),
        sa.Column("body", sa.Text),
        sa.Column("fence", sa.BigInteger),
    )
    md.create_all(engine)
    yield table
    md.drop_all(engine)


def _rows(n: int, version: str = "v1") -> list[dict[str, Any]]:
    return [
        {"url": f"https://example.com/{i}", "title": f"{version} title {i}", "body": f"body {i}"}
        for i in range(n)
    ]


def _contents(engine: sa.Engine, table: sa.Table) -> dict[str, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {
            row.url: (row.title, row.body, row.fence)
            for row in conn.execute(sa.select(table).order_by(table.c.url))
        }


def _written(engine: sa.Engine, n: int) -> int | None:
    return None if engine.dialect.name in ("mysql", "mariadb") else n


def test_running_the_same_ingestion_twice_converges(engine: sa.Engine, feeds: sa.Table) -> None:
    rows = _rows(250)
    with engine.begin() as conn:
        first = upsert(conn, feeds, rows, key=["url"], fence=BIG)
    once = _contents(engine, feeds)
    with engine.begin() as conn:
        second = upsert(conn, feeds, rows, key=["url"], fence=BIG)
    assert first == second == UpsertResult(250, _written(engine, 250))
    assert _contents(engine, feeds) == once
    assert len(once) == 250
    assert once["https://example.com/7"] == ("v1 title 7", "body 7", BIG)


@pytest.mark.parametrize("fence_in", ["rows", "statement"])
def test_a_lower_fence_does_not_overwrite_an_equal_or_higher_one_does(
    engine: sa.Engine, feeds: sa.Table, fence_in: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small calls stamp the fence on each row; large ones write it into the statement.
    monkeypatch.setattr(_upsert, "_INLINE_FROM", 1 if fence_in == "statement" else 10**9)
    with engine.begin() as conn:
        upsert(conn, feeds, _rows(40, "new"), key="url", fence=BIG + 10)
    newer = _contents(engine, feeds)
    # A stale holder's rows: every key exists with a higher fence, and some keys are new.
    with engine.begin() as conn:
        stale = upsert(conn, feeds, _rows(50, "stale"), key="url", fence=BIG + 9)
    after = _contents(engine, feeds)
    assert stale.rows == 50 and stale.written == _written(engine, 10)
    assert {url: v for url, v in after.items() if url in newer} == newer
    assert after["https://example.com/45"] == ("stale title 45", "body 45", BIG + 9)
    # Equal fence: the same holder running again overwrites; higher: a newer holder.
    with engine.begin() as conn:
        upsert(
            conn, feeds, [{"url": "https://example.com/1", "title": "again"}], "url", fence=BIG + 10
        )
        upsert(
            conn, feeds, [{"url": "https://example.com/2", "title": "later"}], "url", fence=BIG + 11
        )
    after = _contents(engine, feeds)
    assert after["https://example.com/1"] == ("again", "body 1", BIG + 10)  # body untouched
    assert after["https://example.com/2"] == ("later", "body 2", BIG + 11)
    assert after["https://example.com/3"] == ("new title 3", "body 3", BIG + 10)


def test_rows_written_before_fencing_are_overwritten(engine: sa.Engine, feeds: sa.Table) -> None:
    with engine.begin() as conn:
        conn.execute(sa.insert(feeds), [{"url": "u1", "title": "legacy", "fence": None}])
        upsert(conn, feeds, [{"url": "u1", "title": "fenced"}], key=["url"], fence=1)
    assert _contents(engine, feeds)["u1"] == ("fenced", None, 1)


def test_one_statement_per_batch(engine: sa.Engine, feeds: sa.Table) -> None:
    rows = _rows(2500)
    with engine.begin() as conn:
        with Statements(engine) as first:
            upsert(conn, feeds, rows, key=["url"], fence=BIG, batch_size=1000)
        with Statements(engine) as second:
            result = upsert(conn, feeds, rows, key=["url"], fence=BIG + 1, batch_size=1000)
    for counted in (first, second):
        assert len(counted.sent) == 3, counted.sent
        assert all(s.lstrip().upper().startswith("INSERT") for s in counted.sent)
    assert result == UpsertResult(2500, _written(engine, 2500))
    assert len(_contents(engine, feeds)) == 2500


def test_mysql_pages_reach_the_server_as_multi_row_statements(
    engine: sa.Engine, feeds: sa.Table
) -> None:
    # Each page is one executemany, which the driver folds into multi-row INSERTs: the
    # server counts a statement per page, not one per row.
    if engine.dialect.name not in ("mysql", "mariadb"):
        pytest.skip("MySQL/MariaDB: the driver folds an executemany")
    status = sa.text("SHOW SESSION STATUS LIKE 'Com_insert'")
    with engine.begin() as conn:
        for fence in (BIG, BIG + 1):
            before = int(conn.execute(status).one()[1])
            result = upsert(conn, feeds, _rows(2500), key=["url"], fence=fence, batch_size=1000)
            assert int(conn.execute(status).one()[1]) - before == 3
            assert result == UpsertResult(2500, None) and result.skipped is None
    assert len(_contents(engine, feeds)) == 2500


def test_repeated_keys_in_one_call_last_row_wins(engine: sa.Engine, feeds: sa.Table) -> None:
    rows = [
        {"url": "a", "title": "first"},
        {"url": "b", "title": "only"},
        {"url": "a", "title": "last"},
    ]
    with engine.begin() as conn:
        result = upsert(conn, feeds, rows, key=["url"], fence=5)
    assert result.rows == 2
    assert _contents(engine, feeds) == {"a": ("last", None, 5), "b": ("only", None, 5)}


def test_a_key_repeated_with_other_columns_keeps_the_last_row_and_rows_may_be_a_generator(
    engine: sa.Engine, feeds: sa.Table
) -> None:
    rows = [
        {"url": "a", "title": "first", "body": "first body"},
        {"url": "b", "title": "b"},
        {"body": "last body", "url": "a"},
        {"url": "c", "title": "c", "body": "c body"},
        {"title": "b again", "url": "b"},
    ]
    with engine.begin() as conn:
        result = upsert(conn, feeds, (row for row in rows), key=["url"], fence=5)
    assert result.rows == 3
    assert _contents(engine, feeds) == {
        "a": (None, "last body", 5),
        "b": ("b again", None, 5),
        "c": ("c", "c body", 5),
    }


def test_a_key_column_holding_none_is_refused_with_its_row(
    engine: sa.Engine, feeds: sa.Table
) -> None:
    rows = [*_rows(3), {"url": None, "title": "x"}]
    with (
        engine.begin() as conn,
        pytest.raises(ConfigError, match=r"row 3 has no value for key column\(s\) url"),
    ):
        upsert(conn, feeds, rows, key=["url"], fence=5)
    assert _contents(engine, feeds) == {}


def test_rows_with_different_columns_update_only_their_own(
    engine: sa.Engine, feeds: sa.Table
) -> None:
    with engine.begin() as conn:
        upsert(conn, feeds, [{"url": "a", "title": "t", "body": "b"}], key=["url"], fence=5)
        upsert(
            conn,
            feeds,
            [{"url": "a", "body": "new body"}, {"url": "c", "title": "c title"}],
            key=["url"],
            fence=6,
        )
    assert _contents(engine, feeds) == {"a": ("t", "new body", 6), "c": ("c title", None, 6)}


def test_by_table_name_and_through_an_engine(engine: sa.Engine, feeds: sa.Table) -> None:
    result = upsert(engine, feeds.name, _rows(3), key=["url"], fence=9)  # its own transaction
    assert result.rows == 3
    assert upsert(engine, feeds, [], key=["url"], fence=9) == UpsertResult(0, _written(engine, 0))
    assert len(_contents(engine, feeds)) == 3


def test_composite_key_and_a_unique_index_the_table_object_does_not_declare(
    engine: sa.Engine,
) -> None:
    name = f"layer_tiles_{uuid.uuid4().hex[:10]}"
    md = sa.MetaData()
    declared = sa.Table(
        name,
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(50), nullable=False),
        sa.Column("tile", sa.String(50), nullable=False),
        sa.Column("payload", sa.String(50)),
        sa.Column("fence", sa.BigInteger),
    )
    md.create_all(engine)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE UNIQUE INDEX {name}_key ON {name} (tenant, tile)"))
        rows = [{"tenant": "acme", "tile": "0/0", "payload": "x"}]
        with engine.begin() as conn:
            upsert(conn, declared, rows, key=["tenant", "tile"], fence=3)
            upsert(conn, declared, rows, key=["tenant", "tile"], fence=3)
            with pytest.raises(ConfigError, match=r"unique constraint on exactly \(tenant\)"):
                upsert(conn, declared, rows, key=["tenant"], fence=3)
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(declared)).scalar() == 1
    finally:
        md.drop_all(engine)


def test_a_column_declared_unique_inline_is_a_key(engine: sa.Engine) -> None:
    # The DDL Django writes for unique=True: on SQLite an automatic index backs it.
    name = f"feeds_{uuid.uuid4().hex[:10]}"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE {name} "
                "(url VARCHAR(100) NOT NULL UNIQUE, title VARCHAR(100), fence BIGINT)"
            )
        )
    try:
        rows = [{"url": "https://example.com/feed", "title": "t"}]
        upsert(engine, name, rows, key=["url"], fence=5)
        upsert(engine, name, [{**rows[0], "title": "old"}], key=["url"], fence=4)
        with engine.connect() as conn:
            got = conn.execute(sa.text(f"SELECT url, title, fence FROM {name}")).all()
        assert [tuple(r) for r in got] == [("https://example.com/feed", "t", 5)]
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {name}"))


def _table(engine: sa.Engine, *columns: sa.Column[Any]) -> sa.Table:
    md = sa.MetaData()
    table = sa.Table(f"bad_{uuid.uuid4().hex[:10]}", md, *columns)
    md.create_all(engine)
    return table


def test_bad_tables_are_refused_with_the_fix(engine: sa.Engine) -> None:
    tables = [
        no_key := _table(engine, sa.Column("id", sa.Integer, primary_key=True)),
        no_fence := _table(engine, sa.Column("url", sa.String(100), primary_key=True)),
        no_unique := _table(
            engine,
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("url", sa.String(100)),
            sa.Column("fence", sa.BigInteger),
        ),
        narrow := _table(
            engine,
            sa.Column("url", sa.String(100), primary_key=True),
            sa.Column("fence", sa.Integer),
        ),
        text_fence := _table(
            engine,
            sa.Column("url", sa.String(100), primary_key=True),
            sa.Column("fence", sa.String(20)),
        ),
    ]
    rows = [{"url": "u"}]
    try:
        with engine.begin() as conn:
            with pytest.raises(ConfigError, match="no column 'url' to key on"):
                upsert(conn, no_key, rows, key=["url"], fence=1)
            with pytest.raises(ConfigError, match="ADD COLUMN fence BIGINT"):
                upsert(conn, no_fence, rows, key=["url"], fence=1)
            with pytest.raises(ConfigError, match="CREATE UNIQUE INDEX"):
                upsert(conn, no_unique, rows, key=["url"], fence=1)
            with pytest.raises(ConfigError, match="make it BIGINT"):
                upsert(conn, text_fence, rows, key=["url"], fence=1)
            if engine.dialect.name == "sqlite":
                upsert(conn, narrow, rows, key=["url"], fence=BIG)  # SQLite integers are 64-bit
            else:
                with pytest.raises(ConfigError, match="make it BIGINT"):
                    upsert(conn, narrow, rows, key=["url"], fence=BIG)
            with pytest.raises(ConfigError, match="create it first"):
                upsert(conn, "no_such_table_here", rows, key=["url"], fence=1)
    finally:
        for t in tables:
            t.metadata.drop_all(engine)


def test_bad_input_writes_nothing(engine: sa.Engine, feeds: sa.Table) -> None:
    good = _rows(5)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"fence": None}, "not held"),
        ({"fence": "1790000000000000"}, "not an integer"),
        ({"fence": 1.5}, "not an integer"),
        ({"fence": True}, "bool"),
        ({"rows": [*good, {"url": "x", "colour": "red"}]}, "'colour'"),
        ({"rows": [*good, {"title": "no url"}]}, "no value for key column"),
        ({"rows": [*good, {"url": "x", "fence": 2}]}, "upsert stamps it"),
        ({"rows": [*good, ("url", "x")]}, "not a mapping"),
        ({"rows": {"url": "x"}}, "not one row"),
        ({"key": []}, "must name the key"),
        ({"key": ["fence"]}, "cannot be part of the key"),
        ({"batch_size": 0}, "batch_size"),
    ]
    for change, message in cases:
        args: dict[str, Any] = {"rows": good, "key": ["url"], "fence": 1, **change}
        with engine.begin() as conn, pytest.raises(ConfigError, match=message):
            upsert(conn, feeds, **args)
    assert _contents(engine, feeds) == {}
    with pytest.raises(ConfigError, match="Connection or Engine"):
        upsert("sqlite://", feeds, good, key=["url"], fence=1)  # type: ignore[arg-type]
    assert issubclass(ConfigError, FencedError)


def test_a_paused_holder_cannot_overwrite_a_newer_holders_rows(
    server: RedisServer, engine: sa.Engine, feeds: sa.Table
) -> None:
    client = server.client()
    a = Claim(client, "ingest:feeds", ttl=0.3, heartbeat=False)
    assert a.acquire() and a.fence is not None
    time.sleep(0.5)  # paused past its lease
    b = Claim(client, "ingest:feeds", ttl=5, heartbeat=False)
    assert b.acquire() and b.fence is not None
    with engine.begin() as conn:
        upsert(conn, feeds, _rows(20, "from B"), key=["url"], fence=b.fence)
    with engine.begin() as conn:
        upsert(conn, feeds, _rows(20, "from A"), key=["url"], fence=a.fence)  # A resumes
    titles = {title for title, _body, _fence in _contents(engine, feeds).values()}
    assert all(t.startswith("from B") for t in titles)
    b.release()


def test_without_sqlalchemy_the_import_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['sqlalchemy'] = None  # as if it were not installed\n"
        "from fenced.store import ContentStore, FilePointer, RedisPointer\n"
        "try:\n"
        "    from fenced.store import upsert\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'fenced[sql]'" in out.stdout
