"""ObjectStore and ObjectPointer on a real S3 API server: moto in server mode.

Every request goes through a small HTTP proxy in front of moto, which records it (method,
key, status) so the tests count requests; the same proxy, told to, strips If-Match and
If-None-Match, which makes a store that ignores conditions, or answers a create-only
write with S3's 409 for an object that does not exist.

moto checks a precondition and then writes, without a lock between the two, so it shows
that the conditions are sent and honoured one request at a time, not how two racing
writers fare: races are tested on Azurite (test_store_object_azurite.py).
"""

from __future__ import annotations

import http.client
import io
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

obstore = pytest.importorskip("obstore")
boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from fenced import StaleFence, StoreError  # noqa: E402
from fenced.store import ObjectPointer, ObjectStore, Pointer  # noqa: E402

CREDENTIALS: dict[str, Any] = {
    "access_key_id": "test",
    "secret_access_key": "test",
    "region": "us-east-1",
}


@dataclass
class Proxy:
    """An HTTP proxy in front of moto: records requests, can strip conditions or fake 409s."""

    upstream: str
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    strip: bool = False
    #: Answer this many create-only PUTs with 409 ConditionalRequestConflict, unsent.
    conflicts: int = 0
    url: str = ""

    def start(self) -> ThreadingHTTPServer:
        proxy = self
        host, port = urlsplit(self.upstream).netloc.split(":")

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                if proxy.strip:
                    headers = {
                        k: v
                        for k, v in headers.items()
                        if k.lower() not in ("if-match", "if-none-match")
                    }
                key = unquote(urlsplit(self.path).path)
                if proxy.conflicts and self.command == "PUT" and self.headers.get("If-None-Match"):
                    proxy.conflicts -= 1
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>'
                        b"ConditionalRequestConflict</Code><Message>A conflicting "
                        b"operation occurred</Message></Error>"
                    )
                    proxy.requests.append((self.command, key, 409))
                    self.send_response(409)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                proxy.requests.append((self.command, key, resp.status))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, as the upstream said.
                told = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", told or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        return server

    def on(self, key_part: str) -> list[tuple[str, int]]:
        """(method, status) of the requests whose key contains ``key_part``."""
        return [(m, s) for m, k, s in self.requests if key_part in k]


@pytest.fixture(scope="module")
def moto() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def proxied(moto: str, **kwargs: Any) -> Iterator[Proxy]:
    proxy = Proxy(moto, **kwargs)
    server = proxy.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(moto: str) -> Iterator[Proxy]:
    yield from proxied(moto)


@pytest.fixture
def bucket(moto: str) -> str:
    name = f"maps-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=moto,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=name)
    return name


def open_store(proxy: Proxy, bucket: str, **kwargs: Any) -> ObjectStore:
    return ObjectStore(f"s3://{bucket}/out", endpoint=proxy.url, **CREDENTIALS, **kwargs)


@pytest.fixture
def store(proxy: Proxy, bucket: str) -> ObjectStore:
    return open_store(proxy, bucket)


# -- content-addressed, create-only ------------------------------------------------------


def test_put_is_content_addressed_and_create_only(store: ObjectStore, proxy: Proxy) -> None:
    ref = store.put(b"tile 0/0/0")
    assert store.put(b"tile 0/0/0") == ref
    assert str(ref.path) == f"blobs/{ref.digest[:2]}/{ref.digest[2:]}"
    assert store.read_bytes(ref) == b"tile 0/0/0"
    # One upload: the repeat is refused by the store (If-None-Match), then believed
    # only when a HEAD shows the blob with its size.
    assert proxy.on(ref.digest[2:]) == [("PUT", 200), ("PUT", 412), ("HEAD", 200), ("GET", 200)]
    assert store.put(io.BytesIO(b"tile 0/0/0")) == ref


def test_large_bytes_are_looked_up_before_upload(proxy: Proxy, bucket: str, tmp_path: Any) -> None:
    store = open_store(proxy, bucket, head_above=1024)
    data = os.urandom(64 * 1024)
    path = tmp_path / "tile.png"
    path.write_bytes(data)
    ref = store.put(path)
    assert store.put(data) == ref
    assert proxy.on(ref.digest[2:]) == [("HEAD", 404), ("PUT", 200), ("HEAD", 200)]


