"""Fenced pointers: publish one target per name, atomically, and refuse stale holders.

A build writes its output somewhere new (content-addressed objects, a fresh
directory) and then *publishes* it by swapping a pointer. The swap carries the
claim's fence. The pointer remembers the highest fence it has accepted and refuses a
lower one with :class:`~fenced.StaleFence`, so a holder that was paused past its
lease, and resumed after a newer holder published, changes nothing::

    t0    A holds "rebuild:incidents" (fence 1001) and builds
    t1    A is paused; its lease ends; B acquires (fence 1002), builds, publishes
    t2    A resumes and swaps with fence 1001  ->  StaleFence; B's target stays

An equal fence is accepted: the same holder may publish again.

:class:`FilePointer` keeps a small JSON file replaced with ``os.replace`` (readers
never see a partial file) and serialises compare-and-replace with ``flock`` on a
sidecar lock file, so two processes cannot interleave. :class:`RedisPointer` does the
same in one Lua script.

A FilePointer trusts nothing it reads from disk: the pointer file is read only when it
is a regular file (not a link, device or FIFO) of at most :data:`MAX_POINTER_SIZE`
bytes, and with a ``root`` a target it names must stay under the root (no ``..``, no
absolute path, no link leading out), else :class:`~fenced.StoreError` names the file.
Neither the pointer file nor its lock file is opened through a link, and with a
``root`` the pointer's directory is reached from the root one directory at a time,
never through a link made after the pointer was (a link there when it was made is
resolved then, once).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from redis.exceptions import ResponseError

from .._client import connect
from .._errors import ConfigError, StaleFence, StoreError
from .._lease import UNREACHABLE, ClaimKeys, check_replicas, run_replicated
from .._printable import printable, readable
from .._scripts import Script, as_text
from . import _durable
from ._published import Published, Ref, Target

__all__ = ["MAX_POINTER_SIZE", "PUBLISH", "FilePointer", "RedisPointer"]

#: Publishes kept in a RedisPointer's log (trimmed approximately).
HISTORY = 100
#: Largest pointer file a FilePointer reads or writes, in bytes (a swap writes about
#: 200 bytes plus the target's path).
MAX_POINTER_SIZE = 64 * 1024


def _parts(target: object) -> tuple[str | os.PathLike[str], str | None, int | None]:
    if isinstance(target, Ref):
        return target.path, target.digest, target.size
    if isinstance(target, Published):
        return target.target, target.digest, target.size
    if isinstance(target, (str, os.PathLike)):
        if not str(target):
            raise ConfigError("target is empty: pass a Ref from ContentStore.put or a path")
        return target, None, None
    raise ConfigError(
        f"cannot publish a {type(target).__name__}: pass a Ref from ContentStore.put or a path"
    )


def _stale(where: str, fence: int, current: int) -> StaleFence:
    return StaleFence(
        f"pointer {where} refused fence {fence}: it already accepted fence {current}, so a "
        "newer claim holder has published; this run is stale and must stop",
        name=where,
        fence=fence,
        current=current,
    )


class FilePointer:
    """A pointer kept in a small JSON file, swapped atomically under a fence."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        root: str | os.PathLike[str] | None = None,
        *,
        lock_timeout: float = 30.0,
    ) -> None:
        self.root: Path | None = None
        if root is not None:
            root_path = Path(root)
            if not root_path.is_dir():
                raise ConfigError(
                    f"pointer root {root_path.absolute()} is not an existing directory: "
                    "create it first, or leave root=None"
                )
            self.root = root_path.resolve()
        self.path = Path(path).absolute()
        if not self.path.name or self.path.name in (".", ".."):
            raise ConfigError(f"pointer path {path!r} names no file: give it a file name")
        if self.root is not None and not self._inside(self.path):
            raise ConfigError(
                f"pointer {self.path} is outside its root {self.root}: place it under the "
                "root, or pass the directory that holds both as root"
            )
        if self.path.is_dir():
            raise ConfigError(
                f"pointer {self.path} is a directory: a pointer is a file; name a file in it, "
                f"e.g. {self.path / 'current'}"
            )
        parent = next(p for p in self.path.parents if p.exists())  # "/" at least
        if not parent.is_dir():
            raise ConfigError(
                f"pointer {self.path} cannot be made: {parent} is a file, not a "
                "directory; move the file away, or choose another pointer path"
            )
        if lock_timeout <= 0:
            raise ConfigError(f"lock_timeout={lock_timeout!r} must be a positive number")
        self.lock_timeout = float(lock_timeout)
        # The lock file is never removed: removing it would let two writers lock two
        # different inodes under the same name.
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        # Under a root: the real directories from the root to the pointer's, as they are
        # now; each read and swap opens them one by one, refusing a link put there later.
        self._below_root: tuple[str, ...] | None = None
        if self.root is not None:
            self._below_root = self.path.parent.resolve().relative_to(self.root).parts

    def __repr__(self) -> str:
        return f"<FilePointer {str(self.path)!r}>"

    def _inside(self, path: Path, *, follow: bool = False) -> bool:
        assert self.root is not None
        real = path.resolve() if follow else path.parent.resolve() / path.name
        return real == self.root or real.is_relative_to(self.root)

    def _entry(self, target: Target, fence: int) -> dict[str, Any]:
        where, digest, size = _parts(target)
        path = Path(where).absolute()
        if not path.exists():
            raise ConfigError(
                f"target {path} does not exist: write the output completely, then swap"
            )
        stored = str(path)
        if self.root is not None:
            if not (self._inside(path) and self._inside(path, follow=True)):
                raise ConfigError(
                    f"target {path} is outside the pointer's root {self.root}: write the "
                    "output under the root, or pass a root that holds both"
                )
            # Relative to the root, so the whole tree can be moved or mounted elsewhere.
            stored = (path.parent.resolve() / path.name).relative_to(self.root).as_posix()
        return {"target": stored, "fence": fence, "digest": digest, "size": size}

    def _published(self, entry: dict[str, Any]) -> Published:
        target = str(entry["target"])
        if self.root is not None:
            target = self._confined(target)
        return Published(target, int(entry["fence"]), entry.get("digest"), entry.get("size"))

    def _confined(self, stored: str) -> str:
        """The path of a stored target under the root; StoreError when it leads out."""
        assert self.root is not None
        rel = PurePosixPath(stored)
        full = self.root / rel
        if rel.is_absolute() or ".." in rel.parts or not self._inside(full, follow=True):
            raise StoreError(
                f"pointer {self.path} names {stored!r}, which is outside the pointer's root "
                f"{self.root}: the file was changed by something other than swap; swap a "
                "target under the root again, or remove the file"
            )
        return str(full)

    @contextmanager
    def _directory(self, *, create: bool) -> Iterator[int | None]:
        """The pointer's directory, open (None when it is missing and not created)."""
        try:
            fd = self._open_directory(create)
        except FileNotFoundError:
            if create:
                raise
            fd = None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _open_directory(self, create: bool) -> int | None:
        if self._below_root is None:
            if create:
                _durable.ensure_dir(self.path.parent)
            return _durable.open_root(self.path.parent)
        assert self.root is not None
        fd = _durable.open_root(self.root)
        where = self.root
        for part in self._below_root:
            where = where / part
            try:
                inner = _durable.open_dir(fd, where, create=create)
            finally:
                os.close(fd)
            if inner is None:
                return None
            fd = inner
        return fd

    def _load(self, directory: int) -> dict[str, Any] | None:
        """The pointer file's entry (of at most MAX_POINTER_SIZE bytes); None before the
        first swap."""
        try:
            fd = _durable.open_regular(self.path, os.O_RDONLY, dir_fd=directory)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_POINTER_SIZE + 1)
        if len(data) > MAX_POINTER_SIZE:
            raise StoreError(
                f"pointer {self.path} is larger than {MAX_POINTER_SIZE} bytes, so it is not "
                "a fenced pointer file: remove it, or choose another pointer path"
            )
        try:
            entry = json.loads(data)
            if not isinstance(entry, dict) or not isinstance(entry.get("fence"), int):
                raise ValueError("no integer fence")
            str(entry["target"])
            return entry
        except (ValueError, KeyError) as exc:
            raise StoreError(
                f"{self.path} is not a fenced pointer file ({exc}): remove it, or choose "
                "another pointer path"
            ) from None

    def read(self) -> Published | None:
        """The last published target and its fence; None before the first swap."""
        with self._directory(create=False) as directory:
            entry = None if directory is None else self._load(directory)
        return None if entry is None else self._published(entry)

    @contextmanager
    def _locked(self) -> Iterator[int]:
        """The pointer's directory (made if missing), open, while this process holds the
        pointer's lock."""
        with self._directory(create=True) as directory:
            assert directory is not None  # made if missing
            # Never through a link: a planted one would lock, or create, a file elsewhere.
            fd = _durable.open_regular(self.lock_path, os.O_RDWR | os.O_CREAT, dir_fd=directory)
            try:
                deadline = time.monotonic() + self.lock_timeout
                wait = 0.0005
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise StoreError(
                                f"pointer {self.path}: another process has held "
                                f"{self.lock_path} for {self.lock_timeout}s; find it "
                                "(fuser, lsof) or raise lock_timeout"
                            ) from None
                        time.sleep(wait)
                        wait = min(wait * 2, 0.02)
                yield directory
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def swap(self, target: Target, *, fence: int) -> Published:
        """Publish ``target`` under ``fence``; StaleFence if a higher fence was accepted."""
        fence = _durable.check_fence(fence)
        entry = self._entry(target, fence)
        path = self.path
        with _durable.writing(f"cannot swap pointer {path}", path.parent), self._locked() as dir_fd:
            _durable.checkpoint("swap:locked")
            current = self._load(dir_fd)
            if current is not None:
                if fence < current["fence"]:
                    raise _stale(str(path), fence, current["fence"])
                if {k: current.get(k) for k in entry} == entry:
                    return self._published(current)  # already published: write nothing
            body = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
            if len(body) > MAX_POINTER_SIZE:
                raise ConfigError(
                    f"pointer {path}: the target's path is too long to publish (the "
                    f"pointer file would exceed {MAX_POINTER_SIZE} bytes); use a shorter path"
                )
            _durable.write_atomic(path, body, point="swap", dir_fd=dir_fd)
        return self._published(entry)


