"""One fenced publish on object storage beside the same requests written by hand with boto3.

    python benchmarks/object_publish.py [--rounds 8] [--publishes 250] [--size 4096] [--json]

Starts moto in server mode in a process of its own (``python -m moto.server`` on a free
port: its CPU does not share this process's interpreter) with one bucket, and measures
in one run, interleaved (rounds taken in turn, the side that starts alternating), one
publish of a new blob of ``--size`` bytes (distinct bytes every time) under a fence
that grows by one each publish:

* fenced: ``ref = store.put(data)`` then ``pointer.swap(ref, fence=f)`` on an
  ``ObjectStore("s3://bench/fenced")`` and one ``ObjectPointer``;
* boto3, the same requests written by hand on one client: ``put_object`` of the blob
  under its SHA-256 key with ``IfNoneMatch='*'``, ``get_object`` of the pointer's JSON
  (its ETag kept), the fences compared, and ``put_object`` of the new JSON with
  ``IfMatch`` that ETag (``IfNoneMatch='*'`` when there is no pointer yet); the same
  key layout under ``s3://bench/boto3`` and the same JSON, which fenced's pointer reads.

Each side publishes a few times before the timing (fenced's first publish runs the
store's conditional-write probe, once per store). Then ``--publishes`` more through a
small recording HTTP proxy, outside the timing, count the requests per publish.

The target: fenced's median time per publish at most 1.1x the hand-written one (the
median of the per-round ratios). Exits 1 when missed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boto3
import botocore
import moto
import obstore
from _common import table
from botocore.exceptions import ClientError

from fenced import StaleFence
from fenced.store import ObjectPointer, ObjectStore

BUCKET = "bench"
POINTER = "latest"
CREDENTIALS = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}
#: fenced's time per publish against the hand-written boto3 one, at most.
TARGET = 1.1
#: Publishes of each side before the timing.
WARMUP = 10
#: Publishes of each side through the recording proxy (after the first, counted apart).
COUNTED = 50


def blob(i: int, size: int) -> bytes:
    """Bytes of ``size`` that differ for every ``i``."""
    return (i.to_bytes(8, "big") * (size // 8 + 1))[:size]


# -- the server ---------------------------------------------------------------------------


@dataclass
class Moto:
    """``python -m moto.server`` in a process of its own, on a free port."""

    url: str
    process: subprocess.Popen[bytes]

    def cpu(self) -> float | None:
        """CPU seconds the server has used (user and system), from /proc; None elsewhere."""
        try:
            text = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return None
        fields = text.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def moto_server() -> Iterator[Moto]:
    """A moto server, stopped (and its log printed if it failed to start) whatever happens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while not _answers(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    text = log.read().decode(errors="replace")
                    sys.exit(f"moto server did not start:\n{text}")
                time.sleep(0.05)
            yield Moto(f"http://127.0.0.1:{port}", process)
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _answers(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/moto-api/")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


# -- counting requests --------------------------------------------------------------------


@dataclass
class Recorder:
    """An HTTP proxy in front of the server that counts requests, used outside the timing."""

    upstream: str
    #: (method, what: blob, pointer or other, condition header or "") -> requests.
    seen: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    url: str = ""

    @contextmanager
    def running(self) -> Iterator[Recorder]:
        recorder = self
        host, port = urlsplit(self.upstream).netloc.split(":")

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                key = unquote(urlsplit(self.path).path)
                what = "blob" if "/blobs/" in key else "pointer" if "/pointers/" in key else "other"
                names = {k.lower() for k in headers}
                condition = next((c for c in ("if-none-match", "if-match") if c in names), "")
                recorder.seen[(self.command, what, condition)] += 1
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                told = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", told or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = forward

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()

    def take(self) -> Counter[tuple[str, str, str]]:
        """The requests counted since the last call."""
        seen, self.seen = self.seen, Counter()
        return seen


# -- the two sides ------------------------------------------------------------------------


class Fenced:
    """fenced's publish: ``store.put`` then ``pointer.swap``."""

    name = "fenced"

    def __init__(self, endpoint: str) -> None:
        self.store = ObjectStore(f"s3://{BUCKET}/fenced", endpoint=endpoint, **CREDENTIALS)
        self.pointer = ObjectPointer(self.store, POINTER)

    def publish(self, data: bytes, fence: int) -> None:
        self.pointer.swap(self.store.put(data), fence=fence)


class Boto3:
    """The same requests written by hand on one boto3 client."""

    name = "boto3"
    prefix = "boto3"

    def __init__(self, endpoint: str) -> None:
        self.s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=CREDENTIALS["access_key_id"],
            aws_secret_access_key=CREDENTIALS["secret_access_key"],
            region_name=CREDENTIALS["region"],
        )
        self.pointer = f"{self.prefix}/pointers/{POINTER}"

    def publish(self, data: bytes, fence: int) -> None:
        digest = hashlib.sha256(data).hexdigest()
        target = f"blobs/{digest[:2]}/{digest[2:]}"
        try:
            self.s3.put_object(
                Bucket=BUCKET, Key=f"{self.prefix}/{target}", Body=data, IfNoneMatch="*"
            )
        except ClientError as exc:
            if not _refused(exc):
                raise  # refused: the same bytes are there already
        entry = {"digest": digest, "fence": fence, "size": len(data), "target": target}
        body = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        for _ in range(50):
            try:
                got = self.s3.get_object(Bucket=BUCKET, Key=self.pointer)
            except self.s3.exceptions.NoSuchKey:
                condition = {"IfNoneMatch": "*"}
            else:
                current = json.loads(got["Body"].read())
                if fence < current["fence"]:
                    raise StaleFence(
                        f"fence {fence} < {current['fence']}",
                        name=POINTER,
                        fence=fence,
                        current=current["fence"],
                    )
                condition = {"IfMatch": got["ETag"]}
            try:
                self.s3.put_object(Bucket=BUCKET, Key=self.pointer, Body=body, **condition)
                return
            except ClientError as exc:
                if not _refused(exc):
                    raise  # refused: another writer came first, read again
        raise RuntimeError(f"{self.pointer}: 50 conditional writes in a row lost")


def _refused(exc: ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code")
    return code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")


Side = Fenced | Boto3


# -- measuring ----------------------------------------------------------------------------


@dataclass
class Figures:
    """One side's figures, one entry per round."""

    name: str
    #: Median seconds per publish of each round.
    median: list[float] = field(default_factory=list)
    #: This process's CPU seconds per publish of each round.
    cpu: list[float] = field(default_factory=list)
    #: The server's CPU seconds per publish of each round (empty without /proc).
    server_cpu: list[float] = field(default_factory=list)
    #: Requests per publish by (method, what, condition), and of the first publish of a
    #: new store or client.
    requests: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)


class Fences:
    """The fence and the bytes of the next publish: both new every time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fence = 0

    def next(self) -> tuple[bytes, int]:
        self.fence += 1
        return blob(self.fence, self.size), self.fence


def run_round(side: Side, fences: Fences, n: int, server: Moto, out: Figures) -> None:
    """``n`` publishes of one side, each timed; the round's median, CPU per publish."""
    work = [fences.next() for _ in range(n)]
    times = []
    clock = time.perf_counter
    publish = side.publish
    srv = server.cpu()
    cpu = time.process_time()
    for data, fence in work:
        start = clock()
        publish(data, fence)
        times.append(clock() - start)
    out.cpu.append((time.process_time() - cpu) / n)
    srv_after = server.cpu()
    if srv is not None and srv_after is not None:
        out.server_cpu.append((srv_after - srv) / n)
    out.median.append(statistics.median(times))


def count_requests(
    make: Callable[[str], Side], recorder: Recorder, fences: Fences, n: int, out: Figures
) -> None:
    """Requests of a new store or client's first publish, then per publish of ``n`` more."""
    side = make(recorder.url)
    recorder.take()
    side.publish(*fences.next())
    out.first = {_label(k): v for k, v in recorder.take().items()}
    for _ in range(n):
        side.publish(*fences.next())
    out.requests = {_label(k): v / n for k, v in recorder.take().items()}


def _label(key: tuple[str, str, str]) -> str:
    method, what, condition = key
    return f"{what} {method}" + (f" {condition}" if condition else "")


def check_pointers(server: Moto, size: int, last: dict[str, int]) -> None:
    """Both pointers read by fenced, each naming its last blob, whose bytes are there."""
    for prefix, fence in last.items():
        store = ObjectStore(f"s3://{BUCKET}/{prefix}", endpoint=server.url, **CREDENTIALS)
        published = ObjectPointer(store, POINTER).read()
        assert published is not None, f"{prefix}: no pointer"
        assert published.digest is not None, f"{prefix}: the pointer names no digest"
        data = store.read_bytes(published.digest)
        assert published.fence == fence, f"{prefix}: fence {published.fence}, not {fence}"
        assert data == blob(fence, size), f"{prefix}: not the last blob"


# -- report -------------------------------------------------------------------------------


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, lower and upper quartile."""
    if len(values) < 4:
        return statistics.median(values), min(values), max(values)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q2, q1, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each side (8)")
    parser.add_argument("--publishes", type=int, default=250, help="publishes per round (250)")
    parser.add_argument("--size", type=int, default=4096, help="bytes of each blob (4096)")
    parser.add_argument(
        "--quick", action="store_true", help="4 rounds of 60: rougher, a few seconds"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.publishes = 4, 60
    # A TERM runs the finally blocks too, so the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_start = os.getloadavg()[0]

    with moto_server() as server:
        boto3.client(
            "s3",
            endpoint_url=server.url,
            aws_access_key_id=CREDENTIALS["access_key_id"],
            aws_secret_access_key=CREDENTIALS["secret_access_key"],
            region_name=CREDENTIALS["region"],
        ).create_bucket(Bucket=BUCKET)
        began = time.monotonic()
        fences = Fences(args.size)
        makers: list[Callable[[str], Side]] = [Fenced, Boto3]
        sides = [make(server.url) for make in makers]
        figures = {side.name: Figures(side.name) for side in sides}
        for side in sides:
            for _ in range(WARMUP):
                side.publish(*fences.next())
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                run_round(side, fences, args.publishes, server, figures[side.name])
            if not args.json:
                print(
                    f"  round {i + 1}/{args.rounds} {time.monotonic() - began:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
        last = {}
        with Recorder(server.url).running() as recorder:
            for make, side in zip(makers, sides):
                count_requests(make, recorder, fences, COUNTED, figures[side.name])
                last[side.name] = fences.fence
        check_pointers(server, args.size, last)

    f, b = figures["fenced"], figures["boto3"]
    ratio, r_low, r_high = quartiles([x / y for x, y in zip(f.median, b.median)])
    cpu_ratio = statistics.median(f.cpu) / statistics.median(b.cpu)
    info = {
        "moto": moto.__version__,
        "boto3": boto3.__version__,
        "botocore": botocore.__version__,
        "obstore": obstore.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load": [load_start, os.getloadavg()[0]],
        "rounds": args.rounds,
        "publishes": args.publishes,
        "size": args.size,
    }
    missed = [] if ratio <= TARGET else [f"time per publish {ratio:.3f}x boto3's"]
    if args.json:
        print(json.dumps({
            "info": info,
            "sides": {
                s.name: {
                    "ms_per_publish": statistics.median(s.median) * 1e3,
                    "rounds_ms": [m * 1e3 for m in s.median],
                    "cpu_us_per_publish": statistics.median(s.cpu) * 1e6,
                    "server_cpu_us_per_publish": (
                        statistics.median(s.server_cpu) * 1e6 if s.server_cpu else None
                    ),
                    "requests_per_publish": s.requests,
                    "first_publish_requests": s.first,
                }
                for s in (f, b)
            },
            "time_ratio": [ratio, r_low, r_high],
            "cpu_ratio": cpu_ratio,
            "target": TARGET,
            "missed": missed,
        }, indent=2))  # fmt: skip
    else:
        print(
            f"object_publish: moto {info['moto']} server (own process, http on 127.0.0.1), "
            f"obstore {info['obstore']}, boto3 {info['boto3']}, Python {info['python']}, "
            f"{info['cpus']} CPUs, load {load_start:.2f} -> {info['load'][1]:.2f}"
        )
        print(
            f"{args.rounds} rounds of {args.publishes} publishes of {args.size} bytes per "
            f"side, taken in turn, after {WARMUP} warm-up publishes each (fenced's first "
            "runs the store's probe)"
        )
        rows = []
        for s in (f, b):
            srv = f"{statistics.median(s.server_cpu) * 1e6:,.0f}" if s.server_cpu else "-"
            rows.append([
                s.name,
                f"{statistics.median(s.median) * 1e3:.2f}",
                f"{min(s.median) * 1e3:.2f}-{max(s.median) * 1e3:.2f}",
                f"{statistics.median(s.cpu) * 1e6:,.0f}",
                srv,
                f"{sum(s.requests.values()):.2f}",
                f"{sum(s.first.values()):.0f}",
            ])  # fmt: skip
        print(
            table(
                ["side", "ms/publish", "rounds min-max", "cpu µs", "srv cpu µs", "requests",
                 "first"],
                rows,
                right={1, 2, 3, 4, 5, 6},
            )
        )  # fmt: skip
        for s in (f, b):
            per = ", ".join(f"{k} {v:.2f}" for k, v in sorted(s.requests.items()))
            print(f"{s.name} requests per publish: {per}")
        print(
            f"fenced/boto3: time {ratio:.3f}x (quartiles of the rounds {r_low:.3f}-"
            f"{r_high:.3f}x), client CPU {cpu_ratio:.3f}x"
        )
        verdict = "met" if not missed else "MISSED"
        print(f"target: fenced's publish at most {TARGET}x the hand-written boto3 one: {verdict}")
    if missed:
        print("missed: " + "; ".join(missed))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