def test_a_reused_old_blob_is_written_again(proxy: Proxy, bucket: str) -> None:
    # With grace 0 every stored blob is "old": its reuse writes it again, so a gc that
    # judges by last_modified counts the grace from this put.
    store = open_store(proxy, bucket, grace=0)
    ref = store.put(b"reused")
    assert store.put(b"reused") == ref
    assert proxy.on(ref.digest[2:]) == [("PUT", 200), ("PUT", 412), ("HEAD", 200), ("PUT", 200)]


def test_a_409_on_create_is_not_taken_as_stored(moto: str, bucket: str) -> None:
    # S3 answers a create-only write racing another with 409, which obstore reports as
    # "already exists": put looks (HEAD), finds nothing, and writes again.
    for proxy in proxied(moto, conflicts=1):
        store = open_store(proxy, bucket)
        ref = store.put(b"raced")
        assert proxy.on(ref.digest[2:]) == [("PUT", 409), ("HEAD", 404), ("PUT", 200)]
        assert store.read_bytes(ref) == b"raced"


# -- the pointer --------------------------------------------------------------------------


def kind(key: str) -> str:
    """What a request's key is: blobs, pointers, .fenced-probe, or the bucket itself."""
    return key.split("/out/", 1)[1].split("/")[0] if "/out/" in key else "bucket"


def test_requests_per_publish(store: ObjectStore, proxy: Proxy) -> None:
    pointer = ObjectPointer(store, "latest")
    pointer.swap(store.put(b"first build"), fence=1)  # the probe runs here, once
    # The blob, the probe's 12 requests (its writes, the reads that check them, two
    # bulk deletes), then the pointer: missing, so written create-only.
    first = [(m, kind(k), s) for m, k, s in proxy.requests]
    assert first[0] == ("PUT", "blobs", 200)
    assert {k for _, k, _ in first[1:13]} == {".fenced-probe", "bucket"}
    assert first[13:] == [("GET", "pointers", 404), ("PUT", "pointers", 200)]
    del proxy.requests[:]
    pointer.swap(store.put(b"second build"), fence=2)
    sent = [(m, kind(k), s) for m, k, s in proxy.requests]
    # One blob write, one pointer read, one conditional pointer write; no probe again.
    assert sent == [("PUT", "blobs", 200), ("GET", "pointers", 200), ("PUT", "pointers", 200)]
    print(f"requests per publish: {len(sent)}: {sent}")


def test_swap_with_a_lower_fence_raises_and_leaves_the_pointer(store: ObjectStore) -> None:
    pointer = ObjectPointer(store, "maps/incidents")
    assert isinstance(pointer, Pointer)
    assert pointer.read() is None
    newer = store.put(b"built by B")
    pointer.swap(newer, fence=1002)
    with pytest.raises(StaleFence) as caught:
        pointer.swap(store.put(b"built by A"), fence=1001)
    assert caught.value.current == 1002
    published = pointer.read()
    assert published is not None and published.fence == 1002
    assert published.ref == store.ref(newer.digest, newer.size)
    # An equal fence is accepted (the same holder publishing again), as by FilePointer.
    again = store.put(b"built by B again")
    assert pointer.swap(again, fence=1002).digest == again.digest
    assert store.read_bytes(pointer.read().digest or "") == b"built by B again"  # type: ignore[union-attr]


def test_only_a_blob_of_the_store_is_published(store: ObjectStore, tmp_path: Any) -> None:
    from fenced import ConfigError
    from fenced.store import ContentStore

    local = ContentStore(tmp_path, create=True).put(b"a local file")
    with pytest.raises(ConfigError, match="not a blob of"):
        ObjectPointer(store, "latest").swap(local, fence=1)


def test_a_write_between_read_and_swap_is_read_again(store: ObjectStore) -> None:
    slow, fast = ObjectPointer(store, "p"), ObjectPointer(store, "p")
    slow.swap(store.put(b"v1"), fence=1)
    load = slow._load
    calls = 0

    def racing() -> Any:
        nonlocal calls
        calls += 1
        seen = load()
        if calls == 1:  # another holder publishes between this read and the write
            fast.swap(store.put(b"v3"), fence=3)
        return seen

    slow._load = racing  # type: ignore[method-assign]
    with pytest.raises(StaleFence):
        slow.swap(store.put(b"v2"), fence=2)  # 412, read again: fence 3 > 2
    assert calls == 2
    assert slow.read().fence == 3  # type: ignore[union-attr]


