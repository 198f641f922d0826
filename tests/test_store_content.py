"""The content-addressed store on a real filesystem: atomic puts, repeats, digests, gc."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, cast

import pytest

from fenced import ConfigError, CorruptObject, FencedError, StoreError
from fenced.store import ContentStore, FilePointer, Pointer, Ref
from fenced.store._content import MANIFEST_PREFIX, TMP_DIR


@pytest.fixture
def store(tmp_path: Path) -> ContentStore:
    return ContentStore(tmp_path / "objects", create=True)


def _tmp_files(store: ContentStore) -> list[Path]:
    tmp = store.root / TMP_DIR
    return sorted(tmp.iterdir()) if tmp.is_dir() else []


class Trickle(io.RawIOBase):
    """A non-seekable stream that hands out its bytes slowly, in small pieces."""

    def __init__(self, data: bytes, piece: int, pause: float = 0.0) -> None:
        self.data = data
        self.piece = piece
        self.pause = pause
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, size: int = -1) -> bytes:
        if self.pause:
            time.sleep(self.pause)
        chunk = self.data[self.pos : self.pos + self.piece]
        self.pos += len(chunk)
        return chunk


def trickle(data: bytes, piece: int, pause: float = 0.0) -> IO[bytes]:
    """A Trickle, typed as the binary file it is (typeshed has no RawIOBase in IO[bytes])."""
    return cast(IO[bytes], Trickle(data, piece, pause))


def test_put_bytes_names_the_object_by_its_sha256(store: ContentStore) -> None:
    data = b"incidents layer, tile 0\n" * 100
    ref = store.put(data)
    digest = hashlib.sha256(data).hexdigest()
    assert ref == Ref(digest, store.root / digest[:2] / digest[2:], len(data))
    assert ref.path.read_bytes() == data
    assert store.exists(digest) and store.exists(ref)
    assert store.read_bytes(ref) == data == store.read_bytes(digest)
    # Immutable on disk: an accidental in-place edit fails instead of corrupting.
    assert not os.stat(ref.path).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    assert _tmp_files(store) == []


def test_same_bytes_twice_writes_nothing_the_second_time(
    store: ContentStore, tmp_path: Path
) -> None:
    data = os.urandom(300_000)
    first = store.put(data)
    inode = first.path.stat().st_ino
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    again = [
        store.put(data),
        store.put(bytearray(data)),
        store.put(source),
        store.put(str(source)),
        store.put(io.BytesIO(data)),
        store.put(trickle(data, 65536)),  # not seekable: streamed to a temp file, discarded
    ]
    assert all(ref == first for ref in again)
    assert first.path.stat().st_ino == inode  # the object was never replaced
    assert list(store.refs()) == [first]
    assert _tmp_files(store) == []


def test_file_object_is_read_from_its_position(store: ContentStore) -> None:
    f = io.BytesIO(b"header|payload")
    f.seek(7)
    assert store.read_bytes(store.put(f)) == b"payload"


def test_a_reader_never_sees_a_partial_object(store: ContentStore) -> None:
    data = os.urandom(4 << 20)
    digest = hashlib.sha256(data).hexdigest()
    final = store.path_of(digest)
    sizes: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                sizes.append(final.stat().st_size)
            except FileNotFoundError:
                sizes.append(-1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ref = store.put(trickle(data, 256 << 10, pause=0.005))
    finally:
        done.set()
        watcher.join()
    assert ref.digest == digest
    assert -1 in sizes  # the watcher looked while the bytes were still arriving
    assert set(sizes) <= {-1, len(data)}  # absent, or complete: never in between
    assert store.read_bytes(ref) == data


def test_corrupted_object_is_detected_on_read(store: ContentStore) -> None:
    ref = store.put(b"A" * 10_000)
    os.chmod(ref.path, 0o644)
    with open(ref.path, "r+b") as f:
        f.seek(5000)
        f.write(b"B")  # same size, one byte flipped
    with pytest.raises(CorruptObject) as info:
        store.read_bytes(ref)
    assert ref.digest in str(info.value) and isinstance(info.value, StoreError)
    with pytest.raises(CorruptObject), store.open(ref.digest) as f:
        while f.read(1024):
            pass
    with pytest.raises(CorruptObject):
        store.verify(ref)


def test_truncated_object_fails_on_open_and_a_repeat_put_repairs_it(store: ContentStore) -> None:
    data = b"0123456789" * 1000
    ref = store.put(data)
    os.chmod(ref.path, 0o644)
    with open(ref.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptObject, match="100 bytes, expected 10000"):
        store.open(ref)
    with pytest.raises(CorruptObject):
        store.read_bytes(ref.digest)  # without the size, the digest still catches it
    assert store.put(data) == ref
    assert store.read_bytes(ref) == data


def test_manifest_is_deterministic_and_lists_refs(store: ContentStore) -> None:
    a, b = store.put(b"a"), store.put(b"b")
    m1 = store.put_manifest({"x/a.txt": a, "b.txt": b})
    m2 = store.put_manifest({"b.txt": b.digest, "x/a.txt": a})
    assert m1 == m2
    assert store.read_bytes(m1).startswith(MANIFEST_PREFIX)
    assert store.read_manifest(m1) == {"b.txt": b, "x/a.txt": a}
    with pytest.raises(StoreError, match="not a manifest"):
        store.read_manifest(a)
    with pytest.raises(StoreError, match="put its bytes first"):
        store.put_manifest({"gone": "0" * 64})


def _age(ref: Ref, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(ref.path, (past, past))


def test_gc_removes_only_what_nothing_references(store: ContentStore, tmp_path: Path) -> None:
    old = [store.put(f"old {i}".encode()) for i in range(3)]
    tiles = [store.put(f"tile {i}".encode()) for i in range(3)]
    manifest = store.put_manifest({f"t{i}": ref for i, ref in enumerate(tiles)})
    kept_by_digest = store.put(b"kept by digest")
    young = store.put(b"written a moment ago")
    pointer = FilePointer(tmp_path / "current")
    pointer.swap(manifest, fence=7)
    for ref in [*old, *tiles, manifest, kept_by_digest]:
        _age(ref, 3600)
    stray = store.root / TMP_DIR / ".crashed.tmp"
    stray.write_bytes(b"half")
    os.utime(stray, (time.time() - 3600, time.time() - 3600))

    keep: list[Pointer | str] = [pointer, kept_by_digest.digest]
    assert sorted(store.gc(keep=keep, grace=60, dry_run=True), key=str) == sorted(old, key=str)
    assert all(store.exists(ref) for ref in old) and stray.exists()

    removed = store.gc(keep=keep, grace=60)
    assert sorted(removed, key=str) == sorted(old, key=str)
    assert not any(store.exists(ref) for ref in old)
    assert not stray.exists()
    survivors = {ref.digest for ref in store.refs()}
    assert survivors == {r.digest for r in [*tiles, manifest, kept_by_digest, young]}
    # A repeat finds nothing more; keeping by Ref, Published or path works alike.
    published = pointer.read()
    assert published is not None
    assert store.gc(keep=[published, kept_by_digest.path, young], grace=0) == []


def test_a_repeat_put_protects_an_old_object_from_gc(store: ContentStore) -> None:
    ref = store.put(b"reused by the next build")
    _age(ref, 7200)
    store.put(b"reused by the next build")  # the next build, before it publishes
    assert store.gc(keep=[], grace=3600) == []
    assert store.exists(ref)


def test_gc_with_a_damaged_manifest_removes_nothing(store: ContentStore) -> None:
    tile = store.put(b"tile")
    manifest = store.put_manifest({"tile": tile})
    other = store.put(b"unreferenced")
    os.chmod(manifest.path, 0o644)
    with open(manifest.path, "r+b") as f:
        f.seek(len(MANIFEST_PREFIX) + 2)
        f.write(b"#")
    with pytest.raises(CorruptObject):
        store.gc(keep=[manifest], grace=0)
    assert store.exists(tile) and store.exists(other)


def test_missing_root_is_a_config_error_naming_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "builds" / "objects"
    with pytest.raises(ConfigError, match="create=True"):
        ContentStore(missing)
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        ContentStore(tmp_path / "file")
    assert ContentStore(missing, create=True).root == missing


def test_a_file_where_the_store_or_pointer_goes_is_named_at_construction(tmp_path: Path) -> None:
    in_the_way = tmp_path / "objects"
    in_the_way.write_text("x")
    with pytest.raises(ConfigError, match=f"{in_the_way} is a file, not a directory"):
        ContentStore(in_the_way, create=True)
    with pytest.raises(StoreError) as info:
        ContentStore(in_the_way / "sub", create=True)
    assert str(in_the_way) in str(info.value) and "a file stands where" in str(info.value)
    with pytest.raises(ConfigError, match=f"{in_the_way} is a file"):
        FilePointer(in_the_way / "dir" / "current")
    assert in_the_way.read_text() == "x"


# Run as an unprivileged user: root may write into any directory.
_READ_ONLY_CHILD = """
import json, os, sys
from pathlib import Path
from fenced import StoreError
from fenced.store import ContentStore, FilePointer

