"""Child processes for the store tests: a build that can crash, pointer readers, swappers.

python store_child.py build STORE POINTER FENCE VERSION N
    put N objects, a manifest listing them, then swap POINTER to the manifest.
    FENCED_CRASH_AT=point[@n] kills the process (SIGKILL) at the n-th time it
    reaches that checkpoint (default the first).
python store_child.py read STORE POINTER READY STOP
    poll the pointer until STOP exists; check every published target fully;
    print a JSON report.
python store_child.py swap STORE POINTER FENCE COUNT GO
    wait for GO, then swap POINTER COUNT times under FENCE; print a JSON report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from fenced import StaleFence
from fenced.store import ContentStore, FilePointer, Published, _durable


def build_objects(version: str, n: int) -> dict[str, bytes]:
    """The deterministic output of one build: the same version gives the same bytes."""
    return {
        f"tile-{i:03d}.txt": (f"{version} tile {i}\n" * (200 + 37 * i)).encode() for i in range(n)
    }


def build(store: ContentStore, pointer: FilePointer, fence: int, version: str, n: int) -> None:
    """Write every object, then the manifest, then publish: the order a real build uses."""
    refs = {name: store.put(data) for name, data in build_objects(version, n).items()}
    _durable.checkpoint("build:objects")
    manifest = store.put_manifest(refs)
    _durable.checkpoint("build:manifest")
    pointer.swap(manifest, fence=fence)


def check_published(store: ContentStore, pub: Published) -> int:
    """Read a published manifest and everything it lists; raises on anything partial."""
    assert pub.ref is not None, f"published without a digest: {pub}"
    entries = store.read_manifest(pub.ref)
    assert entries, "empty manifest"
    for ref in entries.values():
        store.read_bytes(ref)  # checks the digest: complete, uncorrupted bytes
    return len(entries)


def _install_crash(spec: str) -> None:
    point, _, nth_text = spec.partition("@")
    nth = int(nth_text or "1")
    seen = 0

    def crash_at(reached: str) -> None:
        nonlocal seen
        if reached == point:
            seen += 1
            if seen == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    _durable.checkpoint = crash_at  # type: ignore[assignment]


def _read(store: ContentStore, pointer: FilePointer, ready: Path, stop: Path) -> None:
    reads = published = 0
    last_fence = -1
    targets: set[str] = set()
    errors: list[str] = []
    ready.touch()
    finished = False
    while not finished:
        finished = stop.exists()  # one more read after STOP: it sees the final publish
        reads += 1
        try:
            pub = pointer.read()
            if pub is None:
                continue
            published += 1
            if pub.fence < last_fence:
                errors.append(f"fence went back from {last_fence} to {pub.fence}")
            last_fence = pub.fence
            targets.add(pub.target)
            data = store.read_bytes(pub.ref) if pub.ref else b""
            if data.startswith(b'{"fenced_manifest"'):
                check_published(store, pub)
            elif not data.startswith(b"object "):
                errors.append(f"unexpected bytes at {pub.target}: {data[:40]!r}")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        if len(errors) > 20:
            break
    print(
        json.dumps(
            {
                "reads": reads,
                "published": published,
                "targets": len(targets),
                "last_fence": last_fence,
                "errors": errors,
            }
        )
    )


def _swap(store: ContentStore, pointer: FilePointer, fence: int, count: int, go: Path) -> None:
    refs = sorted(store.refs(), key=lambda r: r.digest)
    accepted = stale = 0
    while not go.exists():
        time.sleep(0.001)
    for i in range(count):
        try:
            pointer.swap(refs[(i + fence) % len(refs)], fence=fence)
            accepted += 1
        except StaleFence:
            stale += 1
    print(json.dumps({"fence": fence, "accepted": accepted, "stale": stale}))


def main(argv: list[str]) -> None:
    mode, store_dir, pointer_path, *rest = argv
    store = ContentStore(store_dir, create=True)
    pointer = FilePointer(pointer_path)
    if mode == "build":
        if os.environ.get("FENCED_CRASH_AT"):
            _install_crash(os.environ["FENCED_CRASH_AT"])
        build(store, pointer, int(rest[0]), rest[1], int(rest[2]))
    elif mode == "read":
        _read(store, pointer, Path(rest[0]), Path(rest[1]))
    elif mode == "swap":
        _swap(store, pointer, int(rest[0]), int(rest[1]), Path(rest[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