def test_a_pointer_always_names_a_complete_blob(store: ObjectStore) -> None:
    pointer = ObjectPointer(store, "latest")
    good = store.put(b"complete output" * 1000)
    pointer.swap(good, fence=7)

    class Broken(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise OSError("disk gone halfway")

    with pytest.raises(OSError):
        store.put(io.BufferedReader(Broken()))
    published = pointer.read()
    assert published is not None and published.digest == good.digest
    assert store.read_bytes(published.digest) == b"complete output" * 1000
    assert [ref.digest for ref in store.refs()] == [good.digest]


def test_gc_keeps_what_the_pointer_names(store: ObjectStore) -> None:
    pointer = ObjectPointer(store, "latest")
    tile = store.put(b"tile")
    manifest = store.put_manifest({"0/0/0.png": tile})
    old = store.put(b"old tile")
    pointer.swap(manifest, fence=3)
    assert store.gc(keep=[pointer]) == []  # everything is younger than the grace
    assert store.gc(keep=[pointer], grace=0, dry_run=True) == [old]
    assert store.gc(keep=[pointer], grace=0) == [old]
    assert {ref.digest for ref in store.refs()} == {tile.digest, manifest.digest}
    assert store.read_manifest(pointer.read().digest or "") == {"0/0/0.png": tile}  # type: ignore[union-attr]


# -- the probe ----------------------------------------------------------------------------


def test_the_probe_passes_on_moto(store: ObjectStore, proxy: Proxy) -> None:
    checks = store.probe()
    assert [(c.name, c.ok) for c in checks] == [
        ("create-only", True),
        ("if-match-wrong-etag", True),
        ("if-match-missing", True),
        ("if-match", True),
    ]
    assert list(obstore.list(store.backend, prefix=".fenced-probe/").collect()) == []


def test_a_store_that_ignores_conditions_is_refused(moto: str, bucket: str) -> None:
    for proxy in proxied(moto, strip=True):
        store = open_store(proxy, bucket)
        failed = {c.name: c.detail for c in store.probe() if not c.ok}
        assert set(failed) == {"create-only", "if-match-wrong-etag", "if-match-missing"}
        assert "holds b'second'" in failed["create-only"]
        pointer = ObjectPointer(store, "latest")
        ref = store.put(b"output")
        with pytest.raises(StoreError) as caught:
            pointer.swap(ref, fence=1)
        message = str(caught.value)
        assert "does not honour conditional writes" in message
        assert "create-only" in message and "if-match-wrong-etag" in message
        assert "If-None-Match and If-Match" in message  # the fix
        assert pointer.read() is None  # nothing published


def test_a_local_store_without_if_match_is_refused(tmp_path: Any) -> None:
    store = ObjectStore(f"file://{tmp_path}")
    failed = {c.name for c in store.probe() if not c.ok}
    assert "if-match-wrong-etag" in failed and "if-match" in failed
    with pytest.raises(StoreError, match="does not honour conditional writes"):
        ObjectPointer(store, "latest").swap(store.put(b"x"), fence=1)


def test_a_memory_store_publishes() -> None:
    store = ObjectStore("memory:///")
    pointer = ObjectPointer(store, "latest")
    ref = store.put(b"in memory")
    assert pointer.swap(ref, fence=1).digest == ref.digest
    assert pointer.read() == pointer.swap(ref, fence=1)


# -- fenced doctor --store ----------------------------------------------------------------


def doctor(store_url: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FENCED_", "AWS_"))}
    env |= {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", "doctor", "--store", store_url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_doctor_store_passes_on_moto(moto: str, bucket: str) -> None:
    res = doctor(f"s3://{bucket}/out", moto)
    assert res.returncode == 0, res.stdout + res.stderr
    found = {f["code"]: f["severity"] for f in json.loads(res.stdout)["findings"]}
    assert found == {"store.conditions": "info"}


def test_doctor_store_names_what_fails(moto: str, bucket: str) -> None:
    for proxy in proxied(moto, strip=True):
        res = doctor(f"s3://{bucket}/out", proxy.url)
        assert res.returncode == 1, res.stdout + res.stderr
        found = {f["code"]: f for f in json.loads(res.stdout)["findings"]}
        assert set(found) == {
            "store.create-only",
            "store.if-match-wrong-etag",
            "store.if-match-missing",
        }
        assert all(f["severity"] == "error" for f in found.values())
        assert "If-None-Match and If-Match" in found["store.create-only"]["fix"]


def test_without_obstore_the_store_package_imports_and_names_the_extra() -> None:
    code = (
        "import sys\n"
        "sys.modules['obstore'] = None\n"
        "import fenced.store\n"
        "try:\n"
        "    from fenced.store import ObjectStore\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'fenced[objstore]'" in out.stdout, out.stderr
