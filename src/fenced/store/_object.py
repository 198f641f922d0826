"""Fenced output on object storage (S3, GCS, Azure Blob, S3-compatible), through obstore.

:class:`ObjectStore` keeps content-addressed blobs under ``<prefix>/blobs/ab/cdef…`` (the
SHA-256 of their bytes), each written create-only (``If-None-Match: *``): a blob is
whole or absent, and a repeat uploads nothing new. :class:`ObjectPointer` keeps a small
JSON object under ``<prefix>/pointers/<name>`` holding the target and the fence that
published it. A swap reads it with its ETag, compares the fences, and replaces it only
``If-Match`` that ETag (a new pointer: create-only); when the store answers 412 or 409,
another writer came first, so the swap reads again and decides again::

    GET pointers/latest            -> {"fence": 1002, ...}, ETag "e1"
    fence 1001 < 1002              -> StaleFence, nothing written
    fence 1003 >= 1002             -> PUT pointers/latest If-Match "e1"
                                      412: read again, compare again

A store that ignores the conditions would turn every one of these checks into a blind
overwrite, so it is refused, never trusted: before its first swap a pointer has the
store probed (:meth:`ObjectStore.probe`: two create-only writes of one key, the second
must be refused; If-Match with a wrong ETag, refused; If-Match on a missing key,
refused; If-Match with the right ETag, accepted), and publishes nothing when a check
fails. ``fenced doctor --store URL`` runs the same probe.

S3 answers a create-only write that races another with 409, which obstore reports as
"already exists" although the object may not exist: an existing blob is believed only
after a HEAD shows it with the right size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, Union

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError
    from obstore.store import from_url
except ImportError as exc:  # pragma: no cover - exercised in a fresh environment
    raise ImportError(
        "fenced.store.ObjectStore needs obstore: pip install 'fenced[objstore]'"
    ) from exc

from .._errors import ConfigError, CorruptObject, StaleFence, StoreError
from . import _durable
from ._content import DEFAULT_GRACE, MANIFEST_PREFIX, _chunks, put_source
from ._published import Pointer, Published, Ref, Target

if TYPE_CHECKING:
    from obstore import ObjectMeta, PutMode, UpdateVersion
    from obstore.store import ObjectStore as _Backend

__all__ = [
    "BLOBS",
    "POINTERS",
    "ObjectPointer",
    "ObjectStore",
    "ProbeCheck",
]

#: Where blobs and pointers live under the store's URL.
BLOBS = "blobs"
POINTERS = "pointers"
PROBES = ".fenced-probe"
#: Bytes of this size or more are looked up (HEAD) before they are uploaded; smaller
#: ones are sent create-only at once (one request when new, the store refuses a repeat).
HEAD_ABOVE = 256 * 1024
#: Largest pointer object read or written, in bytes.
MAX_POINTER_SIZE = 64 * 1024
#: Attempts of a swap that keeps losing its conditional write to other writers.
SWAP_ATTEMPTS = 50

_DIGEST = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9._\-][A-Za-z0-9._\-/]*")
_FIX = (
    "use a store that honours If-None-Match and If-Match on PUT (AWS S3, Google Cloud "
    "Storage, Azure Blob Storage, or an S3-compatible server that implements conditional "
    "writes); for an S3-compatible store keep AWS_CONDITIONAL_PUT at its default (etag) "
    "and upgrade the server if it still ignores the conditions"
)

Source = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]", IO[bytes]]
Keep = Ref | Published | Pointer | str


#: The errors of a write whose condition did not hold (412; 409 on S3, which obstore
#: reports as "already exists"; 404 for If-Match on a missing key).
_REFUSED = (AlreadyExistsError, PreconditionError)


@dataclass(frozen=True)
class ProbeCheck:
    """One check of the conditional-write probe: its name, whether it held, and what was seen."""

    name: str
    ok: bool
    detail: str


class ObjectStore:
    """Content-addressed blobs in an object store, named by the SHA-256 of their bytes.

    ``url`` is ``s3://bucket/prefix``, ``gs://…``, ``az://…`` (or another URL obstore
    reads, ``memory:///`` included), or an obstore store already made. Credentials and
    endpoints are read as obstore reads them (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``;
    ``AWS_ENDPOINT_URL`` for an S3-compatible server); ``config`` and keyword options
    (``endpoint=``, ``region=``…) are passed to obstore. An ``http://`` endpoint is
    allowed plain HTTP.
    """

    def __init__(
        self,
        url: str | _Backend,
        *,
        config: Mapping[str, Any] | None = None,
        client_options: Mapping[str, Any] | None = None,
        retry_config: Mapping[str, Any] | None = None,
        credential_provider: Any = None,
        grace: float = DEFAULT_GRACE,
        head_above: int = HEAD_ABOVE,
        **options: Any,
    ) -> None:
        if grace < 0:
            raise ConfigError(f"grace={grace!r} must be >= 0 seconds")
        if isinstance(head_above, bool) or not isinstance(head_above, int) or head_above < 0:
            raise ConfigError(f"head_above={head_above!r} must be an int >= 0 (bytes)")
        if isinstance(url, str):
            self.url = url
            self.backend = _from_url(
                url, config, client_options, retry_config, credential_provider, options
            )
        else:
            if config or client_options or retry_config or credential_provider or options:
                raise ConfigError(
                    "options are given to obstore when it makes the store: pass a URL with "
                    "them, or a store made with them"
                )
            self.url = repr(url)
            self.backend = url
        self.grace = float(grace)
        self.head_above = int(head_above)
        self._probe_lock = threading.Lock()
        self._probed = False

    def __repr__(self) -> str:
        return f"<ObjectStore {self.url!r}>"

    # -- keys -------------------------------------------------------------------------

    @staticmethod
    def key_of(digest: str) -> str:
        """The key of the blob with this SHA-256 digest."""
        if not _DIGEST.fullmatch(digest):
            raise ConfigError(f"{digest!r} is not a SHA-256 digest (64 lowercase hex digits)")
        return f"{BLOBS}/{digest[:2]}/{digest[2:]}"

    def ref(self, digest: str, size: int) -> Ref:
        """A Ref to a blob of this store."""
        return Ref(digest, Path(self.key_of(digest)), size)

    @staticmethod
    def _digest_of_key(key: str) -> str | None:
        parts = PurePosixPath(key).parts
        if len(parts) == 3 and parts[0] == BLOBS and _DIGEST.fullmatch(parts[1] + parts[2]):
            return parts[1] + parts[2]
        return None

    # -- writing ----------------------------------------------------------------------

    def put(self, source: Source) -> Ref:
        """Store bytes, a binary file object or a file's content; returns its Ref.

        The same bytes give the same key, written once: a blob is written create-only,
        and one that exists (checked with a HEAD) is not uploaded again.
        """
        return put_source(source, self._put, self._put_file)

    def _put_file(self, f: IO[bytes]) -> Ref:
        # One PUT carries the whole blob (a conditional write is never multipart), so the
        # bytes are read whole once, hashed, and sent as read.
        return self._put(b"".join(_chunks(f)))

    def _put(self, data: bytes) -> Ref:
        digest, size = hashlib.sha256(data).hexdigest(), len(data)
        key = self.key_of(digest)
        ref = self.ref(digest, size)
        state = self._state(key, size) if size >= self.head_above else "missing"
        for _ in range(SWAP_ATTEMPTS):
            if state == "stored":
                return ref
            if state == "old":
                # Its own bytes again, so gc's grace counts from this put (gc judges by
                # last_modified, which nothing else moves): a build reusing the blob has
                # that long to publish. Identical bytes: no condition is needed.
                obstore.put(self.backend, key, data, use_multipart=False)
                return ref
            try:
                obstore.put(self.backend, key, data, mode="create", use_multipart=False)
                return ref
            except _REFUSED:
                # Refused: maybe it exists, maybe S3's 409 for a racing create-only write
                # of an object that is not there (yet). Believe only a HEAD.
                state = self._state(key, size)
            if state == "missing":
                time.sleep(0.01)
        raise StoreError(
            f"{self.url}: the create-only write of blob {key} kept being refused while the "
            "blob never appeared: another writer may be failing mid-upload; put again"
        )

    def _state(self, key: str, size: int) -> str:
        """``stored``, ``missing``, or ``old`` (stored, older than half the grace), by a HEAD."""
        meta = self._head(key)
        if meta is None:
            return "missing"
        if meta["size"] != size:
            raise CorruptObject(
                f"blob {key} in {self.url} is {meta['size']} bytes, expected {size}: "
                "delete it, then put the original bytes again"
            )
        age = time.time() - meta["last_modified"].timestamp()
        return "old" if age > self.grace / 2 else "stored"

    def _head(self, key: str) -> ObjectMeta | None:
        try:
            return obstore.head(self.backend, key)
        except FileNotFoundError:
            return None

    # -- reading ----------------------------------------------------------------------

    def read_bytes(self, ref: Ref | str) -> bytes:
        """A blob's bytes, checked against its digest (CorruptObject when damaged)."""
        digest = ref.digest if isinstance(ref, Ref) else ref
        key = self.key_of(digest)
        try:
            data = bytes(obstore.get(self.backend, key).bytes())
        except FileNotFoundError:
            raise StoreError(f"no blob {digest} in {self.url}: put its bytes first") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptObject(
                f"blob {key} in {self.url} is corrupt: its bytes do not hash to {digest}; "
                "delete it, then put the original bytes again"
            )
        return data

    def exists(self, ref: Ref | str) -> bool:
        """Whether the blob is stored (one HEAD)."""
        digest = ref.digest if isinstance(ref, Ref) else ref
        return self._head(self.key_of(digest)) is not None

    def put_manifest(self, entries: Mapping[str, Ref | str]) -> Ref:
        """Store a manifest naming blobs (name -> Ref or digest); gc keeps what it lists."""
        body: dict[str, dict[str, Any]] = {}
        for name, item in entries.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"manifest name {name!r} must be a non-empty string")
            if isinstance(item, Ref):
                body[name] = {"digest": item.digest, "size": item.size}
                continue
            meta = self._head(self.key_of(item))
            if meta is None:
                raise StoreError(
                    f"manifest entry {name!r} names {item}, which is not in {self.url}: put "
                    "its bytes before the manifest"
                )
            body[name] = {"digest": item, "size": meta["size"]}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return self.put(MANIFEST_PREFIX + b'"entries":' + text.encode() + b"}\n")

    def read_manifest(self, ref: Ref | str) -> dict[str, Ref]:
        """The entries of a manifest written by :meth:`put_manifest`."""
        data = self.read_bytes(ref)
        if not data.startswith(MANIFEST_PREFIX):
            raise StoreError(f"blob {ref} is not a manifest")
        try:
            entries = json.loads(data)["entries"]
            return {n: self.ref(e["digest"], int(e["size"])) for n, e in entries.items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"manifest {ref} is malformed: {exc}") from exc

    def refs(self) -> Iterator[Ref]:
        """Every blob in the store, as listed (a listing may lag writes)."""
        for ref, _modified in self._listing():
            yield ref

    def _listing(self) -> Iterator[tuple[Ref, datetime]]:
        """Every blob listed, with its last-modified time."""
        for batch in obstore.list(self.backend, prefix=BLOBS + "/"):
            for meta in batch:
                digest = self._digest_of_key(meta["path"])
                if digest is not None:
                    yield self.ref(digest, meta["size"]), meta["last_modified"]

    # -- garbage collection -----------------------------------------------------------

    def gc(
        self, keep: Iterable[Keep], *, grace: float | None = None, dry_run: bool = False
    ) -> list[Ref]:
        """Delete blobs nothing in ``keep`` references; returns what was deleted.

        ``keep`` holds Refs, digests, blob keys, pointers (what they publish when gc
        reads them) or their published states; manifests are followed. Blobs modified
        less than ``grace`` seconds ago (default: the store's) stay, because a build that
        put them may not have published yet; :meth:`put` writes a reused blob again when
        it is older than half the store's grace. Each blob is looked at again (HEAD)
        just before it is deleted.
        """
        if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
            raise ConfigError("gc(keep=...) takes a list of Refs, digests or pointers")
        grace = self.grace if grace is None else grace
        if grace < 0:
            raise ConfigError(f"grace={grace!r} must be >= 0 seconds")
        keep = list(keep)
        # Listed before the pointers are read: a blob put after the listing is not in it,
        # and one published before the pointers are read is kept.
        listed = list(self._listing())
        live = self._live(keep)
        cutoff = time.time() - grace
        removed: list[Ref] = []
        for ref, modified in listed:
            if ref.digest in live or modified.timestamp() > cutoff:
                continue
            meta = self._head(str(ref.path))
            if meta is None or meta["last_modified"].timestamp() > cutoff:
                continue  # gone already, or put again since it was listed
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    obstore.delete(self.backend, str(ref.path))
            removed.append(ref)
        return removed

    def _live(self, keep: Iterable[Keep]) -> set[str]:
        """Digests reachable from ``keep``; reads (and checks) every manifest on the way."""
        todo: list[tuple[str, int | None]] = []
        for item in keep:
            reader = getattr(item, "read", None)
            if callable(reader) and not isinstance(item, (Ref, str)):
                item = reader()  # a pointer: keep what it publishes now
                if item is None:
                    continue
            if isinstance(item, Ref):
                todo.append((item.digest, item.size))
            elif isinstance(item, Published):
                digest = item.digest or self._digest_of_key(item.target)
                if digest:
                    todo.append((digest, item.size))
            elif isinstance(item, str):
                digest = item if _DIGEST.fullmatch(item) else self._digest_of_key(item)
                if digest is None:
                    raise ConfigError(f"gc cannot keep {item!r}: not a digest or a blob key")
                todo.append((digest, None))
            else:
                raise ConfigError(
                    f"gc cannot keep {item!r}: pass Refs, digests, blob keys or pointers"
                )
        live: set[str] = set()
        while todo:
            digest, size = todo.pop()
            if digest in live:
                continue
            live.add(digest)
            if self._is_manifest(digest, size):
                # A damaged manifest raises here, before anything is deleted.
                todo.extend((r.digest, r.size) for r in self.read_manifest(digest).values())
        return live

    def _is_manifest(self, digest: str, size: int | None) -> bool:
        if size is not None and size < len(MANIFEST_PREFIX):
            return False
        key = self.key_of(digest)
        if size is None:
            meta = self._head(key)
            if meta is None or meta["size"] < len(MANIFEST_PREFIX):
                return False
        try:
            head = obstore.get_range(self.backend, key, start=0, length=len(MANIFEST_PREFIX))
        except FileNotFoundError:
            return False
        return bytes(head) == MANIFEST_PREFIX

    # -- the conditional-write probe --------------------------------------------------

    def probe(self) -> list[ProbeCheck]:
        """Check that the store honours conditional writes, on a probe key of its own.

        Two create-only writes of one key (the second must be refused), If-Match with a
        wrong ETag (refused), If-Match on a missing key (refused), If-Match with the
        right ETag (accepted). The probe keys are deleted afterwards.
        """
        store = self.backend
        key = f"{PROBES}/{uuid.uuid4().hex}"
        missing = key + "-missing"
        checks: list[ProbeCheck] = []

        def content() -> bytes | None:
            try:
                return bytes(obstore.get(store, key).bytes())
            except FileNotFoundError:
                return None

        def attempt(path: str, data: bytes, mode: PutMode) -> str | None:
            """None when the write was refused for its condition, else what happened."""
            try:
                obstore.put(store, path, data, mode=mode, use_multipart=False)
            except _REFUSED:
                return None
            except NotImplementedError as exc:
                return f"not supported ({_first_line(exc)})"
            return "accepted"

        try:
            try:
                first = obstore.put(store, key, b"first", mode="create", use_multipart=False)
            except Exception as exc:
                return [ProbeCheck("write", False, f"cannot write {key}: {_first_line(exc)}")]
            etag = first.get("e_tag")
            seen = attempt(key, b"second", "create")
            now = content()
            ok = seen is None and now == b"first"
            checks.append(ProbeCheck(
                "create-only", ok,
                "a second create-only write of one key was refused" if ok else
                f"a second create-only write of {key} was {seen or 'refused'} and the key "
                f"now holds {now!r}",
            ))  # fmt: skip
            seen = attempt(key, b"wrong", {"e_tag": '"fenced-probe-wrong-etag"'})
            now = content()
            ok = seen is None and now == b"first"
            checks.append(ProbeCheck(
                "if-match-wrong-etag", ok,
                "a write If-Match a wrong ETag was refused" if ok else
                f"a write of {key} If-Match a wrong ETag was {seen or 'refused'} and the key "
                f"now holds {now!r}",
            ))  # fmt: skip
            seen = attempt(missing, b"missing", {"e_tag": etag or '"fenced-probe"'})
            there = self._head(missing) is not None
            ok = seen is None and not there
            checks.append(ProbeCheck(
                "if-match-missing", ok,
                "a write If-Match on a missing key was refused" if ok else
                f"a write If-Match on the missing key {missing} was {seen or 'refused'}"
                + (" and created it" if there else ""),
            ))  # fmt: skip
            current = self._head(key)
            if current is None or current.get("e_tag") is None:
                checks.append(ProbeCheck(
                    "if-match", False, f"the store gives no ETag for {key}: a pointer cannot "
                    "be replaced If-Match its ETag",
                ))  # fmt: skip
            else:
                seen = attempt(key, b"right", _version(current))
                now = content()
                ok = seen == "accepted" and now == b"right"
                checks.append(ProbeCheck(
                    "if-match", ok,
                    "a write If-Match the right ETag was accepted" if ok else
                    f"a write of {key} If-Match its current ETag was {seen or 'refused'}: "
                    "no pointer could ever be replaced",
                ))  # fmt: skip
        finally:
            for path in (key, missing):
                with contextlib.suppress(Exception):
                    obstore.delete(store, path)
        return checks

    def check_conditions(self) -> None:
        """Run the probe once for this store; StoreError naming each failed check."""
        with self._probe_lock:
            if self._probed:
                return
            failed = [c for c in self.probe() if not c.ok]
            if failed:
                raise StoreError(
                    f"{self.url} does not honour conditional writes, so fenced will not "
                    "publish to it (a stale holder's write would overwrite a newer one): "
                    + "; ".join(f"{c.name}: {c.detail}" for c in failed)
                    + f". Fix: {_FIX}"
                )
            self._probed = True


