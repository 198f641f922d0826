"""Writers and a watching reader for the ObjectPointer race (test_store_object_races.py).

A writer runs in a thread of the test, or in a process of its own, as::

    python object_race.py writer ENDPOINT CONTAINER REDIS_URL CLAIM INDEX [--blind]

saying ``{"ready": true}``, then reading one JSON command a line and answering each
with one JSON line: ``acquire`` (take the claim, a real ``fenced.Claim`` with a lease
of LEASE seconds and no renewal: answers its fence), ``put`` (store this writer's bytes
for that fence: answers the digest), ``swap`` (publish them under the fence: answers
whether the pointer accepted it, the fence a refusal named, and how many times the
pointer was read). A swap given ``"pause": "start"`` stops its own process (SIGSTOP)
before it reads the pointer; ``"pause": "read"`` stops it between its first read of
the pointer and its conditional write. The test resumes it (SIGCONT). ``--blind``
publishes with an unconditional write after the same fence check: the negative control.

The reader polls the pointer until a file appears, and prints a JSON report::

    python object_race.py reader ENDPOINT CONTAINER STOP
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import obstore
import redis

from _azurite import open_store
from fenced import Claim, ClaimUnavailable, StaleFence
from fenced.store import ObjectPointer, ObjectStore, Published, Ref

#: The pointer the writers race on.
POINTER = "latest"
#: Seconds of each claim's lease: a stopped zombie is kept stopped longer than this.
LEASE = 0.02
#: Grants of a claim that came after their deadline, in a row, before a writer gives up.
ATTEMPTS = 20
#: Seconds between two reads of the pointer by the reader.
POLL = 0.005


def payload(fence: int, writer: int) -> bytes:
    """The bytes writer ``writer`` puts under ``fence``: its own, a size of their own."""
    rnd = random.Random(fence)
    head = f"fence {fence} writer {writer}\n".encode()
    return head + rnd.randbytes(100 + rnd.randrange(4000))


def author(data: bytes) -> tuple[int, int]:
    """The fence and writer a payload's first line names."""
    _, fence, _, writer = data.split(b"\n", 1)[0].split()
    return int(fence), int(writer)


class BlindPointer(ObjectPointer):
    """The swap with its conditional write made unconditional (the negative control)."""

    def swap(self, target: Any, *, fence: int) -> Published:
        current = self.read()
        if current is not None and fence < current.fence:
            raise StaleFence("refused", name=self.name, fence=fence, current=current.fence)
        entry = self._entry(target, fence)
        body = json.dumps(entry, sort_keys=True).encode() + b"\n"
        obstore.put(self.store.backend, self.key, body, use_multipart=False)
        return Published(entry["target"], fence, entry["digest"], entry["size"])


class Writer:
    """One writer: its own store client, Redis client, claim, and pointer."""

    def __init__(
        self, endpoint: str, container: str, redis_url: str, claim: str, index: int, blind: bool
    ) -> None:
        self.store = open_store(endpoint, container)
        self.redis = redis.Redis.from_url(redis_url)
        self.claim = claim
        self.index = index
        self.pointer_type = BlindPointer if blind else ObjectPointer
        self.fence = 0
        self.ref: Ref | None = None

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "acquire":
            return self.acquire()
        if op == "put":
            self.ref = self.store.put(payload(self.fence, self.index))
            return {"digest": self.ref.digest}
        if op == "swap":
            return self.swap(command.get("pause"))
        return {"error": f"unknown command {command!r}"}

    def acquire(self) -> dict[str, Any]:
        # A lease this short is sometimes granted after its own deadline on a busy
        # machine; the claim then gives it back (fail closed), and the writer asks again.
        for late in range(ATTEMPTS):
            claim = Claim(self.redis, self.claim, ttl=LEASE, heartbeat=False)
            try:
                if not claim.acquire() or claim.fence is None:
                    return {"error": f"writer {self.index} could not acquire: {claim.holder}"}
            except ClaimUnavailable:
                continue
            self.fence = claim.fence
            return {"fence": self.fence, "late": late}
        return {"error": f"writer {self.index}: {ATTEMPTS} grants in a row came too late"}

    def swap(self, pause: str | None) -> dict[str, Any]:
        assert self.ref is not None
        pointer = self.pointer_type(self.store, POINTER)
        load = pointer._load
        loads = 0

        def watched() -> Any:
            nonlocal loads
            loads += 1
            seen = load()
            if pause == "read" and loads == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            return seen

        pointer._load = watched  # type: ignore[method-assign]
        if pause == "start":
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            pointer.swap(self.ref, fence=self.fence)
        except StaleFence as exc:
            return {"fence": self.fence, "accepted": False, "current": exc.current, "loads": loads}
        return {"fence": self.fence, "accepted": True, "current": None, "loads": loads}


def check_blob(store: ObjectStore, published: Published) -> tuple[int, int] | str:
    """The (fence, writer) of the complete blob a pointer names, or what is wrong with it."""
    if published.digest is None or published.size is None:
        return f"pointer at fence {published.fence} names no digest and size: {published}"
    key = store.key_of(published.digest)
    if published.target != key:
        return f"pointer at fence {published.fence} names {published.target}, not {key}"
    try:
        data = bytes(obstore.get(store.backend, key).bytes())
    except FileNotFoundError:
        return f"pointer at fence {published.fence} names {key}, which is not there"
    if len(data) != published.size:
        return f"{key} is {len(data)} bytes, its pointer says {published.size}"
    if hashlib.sha256(data).hexdigest() != published.digest:
        return f"{key} does not hash to its name"
    fence, writer = author(data)
    if fence != published.fence or data != payload(fence, writer):
        return f"{key} holds writer {writer}'s bytes for fence {fence}, published at {published}"
    return fence, writer


def read_until(endpoint: str, container: str, stop: Path) -> dict[str, Any]:
    """Poll the pointer until ``stop`` exists: its fence must never go back, and every
    pointer read must name a complete blob holding the bytes its writer put."""
    store = open_store(endpoint, container)
    pointer = ObjectPointer(store, POINTER)
    high: int | None = None
    reads = 0
    back: list[str] = []
    errors: list[str] = []
    seen: list[tuple[int, int]] = []
    while not stop.exists():
        published = pointer.read()
        reads += 1
        if published is not None:
            if high is not None and published.fence < high:
                back.append(f"the pointer went back from fence {high} to {published.fence}")
            if published.fence != high:
                checked = check_blob(store, published)
                if isinstance(checked, str):
                    errors.append(checked)
                else:
                    seen.append(checked)
            high = published.fence if high is None else max(high, published.fence)
        time.sleep(POLL)
    return {"reads": reads, "back": back, "errors": errors, "seen": seen}


def main(argv: list[str]) -> None:
    if argv[0] == "reader":
        endpoint, container, stop = argv[1:]
        print(json.dumps(read_until(endpoint, container, Path(stop))), flush=True)
        return
    endpoint, container, redis_url, claim, index = argv[1:6]
    writer = Writer(endpoint, container, redis_url, claim, int(index), "--blind" in argv)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            reply = writer.handle(json.loads(line))
        except Exception:
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
