"""The stores the workers write to, for each lane.

The fenced lane writes through fenced's own stores, each refusing a stale fence:
``RedisPointer`` on the store Redis, ``FilePointer``, ``upsert``, and, where Azurite
runs (the Azure Blob Storage emulator), an ``ObjectPointer`` naming a blob of an
``ObjectStore``. The Lock lane does the same writes with no fence (what code under
redis-py's ``Lock`` can do): a hash set in a transaction, a file replaced with
``os.replace``, an unconditional upsert, a pointer object overwritten. Each store of
both lanes also keeps its order of acceptance where it can (the pointer's publish
stream; a log table written in the upsert's transaction), which the checker reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import obstore
import redis
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from fenced import CorruptObject, StaleFence, StoreError
from fenced.store import FilePointer, ObjectPointer, ObjectStore, RedisPointer, upsert
from fenced.testing import AzuriteServer

from .config import LANES, Shared

__all__ = [
    "CONTAINER",
    "KEY",
    "STORES",
    "Final",
    "Stores",
    "create_tables",
    "drop_tables",
    "read_final",
    "stores_of",
]

#: Every store a run may write; "object" only where Azurite runs (``stores_of``).
STORES = ("redis", "file", "sql", "object")
#: The Azurite container of a run's object stores (a prefix per lane under it).
CONTAINER = "chaos"
#: The one row every upsert writes.
KEY = "current"
#: Publishes a RedisPointer keeps in its stream: all of them, for the checker.
HISTORY = 1_000_000


def stores_of(shared: Shared) -> tuple[str, ...]:
    """The stores this run writes."""
    return STORES if shared.extra.get("object_endpoint") else STORES[:-1]


def object_store(endpoint: str, lane: str) -> ObjectStore:
    """A lane's ObjectStore on the run's Azurite (its account endpoint)."""
    options = AzuriteServer.options_for(endpoint)
    # A request that hangs (Azurite paused, a worker stopped mid-request) fails in 10 s.
    return ObjectStore(f"az://{CONTAINER}/{lane}", client_options={"timeout": "10s"}, **options)


def _tables(prefix: str) -> dict[str, sa.Table]:
    md = sa.MetaData()
    out: dict[str, sa.Table] = {}
    for lane in LANES:
        out[lane] = sa.Table(
            f"{prefix}_{lane}",
            md,
            sa.Column("key", sa.String(32), primary_key=True),
            sa.Column("value", sa.String(200), nullable=False),
            sa.Column("fence", sa.BigInteger),
        )
        out[f"{lane}_log"] = sa.Table(
            f"{prefix}_{lane}_log",
            md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("value", sa.String(200), nullable=False),
            sa.Column("fence", sa.BigInteger),
        )
    return out


def engine_for(url: str) -> sa.Engine:
    """An engine for one worker process: SQLite waits for its lock instead of failing."""
    if url.startswith("sqlite"):
        return sa.create_engine(url, connect_args={"timeout": 60})
    return sa.create_engine(url, pool_size=1, max_overflow=2, pool_pre_ping=True)


def create_tables(url: str, prefix: str) -> None:
    """Create this run's tables (the harness, before any worker starts)."""
    engine = engine_for(url)
    with engine.begin() as conn:
        if url.startswith("sqlite"):
            # Many writer processes: a write-ahead log lets readers and one writer along.
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        next(iter(_tables(prefix).values())).metadata.create_all(conn)
    engine.dispose()


def drop_tables(url: str, prefix: str) -> None:
    """Drop this run's tables."""
    engine = engine_for(url)
    with engine.begin() as conn:
        next(iter(_tables(prefix).values())).metadata.drop_all(conn)
    engine.dispose()