# PUBLISH
# KEYS[1] pointer hash (target, fence, digest, size)   KEYS[2] publish log (a stream)
# ARGV[1] target   ARGV[2] fence, decimal without leading zeros
# ARGV[3] digest or ""   ARGV[4] size or ""   ARGV[5] log length to keep, "0" for no log
# ARGV[6] "1" to write the hash again when it already holds this publish (so that a
#         WAIT after the script covers the earlier write too), else absent
# returns {1, fence} when accepted, {0, current fence} when a higher fence was accepted,
#         {2, key, what is wrong} when KEYS[1] or KEYS[2] holds what PUBLISH never writes
#         (another type, a fence that is not a decimal integer): nothing is written then
# Fences are compared as decimal strings, length first, so no size of integer loses
# precision in Lua's doubles.
PUBLISH = Script(
    "publish",
    """
local function below(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local types = {'hash', 'stream'}
for i = 1, (ARGV[5] == '0') and 1 or 2 do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= types[i] and kind ~= 'none' then
    return {2, KEYS[i], 'is a ' .. kind .. ', not a ' .. types[i]}
  end
end
local current = redis.call('HGET', KEYS[1], 'fence')
-- a fence that does not compare as one would let any fence overwrite it
if current and current ~= '0' and not string.match(current, '^[1-9]%d*$') then
  return {2, KEYS[1], 'holds fence ' .. string.sub(current, 1, 40) .. ', not an integer'}
end
if current and below(ARGV[2], current) then
  return {0, current}
end
if current == ARGV[2] and redis.call('HGET', KEYS[1], 'target') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'digest') == ARGV[3] then
  if ARGV[6] == '1' then
    redis.call('HSET', KEYS[1], 'fence', current)
  end
  return {1, current}
end
redis.call('HSET', KEYS[1], 'target', ARGV[1], 'fence', ARGV[2],
           'digest', ARGV[3], 'size', ARGV[4])
if ARGV[5] ~= '0' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'target', ARGV[1],
             'fence', ARGV[2], 'digest', ARGV[3], 'size', ARGV[4])
end
return {1, ARGV[2]}
""",
)


