"""ObjectPointer under racing writers, on Azurite (the Azure Blob Storage emulator).

moto checks a precondition and writes later without a lock, so races are tested here,
on a server that decides each conditional write atomically. Azurite is an npm package
that `make test` installs from tests/npm/package.json (at the version its lockfile
pins) when npm is there; outside CI, without it, these tests are skipped naming the
fix, and in CI (CI set) they run and fail, so they never stop silently.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import os
import random
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")

from fenced import StaleFence
from fenced.store import ObjectPointer, ObjectStore

_OWN = Path(__file__).resolve().parent / "npm" / "node_modules" / ".bin" / "azurite-blob"
AZURITE = str(_OWN) if _OWN.exists() else shutil.which("azurite-blob")
pytestmark = pytest.mark.skipif(
    AZURITE is None and not os.environ.get("CI"),
    reason="Azurite is not installed: `make test` installs it from tests/npm (needs npm), "
    "or `cd tests/npm && npm ci`; in CI (CI set) these tests run and fail instead",
)

# Azurite's well-known development account (documented, not a secret).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
WRITERS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert AZURITE is not None, "Azurite is not installed: `cd tests/npm && npm ci`"
    port = free_port()
    where = tmp_path_factory.mktemp("azurite")
    log = (where / "azurite.log").open("wb")
    proc = subprocess.Popen(
        [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
         str(where), "--silent", "--disableTelemetry", "--skipApiVersionCheck"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"azurite did not start: {(where / 'azurite.log').read_text()}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def create_container(endpoint: str, name: str) -> None:
    """Create a container with a SharedKey-signed request (obstore makes no containers)."""
    headers = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    signed = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    # The verb, then eleven standard headers, all empty (a Content-Length of 0 too).
    text = "PUT\n" + "\n" * 11 + signed + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
    mac = hmac.new(base64.b64decode(KEY), text.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
    headers["Content-Length"] = "0"
    host = endpoint.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=10)
    try:
        conn.request("PUT", f"/{ACCOUNT}/{name}?restype=container", headers=headers)
        resp = conn.getresponse()
        assert resp.status == 201, (resp.status, resp.read())
    finally:
        conn.close()


@pytest.fixture
def store(azurite: str) -> ObjectStore:
    name = f"maps{uuid.uuid4().hex[:12]}"
    create_container(azurite, name)
    return ObjectStore(
        f"az://{name}/out",
        account_name=ACCOUNT,
        access_key=KEY,
        endpoint=f"{azurite}/{ACCOUNT}",
    )


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