class ObjectPointer:
    """A pointer kept as a small JSON object, replaced If-Match its ETag under a fence."""

    def __init__(self, store: ObjectStore, name: str, *, attempts: int = SWAP_ATTEMPTS) -> None:
        if not isinstance(store, ObjectStore):
            raise ConfigError(f"store={store!r} is not an ObjectStore")
        if (
            not isinstance(name, str)
            or not _NAME.fullmatch(name)
            or any(part in ("", ".", "..") for part in name.split("/"))
        ):
            raise ConfigError(
                f"pointer name {name!r}: use letters, digits, '.', '_', '-' and '/' between "
                "them (no empty, '.' or '..' part)"
            )
        if attempts < 1:
            raise ConfigError(f"attempts={attempts!r} must be at least 1")
        self.store = store
        self.name = name
        self.key = f"{POINTERS}/{name}"
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"<ObjectPointer {self.store.url!r} {self.key!r}>"

    def _entry(self, target: Target, fence: int) -> dict[str, Any]:
        if isinstance(target, Ref):
            key = self.store.key_of(target.digest)
            if PurePosixPath(target.path) != PurePosixPath(key):
                raise ConfigError(
                    f"Ref {target.path} is not a blob of {self.store.url}: publish what "
                    "ObjectStore.put returned (a ContentStore's Ref names a local file)"
                )
            return {
                "target": key,
                "fence": fence,
                "digest": target.digest,
                "size": target.size,
            }
        if isinstance(target, Published):
            return {
                "target": target.target,
                "fence": fence,
                "digest": target.digest,
                "size": target.size,
            }
        if isinstance(target, (str, os.PathLike)):
            text = os.fspath(target)
            if not text:
                raise ConfigError("target is empty: pass a Ref from ObjectStore.put or a key")
            digest = ObjectStore._digest_of_key(text)
            return {"target": text, "fence": fence, "digest": digest, "size": None}
        raise ConfigError(
            f"cannot publish a {type(target).__name__}: pass a Ref from ObjectStore.put or a key"
        )

    def _load(self) -> tuple[dict[str, Any], ObjectMeta] | None:
        """The pointer's entry and metadata (ETag, version); None before the first swap."""
        try:
            result = obstore.get(self.store.backend, self.key)
        except FileNotFoundError:
            return None
        meta = result.meta
        if meta["size"] > MAX_POINTER_SIZE:
            raise StoreError(
                f"pointer {self.key} in {self.store.url} is larger than {MAX_POINTER_SIZE} "
                "bytes, so it is not a fenced pointer: delete it, or choose another name"
            )
        data = bytes(result.bytes())
        try:
            entry = json.loads(data)
            if not isinstance(entry, dict) or type(entry.get("fence")) is not int:
                raise ValueError("no integer fence")
            if not isinstance(entry.get("target"), str):
                raise ValueError("no target")
        except ValueError as exc:
            raise StoreError(
                f"{self.key} in {self.store.url} is not a fenced pointer ({exc}): delete it, "
                "or choose another name"
            ) from None
        return entry, meta

    def read(self) -> Published | None:
        """The last published target and its fence; None before the first swap."""
        loaded = self._load()
        return None if loaded is None else _published(loaded[0])

    def swap(self, target: Target, *, fence: int) -> Published:
        """Publish ``target`` under ``fence``; StaleFence if a higher fence was accepted."""
        fence = _durable.check_fence(fence)
        entry = self._entry(target, fence)
        body = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        if len(body) > MAX_POINTER_SIZE:
            raise ConfigError(f"pointer {self.key}: the target is too long to publish")
        self.store.check_conditions()
        for _ in range(self.attempts):
            loaded = self._load()
            if loaded is None:
                mode: PutMode = "create"
            else:
                current, meta = loaded
                if fence < current["fence"]:
                    raise StaleFence(
                        f"pointer {self.key} in {self.store.url} refused fence {fence}: it "
                        f"already accepted fence {current['fence']}, so a newer claim holder "
                        "has published; this run is stale and must stop",
                        name=self.name,
                        fence=fence,
                        current=current["fence"],
                    )
                if {k: current.get(k) for k in entry} == entry:
                    return _published(current)  # already published: write nothing
                if meta.get("e_tag") is None:
                    raise StoreError(
                        f"pointer {self.key}: {self.store.url} gave no ETag, so it cannot be "
                        f"replaced conditionally. Fix: {_FIX}"
                    )
                mode = _version(meta)
            try:
                obstore.put(self.store.backend, self.key, body, mode=mode, use_multipart=False)
            except _REFUSED:
                continue  # another writer came first: read again, decide again
            return _published(entry)
        raise StoreError(
            f"pointer {self.key} in {self.store.url}: {self.attempts} conditional writes in a "
            "row lost to other writers; swap again"
        )


