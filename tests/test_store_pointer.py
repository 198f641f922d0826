"""Fenced pointers: atomic swaps under concurrent readers, stale fences, crashes, Cluster."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from _wait import wait_for
from fenced import Claim, ConfigError, FencedError, StaleFence, StoreError
from fenced.store import ContentStore, FilePointer, Pointer, Published, RedisPointer, Ref
from fenced.testing import RedisServer

HERE = Path(__file__).parent
CHILD = str(HERE / "store_child.py")
sys.path.insert(0, str(HERE))
import store_child  # noqa: E402

BIG = 1_790_000_000_000_000  # fences are microseconds: about this size


@pytest.fixture
def store(tmp_path: Path) -> ContentStore:
    return ContentStore(tmp_path / "objects", create=True)


def _child(*args: object, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CHILD, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    data: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return data


# -- FilePointer ----------------------------------------------------------------------


def test_swap_and_read(store: ContentStore, tmp_path: Path) -> None:
    ptr = FilePointer(tmp_path / "builds" / "incidents" / "current")
    assert ptr.read() is None
    a, b = store.put(b"object a"), store.put(b"object b")
    published = ptr.swap(a, fence=BIG)
    assert published == Published(str(a.path), BIG, a.digest, a.size)
    assert ptr.read() == published and published.ref == a
    assert ptr.swap(b, fence=BIG + 1).target == str(b.path)
    assert ptr.read() == Published(str(b.path), BIG + 1, b.digest, b.size)
    # A plain path (a directory a build wrote) publishes too, without a digest.
    out = tmp_path / "out-2"
    out.mkdir()
    assert ptr.swap(out, fence=BIG + 2) == Published(str(out), BIG + 2)
    assert json.loads(ptr.path.read_text()) == {
        "target": str(out),
        "fence": BIG + 2,
        "digest": None,
        "size": None,
    }


def test_lower_fence_is_refused_and_changes_nothing(store: ContentStore, tmp_path: Path) -> None:
    ptr = FilePointer(tmp_path / "current")
    new, old = store.put(b"object new"), store.put(b"object old")
    ptr.swap(new, fence=BIG + 5)
    before = ptr.path.read_bytes(), ptr.path.stat().st_ino
    with pytest.raises(StaleFence) as info:
        ptr.swap(old, fence=BIG + 4)
    assert info.value.fence == BIG + 4 and info.value.current == BIG + 5
    assert "newer claim holder" in str(info.value)
    assert (ptr.path.read_bytes(), ptr.path.stat().st_ino) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "current.lock", "objects"]


def test_equal_fence_is_accepted_and_a_repeat_writes_nothing(
    store: ContentStore, tmp_path: Path
) -> None:
    ptr = FilePointer(tmp_path / "current")
    a, b = store.put(b"object a"), store.put(b"object b")
    ptr.swap(a, fence=BIG)
    inode = ptr.path.stat().st_ino
    assert ptr.swap(a, fence=BIG) == ptr.read()  # the same publish again: nothing written
    assert ptr.path.stat().st_ino == inode
    ptr.swap(b, fence=BIG)  # the same holder publishing something new
    assert ptr.read() == Published(str(b.path), BIG, b.digest, b.size)
    assert ptr.path.stat().st_ino != inode


def test_readers_polling_during_1000_swaps_always_see_a_complete_target(
    store: ContentStore, tmp_path: Path
) -> None:
    refs = [store.put(f"object {i}\n".encode() * (50 + i * 40)) for i in range(25)]
    pointer = tmp_path / "current"
    ready = [tmp_path / f"ready-{i}" for i in range(2)]
    stop = tmp_path / "stop"
    readers = [_child("read", store.root, pointer, r, stop) for r in ready]
    try:
        for r, proc in zip(ready, readers, strict=True):
            wait_for("a reader to be ready", r.exists, proc=proc)
        ptr = FilePointer(pointer)
        for i in range(1000):
            ptr.swap(refs[i % len(refs)], fence=BIG + i // 3)  # equal fences, too
    finally:
        stop.touch()
    reports = [_report(proc) for proc in readers]
    for report in reports:
        assert report["errors"] == []
        assert report["published"] > 0
        assert report["last_fence"] == BIG + 333
    assert sum(report["targets"] for report in reports) > 2  # they saw swaps happen


def test_stale_and_fresh_writers_racing_never_move_the_fence_back(
    store: ContentStore, tmp_path: Path
) -> None:
    for i in range(10):
        store.put(f"object {i}\n".encode() * 100)
    pointer, go, stop, ready = (tmp_path / n for n in ("current", "go", "stop", "ready"))
    reader = _child("read", store.root, pointer, ready, stop)
    wait_for("the reader to be ready", ready.exists, proc=reader)
    # The stale writer holds the lower fence; without the lock around compare-and-replace
    # it could read the old fence, lose the CPU, and replace the fresh writer's publish.
    writers = [_child("swap", store.root, pointer, BIG + f, 500, go) for f in (1, 2)]
    go.touch()
    try:
        stale, fresh = (_report(w) for w in writers)
    finally:
        stop.touch()
    report = _report(reader)
    assert report["errors"] == []
    assert fresh == {"fence": BIG + 2, "accepted": 500, "stale": 0}
    assert stale["accepted"] + stale["stale"] == 500
    published = FilePointer(pointer).read()
    assert published is not None and published.fence == BIG + 2


def test_swap_waits_for_the_lock_then_gives_up_with_a_clear_error(
    store: ContentStore, tmp_path: Path
) -> None:
    ptr = FilePointer(tmp_path / "current", lock_timeout=0.2)
    ref = store.put(b"object")
    with open(ptr.lock_path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(StoreError, match="raise lock_timeout"):
            ptr.swap(ref, fence=1)
    assert ptr.read() is None
    assert ptr.swap(ref, fence=1).fence == 1


def test_root_confines_pointer_and_target_and_keeps_them_relative(tmp_path: Path) -> None:
    builds = tmp_path / "builds"
    store = ContentStore(builds / "objects", create=True)
    ref = store.put(b"object inside")
    ptr = FilePointer(builds / "incidents" / "current", root=builds)
    ptr.swap(ref, fence=3)
    stored = json.loads(ptr.path.read_text())
    assert stored["target"] == f"objects/{ref.digest[:2]}/{ref.digest[2:]}"
    # Move the whole tree: the pointer still resolves, against its new root.
    moved = tmp_path / "moved"
    builds.rename(moved)
    again = FilePointer(moved / "incidents" / "current", root=moved)
    published = again.read()
    assert published is not None and published.ref is not None
    assert ContentStore(moved / "objects").read_bytes(published.ref) == b"object inside"


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "builds"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    with pytest.raises(ConfigError, match="is not an existing directory"):
        FilePointer(root / "current", root=tmp_path / "missing")
    with pytest.raises(ConfigError, match="outside its root"):
        FilePointer(tmp_path / "current", root=root)
    with pytest.raises(ConfigError, match="outside its root"):
        FilePointer(root / "escape" / "current", root=root)
    with pytest.raises(ConfigError, match="is a directory"):
        FilePointer(root)

    ptr = FilePointer(root / "current", root=root)
    target = root / "out"
    target.mkdir()
    with pytest.raises(ConfigError, match="outside the pointer's root"):
        ptr.swap(outside, fence=1)
    with pytest.raises(ConfigError, match="does not exist"):
        ptr.swap(root / "not-written-yet", fence=1)
    with pytest.raises(ConfigError, match="cannot publish"):
        ptr.swap(42, fence=1)  # type: ignore[arg-type]
    for fence in (None, "5", 5.0, True, -1, 2**63):
        with pytest.raises(ConfigError, match="fence"):
            ptr.swap(target, fence=fence)  # type: ignore[arg-type]
    assert sorted(p.name for p in root.iterdir()) == ["escape", "out"]  # nothing written
    assert issubclass(ConfigError, FencedError)


def test_a_foreign_file_is_not_read_as_a_pointer(tmp_path: Path) -> None:
    path = tmp_path / "current"
    path.write_text("not json")
    ptr = FilePointer(path)
    with pytest.raises(StoreError, match="not a fenced pointer file"):
        ptr.read()
    with pytest.raises(StoreError, match="not a fenced pointer file"):
        ptr.swap(tmp_path, fence=1)
    assert path.read_text() == "not json"


# -- crash safety ---------------------------------------------------------------------

TILES = 6
CRASH_POINTS = [
    "put:written@3",  # an object's bytes written, not yet fsynced
    "put:synced@3",  # fsynced, not yet renamed into place
    "put:renamed@3",  # renamed, directory not yet fsynced
    "build:objects",  # every object stored, no manifest yet
    f"put:synced@{TILES + 1}",  # the manifest itself, half way
    "build:manifest",  # manifest stored, pointer not swapped
    "swap:locked",  # holding the pointer lock
    "swap:written",  # new pointer file written beside the old one
    "swap:replaced",  # pointer replaced, directory not yet fsynced
]


def _expected(tmp_path: Path, version: str) -> tuple[Ref, dict[str, bytes]]:
    """A clean reference build in a separate store: what every run must converge to."""
    store = ContentStore(tmp_path / f"reference-{version}", create=True)
    objects = store_child.build_objects(version, TILES)
    manifest = store.put_manifest({name: store.put(data) for name, data in objects.items()})
    return manifest, objects


def _watch(store: ContentStore, ptr: FilePointer, seen: list[str], stop: threading.Event) -> None:
    """Poll like a web server would: every publish seen must be complete."""
    while not stop.is_set():
        try:
            pub = ptr.read()
            if pub is not None:
                store_child.check_published(store, pub)
                seen.append(pub.digest or "")
        except Exception as exc:
            seen.append(f"ERROR {type(exc).__name__}: {exc}")
            return


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_build_killed_at_any_point_converges_when_run_again(tmp_path: Path, point: str) -> None:
    store_dir, pointer = tmp_path / "objects", tmp_path / "incidents" / "current"
    v1, _ = _expected(tmp_path, "v1")
    v2, v2_objects = _expected(tmp_path, "v2")
    store_child.build(ContentStore(store_dir, create=True), FilePointer(pointer), BIG, "v1", TILES)
    store, ptr = ContentStore(store_dir), FilePointer(pointer)
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(store, ptr, seen, stop))
    watcher.start()
    try:
        crashed = _child(
            "build", store_dir, pointer, BIG + 10, "v2", TILES, env={"FENCED_CRASH_AT": point}
        )
        crashed.communicate(timeout=120)
        assert crashed.returncode == -9, f"the build was not killed at {point}"
        # Killed: the pointer shows the old build or the new one, complete either way,
        # and every object under its final name is whole.
        after_crash = ptr.read()
        assert after_crash is not None and after_crash.digest in (v1.digest, v2.digest)
        assert after_crash.digest == v2.digest or point != "swap:replaced"
        for ref in store.refs():
            store.verify(ref)
        # The next run (a new claim, a higher fence) converges on the clean build.
        rerun = _child("build", store_dir, pointer, BIG + 20, "v2", TILES)
        rerun.communicate(timeout=120)
        assert rerun.returncode == 0
    finally:
        stop.set()
        watcher.join()
    assert not [s for s in seen if s.startswith("ERROR")], seen
    assert set(seen) <= {v1.digest, v2.digest}
    published = ptr.read()
    assert published == Published(str(store.path_of(v2.digest)), BIG + 20, v2.digest, v2.size)
    entries = store.read_manifest(v2)
    assert {name: store.read_bytes(ref) for name, ref in entries.items()} == v2_objects
    # Whatever the crash left behind (temp files, the unpublished v1) goes with gc.
    removed = store.gc(keep=[ptr], grace=0)
    assert v1.digest in {ref.digest for ref in removed}
    assert not list((store.root / ".tmp").iterdir())
    assert {ref.digest for ref in store.refs()} == {v2.digest} | {
        ref.digest for ref in entries.values()
    }


# -- a stale claim holder -------------------------------------------------------------


def test_a_paused_holder_cannot_publish_after_a_newer_holder(
    server: RedisServer, store: ContentStore, tmp_path: Path
) -> None:
    client = server.client()
    file_ptr = FilePointer(tmp_path / "current")
    redis_ptr = RedisPointer(client, "rebuild:incidents")
    a = Claim(client, "rebuild:incidents", ttl=0.3, heartbeat=False)
    assert a.acquire()
    old = store.put(b"object from A")
    time.sleep(0.5)  # A is paused past its lease
    b = Claim(client, "rebuild:incidents", ttl=5, heartbeat=False)
    assert b.acquire()
    assert a.fence is not None and b.fence is not None and b.fence > a.fence
    new = store.put(b"object from B")
    for ptr in (file_ptr, redis_ptr):
        ptr.swap(new, fence=b.fence)
        with pytest.raises(StaleFence):
            ptr.swap(old, fence=a.fence)  # A resumes and tries to publish
        published = ptr.read()
        assert published is not None and published.digest == new.digest
    b.release()


# -- the Pointer protocol -------------------------------------------------------------


def test_both_pointers_are_pointers_and_gc_keeps_what_each_publishes(
    r: Any, store: ContentStore, tmp_path: Path
) -> None:
    pointers: list[Pointer] = [FilePointer(tmp_path / "current"), RedisPointer(r, "maps:gc")]
    kept: list[set[str]] = []
    for n, ptr in enumerate(pointers):
        assert isinstance(ptr, Pointer)
        tile = store.put(f"tile {n}".encode())
        manifest = store.put_manifest({"tile": tile})
        ptr.swap(manifest, fence=BIG + n)
        kept.append({manifest.digest, tile.digest})
    orphan = store.put(b"never published")
    everything = {ref.digest for ref in store.refs()}
    assert everything == kept[0] | kept[1] | {orphan.digest}
    for ptr, published in zip(pointers, kept, strict=True):
        removed = store.gc(keep=[ptr], grace=0, dry_run=True)
        assert {ref.digest for ref in removed} == everything - published
    removed = store.gc(keep=pointers, grace=0)
    assert [ref.digest for ref in removed] == [orphan.digest]
    assert {ref.digest for ref in store.refs()} == kept[0] | kept[1]
    assert not isinstance(store, Pointer) and not isinstance(orphan, Pointer)


# -- RedisPointer ---------------------------------------------------------------------


def test_redis_pointer_contract(r: Any) -> None:
    ptr = RedisPointer(r, "maps:incidents")
    assert ptr.read() is None
    ref = Ref("a" * 64, Path("/builds/objects/aa/" + "a" * 62), 10)
    assert ptr.swap(ref, fence=BIG) == Published(str(ref.path), BIG, ref.digest, 10)
    assert ptr.read() == Published(str(ref.path), BIG, ref.digest, 10)
    assert ptr.swap(ref, fence=BIG) == ptr.read()  # equal fence: accepted
    ptr.swap("s3://bucket/incidents/v2", fence=BIG + 1)
    with pytest.raises(StaleFence) as info:
        ptr.swap("s3://bucket/incidents/v1", fence=BIG)
    assert info.value.current == BIG + 1
    assert ptr.read() == Published("s3://bucket/incidents/v2", BIG + 1)
    # The log holds accepted publishes only (the repeat was not logged), newest first.
    assert [p.fence for p in ptr.history()] == [BIG + 1, BIG]


def test_redis_pointer_compares_fences_beyond_double_precision(r: Any) -> None:
    ptr = RedisPointer(r, "maps:huge")
    ptr.swap("high", fence=2**60 + 1)
    with pytest.raises(StaleFence):
        ptr.swap("low", fence=2**60)  # the same double as 2**60 + 1
    ptr.swap("higher", fence=2**62)
    assert ptr.read() == Published("higher", 2**62)


def test_redis_pointer_reads_are_never_torn(server: RedisServer) -> None:
    client = server.client(decode_responses=True)
    ptr = RedisPointer(client, "maps:incidents", history=10)
    errors: list[str] = []
    reads = [0]
    stop = threading.Event()

    def poll() -> None:
        reader = RedisPointer(server.client(), "maps:incidents")
        last = -1
        while not stop.is_set():
            pub = reader.read()
            reads[0] += 1
            if pub is None:
                continue
            if pub.target != f"target-{pub.fence}" or pub.fence < last:
                errors.append(f"{pub} after fence {last}")
            last = pub.fence

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        for i in range(1000):
            ptr.swap(f"target-{BIG + i}", fence=BIG + i)
    finally:
        stop.set()
        thread.join()
    assert errors == [] and reads[0] > 0
    assert len(ptr.history(limit=1000)) < 200  # the log is capped


def test_redis_pointer_bad_input(r: Any) -> None:
    with pytest.raises(ConfigError, match="no Redis given"):
        RedisPointer(None, "x")
    with pytest.raises(ConfigError, match="namespace"):
        RedisPointer(r, "x", namespace="a{b}")
    with pytest.raises(ConfigError, match="history"):
        RedisPointer(r, "x", history=-1)
    ptr = RedisPointer(r, "x")
    for fence in (None, "7", 7.5):
        with pytest.raises(ConfigError, match="fence"):
            ptr.swap("t", fence=fence)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="empty"):
        ptr.swap("", fence=1)
    assert ptr.read() is None and r.keys("*") == []


def test_redis_pointer_keys_share_one_cluster_slot_with_the_claim() -> None:
    for name in ("maps:incidents", "rebuild:{weird} name", "t" * 300):
        ptr = RedisPointer(redis.Redis(), name, namespace="prod")
        claim = Claim(redis.Redis(), name, namespace="prod", heartbeat=False)
        assert ptr.key.startswith("prod:{")
        slots = {key_slot(k.encode()) for k in (ptr.key, ptr.log_key, claim.keys.lock)}
        assert len(slots) == 1, (name, ptr.key, claim.keys.lock)


def test_redis_pointer_on_a_real_cluster(cluster_server: RedisServer) -> None:
    node = cluster_server.client()
    cluster = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        ptr = RedisPointer(cluster, "maps:incidents")
        ptr.swap("v1", fence=BIG)
        ptr.swap("v2", fence=BIG + 1)
        with pytest.raises(StaleFence):
            ptr.swap("v0", fence=BIG - 1)
        assert ptr.read() == Published("v2", BIG + 1)
        assert [p.target for p in ptr.history()] == ["v2", "v1"]
        # The server itself refuses a script over keys in two slots: the check is real.
        with pytest.raises(redis.ResponseError, match="same slot"):
            node.eval("return 1", 2, "a:{one}", "a:{two}")
    finally:
        cluster.close()
        node.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "appendonly"])
def test_redis_pointer_keeps_its_fence_over_a_restart_only_with_persistence(
    persistent: bool,
) -> None:
    """The model's finding (docs/model.md), on a real server: a RedisPointer remembers its
    last fence only as long as its Redis does. Killed and restarted without persistence,
    it accepts a lower fence; with ``appendonly yes`` (fsync always) it refuses it."""
    extra = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else []
    with RedisServer(extra=extra) as server:
        ptr = RedisPointer(server.client(), "maps:restart")
        ptr.swap("s3://bucket/v2", fence=BIG + 2)
        server.restart()  # kill -9, then the same server again
        ptr = RedisPointer(server.client(), "maps:restart")
        if persistent:
            with pytest.raises(StaleFence):
                ptr.swap("s3://bucket/v1", fence=BIG + 1)
            assert ptr.read() == Published("s3://bucket/v2", BIG + 2)
        else:
            assert ptr.read() is None  # forgotten
            ptr.swap("s3://bucket/v1", fence=BIG + 1)  # a stale holder's swap: accepted
            assert ptr.read() == Published("s3://bucket/v1", BIG + 1)
