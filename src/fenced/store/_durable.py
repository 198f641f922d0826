"""Durable file steps shared by the store and the file pointer: fsync, atomic replace, fences.

A file becomes visible under its final name only by ``os.replace`` of a complete,
fsynced temporary file in the same directory (or the same filesystem), and the
directory is fsynced afterwards so the new name itself survives a power cut.
"""

from __future__ import annotations

import errno
import operator
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .._errors import ConfigError, StoreError

__all__ = [
    "check_fence",
    "check_writable",
    "checkpoint",
    "ensure_dir",
    "fsync_dir",
    "temp_name",
    "writable_fix",
    "write_atomic",
    "writing",
]

#: Largest fence a signed 64-bit (BIGINT) column holds.
MAX_FENCE = 2**63 - 1


def checkpoint(point: str) -> None:
    """Mark a step of a durable write; does nothing.

    It exists so crash tests can replace it and kill the process between two steps.
    """


def check_fence(fence: object) -> int:
    """The fence as an int, or ConfigError naming the fix (None, bool, float, str...)."""
    if fence is None:
        raise ConfigError(
            "fence is None: the claim is not held; acquire it first and pass fence=claim.fence"
        )
    if isinstance(fence, bool):
        raise ConfigError(f"fence={fence!r} is a bool: pass fence=claim.fence (an integer)")
    try:
        value = operator.index(fence)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"fence={fence!r} is not an integer ({type(fence).__name__}): pass "
            "fence=claim.fence, the integer fencing token of a held claim"
        ) from None
    if not 0 <= value <= MAX_FENCE:
        raise ConfigError(
            f"fence={value} is outside 0..2**63-1: pass fence=claim.fence, the fencing "
            "token of a held claim"
        )
    return value


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new or replaced name) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """Create a directory and its missing parents, each made durable in its own parent."""
    missing: list[Path] = []
    p = path
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # a concurrent writer created it
        fsync_dir(d.parent)


def temp_name(directory: Path, stem: str) -> Path:
    """A fresh hidden name in ``directory`` that no other writer will choose."""
    return directory / f".{stem}.{secrets.token_hex(6)}.tmp"


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, point: str = "write") -> None:
    """Replace ``path`` with ``data`` in one step: temp file, fsync, os.replace, dir fsync."""
    tmp = temp_name(path.parent, path.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        checkpoint(f"{point}:written")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    checkpoint(f"{point}:replaced")
    fsync_dir(path.parent)


def writable_fix(path: Path, err: int | None) -> str:
    """What to do so that files can be written in the directory ``path``."""
    if err == errno.EROFS:
        return f"{path} is on a read-only filesystem: choose a directory on a writable one"
    if err in (errno.ENOSPC, errno.EDQUOT):
        return f"the filesystem of {path} is full (or its quota is): free space, or choose another"
    if err in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
        return (
            "a file stands where a directory is needed (or the reverse): move it, "
            "or choose another path"
        )
    if err == errno.ENOENT:
        return f"{path} (or a directory in it) was removed: create it again"
    if err in (errno.EACCES, errno.EPERM):
        return (
            f"let this user (uid {os.geteuid()}) write there (chmod u+w, or chown), "
            "or choose another directory"
        )
    return f"check that {path} is a writable directory with free space"


@contextmanager
def writing(what: str, directory: Path) -> Iterator[None]:
    """Turn an OSError of a write under ``directory`` into a StoreError naming the fix."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or directory
        raise StoreError(
            f"{what}: cannot write {where} ({exc.strerror or exc}); "
            f"{writable_fix(directory, exc.errno)}"
        ) from exc


def check_writable(directory: Path, what: str) -> None:
    """StoreError naming the fix when files cannot be made in ``directory``."""
    read_only = False
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        pass
    if read_only:
        err: int | None = errno.EROFS
    elif not os.access(directory, os.W_OK | os.X_OK):
        err = errno.EACCES
    else:
        return
    raise StoreError(f"{what} is not writable: {writable_fix(directory, err)}")
