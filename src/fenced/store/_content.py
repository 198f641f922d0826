"""A content-addressed object store on the filesystem: a repeat writes nothing new.

Each object is stored once under the SHA-256 of its bytes, ``<root>/ab/cdef…``. A
put streams into a temporary file under ``<root>/.tmp``, fsyncs it, renames it into
place and fsyncs the directory, so a reader that finds an object finds all of it,
and a crash leaves at most a stray temporary file (removed by :meth:`ContentStore.gc`).
The fan-out directories, ``.tmp`` and the objects are never reached through a
symbolic link (see ``_durable``): a link planted in the store is refused by name, and
gc removes names only beside a directory it opened (``dir_fd``), so a directory swapped
for a link while gc runs cannot send a removal outside the store.
Objects are read-only: the umask's read bits, no write bits.
Reads check the digest, so a corrupted object raises :class:`~fenced.CorruptObject`
instead of publishing bad bytes.

A build writes its files with :meth:`ContentStore.put`, lists them in a manifest
(:meth:`ContentStore.put_manifest`, itself an object) and publishes the manifest with
a pointer. The same inputs give the same manifest digest, so a repeated build
converges on the same published target.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar, Union

from .._errors import ConfigError, CorruptObject, StoreError
from . import _durable
from ._published import Pointer, Published, Ref

__all__ = ["MANIFEST_PREFIX", "ContentStore"]

_DIGEST = re.compile(r"[0-9a-f]{64}")
_FAN = re.compile(r"[0-9a-f]{2}")
_CHUNK = 1 << 20
#: First bytes of every manifest object; gc follows the digests a manifest lists.
MANIFEST_PREFIX = b'{"fenced_manifest":1,'
#: Temporary files live here, on the store's filesystem, so the rename is atomic.
TMP_DIR = ".tmp"
#: Objects younger than this many seconds survive gc (a build may not have published yet).
DEFAULT_GRACE = 24 * 3600.0


_T = TypeVar("_T")
Source = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", IO[bytes]]
#: What gc keeps: objects by Ref, digest or path, and what pointers publish.
Keep = Union[Ref, Published, Pointer, str, "os.PathLike[str]"]
#: The store's objects: each fan-out directory's name, and its objects' names and metadata.
_Listing = list[tuple[str, list[tuple[str, os.stat_result]]]]


class _Verifying(io.RawIOBase):
    """Reads an object file and checks size and digest when the end is reached."""

    def __init__(self, f: io.FileIO, ref: Ref) -> None:
        super().__init__()
        self._f = f
        self._ref = ref
        self._hash = hashlib.sha256()
        self._seen = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        if n:
            self._hash.update(memoryview(buffer)[:n])
            self._seen += n
        elif not self._checked:
            digest = self._hash.hexdigest()
            if digest != self._ref.digest or self._seen != self._ref.size:
                raise CorruptObject(
                    f"object {self._ref.digest} at {self._ref.path} is corrupt: its bytes "
                    f"hash to {digest} ({self._seen} bytes, expected {self._ref.size}); "
                    "remove the file, then put the original bytes again"
                )
            self._checked = True
        return n or 0

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def put_source(
    source: Source, put_bytes: Callable[[bytes], Ref], put_file: Callable[[IO[bytes]], Ref]
) -> Ref:
    """What a store's ``put`` takes, handed on: bytes to ``put_bytes``, a binary file
    object (or the file at a path, opened here) to ``put_file``; anything else refused."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return put_bytes(bytes(source))
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"nothing to put: {path} is not a file (to store a string's content, "
                "pass bytes: text.encode())"
            )
        with path.open("rb") as f:
            return put_file(f)
    if callable(getattr(source, "read", None)):
        return put_file(source)
    raise ConfigError(
        f"cannot put a {type(source).__name__}: pass bytes, a binary file object or a path"
    )