def _version(meta: ObjectMeta) -> UpdateVersion:
    """The If-Match condition for an object's metadata: its ETag (and version, if any)."""
    out: UpdateVersion = {"e_tag": meta["e_tag"]}
    if meta.get("version") is not None:
        out["version"] = meta["version"]
    return out


def _published(entry: Mapping[str, Any]) -> Published:
    size = entry.get("size")
    return Published(
        str(entry["target"]),
        int(entry["fence"]),
        entry.get("digest"),
        int(size) if isinstance(size, int) else None,
    )


def _from_url(
    url: str,
    config: Mapping[str, Any] | None,
    client_options: Mapping[str, Any] | None,
    retry_config: Mapping[str, Any] | None,
    credential_provider: Any,
    options: Mapping[str, Any],
) -> _Backend:
    client = dict(client_options or {})
    endpoint = options.get("endpoint") or (config or {}).get("endpoint")
    if not endpoint and url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
    if str(endpoint or "").startswith("http://"):
        # An endpoint named with http:// (a local or in-cluster server) is meant.
        client.setdefault("allow_http", True)
    kwargs: dict[str, Any] = dict(options)
    if config:
        kwargs["config"] = dict(config)
    if client:
        kwargs["client_options"] = client
    if retry_config:
        kwargs["retry_config"] = dict(retry_config)
    if credential_provider is not None:
        kwargs["credential_provider"] = credential_provider
    try:
        store: _Backend = from_url(url, **kwargs)
    except BaseException as exc:  # obstore raises a PanicException for a bad config key
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise ConfigError(f"cannot open object store {url!r}: {_first_line(exc)}") from None
    return store


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
