"""ObjectPointer under racing writers, on Azurite (the Azure Blob Storage emulator).

moto checks a precondition and writes later without a lock, so races are tested here,
on a server that decides each conditional write atomically (see ``_azurite`` for how
Azurite is installed, and when its absence skips or fails these tests). The race at
scale, with claims, zombie processes and a watching reader, is in
test_store_object_races.py.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("obstore")

from _azurite import create_container, needs_azurite, open_store, running_azurite
from fenced import StaleFence
from fenced.store import ObjectPointer, ObjectStore

pytestmark = needs_azurite
WRITERS = 8


@pytest.fixture(scope="module")
def azurite() -> Iterator[str]:
    with running_azurite() as endpoint:
        yield endpoint


@pytest.fixture
def store(azurite: str) -> ObjectStore:
    name = f"maps{uuid.uuid4().hex[:12]}"
    create_container(azurite, name)
    return open_store(azurite, name)


def counting(pointer: ObjectPointer, reads: list[int]) -> None:
    load = pointer._load

    def counted() -> Any:
        reads.append(1)
        return load()

    pointer._load = counted  # type: ignore[method-assign]


def test_the_probe_passes_on_azurite(store: ObjectStore) -> None:
    assert all(c.ok for c in store.probe()), store.probe()


def test_racing_swaps_leave_the_highest_fence(store: ObjectStore) -> None:
    """Writers with fences in shuffled order swap at once, round after round: the
    pointer ends on the highest fence, every refusal names a higher accepted fence, the
    highest writer is never refused, and refused conditional writes were read again."""
    refs = [store.put(f"build {i}".encode()) for i in range(WRITERS)]
    reads: list[int] = []
    swaps = 0
    for round_ in range(5):
        fences = [round_ * 100 + i for i in range(1, WRITERS + 1)]
        random.shuffle(fences)
        barrier = threading.Barrier(WRITERS)
        outcome: dict[int, Any] = {}

        def write(
            fence: int, ref: Any, barrier: threading.Barrier, outcome: dict[int, Any]
        ) -> None:
            pointer = ObjectPointer(store, "latest")
            counting(pointer, reads)
            barrier.wait()
            try:
                outcome[fence] = pointer.swap(ref, fence=fence)
            except StaleFence as exc:
                outcome[fence] = exc

        threads = [
            threading.Thread(target=write, args=(fence, refs[i], barrier, outcome))
            for i, fence in enumerate(fences)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        swaps += WRITERS
        top = max(fences)
        assert not isinstance(outcome[top], BaseException), outcome[top]
        for fence, result in outcome.items():
            if isinstance(result, StaleFence):
                assert result.current is not None and result.current > fence
        final = ObjectPointer(store, "latest").read()
        assert final is not None and final.fence == top
        assert final.digest == refs[fences.index(top)].digest
    # More reads than swaps: some conditional writes lost a race and read again.
    print(f"racing swaps: {swaps} swaps, {len(reads)} pointer reads")
    assert len(reads) > swaps


def test_a_paused_writer_is_refused_after_a_newer_publish(store: ObjectStore) -> None:
    old, new = ObjectPointer(store, "p"), ObjectPointer(store, "p")
    old.swap(store.put(b"v1"), fence=1)
    load = old._load
    paused = threading.Event()
    resume = threading.Event()
    calls = 0

    def pausing() -> Any:
        nonlocal calls
        calls += 1
        seen = load()
        if calls == 1:
            paused.set()
            resume.wait(10)
        return seen

    old._load = pausing  # type: ignore[method-assign]
    result: list[Any] = []

    def stale() -> None:
        try:
            result.append(old.swap(store.put(b"v2"), fence=2))
        except StaleFence as exc:
            result.append(exc)

    t = threading.Thread(target=stale)
    t.start()
    assert paused.wait(10)
    new.swap(store.put(b"v3"), fence=3)  # while the fence-2 writer is paused
    resume.set()
    t.join(30)
    assert isinstance(result[0], StaleFence) and result[0].current == 3
    assert new.read().fence == 3  # type: ignore[union-attr]
    assert calls == 2  # its If-Match write was refused, and it read again


def test_racing_puts_of_the_same_bytes_store_one_blob(store: ObjectStore) -> None:
    data = b"same tile" * 1000
    barrier = threading.Barrier(WRITERS)
    refs: list[Any] = []

    def put() -> None:
        barrier.wait()
        refs.append(store.put(data))

    threads = [threading.Thread(target=put) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(refs) == WRITERS and len(set(refs)) == 1
    assert store.read_bytes(refs[0]) == data
    assert [r.digest for r in store.refs()] == [refs[0].digest]
