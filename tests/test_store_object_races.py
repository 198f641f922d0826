"""ObjectPointer at scale on Azurite: 16 zombie holders race, round after round.

Each round, 16 writers (12 threads of this process and 4 processes) take one real claim
in turn (fenced.Claim on a private redis-server), and each loses it at once: an operator
force-releases it, so that 16 holders with ordered fences, all of them zombies, then put
their own bytes and swap the pointer at once, in shuffled order. Two of the processes
are stopped (SIGSTOP) longer than a lease, while newer holders publish:

- one takes the claim first (so its fence is the round's lowest), reads the pointer,
  and is stopped before its conditional write; its lease expires while it is stopped
  (no operator), and only then do the others take the claim. Resumed at the end of the
  round, its write must be refused (its If-Match is stale), and it must read again and
  end in StaleFence naming a fence at least as high as all the others that finished;
- one is stopped in the middle of the race (before its swap, or between its first read
  and its conditional write, in turn), and resumed with the first, after the others
  finished: it must be refused, or, holding the top fence, win.

Checked every round: the top writer is never refused, every refusal names a higher
fence (at most the top), the pointer ends on the top fence, naming the top writer's
complete blob. A reader process polls the pointer all along: its fence never goes
back, and every pointer it reads names a complete blob with the bytes its writer put
(size, SHA-256, content), a writer that held that fence.

FENCED_RACE_ROUNDS sets the rounds (default 50; `make races` runs 1,000). The negative
control runs the same race with an unconditional pointer write: rounds end below their
top fence, and the reader sees the fence go back.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pytest
import redis

obstore = pytest.importorskip("obstore")

from _azurite import create_container, needs_azurite, open_store, running_azurite  # noqa: E402
from _wait import WAIT, wait_for  # noqa: E402
from fenced import force_release, read_holder  # noqa: E402
from fenced.store import ObjectPointer, Published  # noqa: E402
from fenced.testing import RedisServer  # noqa: E402
from object_race import LEASE, POINTER, Writer, check_blob  # noqa: E402

pytestmark = needs_azurite

ROUNDS = int(os.environ.get("FENCED_RACE_ROUNDS", "50"))
CONTROL_ROUNDS = 5
WRITERS = 16
#: Rounds whose blobs are kept before they are deleted (see Race._forget).
KEEP_ROUNDS = 20
PROCESSES = 4
CHILD = Path(__file__).resolve().parent / "object_race.py"


@pytest.fixture(scope="module")
def azurite() -> Iterator[str]:
    with running_azurite(memory=True) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


class Handle(Protocol):
    index: int
    pid: int | None

    def send(self, command: dict[str, Any]) -> None: ...
    def reply(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class ThreadWriter:
    """A writer in a thread of this process, taking commands from a queue."""

    pid: int | None = None

    def __init__(self, writer: Writer) -> None:
        self.index = writer.index
        self.writer = writer
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.outbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(writer,), daemon=True)
        self.thread.start()

    def _serve(self, writer: Writer) -> None:
        while (command := self.inbox.get()) is not None:
            try:
                self.outbox.put(writer.handle(command))
            except Exception:
                self.outbox.put({"error": traceback.format_exc()})

    def send(self, command: dict[str, Any]) -> None:
        if command["op"] == "acquire":
            # Claims are taken one at a time: no need to wake the thread for it.
            self.outbox.put(self.writer.handle(command))
        else:
            self.inbox.put(command)

    def reply(self) -> dict[str, Any]:
        answer = self.outbox.get(timeout=WAIT)
        assert "error" not in answer, f"writer {self.index}: {answer['error']}"
        return answer

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(WAIT)


class ProcessWriter:
    """A writer in a process of its own (object_race.py), one JSON line per command."""

    def __init__(self, args: list[str], index: int, blind: bool, log: Path) -> None:
        self.index = index
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), "writer", *args, str(index)]
                + (["--blind"] if blind else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            )  # fmt: skip
        self.pid: int | None = self.proc.pid

    def ready(self) -> None:
        assert self.reply() == {"ready": True}

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"writer process {self.index} exited: {self.log.read_text()}"
        answer: dict[str, Any] = json.loads(line)
        assert "error" not in answer, f"writer {self.index}: {answer['error']}"
        return answer

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(WAIT)


def stopped(pid: int) -> bool:
    """Whether a process is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@dataclass
class Round:
    """What one round did: each writer's fence, digest and swap answer; who was stopped."""

    fences: dict[int, int] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)
    swaps: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: The writer whose lease expired while it was stopped before its conditional write.
    expired: int = -1
    #: The writer stopped in the middle of the race, and where ("start" or "read").
    paused: int = -1
    pause_at: str = ""
    #: Seconds each stopped writer was stopped.
    stopped_for: dict[int, float] = field(default_factory=dict)
    final: Published | None = None
    #: Grants that came after their deadline and were given back (then asked again).
    late: int = 0

    @property
    def top(self) -> int:
        return max(self.fences, key=self.fences.__getitem__)


