"""The stores against hostile data: symlinks, devices, tampered pointer files, umask, and
values in Redis that a RedisPointer never writes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fenced import ConfigError, FencedError, StaleFence, StoreError
from fenced.store import ContentStore, FilePointer, RedisPointer
from fenced.store._content import TMP_DIR
from fenced.store._pointer import MAX_POINTER_SIZE


@pytest.fixture
def root(tmp_path: Path) -> Path:
    builds = tmp_path / "builds"
    builds.mkdir()
    return builds


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the store holding a file nobody may touch through the store."""
    there = tmp_path / "outside"
    there.mkdir()
    (there / "secret").write_text("outside bytes\n")
    return there


def _tree(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` with its bytes and mtime: what 'untouched' means."""
    return {
        str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# -- reads are bounded ----------------------------------------------------------------


def test_a_pointer_linked_to_dev_zero_is_refused_not_read_forever(tmp_path: Path) -> None:
    # In a child with capped memory: a read without a bound fails there, not here.
    link = tmp_path / "current"
    link.symlink_to("/dev/zero")
    code = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from fenced import StoreError
        from fenced.store import FilePointer
        try:
            FilePointer({str(link)!r}).read()
        except StoreError as exc:
            print(exc)
            sys.exit(0)
        sys.exit(3)
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert str(link) in res.stdout and "symbolic link" in res.stdout


def test_a_pointer_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "current"
    os.mkfifo(fifo)  # a read of a FIFO nobody writes would block forever
    with pytest.raises(StoreError, match="not a regular file") as err:
        FilePointer(fifo).read()
    assert str(fifo) in str(err.value)


def test_a_pointer_larger_than_the_maximum_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "current"
    entry = {"target": "x" * MAX_POINTER_SIZE, "fence": 1}
    path.write_text(json.dumps(entry))
    with pytest.raises(StoreError, match="larger than") as err:
        FilePointer(path).read()
    assert str(path) in str(err.value) and str(MAX_POINTER_SIZE) in str(err.value)
    # A swap refuses it too, and leaves it as it was.
    with pytest.raises(StoreError, match="larger than"):
        FilePointer(path).swap(tmp_path, fence=2)
    assert json.loads(path.read_text()) == entry


# -- reads are confined to the root ---------------------------------------------------


@pytest.mark.parametrize(
    "target",
    ["../../etc/passwd", "objects/../../../etc/passwd", "/etc/passwd", "escape/secret", ".."],
)
def test_a_tampered_pointer_cannot_send_a_reader_outside_its_root(
    root: Path, outside: Path, target: str
) -> None:
    (root / "objects").mkdir()
    (root / "escape").symlink_to(outside)
    ptr = FilePointer(root / "current", root=root)
    ptr.path.write_text(json.dumps({"target": target, "fence": 7}))
    with pytest.raises(StoreError, match="outside the pointer's root") as err:
        ptr.read()
    assert str(ptr.path) in str(err.value)
    assert isinstance(err.value, FencedError)


def test_a_target_inside_the_root_through_an_inner_symlink_still_reads(root: Path) -> None:
    (root / "v2").mkdir()
    (root / "latest").symlink_to("v2")
    ptr = FilePointer(root / "current", root=root)
    published = ptr.swap(root / "latest", fence=1)
    assert ptr.read() == published and published.target == str(root.resolve() / "latest")
    whole = ptr.swap(root, fence=2)  # the root itself is inside it
    assert ptr.read() == whole and whole.target == str(root.resolve())


def test_swap_refuses_a_target_whose_last_link_leads_outside(root: Path, outside: Path) -> None:
    ptr = FilePointer(root / "current", root=root)
    (root / "ok").mkdir()
    before = ptr.swap(root / "ok", fence=1)
    (root / "link").symlink_to(outside / "secret")
    with pytest.raises(ConfigError, match="outside the pointer's root"):
        ptr.swap(root / "link", fence=2)
    assert ptr.read() == before


# -- writes never follow a symlink ----------------------------------------------------


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(
    root: Path, outside: Path
) -> None:
    ptr = FilePointer(root / "current", root=root)
    (root / "a").mkdir()
    before = ptr.swap(root / "a", fence=1)
    untouched = _tree(outside)
    ptr.lock_path.unlink()
    ptr.lock_path.symlink_to(outside / "secret")
    with pytest.raises(StoreError, match="symbolic link") as err:
        ptr.swap(root / "a", fence=2)
    assert str(ptr.lock_path) in str(err.value)
    assert _tree(outside) == untouched
    assert ptr.read() == before  # the previous pointer stays
    # A dangling link is not a way to create a file elsewhere either.
    ptr.lock_path.unlink()
    ptr.lock_path.symlink_to(outside / "created")
    with pytest.raises(StoreError, match="symbolic link"):
        ptr.swap(root / "a", fence=2)
    assert not (outside / "created").exists() and ptr.read() == before


def test_a_symlinked_pointer_file_is_neither_read_nor_replaced(root: Path, outside: Path) -> None:
    (root / "a").mkdir()
    ptr = FilePointer(root / "current", root=root)
    ptr.path.symlink_to(outside / "secret")
    for act in (ptr.read, lambda: ptr.swap(root / "a", fence=1)):
        with pytest.raises(StoreError, match="symbolic link"):
            act()
    assert ptr.path.is_symlink() and (outside / "secret").read_text() == "outside bytes\n"


def test_a_symlinked_fan_out_directory_is_refused(tmp_path: Path, outside: Path) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    data = b"bytes that must stay inside the store"
    fan = store.path_of(hashlib.sha256(data).hexdigest()).parent
    fan.symlink_to(outside, target_is_directory=True)
    untouched = _tree(outside)
    with pytest.raises(StoreError, match="symbolic link") as err:
        store.put(data)
    assert str(fan) in str(err.value)
    assert _tree(outside) == untouched
    tmp = store.root / TMP_DIR
    assert not tmp.exists() or list(tmp.iterdir()) == []
    # Written from a stream, the object is refused at the rename, and nothing is left.
    read_end, write_end = os.pipe()
    os.write(write_end, data)
    os.close(write_end)
    with open(read_end, "rb") as stream, pytest.raises(StoreError, match="symbolic link"):
        store.put(stream)
    assert _tree(outside) == untouched and list(tmp.iterdir()) == []


def test_objects_are_not_read_through_symlinks(tmp_path: Path, outside: Path) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    ref = store.put(b"an object")
    # The fan-out directory swapped for a link to a copy elsewhere.
    copy = outside / "copy"
    copy.mkdir()
    (copy / ref.path.name).write_bytes(b"an object")
    fan = ref.path.parent
    fan.rename(tmp_path / "moved-fan")
    fan.symlink_to(copy, target_is_directory=True)
    for act in (
        lambda: store.read_bytes(ref),
        lambda: store.read_bytes(ref.digest),
        lambda: store.exists(ref),
        lambda: store.ref(ref.digest),
        lambda: list(store.refs()),
        lambda: store.gc(keep=[], grace=0),
    ):
        with pytest.raises(StoreError, match="symbolic link"):
            act()
    assert (copy / ref.path.name).exists()  # gc removed nothing through the link
    # The object itself a link to /dev/zero: refused, not read forever.
    fan.unlink()
    (tmp_path / "moved-fan").rename(fan)
    os.chmod(ref.path, 0o644)
    ref.path.unlink()
    ref.path.symlink_to("/dev/zero")
    for digest_or_ref in (ref, ref.digest):
        with pytest.raises(StoreError, match="symbolic link"):
            store.read_bytes(digest_or_ref)


def test_a_symlinked_temporary_directory_is_refused(tmp_path: Path, outside: Path) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    (store.root / TMP_DIR).symlink_to(outside, target_is_directory=True)
    untouched = _tree(outside)
    with pytest.raises(StoreError, match="symbolic link"):
        store.put(b"never written elsewhere")
    assert _tree(outside) == untouched


# -- created files honour the umask ---------------------------------------------------


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    mask: int = request.param
    old = os.umask(mask)
    try:
        yield mask
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_created_files_and_directories_honour_the_umask(tmp_path: Path, umask: int) -> None:
    store = ContentStore(tmp_path / "builds" / "objects", create=True)
    ref = store.put(b"readable as the umask allows")
    assert _mode(ref.path) == 0o444 & ~umask  # read-only: immutable objects
    assert _mode(ref.path.parent) == 0o777 & ~umask
    assert _mode(store.root / TMP_DIR) == 0o777 & ~umask
    assert _mode(store.root) == 0o777 & ~umask
    ptr = FilePointer(tmp_path / "builds" / "feeds" / "current", root=tmp_path / "builds")
    ptr.swap(ref, fence=1)
    assert _mode(ptr.path) == 0o666 & ~umask
    assert _mode(ptr.lock_path) == 0o666 & ~umask
    assert _mode(ptr.path.parent) == 0o777 & ~umask


# -- a RedisPointer over values it never writes ----------------------------------------

#: case -> (the pointer hash's fields, or a seed of the key, what read() names)
FOREIGN_POINTERS: dict[str, tuple[Any, str]] = {
    "fence not an integer": ({"target": "t", "fence": "yesterday"}, "'yesterday' is not an"),
    "fence negative": ({"target": "t", "fence": "-5"}, "'-5' is not an integer"),
    "size not an integer": ({"target": "t", "fence": "7", "size": "big"}, "size 'big'"),
    "target not UTF-8": ({"target": b"\xff\xfe", "fence": "7"}, "not UTF-8"),
    "a string": (lambda c, k: c.set(k, "x"), "not a hash"),
    "a list": (lambda c, k: c.rpush(k, "x"), "not a hash"),
}


@pytest.mark.parametrize("case", list(FOREIGN_POINTERS))
def test_a_redis_pointer_read_refuses_what_a_swap_never_writes(
    case: str, r: Any, server: Any
) -> None:
    seed, says = FOREIGN_POINTERS[case]
    raw = server.client()
    ptr = RedisPointer(r, "maps:bad")
    if callable(seed):
        seed(raw, ptr.key)
    else:
        raw.hset(ptr.key, mapping=seed)
    with pytest.raises(StoreError) as err:
        ptr.read()
    text = str(err.value)
    assert f"DEL {ptr.key}" in text, text
    if r.get_encoder().decode_responses and case == "target not UTF-8":
        return  # the client cannot hand the reply over at all; the key is still named
    assert says in text, text


def test_a_redis_pointer_swap_refuses_a_foreign_fence_and_keeps_it(r: Any, server: Any) -> None:
    raw = server.client()
    ptr = RedisPointer(r, "maps:bad")
    for stored in ("x", "yesterday", "0012", "1e9", "\xff"):
        raw.hset(ptr.key, mapping={"target": "old", "fence": stored})
        for fence in (1, 2**62):
            with pytest.raises(StoreError, match="not an integer") as err:
                ptr.swap("new", fence=fence)
            assert not isinstance(err.value, StaleFence)
            assert f"DEL {ptr.key}" in str(err.value)
        assert raw.hget(ptr.key, "target") == b"old"  # never overwritten
    assert raw.exists(ptr.log_key) == 0


@pytest.mark.parametrize("which", ["key", "log_key"])
def test_a_redis_pointer_swap_refuses_a_key_of_another_type_unwritten(
    which: str, r: Any, server: Any
) -> None:
    raw = server.client()
    ptr = RedisPointer(r, "maps:bad")
    ptr.swap("old", fence=1)
    key = getattr(ptr, which)
    raw.delete(key)
    raw.set(key, "x")
    with pytest.raises(StoreError, match="is a string") as err:
        ptr.swap("new", fence=2)
    assert f"DEL {key}" in str(err.value)
    if which == "log_key":
        assert raw.hget(ptr.key, "target") == b"old"  # not half published
    raw.delete(key)
    assert ptr.swap("new", fence=2).target == "new"


def test_a_redis_pointer_history_lists_unreadable_entries_and_goes_on(r: Any, server: Any) -> None:
    raw = server.client()
    ptr = RedisPointer(r, "maps:bad")
    ptr.swap("first", fence=1)
    raw.xadd(ptr.log_key, {"target": "t", "fence": "ten"})
    raw.xadd(ptr.log_key, {"no": "fields"})
    raw.xadd(ptr.log_key, {"target": "t", "fence": "3", "size": "-1"})
    ptr.swap("last", fence=5)
    got = ptr.history()
    assert [p.target for p in got] == ["last", "t", "", "t", "first"]
    assert [p.unreadable is None for p in got] == [True, False, False, False, True]
    assert "'-1' is not an integer" in str(got[1].unreadable)
    assert "target" in str(got[2].unreadable)
    assert got[3].as_dict()["unreadable"] == "its fence 'ten' is not an integer"
    assert "unreadable" not in got[0].as_dict()

    raw.xadd(ptr.log_key, {"target": b"\xff", "fence": "6"})
    got = ptr.history()
    assert got[0].unreadable is not None and "UTF-8" in got[0].unreadable
    if not r.get_encoder().decode_responses:
        assert len(got) == 6 and got[1].target == "last"

    raw.delete(ptr.log_key)
    raw.set(ptr.log_key, "x")
    (only,) = ptr.history()
    assert only.unreadable is not None and ptr.log_key in only.unreadable


def test_a_redis_pointer_reads_a_decoding_client_and_raw_bytes_alike(server: Any) -> None:
    url = server.url
    for client in (redis.Redis.from_url(url), redis.Redis.from_url(url, decode_responses=True)):
        ptr = RedisPointer(client, "maps:fine")
        ptr.swap("target", fence=3)
        assert ptr.read() is not None and ptr.history()[0].fence == 3
        client.close()
