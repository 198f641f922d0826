"""Azurite (the Azure Blob Storage emulator) for the object store's race tests.

Azurite decides each conditional write atomically, which moto does not, so races run on
it. It is an npm package that `make test` installs from tests/npm/package.json (at the
version its lockfile pins) when npm is there; outside CI, without it, the tests marked
``needs_azurite`` are skipped naming the fix, and in CI (CI set) they run and fail, so
they never stop silently.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate
from pathlib import Path

import pytest

from fenced.store import ObjectStore

_OWN = Path(__file__).resolve().parent / "npm" / "node_modules" / ".bin" / "azurite-blob"
AZURITE = str(_OWN) if _OWN.exists() else shutil.which("azurite-blob")
needs_azurite = pytest.mark.skipif(
    AZURITE is None and not os.environ.get("CI"),
    reason="Azurite is not installed: `make test` installs it from tests/npm (needs npm), "
    "or `cd tests/npm && npm ci`; in CI (CI set) these tests run and fail instead",
)

# Azurite's well-known development account (documented, not a secret).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def running_azurite(where: Path, *, memory: bool = False) -> Iterator[str]:
    """An Azurite blob server keeping its files (or, with ``memory``, only its log) in
    ``where``; yields its endpoint URL."""
    assert AZURITE is not None, "Azurite is not installed: `cd tests/npm && npm ci`"
    port = free_port()
    log = (where / "azurite.log").open("wb")
    keep = ["--inMemoryPersistence"] if memory else ["--location", str(where)]
    proc = subprocess.Popen(
        [AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), *keep, "--silent",
         "--disableTelemetry", "--skipApiVersionCheck"],
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


def open_store(endpoint: str, container: str) -> ObjectStore:
    """An ObjectStore on a container of the Azurite at ``endpoint`` (prefix ``out``)."""
    return ObjectStore(
        f"az://{container}/out",
        account_name=ACCOUNT,
        access_key=KEY,
        endpoint=f"{endpoint}/{ACCOUNT}",
    )
