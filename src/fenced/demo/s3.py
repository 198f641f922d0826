"""An S3 API server for ``fenced demo``: moto's, in a thread of the runner's process.

The object-storage act publishes to it from both workers over HTTP, so it runs for the
whole demo (the workers are told where it is when they start) and stops with it. Every
request is counted by what it touched (blobs, pointers, the probe's keys, the bucket)
and how it was answered, so the act can say what each worker's publish cost.

moto (``pip install 'moto[server]'``) is not a dependency of any extra: without it
:func:`serve` gives None and :func:`missing` says why.
"""

from __future__ import annotations

import secrets
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

#: What to install for the S3 API server (obstore, which talks to it, comes with the
#: demo extra).
FIX = "pip install 'moto[server]'"

#: (method, what the request touched, status) -> how many.
Requests = Counter[tuple[str, str, int]]


class S3Server:
    """moto's S3 API on 127.0.0.1, a bucket of its own made on it, each request counted."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class Quiet(MotoRequestHandler):
            def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
                pass  # the act says what the requests did, not werkzeug on stderr

        #: A bucket per run: moto keeps its buckets for the life of the process.
        self.bucket = f"fenced-demo-{secrets.token_hex(4)}"
        #: The URL of the demo's object store on it (an ObjectStore's ``url``).
        self.store_url = f"s3://{self.bucket}/maps"
        self.requests: Requests = Counter()
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(
            "127.0.0.1", 0, self._counted(app), threaded=True, request_handler=Quiet
        )
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fenced-demo-s3", daemon=True
        )

    def __enter__(self) -> S3Server:
        self._thread.start()
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{self.url}/{self.bucket}", method="PUT"), timeout=30
            ):
                pass
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and close the socket (waits for the serving thread)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def _counted(self, app: Any) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
        def counted(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            def start(status: str, headers: Any, exc_info: Any = None) -> Any:
                method, kind = environ["REQUEST_METHOD"], self.kind(environ["PATH_INFO"])
                with self._lock:
                    self.requests[method, kind, int(status[:3])] += 1
                return start_response(status, headers, exc_info)

            result: Iterable[bytes] = app(environ, start)
            return result

        return counted

    @staticmethod
    def kind(path: str) -> str:
        """What a request's path touched: ``blobs``, ``pointers``, ``probe`` or ``bucket``."""
        parts = path.strip("/").split("/")
        # /<bucket>/<prefix>/<blobs|pointers|.fenced-probe>/...
        if len(parts) < 3:
            return "bucket"
        return "probe" if parts[2] == ".fenced-probe" else parts[2]

    def snapshot(self) -> Requests:
        """The requests counted so far (a copy)."""
        with self._lock:
            return Counter(self.requests)


def describe(requests: Requests) -> str:
    """Requests counted, as ``3: 2 to pointers (GET 404, PUT 200), 1 to probe the store``."""
    seen: dict[str, list[str]] = {"pointers": [], "blobs": []}
    counts: Counter[str] = Counter()
    for (method, kind, status), n in sorted(requests.items(), key=lambda i: (i[0][1], i[0])):
        # The bucket's requests are the probe's deletes: it is made before any is counted.
        kind = kind if kind in seen else "probe"
        counts[kind] += n
        seen.setdefault(kind, []).append(f"{method} {status}" + (f" ×{n}" if n > 1 else ""))
    parts = [f"{counts[k]} to {k} ({', '.join(seen[k])})" for k in ("pointers", "blobs")]
    parts.append(f"{counts['probe']} to probe the store's conditional writes")
    return f"{sum(requests.values())}: " + ", ".join(p for p in parts if not p.startswith("0 "))


def missing() -> str | None:
    """Why no S3 server can run here (the module that is not installed), or None."""
    try:
        import moto.moto_server.werkzeug_app  # noqa: F401
    except ImportError as exc:
        return f"{(exc.name or 'moto').split('.')[0]} is not installed"
    return None


@contextmanager
def serve(wanted: bool = True) -> Iterator[S3Server | None]:
    """A running S3 server, stopped when the block ends however it ends; None when it
    is not wanted or cannot run here (:func:`missing` says why)."""
    if not wanted or missing() is not None:
        yield None
        return
    with S3Server() as server:
        yield server