root = Path(sys.argv[1])
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
out = {}
for what, act in (
    ("create", lambda: ContentStore(root, create=True)),
    ("put", lambda: ContentStore(root).put(b"tile 0")),
    ("swap", lambda: FilePointer(root / "current").swap(root / "target", fence=1)),
):
    try:
        act()
        out[what] = None
    except StoreError as exc:
        out[what] = str(exc)
print(json.dumps(out))
"""


def test_a_directory_this_user_cannot_write_is_a_store_error_naming_the_fix() -> None:
    root = Path(tempfile.mkdtemp(prefix="fenced-ro-"))
    try:
        (root / "target").write_bytes(b"published")
        root.chmod(0o555)
        res = subprocess.run(
            [sys.executable, "-c", _READ_ONLY_CHILD, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["create"].startswith(f"store root {root} is not writable: let this user")
        assert "chmod u+w" in out["create"]
        assert out["put"].startswith(f"cannot store an object in {root}: cannot write {root}")
        assert "Permission denied" in out["put"] and "chmod" in out["put"]
        assert out["swap"].startswith(f"cannot swap pointer {root / 'current'}: cannot write")
        assert "Permission denied" in out["swap"] and "chmod" in out["swap"]
        assert sorted(p.name for p in root.iterdir()) == ["target"]  # nothing was left
    finally:
        root.chmod(0o755)
        shutil.rmtree(root)


@pytest.mark.parametrize(
    "bad, message",
    [
        ("no/such/file.bin", "not a file"),
        (12345, "cannot put a int"),
        (io.StringIO("text"), "binary mode"),
    ],
)
def test_bad_sources_write_nothing(store: ContentStore, bad: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        store.put(bad)  # type: ignore[arg-type]
    assert list(store.refs()) == [] and _tmp_files(store) == []


def test_bad_digests_and_missing_objects(store: ContentStore) -> None:
    for bad in ["abc", "Z" * 64, "/etc/passwd"]:
        with pytest.raises(ConfigError, match="names no object"):
            store.exists(bad)
    with pytest.raises(StoreError, match="put its bytes first"):
        store.open("0" * 64)
    with pytest.raises(ConfigError, match="keep"):
        store.gc(keep="0" * 64)  # one digest, not a list of them
    assert issubclass(ConfigError, FencedError) and issubclass(ConfigError, ValueError)


def test_source_changing_while_stored_is_refused(store: ContentStore) -> None:
    class Growing(io.BytesIO):
        """Seekable, but its second pass reads different bytes than its first."""

        def seek(self, pos: int, whence: int = 0) -> int:
            self.write(b"appended later")
            return super().seek(pos, whence)

    with pytest.raises(StoreError, match="changed while it was being stored"):
        store.put(Growing(b"first pass"))
    assert list(store.refs()) == [] and _tmp_files(store) == []


def test_gc_keeps_a_path_target_published_through_a_symlinked_root(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    store = ContentStore(link / "objects", create=True)
    kept, other = store.put(b"published by path"), store.put(b"not published")
    ptr = FilePointer(link / "current", root=link)
    published = ptr.swap(kept.path, fence=1)  # a plain path: no digest is recorded
    assert published.digest is None and published.target.startswith(str(real))
    assert store.gc(keep=[ptr], grace=0) == [other]
    assert store.exists(kept)