class RedisPointer:
    """A pointer kept in Redis, swapped under a fence by one Lua script.

    With ``replicas=N``, each swap waits up to ``replica_timeout`` seconds for N replicas
    to acknowledge it (``WAIT``, in the same round trip), and raises StoreError when
    fewer do: a failover could forget the publish, and then accept a lower fence.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        namespace: str = "fenced",
        history: int = HISTORY,
        replicas: int = 0,
        replica_timeout: float = 1.0,
    ) -> None:
        redis = connect(redis, what="the pointer")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ConfigError(f"history={history!r} must be an int >= 0 (0 keeps no log)")
        # No lease to outlast: any timeout is allowed.
        self.replicas, self._replica_ms = check_replicas(replicas, replica_timeout, math.inf)
        keys = ClaimKeys.of(name, namespace)
        self.redis = redis
        self.name = keys.name
        self.namespace = namespace
        self.history_length = history
        # The same hash tag as a claim of the same name: one Cluster slot for both.
        self.key = keys.pointer
        self.log_key = keys.pointer_log

    def __repr__(self) -> str:
        return f"<RedisPointer {self.key!r}>"

    def swap(self, target: Target, *, fence: int) -> Published:
        """Publish ``target`` under ``fence``; StaleFence if a higher fence was accepted."""
        fence = _durable.check_fence(fence)
        where, digest, size = _parts(target)
        text = os.fspath(where)
        args = [text, str(fence), digest or "", "" if size is None else str(size)]
        keys = [self.key, self.log_key]
        acked = 0
        try:
            if self.replicas:
                wait = (self.replicas, self._replica_ms)
                call = (PUBLISH, keys, [*args, str(self.history_length), "1"])
                answer, acked = run_replicated(self.redis, self.key, call, wait)
            else:
                answer = PUBLISH(self.redis, keys, [*args, str(self.history_length)])
        except UNREACHABLE as exc:
            raise StoreError(
                f"pointer {self.key}: Redis unreachable ({exc})", name=self.name
            ) from exc
        accepted = int(answer[0])
        if accepted == 2:
            raise self._foreign(f"cannot swap to fence {fence}", answer[1], answer[2])
        if not accepted:
            raise _stale(self.key, fence, int(as_text(answer[1])))
        if acked < self.replicas:
            raise self._unreplicated(fence, acked)
        return Published(text, fence, digest, size)

    def _unreplicated(self, fence: int, acked: int) -> StoreError:
        # Fail closed: the master holds the publish, a promoted replica may not, and
        # would then take a lower fence. Swapping again (same fence) is safe.
        return StoreError(
            f"pointer {self.key}: the master accepted fence {fence}, but only {acked} of "
            f"the {self.replicas} replica(s) asked for acknowledged it within "
            f"{self._replica_ms / 1000:g} s, so the publish is not durable: readers of the "
            "master see the new target, and a failover now could bring back the previous "
            "one and accept a lower fence. Do not count it as published: swap again once "
            "the replicas answer (INFO replication), or lower replicas=",
            name=self.name,
            fence=fence,
        )

    def _foreign(self, doing: str, key: Any, problem: Any) -> StoreError:
        """StoreError for a key of the pointer holding what fenced never writes there."""
        key = printable(readable(key))
        return StoreError(
            f"pointer {self.name!r}: {doing}: its key {key!r} {printable(readable(problem))}; "
            f"fenced did not write that. Delete the key (DEL {key}) and swap again, or "
            "restore what a swap writes there",
            name=self.name,
        )

    def read(self) -> Published | None:
        """The last published target and its fence; None before the first swap.

        A pointer that holds what a swap never writes raises StoreError naming its key.
        """
        try:
            target, fence, digest, size = self.redis.hmget(
                self.key, "target", "fence", "digest", "size"
            )
        except UnicodeDecodeError:  # a client that decodes replies
            raise self._foreign(
                "cannot read", self.key, "holds a value that is not UTF-8"
            ) from None
        except ResponseError as exc:  # WRONGTYPE: not a hash
            raise self._foreign("cannot read", self.key, f"is not a hash ({exc})") from None
        if target is None or fence is None:
            return None
        try:
            return _from_fields(target, fence, digest, size)
        except ValueError as exc:
            raise self._foreign(
                "cannot read", self.key, f"holds an unreadable publish: {exc}"
            ) from None

    def history(self, limit: int = 20) -> list[Published]:
        """Accepted publishes, newest first (stale attempts are never recorded).

        A logged entry that cannot be read comes back with ``unreadable`` saying why.
        """
        try:
            entries = self.redis.xrevrange(self.log_key, count=limit)
        except UnicodeDecodeError:  # a client that decodes replies cannot read any of it
            why = "a logged publish is not UTF-8; a client without decode_responses reads the rest"
            return [Published("", 0, unreadable=why)]
        except ResponseError as exc:  # WRONGTYPE: not a stream
            return [Published("", 0, unreadable=f"{self.log_key}: {exc}")]
        out = []
        for _id, fields in entries:
            f = {readable(k): v for k, v in fields.items()}
            try:
                out.append(_from_fields(f["target"], f["fence"], f.get("digest"), f.get("size")))
            except (KeyError, ValueError) as exc:
                why = f"no {exc} field" if isinstance(exc, KeyError) else str(exc)
                target = readable(f.get("target", ""))
                out.append(Published(target, 0, unreadable=why))
        return out


def _from_fields(target: Any, fence: Any, digest: Any, size: Any) -> Published:
    """A publish from its stored fields; ValueError saying which one is not readable."""
    texts = {}
    for field, value in (("target", target), ("fence", fence), ("digest", digest), ("size", size)):
        try:
            texts[field] = "" if value is None else as_text(value)
        except UnicodeDecodeError:
            raise ValueError(f"its {field} is not UTF-8") from None
    for field in ("fence", "size"):
        text = texts[field]
        if text and not (text.isascii() and text.isdigit()):
            raise ValueError(f"its {field} {printable(text[:40])!r} is not an integer")
    if not texts["fence"]:
        raise ValueError("its fence is empty")
    target, fence, digest, size = texts.values()
    return Published(target, int(fence), digest or None, int(size) if size else None)
