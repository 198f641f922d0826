"""Azurite (the Azure Blob Storage emulator) for the object store's race tests.

Azurite decides each conditional write atomically, which moto does not, so races run on
it. It is an npm package that `make test` installs from tests/npm/package.json (at the
version its lockfile pins) when npm is there; outside CI, without it, the tests marked
``needs_azurite`` are skipped naming the fix, and in CI (CI set) they run and fail, so
they never stop silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fenced.store import ObjectStore
from fenced.testing import AZURITE_ACCOUNT, AzuriteServer, azurite_container, find_azurite

AZURITE = find_azurite(Path(__file__).resolve().parent / "npm" / "node_modules" / ".bin")
needs_azurite = pytest.mark.skipif(
    AZURITE is None and not os.environ.get("CI"),
    reason="Azurite is not installed: `make test` installs it from tests/npm (needs npm), "
    "or `cd tests/npm && npm ci`; in CI (CI set) these tests run and fail instead",
)
#: Create a container on the Azurite at an endpoint URL (obstore makes no containers).
create_container = azurite_container


@contextmanager
def running_azurite(*, memory: bool = False) -> Iterator[str]:
    """An Azurite blob server (with ``memory``, its blobs in memory only); yields its
    endpoint URL."""
    assert AZURITE is not None, "Azurite is not installed: `cd tests/npm && npm ci`"
    with AzuriteServer(AZURITE, memory=memory) as server:
        yield server.url


def open_store(endpoint: str, container: str) -> ObjectStore:
    """An ObjectStore on a container of the Azurite at ``endpoint`` (prefix ``out``)."""
    options = AzuriteServer.options_for(f"{endpoint}/{AZURITE_ACCOUNT}")
    return ObjectStore(f"az://{container}/out", **options)