class ContentStore:
    """Immutable objects named by the SHA-256 of their bytes, under one root directory."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = False) -> None:
        """Open the store at ``root``; ``create=True`` makes it, and checks it is writable."""
        self.root = Path(root).absolute()
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(
                f"store root {self.root} is a file, not a directory: choose a directory "
                "(or move the file away)"
            )
        if create:
            with _durable.writing(f"cannot create store root {self.root}", self.root):
                _durable.ensure_dir(self.root)
        if not self.root.exists():
            raise ConfigError(
                f"store root {self.root} does not exist: create it (mkdir -p {self.root}) "
                "or pass ContentStore(..., create=True)"
            )
        if create:
            # A store made to be written to: say now, not at the first put, when it cannot be.
            _durable.check_writable(self.root, f"store root {self.root}")
        self._real_root = self.root.resolve()
        self._tmp = self.root / TMP_DIR

    def __repr__(self) -> str:
        return f"<ContentStore {str(self.root)!r}>"

    # -- naming -----------------------------------------------------------------------

    def path_of(self, digest: str) -> Path:
        """Where the object with this digest lives (whether or not it exists)."""
        digest = self._digest(digest)
        return self.root / digest[:2] / digest[2:]

    def _digest(self, item: object) -> str:
        """The digest an item names: a Ref, a Published target, a digest or an object path."""
        found = item.digest if isinstance(item, Ref) else self._named(item)
        if found:
            return found
        raise ConfigError(
            f"{item!r} names no object of {self.root}: pass a Ref, a 64-character "
            "SHA-256 hex digest, or a path inside the store"
        )

    def _named(self, item: object) -> str | None:
        """The digest an item carries, is, or names as an object's path in this store."""
        digest = getattr(item, "digest", None)
        if isinstance(digest, str) and _DIGEST.fullmatch(digest):
            return digest
        if isinstance(item, str) and _DIGEST.fullmatch(item):
            return item
        if isinstance(item, (str, os.PathLike)):
            return self._digest_from_path(Path(item))
        return None

    def _digest_from_path(self, path: Path) -> str | None:
        # Both spellings: a pointer with a root stores paths with symlinks resolved.
        for base, candidate in ((self.root, path.absolute()), (self._real_root, path.resolve())):
            try:
                parts = candidate.relative_to(base).parts
            except ValueError:
                continue
            if len(parts) == 2 and _DIGEST.fullmatch(parts[0] + parts[1]):
                return parts[0] + parts[1]
        return None

    def ref(self, digest: str) -> Ref:
        """The Ref of a stored object; StoreError when it is not in the store."""
        digest = self._digest(digest)
        st = self._stat(digest)
        if st is None:
            raise StoreError(f"no object {digest} in {self.root}: put its bytes first")
        return Ref(digest, self.path_of(digest), st.st_size)

    def exists(self, digest: str | Ref) -> bool:
        """True when the object is in the store (its bytes are not read)."""
        return self._stat(self._digest(digest)) is not None

    # -- the fan-out directories, never through a link ----------------------------------

    def _at(self, digest: str, call: Callable[[int], _T]) -> _T | None:
        """``call`` with the object's fan-out directory open (never through a link); None
        when the store, that directory or the object is missing."""
        try:
            root = _durable.open_root(self.root)
        except FileNotFoundError:
            return None  # the store was removed: no object is in it
        try:
            fan = _durable.open_dir(root, self.root / digest[:2], create=False)
        finally:
            os.close(root)
        if fan is None:
            return None
        try:
            return call(fan)
        except FileNotFoundError:
            return None
        finally:
            os.close(fan)

    def _stat(self, digest: str) -> os.stat_result | None:
        """An object's metadata, None when it is missing; a link or device is refused."""
        st = self._at(digest, lambda fan: os.stat(digest[2:], dir_fd=fan, follow_symlinks=False))
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _durable.not_followed(self.path_of(digest), "regular file")
        return st

    def _open_fd(self, digest: str) -> int | None:
        """An object opened for reading, None when it is missing."""
        path = self.path_of(digest)
        return self._at(digest, lambda fan: _durable.open_regular(path, os.O_RDONLY, dir_fd=fan))

    # -- writing ----------------------------------------------------------------------

    def put(self, source: Source) -> Ref:
        """Store bytes, a binary file object or the file at a path; same bytes, same Ref."""
        return put_source(source, self._put_bytes, self._put_file)

    def _put_bytes(self, data: bytes) -> Ref:
        digest = hashlib.sha256(data).hexdigest()
        return self._existing(digest, len(data)) or self._write(digest, [data])

    def _put_file(self, f: IO[bytes]) -> Ref:
        seekable = False
        with contextlib.suppress(AttributeError, OSError, ValueError):
            seekable = f.seekable()
        if not seekable:
            # One pass: write while hashing, then keep the existing copy if there is one.
            return self._write(None, _chunks(f))
        start = f.tell()
        hasher, size = hashlib.sha256(), 0
        for chunk in _chunks(f):
            hasher.update(chunk)
            size += len(chunk)
        digest = hasher.hexdigest()
        existing = self._existing(digest, size)
        if existing:
            return existing
        f.seek(start)
        return self._write(digest, _chunks(f))

    def _existing(self, digest: str, size: int) -> Ref | None:
        st = self._stat(digest)
        if st is None:
            return None
        if st.st_size != size:
            return None  # a damaged copy: the caller writes the good bytes over it
        # Refresh the age gc judges by, so an old object reused by a build in progress
        # survives until that build publishes. Only metadata changes; no bytes are written.
        with contextlib.suppress(OSError):
            self._at(digest, lambda fan: os.utime(digest[2:], dir_fd=fan, follow_symlinks=False))
        return Ref(digest, self.path_of(digest), size)

    def _write(self, digest: str | None, chunks: Iterable[bytes]) -> Ref:
        with (
            _durable.writing(f"cannot store an object in {self.root}", self.root),
            contextlib.ExitStack() as opened,
        ):
            root = _durable.open_root(self.root)
            opened.callback(os.close, root)
            tmp_dir = _durable.open_dir(root, self._tmp, create=True)
            assert tmp_dir is not None
            opened.callback(os.close, tmp_dir)
            stem = (digest or "stream")[:16]
            name, fd = opened.enter_context(_durable.temp_file(tmp_dir, stem))
            hasher, size = hashlib.sha256(), 0
            for chunk in chunks:
                hasher.update(chunk)
                size += len(chunk)
                _durable.write_all(fd, chunk)
            _durable.checkpoint("put:written")
            os.fsync(fd)
            # Objects are immutable: read-only makes an accidental in-place edit fail loudly.
            _durable.read_only(fd)
            actual = hasher.hexdigest()
            if digest is not None and actual != digest:
                raise StoreError(
                    "the source changed while it was being stored (its bytes no longer hash "
                    f"to {digest}): put it again once it is complete"
                )
            existing = None if digest is not None else self._existing(actual, size)
            if existing:
                os.unlink(name, dir_fd=tmp_dir)
                return existing
            _durable.checkpoint("put:synced")
            final = self.path_of(actual)
            fan = _durable.open_dir(root, final.parent, create=True)
            assert fan is not None
            opened.callback(os.close, fan)
            os.replace(name, final.name, src_dir_fd=tmp_dir, dst_dir_fd=fan)
            _durable.checkpoint("put:renamed")
            os.fsync(fan)
        return Ref(actual, final, size)

    def put_manifest(self, entries: Mapping[str, Ref | str]) -> Ref:
        """Store a manifest naming objects (name -> Ref or digest); gc keeps what it lists."""
        body: dict[str, dict[str, Any]] = {}
        for name, item in entries.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"manifest name {name!r} must be a non-empty string")
            ref = item if isinstance(item, Ref) else self.ref(item)
            if not self.exists(ref):
                raise StoreError(
                    f"manifest entry {name!r} names {ref.digest}, which is not in "
                    f"{self.root}: put its bytes before the manifest"
                )
            body[name] = {"digest": ref.digest, "size": ref.size}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return self.put(MANIFEST_PREFIX + b'"entries":' + text.encode() + b"}\n")

    # -- reading ----------------------------------------------------------------------

    def open(self, ref: Ref | str) -> BinaryIO:
        """Open an object for reading; reading to the end raises CorruptObject on damage."""
        digest = self._digest(ref)
        path = self.path_of(digest)
        fd = self._open_fd(digest)
        if fd is None:
            raise StoreError(f"no object {digest} in {self.root}: put its bytes first")
        f = io.FileIO(fd, "rb")
        size = os.fstat(f.fileno()).st_size
        expected = ref.size if isinstance(ref, Ref) else size
        checked = Ref(digest, path, expected)
        if size != expected:
            f.close()
            raise CorruptObject(
                f"object {digest} at {path} is {size} bytes, expected {expected}: put the "
                "original bytes again to repair it, or remove the file"
            )
        return io.BufferedReader(_Verifying(f, checked), buffer_size=_CHUNK)

    def read_bytes(self, ref: Ref | str) -> bytes:
        """An object's bytes, checked against its digest (CorruptObject when damaged)."""
        with self.open(ref) as f:
            return f.read()

    def verify(self, ref: Ref | str) -> Ref:
        """Read an object through and check its digest; returns its Ref."""
        with self.open(ref) as f:
            while f.read(_CHUNK):
                pass
        return self.ref(self._digest(ref))

    def read_manifest(self, ref: Ref | str) -> dict[str, Ref]:
        """The entries of a manifest written by :meth:`put_manifest`."""
        data = self.read_bytes(ref)
        if not data.startswith(MANIFEST_PREFIX):
            raise StoreError(f"object {self._digest(ref)} is not a manifest")
        try:
            entries = json.loads(data)["entries"]
            return {
                name: Ref(e["digest"], self.path_of(e["digest"]), int(e["size"]))
                for name, e in entries.items()
            }
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"manifest {self._digest(ref)} is malformed: {exc}") from exc

    def refs(self) -> Iterator[Ref]:
        """Every object in the store (its bytes are not read)."""
        root = _durable.open_root(self.root)
        try:
            for fan, listed in self._listing(root):
                for name, st in listed:
                    yield Ref(fan + name, self.root / fan / name, st.st_size)
        finally:
            os.close(root)

    def _listing(self, root: int) -> _Listing:
        """Each fan-out directory's objects with their metadata, in full: a link where a
        fan-out directory belongs is refused before anything is returned."""
        found = []
        for fan in sorted(_names(root)):
            if not _FAN.fullmatch(fan):
                continue
            with self._opened(root, fan) as fd:
                if fd is None:
                    continue
                listed = []
                for name in sorted(_names(fd)):
                    if not _DIGEST.fullmatch(fan + name):
                        continue
                    try:
                        listed.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False)))
                    except FileNotFoundError:
                        continue  # removed by a concurrent gc
                found.append((fan, listed))
        return found

    @contextlib.contextmanager
    def _opened(self, root: int, name: str) -> Iterator[int | None]:
        """The directory ``name`` of the root, open and never a link: None when it is
        missing or a file; StoreError when it is a link (gc would follow it)."""
        try:
            st = os.stat(name, dir_fd=root, follow_symlinks=False)
        except FileNotFoundError:
            yield None
            return
        if stat.S_ISLNK(st.st_mode):
            raise _durable.not_followed(self.root / name, "directory")
        if not stat.S_ISDIR(st.st_mode):
            yield None
            return
        # Swapped for a link since the stat: open_dir refuses it (O_NOFOLLOW).
        fd = _durable.open_dir(root, self.root / name, create=False)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    # -- garbage collection -----------------------------------------------------------

    def gc(
        self, keep: Iterable[Keep], *, grace: float = DEFAULT_GRACE, dry_run: bool = False
    ) -> list[Ref]:
        """Remove objects that nothing in ``keep`` references; returns what was removed.

        ``keep`` holds Refs, digests, object paths, pointers (a :class:`Pointer`: what
        it publishes now is kept) or their published states; manifests are followed.
        Objects younger than ``grace`` seconds stay, because a build that has put them
        may not have published yet: choose it above your longest build. Stray temporary
        files older than ``grace`` go too. With ``dry_run`` nothing is removed.
        """
        if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
            raise ConfigError(
                "gc(keep=...) takes a list of Refs, digests or pointers, e.g. keep=[ptr]"
            )
        if grace < 0:
            raise ConfigError(f"grace={grace!r} must be >= 0 seconds")
        # Every directory gc removes from is opened once, never through a link, and
        # names are removed beside it (dir_fd): a directory swapped for a link after it
        # was checked cannot send a removal elsewhere.
        root = _durable.open_root(self.root)
        try:
            with self._opened(root, TMP_DIR) as tmp:
                live = self._live(keep)
                cutoff = time.time() - grace
                # Listed in full first: a planted link is refused before anything is removed.
                listing = self._listing(root)
                removed = self._remove_objects(root, listing, live, cutoff, dry_run)
                if tmp is not None and not dry_run:
                    _sweep(tmp, cutoff)
        finally:
            os.close(root)
        return removed

    def _remove_objects(
        self, root: int, listing: _Listing, live: set[str], cutoff: float, dry_run: bool
    ) -> list[Ref]:
        removed: list[Ref] = []
        for fan, listed in listing:
            doomed = [
                name for name, st in listed if fan + name not in live and st.st_mtime <= cutoff
            ]
            if not doomed:
                continue
            with self._opened(root, fan) as fd:
                if fd is None:
                    continue
                gone = 0
                for name in doomed:
                    try:
                        # Its age again: a put may have reused it since it was listed.
                        now = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if now.st_mtime > cutoff:
                            continue
                        if not dry_run:
                            os.unlink(name, dir_fd=fd)
                            gone += 1
                    except FileNotFoundError:
                        continue
                    removed.append(Ref(fan + name, self.root / fan / name, now.st_size))
                if gone:
                    os.fsync(fd)
        return removed

    def _live(self, keep: Iterable[Keep]) -> set[str]:
        """Digests reachable from ``keep``; reads (and checks) every manifest on the way."""
        todo: list[str] = []
        for item in keep:
            reader = getattr(item, "read", None)
            if callable(reader) and not isinstance(item, (Ref, str, os.PathLike)):
                item = reader()  # a pointer: keep what it publishes now
                if item is None:
                    continue
            digest = self._named(item)
            if digest is None:  # a published target: an object of this store, or elsewhere
                target = getattr(item, "target", item)
                if not isinstance(target, (str, os.PathLike)):
                    raise ConfigError(
                        f"gc cannot keep {item!r}: pass Refs, digests, object paths or pointers"
                    )
                digest = self._digest_from_path(Path(target))
            if digest:
                todo.append(digest)
        live: set[str] = set()
        while todo:
            digest = todo.pop()
            if digest in live:
                continue
            live.add(digest)
            fd = self._open_fd(digest)
            if fd is None:
                continue
            with io.FileIO(fd, "rb") as f:
                head = f.read(len(MANIFEST_PREFIX))
            if head == MANIFEST_PREFIX:
                # A damaged manifest raises here, before anything is removed.
                todo.extend(ref.digest for ref in self.read_manifest(digest).values())
        return live


def _names(fd: int) -> list[str]:
    """The names in an open directory."""
    with os.scandir(fd) as entries:
        return [entry.name for entry in entries]


def _sweep(tmp: int, cutoff: float) -> None:
    """Remove the stray files (and links, never what they lead to) older than ``cutoff``
    from the open temporary directory."""
    for name in _names(tmp):
        try:
            st = os.stat(name, dir_fd=tmp, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode) and st.st_mtime <= cutoff:
                os.unlink(name, dir_fd=tmp)
        except FileNotFoundError:
            continue


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise ConfigError(
                f"the file object gave {type(chunk).__name__}, not bytes: "
                "open it in binary mode ('rb')"
            )
        yield chunk