class Race:
    """Sixteen writers, a reader, a claim and a pointer in a container of their own."""

    def __init__(self, azurite: str, redis_url: str, where: Path, *, blind: bool = False) -> None:
        self.blind = blind
        self.container = f"race{uuid.uuid4().hex[:12]}"
        create_container(azurite, self.container)
        self.store = open_store(azurite, self.container)
        self.pointer = ObjectPointer(self.store, POINTER)
        self.claim = f"race:{self.container}"
        self.redis = redis.Redis.from_url(redis_url)
        args = [azurite, self.container, redis_url, self.claim]
        self.threads = [
            ThreadWriter(Writer(azurite, self.container, redis_url, self.claim, index, blind))
            for index in range(WRITERS - PROCESSES)
        ]
        self.processes = [
            ProcessWriter(args, index, blind, where / f"w{index}.log")
            for index in range(WRITERS - PROCESSES, WRITERS)
        ]
        for w in self.processes:
            w.ready()
        self.writers: list[Handle] = [*self.threads, *self.processes]
        self.stop = where / "stop"
        self.reader = subprocess.Popen(
            [sys.executable, str(CHILD), "reader", azurite, self.container, str(self.stop)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.old: collections.deque[list[str]] = collections.deque()
        self.deleter = concurrent.futures.ThreadPoolExecutor(1)
        self.deleting: concurrent.futures.Future[None] | None = None

    def close(self) -> None:
        self.stop.touch()
        self.deleter.shutdown()
        for w in self.writers:
            w.close()
        if self.reader.poll() is None:
            self.reader.kill()
            self.reader.wait(WAIT)

    def report(self) -> dict[str, Any]:
        """Stop the reader and return what it saw."""
        self.stop.touch()
        out, _ = self.reader.communicate(timeout=WAIT)
        assert self.reader.returncode == 0, out
        report: dict[str, Any] = json.loads(out)
        return report

    def _acquire(self, w: Handle, played: Round) -> None:
        w.send({"op": "acquire"})
        answer = w.reply()
        played.fences[w.index] = answer["fence"]
        played.late += answer["late"]

    def _put(self, writers: list[Handle], played: Round) -> None:
        for w in writers:
            w.send({"op": "put"})
        for w in writers:
            played.digests[w.index] = w.reply()["digest"]

    def _wait_stopped(self, w: Handle) -> float:
        assert w.pid is not None
        wait_for(f"writer {w.index} to stop", lambda: stopped(w.pid or 0), every=0.001)
        return time.monotonic()

    def play(self, n: int) -> Round:
        played = Round()
        expired = self.processes[n % PROCESSES]
        paused = self.processes[(n + 1) % PROCESSES]
        played.expired, played.paused = expired.index, paused.index
        played.pause_at = ("read", "start")[n % 2]
        # The first holder reads the pointer and stops before its conditional write; its
        # lease runs out while it is stopped, and only then is the claim free again.
        self._acquire(expired, played)
        self._put([expired], played)
        expired.send({"op": "swap", "pause": "read"})
        stops = {expired.index: self._wait_stopped(expired)}
        wait_for("the stopped holder's lease to expire",
                 lambda: read_holder(self.redis, self.claim) is None, every=0.001)  # fmt: skip
        # The others take the claim in turn, each force-released at once: 15 zombies.
        others = [w for w in self.writers if w is not expired]
        random.shuffle(others)
        for w in others:
            self._acquire(w, played)
            # Cleared by an operator, unless its short lease ran out first: gone either way.
            force_release(self.redis, self.claim, reason="race test")
        self._put(others, played)
        random.shuffle(others)
        for w in others:
            w.send({"op": "swap", "pause": played.pause_at if w is paused else None})
        stops[paused.index] = self._wait_stopped(paused)
        for w in others:
            if w is not paused:
                played.swaps[w.index] = w.reply()
        # Both stay stopped longer than a lease, then both resume at once. With the blind
        # write (the negative control), long enough for the reader (every 5 ms) to see
        # the top fence before a zombie's write takes the pointer back.
        stay = LEASE * 1.5 + (0.2 if self.blind else 0.0)
        time.sleep(max(0.0, stops[paused.index] + stay - time.monotonic()))
        for w in (paused, expired):
            assert w.pid is not None
            os.kill(w.pid, signal.SIGCONT)
            played.stopped_for[w.index] = time.monotonic() - stops[w.index]
        for w in (paused, expired):
            played.swaps[w.index] = w.reply()
        played.final = self.pointer.read()
        self._forget(played)
        return played

    def _forget(self, played: Round) -> None:
        # Azurite finds a blob by scanning every blob of the account, so each request
        # slows down as blobs pile up: the blobs of KEEP_ROUNDS rounds ago are deleted (the
        # pointer cannot name them unless its fence went back, which the reader would
        # report; a reader that stalls after reading a pointer has that many rounds to
        # read its blob). They are deleted in the background, during the next round.
        self.old.append(list(played.digests.values()))
        if len(self.old) > KEEP_ROUNDS:
            if self.deleting is not None:
                self.deleting.result()
            self.deleting = self.deleter.submit(self._delete, self.old.popleft())

    def _delete(self, digests: list[str]) -> None:
        # One request for them all (a blob batch): six times cheaper than one each.
        obstore.delete(self.store.backend, [self.store.key_of(d) for d in digests])


@pytest.fixture
def race(azurite: str, redis_url: str, tmp_path: Path) -> Iterator[Race]:
    race = Race(azurite, redis_url, tmp_path)
    try:
        yield race
    finally:
        race.close()


def check(played: Round, previous_top: int) -> None:
    """The rules of one round, for a pointer that accepts only conditional writes."""
    fences, swaps, top = played.fences, played.swaps, played.top
    assert len(set(fences.values())) == WRITERS and min(fences.values()) > previous_top
    assert swaps[top]["accepted"], f"the top writer was refused: {swaps[top]}"
    for index, answer in swaps.items():
        assert answer["fence"] == fences[index]
        if not answer["accepted"]:
            assert answer["current"] > answer["fence"], answer
            assert answer["current"] <= fences[top], answer
    # The zombie whose lease expired read the pointer before the round: its If-Match
    # write was refused, it read again, and found at least the highest fence of those
    # that had finished (the writer stopped mid-race resumed with it, and may be the top).
    finished = max(f for i, f in fences.items() if i not in (played.paused, played.expired))
    zombie = swaps[played.expired]
    assert not zombie["accepted"] and zombie["current"] >= finished, zombie
    assert zombie["loads"] == 2, zombie
    # The writer stopped mid-race, unless it holds the top fence, is refused: by what
    # it read before it stopped, or else (its write refused) by the top fence, read after.
    stopped = swaps[played.paused]
    if played.paused != top:
        assert not stopped["accepted"], stopped
        if played.pause_at == "start" or stopped["loads"] > 1:
            assert stopped["current"] == fences[top], stopped
    assert all(s > LEASE for s in played.stopped_for.values()), played.stopped_for
    final = played.final
    assert final is not None and final.fence == fences[top], (final, fences[top])
    assert final.digest == played.digests[top]


def test_zombie_holders_never_move_the_pointer_back(
    race: Race, capsys: pytest.CaptureFixture[str]
) -> None:
    top = 0
    swaps = refused = loads = 0
    writer_of: dict[int, int] = {}
    late = 0
    times: list[float] = []
    for n in range(ROUNDS):
        started = time.monotonic()
        played = race.play(n)
        times.append(time.monotonic() - started)
        check(played, top)
        assert played.final is not None
        assert check_blob(race.store, played.final) == (played.fences[played.top], played.top)
        top = played.fences[played.top]
        swaps += len(played.swaps)
        refused += sum(not s["accepted"] for s in played.swaps.values())
        loads += sum(s["loads"] for s in played.swaps.values())
        writer_of.update({fence: index for index, fence in played.fences.items()})
        late += played.late
    took = sum(times)
    report = race.report()
    assert report["back"] == [] and report["errors"] == []
    for fence, writer in report["seen"]:
        assert writer_of[fence] == writer, (fence, writer)
    # It saw more than the end of each round: pointers published mid-race.
    assert len(report["seen"]) > ROUNDS
    with capsys.disabled():
        print(
            f"\nobject store races: {ROUNDS} rounds of {WRITERS} writers "
            f"({PROCESSES} processes, 2 stopped each round): {swaps} swaps, {refused} "
            f"refused (StaleFence), {swaps - refused} accepted; {loads} pointer reads by "
            f"the writers, {report['reads']} by the reader ({len(report['seen'])} "
            f"distinct, each blob checked); {late} claims granted too late, asked again; "
            f"{took:.1f} s: {took / ROUNDS * 1000:.0f} ms per round (the slowest "
            f"{max(times) * 1000:.0f} ms)"
        )


def test_an_unconditional_pointer_write_goes_back(
    azurite: str, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The negative control: the same race with the conditional write made blind. The
    zombies resumed at the end of a round write their lower fences over the top one."""
    race = Race(azurite, redis_url, tmp_path, blind=True)
    lower = 0
    try:
        for n in range(CONTROL_ROUNDS):
            played = race.play(n)
            assert played.final is not None
            lower += played.final.fence < played.fences[played.top]
        report = race.report()
    finally:
        race.close()
    assert lower >= 1
    assert report["back"] != [] and report["errors"] == []
    with capsys.disabled():
        print(
            f"\nobject store races, unconditional write: {lower} of {CONTROL_ROUNDS} rounds "
            f"ended below their top fence; the reader saw the fence go back "
            f"{len(report['back'])} times"
        )
