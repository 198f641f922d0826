"""The object store check: does it honour the conditional writes fenced publishes with?"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._errors import ConfigError
from ._finding import Finding, listed

__all__ = ["check_store"]

_WHY = {
    "write": "The probe writes a small key of its own under the store's URL; without that, "
    "fenced cannot write blobs or pointers there either.",
    "create-only": "Blobs and new pointers are written create-only (If-None-Match: *). A "
    "store that lets a second create-only write through lets two writers each believe "
    "they created a pointer, and the later one silently replaces the other.",
    "if-match-wrong-etag": "A pointer is replaced only If-Match the ETag read with its "
    "fence. A store that ignores a wrong ETag lets a stale holder overwrite a newer "
    "holder's publish after comparing fences against what it read earlier.",
    "if-match-missing": "A store that creates a key for a write If-Match an ETag it does "
    "not have would bring back a pointer deleted meanwhile under an old fence.",
    "if-match": "A pointer is replaced only If-Match its current ETag; a store that "
    "refuses even the right ETag can never be published to.",
}
_FIX = (
    "Use a store that honours If-None-Match and If-Match on PUT: AWS S3, Google Cloud "
    "Storage, Azure Blob Storage, or an S3-compatible server that implements conditional "
    "writes. For an S3-compatible server keep AWS_CONDITIONAL_PUT at its default (etag); "
    "a proxy or gateway in front of the store must pass both headers through."
)


@listed
def check_store(store: Any, **options: Any) -> Iterator[Finding]:
    """Probe an object store (a URL or a :class:`~fenced.store.ObjectStore`) for the
    conditional writes an ObjectPointer relies on; one finding per failed check."""
    try:
        from ..store import ObjectStore

        if not isinstance(store, ObjectStore):
            store = ObjectStore(store, **options)
    except ImportError as exc:
        yield Finding(
            "error",
            "store.unavailable",
            f"Cannot probe {store}: {exc}",
            "The object store is reached through obstore, which is not installed.",
            "pip install 'fenced[objstore]'",
            subject=str(store),
        )
        return
    except ConfigError as exc:
        yield Finding(
            "error",
            "store.config",
            f"Cannot open the object store {store}: {exc}",
            "The URL or its options are not ones obstore accepts.",
            "Pass s3://bucket/prefix, gs://bucket/prefix or az://container/prefix, with "
            "credentials and the endpoint in the environment (AWS_*, GOOGLE_*, AZURE_*; "
            "AWS_ENDPOINT_URL for an S3-compatible server).",
            subject=str(store),
        )
        return
    try:
        checks = store.probe()
    except Exception as exc:
        yield Finding(
            "error",
            "store.unreachable",
            f"Probing {store.url} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}",
            "Without a probe fenced cannot know whether the store honours conditional "
            "writes, so an ObjectPointer will not publish to it.",
            "Check the URL, the credentials and the endpoint (AWS_ENDPOINT_URL), and that "
            "this identity may put, get, head and delete keys under the URL.",
            subject=store.url,
        )
        return
    failed = [c for c in checks if not c.ok]
    for check in failed:
        yield Finding(
            "error",
            f"store.{check.name}",
            f"{store.url}: {check.detail}",
            _WHY.get(check.name, "An ObjectPointer relies on this condition."),
            _FIX,
            subject=store.url,
        )
    if not failed:
        yield Finding(
            "info",
            "store.conditions",
            f"{store.url} honours conditional writes: " + "; ".join(c.detail for c in checks),
            "An ObjectPointer runs the same probe before its first swap.",
            "Nothing to do.",
            subject=store.url,
        )
