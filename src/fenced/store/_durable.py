"""Durable file steps shared by the store and the file pointer: fsync, atomic replace, fences.

A file becomes visible under its final name only by ``os.replace`` of a complete,
fsynced temporary file in the same directory (or the same filesystem), and the
directory is fsynced afterwards so the new name itself survives a power cut.

Inside a store, nothing fenced writes or creates follows a symbolic link: files are
opened with ``O_NOFOLLOW`` (new ones with ``O_EXCL``), and the directories it makes
are opened beside their parent (``dir_fd``) and refused when they are links, so a
link planted in the tree cannot send a write, a create or a read elsewhere. New files
and directories get ``0o666`` and ``0o777`` less the process umask, like any program's.
"""

from __future__ import annotations

import errno
import operator
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from .._errors import ConfigError, StoreError

__all__ = [
    "check_fence",
    "check_writable",
    "checkpoint",
    "ensure_dir",
    "fsync_dir",
    "not_followed",
    "open_dir",
    "open_regular",
    "open_root",
    "read_only",
    "temp_file",
    "writable_fix",
    "write_all",
    "write_atomic",
    "writing",
]

#: Largest fence a signed 64-bit (BIGINT) column holds.
MAX_FENCE = 2**63 - 1
#: Flags that keep an open from following a link in the last component, or leaking.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: Mode of a new file before the umask, as any program creates one.
FILE_MODE = 0o666
#: Mode of a new directory before the umask.
DIR_MODE = 0o777


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


def not_followed(path: Path, kind: str) -> StoreError:
    """The error for a symbolic link (or other non-regular entry) where ``kind`` belongs."""
    return StoreError(
        f"{path} is a symbolic link or not a {kind}: fenced does not follow links inside "
        "a store, so a planted link cannot send its reads and writes elsewhere; replace "
        f"it with a real {kind}, or remove it"
    )


def open_root(path: Path) -> int:
    """Open a directory the caller chose, as given: a store's root may be a link."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)


def open_dir(parent: int, path: Path, *, create: bool) -> int | None:
    """Open the directory ``path`` (a name in ``parent``) never through a link; None if missing.

    With ``create`` it is made first (mode 0o777 less the umask).
    """
    if create:
        try:
            os.mkdir(path.name, DIR_MODE, dir_fd=parent)
            os.fsync(parent)
        except FileExistsError:
            pass  # made by a concurrent writer, or a link: the open below tells which
        except OSError as exc:
            exc.filename = str(path)
            raise
    try:
        return os.open(
            path.name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW, dir_fd=parent
        )
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise not_followed(path, "directory") from None
        raise


def open_regular(path: Path, flags: int, *, dir_fd: int) -> int:
    """Open a regular file, ``path``'s name in the open directory ``dir_fd``, without
    following a link (a FIFO or device is refused too); a new one gets FILE_MODE."""
    try:
        fd = os.open(path.name, flags | NOFOLLOW | os.O_NONBLOCK, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_followed(path, "regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(
                f"{path} is not a regular file (a device, FIFO or socket): remove it, "
                "or choose another path"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_only(fd: int) -> None:
    """Take the write bits off a file, keeping what the umask allowed it to be read by."""
    os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o222)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (os.write may write part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@contextmanager
def temp_file(directory: int, stem: str) -> Iterator[tuple[str, int]]:
    """A new file with a fresh hidden name no other writer will choose, in the open
    ``directory``: its name and a descriptor to write it (closed on leaving the block).
    When the block raises, the file is removed."""
    name = f".{stem}.{secrets.token_hex(6)}.tmp"
    # O_EXCL: a name that exists, a link included, is never opened.
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, FILE_MODE, dir_fd=directory)
    try:
        try:
            yield name, fd
        finally:
            os.close(fd)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=directory)
        raise


def write_atomic(path: Path, data: bytes, *, point: str, dir_fd: int) -> None:
    """Replace ``path``, a name in the open directory ``dir_fd``, with ``data`` in one
    step: temp file, fsync, os.replace, directory fsync."""
    # Every step names files beside the directory (dir_fd): the temporary file, the
    # replace and a failed write's clean-up all happen in it, even when the path to it
    # is changed meanwhile.
    with temp_file(dir_fd, path.name) as (tmp, fd):
        write_all(fd, data)
        os.fsync(fd)
        checkpoint(f"{point}:written")
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    checkpoint(f"{point}:replaced")
    os.fsync(dir_fd)


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
        # A name opened beside its directory (dir_fd) is relative: say the directory.
        where = exc.filename if exc.filename and os.path.isabs(exc.filename) else directory
        raise StoreError(
            f"{what}: cannot write {where} ({exc.strerror or exc}); "
            f"{writable_fix(directory, exc.errno)}"
        ) from exc


def check_writable(directory: Path, what: str) -> None:
    """StoreError naming the fix when files cannot be made in ``directory``."""
    err = None
    with suppress(OSError):
        err = errno.EROFS if os.statvfs(directory).f_flag & os.ST_RDONLY else None
    if err is None and not os.access(directory, os.W_OK | os.X_OK):
        err = errno.EACCES
    if err is not None:
        raise StoreError(f"{what} is not writable: {writable_fix(directory, err)}")