class Stores:
    """The stores of one lane (three, or four with the object store), as one worker
    process writes them."""

    def __init__(self, shared: Shared, lane: str) -> None:
        if lane not in LANES:
            raise ValueError(f"lane {lane!r}: one of {LANES}")
        self.lane = lane
        self.fenced = lane == "fenced"
        self.redis = redis.Redis.from_url(shared.store_url, socket_timeout=10)
        self.dir = Path(shared.files_dir) / lane
        self.targets = self.dir / "targets"
        self.targets.mkdir(parents=True, exist_ok=True)
        tables = _tables(shared.sql_prefix)
        self.table, self.log = tables[lane], tables[f"{lane}_log"]
        self.engine = engine_for(shared.sql_url)
        self.pointer = RedisPointer(self.redis, shared.name, history=HISTORY)
        self.file_pointer = FilePointer(self.dir / "pointer")
        self.plain_key = f"chaos:{lane}:pointer"
        self.plain_log = f"chaos:{lane}:log"
        self.names = stores_of(shared)
        endpoint = shared.extra.get("object_endpoint")
        self.objects = object_store(endpoint, lane) if endpoint else None
        self.object_pointer = ObjectPointer(self.objects, "current") if self.objects else None

    def write(self, store: str, wid: str, fence: int | None) -> bool:
        """Write ``wid`` to one store; False when the store refused it as stale."""
        if self.fenced:
            if fence is None:
                raise ValueError("the fenced lane writes with a fence")
            try:
                if store == "redis":
                    self.pointer.swap(wid, fence=fence)
                elif store == "file":
                    target = self.targets / wid
                    target.touch()
                    self.file_pointer.swap(target, fence=fence)
                elif store == "object":
                    objects, pointer = self._objects()
                    pointer.swap(objects.put(wid.encode()), fence=fence)
                else:
                    return self._upsert(wid, fence)
            except StaleFence:
                return False
            return True
        if store == "redis":
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.plain_key, "target", wid)
            pipe.xadd(self.plain_log, {"target": wid})
            pipe.execute()
        elif store == "file":
            path = self.dir / "pointer"
            tmp = self.dir / f".pointer.{os.getpid()}"
            tmp.write_text(json.dumps({"target": wid}))
            os.replace(tmp, path)
        elif store == "object":
            objects, pointer = self._objects()
            objects.put(wid.encode())
            # Overwritten whatever it holds: no read, no condition.
            body = json.dumps({"target": wid}).encode()
            obstore.put(objects.backend, pointer.key, body, use_multipart=False)
        else:
            self._plain_upsert(wid)
        return True

    def _objects(self) -> tuple[ObjectStore, ObjectPointer]:
        if self.objects is None or self.object_pointer is None:
            raise ValueError("this run has no object store (no Azurite)")
        return self.objects, self.object_pointer

    def _upsert(self, wid: str, fence: int) -> bool:
        with self.engine.begin() as conn:
            result = upsert(conn, self.table, [{"key": KEY, "value": wid}], key="key", fence=fence)
            if result.written:
                # In the upsert's transaction, after it took the row's lock: the log's
                # ids follow the order in which the database accepted the writes.
                conn.execute(self.log.insert().values(value=wid, fence=fence))
            return bool(result.written)

    def _plain_upsert(self, wid: str) -> None:
        with self.engine.begin() as conn:
            dialect = conn.dialect.name
            if dialect not in ("sqlite", "postgresql"):
                raise ValueError(f"the chaos suite runs on SQLite or PostgreSQL, not {dialect}")
            insert = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(self.table)
            stmt = insert.values(key=KEY, value=wid).on_conflict_do_update(
                index_elements=[self.table.c.key], set_={"value": wid}
            )
            conn.execute(stmt)
            conn.execute(self.log.insert().values(value=wid, fence=None))

    def close(self) -> None:
        """Let go of connections."""
        self.engine.dispose()
        self.redis.close()


@dataclass
class Final:
    """One store's state after the run: its value, and its order of acceptance."""

    value: str | None
    fence: int | None
    #: (write id, fence) in the order the store accepted them; None where it keeps none.
    accepted: list[tuple[str, int | None]] | None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_final(shared: Shared, lane: str) -> dict[str, Final]:
    """What each store of ``lane`` holds once every writer has stopped."""
    stores = Stores(shared, lane)
    try:
        out: dict[str, Final] = {}
        if stores.fenced:
            published = stores.pointer.read()
            history = [(p.target, p.fence) for p in reversed(stores.pointer.history(HISTORY))]
            out["redis"] = Final(
                published.target if published else None,
                published.fence if published else None,
                [(t, f) for t, f in history],
            )
            on_file = stores.file_pointer.read()
            out["file"] = Final(
                Path(on_file.target).name if on_file else None,
                on_file.fence if on_file else None,
                None,
            )
            if stores.object_pointer is not None and stores.objects is not None:
                published = stores.object_pointer.read()
                # The blob it names holds the write's id: read whole, checked by its digest
                # (a pointer naming a missing or damaged blob is a final value no write
                # made: the checker reports it).
                value = None
                if published and published.digest:
                    try:
                        value = stores.objects.read_bytes(published.digest).decode()
                    except (StoreError, CorruptObject) as exc:
                        value = f"(blob {published.digest[:12]} unreadable: {exc})"[:200]
                out["object"] = Final(value, published.fence if published else None, None)
        else:
            client: Any = stores.redis
            raw = client.hget(stores.plain_key, "target")
            entries = client.xrange(stores.plain_log)
            out["redis"] = Final(
                _text(raw) if raw is not None else None,
                None,
                [(_text(fields[b"target"]), None) for _id, fields in entries],
            )
            path = stores.dir / "pointer"
            value = json.loads(path.read_text())["target"] if path.exists() else None
            out["file"] = Final(value, None, None)
            if stores.object_pointer is not None and stores.objects is not None:
                try:
                    got = obstore.get(stores.objects.backend, stores.object_pointer.key)
                    target = json.loads(bytes(got.bytes()))["target"]
                except FileNotFoundError:
                    target = None
                out["object"] = Final(target, None, None)
        with stores.engine.connect() as conn:
            row = conn.execute(
                sa.select(stores.table.c.value, stores.table.c.fence).where(
                    stores.table.c.key == KEY
                )
            ).first()
            log = conn.execute(
                sa.select(stores.log.c.value, stores.log.c.fence).order_by(stores.log.c.id)
            ).all()
        out["sql"] = Final(
            row[0] if row else None,
            row[1] if row else None,
            [(str(v), None if f is None else int(f)) for v, f in log],
        )
        return out
    finally:
        stores.close()
