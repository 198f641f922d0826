"""The content store against a local user who can write in its root: a directory swapped
for a link while gc walks it, and links planted where gc deletes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fenced import StoreError
from fenced.store import ContentStore, FilePointer
from fenced.store._content import TMP_DIR

#: Older than any grace the tests pass: what gc would remove, were it reachable.
OLD = time.time() - 10 * 24 * 3600


def _victim(path: Path, names: list[str]) -> dict[str, bytes]:
    """A directory outside the store full of old files; returns what must survive."""
    path.mkdir()
    kept = {}
    for name in names:
        data = f"victim {name}\n".encode()
        (path / name).write_bytes(data)
        os.utime(path / name, (OLD, OLD))
        kept[name] = data
    return kept


def _survived(path: Path, kept: dict[str, bytes]) -> None:
    assert {p.name: p.read_bytes() for p in path.iterdir()} == kept


@contextlib.contextmanager
def _swapping(real: Path, victim: Path) -> Iterator[Callable[[], int]]:
    """A thread that swaps the directory ``real`` for a link to ``victim`` and back, about
    every millisecond, until the block ends; yields how many swaps it made so far."""
    aside = real.with_name(real.name + ".aside")
    link = real.with_name(real.name + ".link")
    link.symlink_to(victim, target_is_directory=True)
    stop = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not stop.is_set():
            os.rename(real, aside)
            os.rename(link, real)  # the link now stands where the directory was
            time.sleep(0.001)
            os.rename(real, link)
            os.rename(aside, real)
            swaps += 1
            time.sleep(0.001)

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()

    def swapped() -> int:
        assert thread.is_alive(), "the swapping thread stopped"
        return swaps

    try:
        yield swapped
    finally:
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive()


def _gc_racing(store: ContentStore, swaps: Callable[[], int], runs: int) -> int:
    """Run gc ``runs`` times (and until the swapper has swapped often); how many it refused."""
    refused = done = 0
    while done < runs or swaps() < runs:
        try:
            store.gc(keep=[], grace=3600)
        except StoreError as exc:
            assert "symbolic link" in str(exc)
            refused += 1
        done += 1
    return refused


def test_gc_never_deletes_through_a_temporary_directory_swapped_for_a_link(
    tmp_path: Path,
) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    store.put(b"an object")  # makes .tmp
    tmp = store.root / TMP_DIR
    kept = _victim(tmp_path / "victim", [f"precious-{i}" for i in range(50)])
    with _swapping(tmp, tmp_path / "victim") as swaps:
        _gc_racing(store, swaps, runs=300)
    _survived(tmp_path / "victim", kept)
    assert tmp.is_dir() and not tmp.is_symlink()


def test_gc_never_deletes_through_a_fan_out_directory_swapped_for_a_link(
    tmp_path: Path,
) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    ref = store.put(b"an object")
    os.utime(ref.path, (OLD, OLD), follow_symlinks=False)
    fan = ref.path.parent
    # Names gc reads as objects of that fan-out directory.
    names = [f"{i:02x}" + "0" * 60 for i in range(50)]
    kept = _victim(tmp_path / "victim", names)
    with _swapping(fan, tmp_path / "victim") as swaps:
        _gc_racing(store, swaps, runs=300)
    _survived(tmp_path / "victim", kept)


def test_gc_unlinks_a_link_planted_in_the_temporary_directory_not_its_target(
    tmp_path: Path,
) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    store.put(b"an object")
    kept = _victim(tmp_path / "victim", ["precious"])
    tmp = store.root / TMP_DIR
    (tmp / "to-a-file").symlink_to(tmp_path / "victim" / "precious")
    (tmp / "to-a-dir").symlink_to(tmp_path / "victim", target_is_directory=True)
    for link in tmp.iterdir():
        os.utime(link, (OLD, OLD), follow_symlinks=False)
    store.gc(keep=[], grace=3600)
    assert list(tmp.iterdir()) == []
    _survived(tmp_path / "victim", kept)


def test_gc_leaves_a_directory_planted_in_the_temporary_directory(tmp_path: Path) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    store.put(b"an object")
    inner = store.root / TMP_DIR / "planted"
    inner.mkdir()
    (inner / "file").write_bytes(b"x")
    os.utime(inner / "file", (OLD, OLD))
    os.utime(inner, (OLD, OLD))
    store.gc(keep=[], grace=3600)
    assert (inner / "file").read_bytes() == b"x"


def test_a_pointer_swap_writes_its_temporary_file_and_replaces_in_one_directory(
    tmp_path: Path,
) -> None:
    # The directory is opened once: every step of the swap happens in it, and a failed
    # swap removes only its own temporary file.
    ptr = FilePointer(tmp_path / "ptr" / "current")
    target = tmp_path / "out"
    target.write_bytes(b"output")
    ptr.swap(target, fence=5)
    assert sorted(p.name for p in (tmp_path / "ptr").iterdir()) == ["current", "current.lock"]
    read = ptr.read()
    assert read is not None and read.fence == 5


@pytest.mark.parametrize("grace", [0.0, 3600.0])
def test_gc_still_removes_what_it_should(tmp_path: Path, grace: float) -> None:
    store = ContentStore(tmp_path / "objects", create=True)
    gone = store.put(b"unreferenced")
    kept = store.put(b"kept")
    os.utime(gone.path, (OLD, OLD), follow_symlinks=False)
    stray = store.root / TMP_DIR / ".stray.tmp"
    stray.write_bytes(b"half")
    os.utime(stray, (OLD, OLD))
    removed = store.gc(keep=[kept], grace=grace)
    assert removed == [gone] and not gone.path.exists() and kept.path.exists()
    assert not stray.exists()
    assert [ref.digest for ref in store.refs()] == [kept.digest]


def test_a_pointer_directory_swapped_for_a_link_is_neither_read_nor_written(
    tmp_path: Path,
) -> None:
    root = tmp_path / "builds"
    (root / "ptrs").mkdir(parents=True)
    target = root / "out"
    target.write_bytes(b"output")
    ptr = FilePointer(root / "ptrs" / "current", root=root)
    ptr.swap(target, fence=5)
    # The directory of the pointer, inside the root, swapped for a link to a victim's
    # directory holding a file of the same name.
    kept = _victim(tmp_path / "victim", ["current"])
    (root / "ptrs").rename(root / "ptrs.aside")
    (root / "ptrs").symlink_to(tmp_path / "victim", target_is_directory=True)
    for act in (lambda: ptr.swap(target, fence=6), ptr.read):
        with pytest.raises(StoreError, match="symbolic link"):
            act()
    _survived(tmp_path / "victim", kept)  # not replaced, and no lock file made there
    # Put back, the pointer works again.
    (root / "ptrs").unlink()
    (root / "ptrs.aside").rename(root / "ptrs")
    assert ptr.swap(target, fence=6).fence == 6


def test_a_pointer_under_a_root_is_made_in_new_directories_and_read_through_inner_links(
    tmp_path: Path,
) -> None:
    root = tmp_path / "builds"
    (root / "real").mkdir(parents=True)
    (root / "alias").symlink_to(root / "real", target_is_directory=True)
    target = root / "out"
    target.write_bytes(b"output")
    # A link that was there when the pointer was made is the user's: it is followed once.
    ptr = FilePointer(root / "alias" / "new" / "current", root=root)
    assert ptr.read() is None
    ptr.swap(target, fence=1)
    assert (root / "real" / "new" / "current").is_file()
    read = ptr.read()
    assert read is not None and read.fence == 1
