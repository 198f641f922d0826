"""Claims seen from outside, as an operator sees them: list, read history, clear a stale one.

Listing SCANs for lock keys (never ``KEYS``, which blocks the server; on a cluster, on
every primary) and reads everything else about the claims it found in pipelined round
trips. Ages and times are measured on the clock of the Redis server that holds the
claim, the one its run records' times come from.
"""

from __future__ import annotations

import functools
import re
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from . import _audit, _lease
from ._audit import claimed_user
from ._beat import BeatStatus, beat_of, claim_of, of_state, read_state
from ._beat import as_dict as beat_dict
from ._errors import ClaimUnavailable, ConfigError
from ._lease import (
    IDLE_TTL,
    MAX_LIMIT,
    MAX_RECORDS,
    ClaimKeys,
    Holder,
    holder_filter,
    int_or_none,
    reachable,
    short_token,
)
from ._nodes import is_cluster, node_of, scan_keys, server_times
from ._options import DEFAULT
from ._printable import readable
from ._scripts import FORCE_RELEASE, Script
from .records import (
    UNREADABLE,
    RunRecord,
    consecutive_skips,
    encode_release,
    from_entries,
    from_replies,
    history,
    queue_read,
    read_problems,
    skip_streak,
)

__all__ = [
    "Burst",
    "ClaimInfo",
    "ClaimReport",
    "Flow",
    "beat_status",
    "clear_queued",
    "force_release",
    "list_claims",
    "list_queued",
    "operator",
    "read_holder",
    "read_slots",
    "release_slot",
    "show_claim",
]

#: Runs read per claim for ``ls``: enough for the current run and the one before it.
LS_RUNS = 10
#: Claims read per pipelined round trip.
BATCH = 500
#: What a client that decodes replies makes of a claim with bytes that are not text.
NOT_TEXT = "a value of the claim is not UTF-8"


@dataclass(frozen=True)
class Burst:
    """A name's pending debounce burst (``claim_debounce``), as its record says: calls
    made, its run not started yet."""

    #: The task id of the burst's one message (the AsyncResult every call returned).
    task_id: str
    #: How many calls joined it (None: the record does not say).
    calls: int | None = None
    #: Epoch seconds, on the clock of the claim's Redis server: its first and last call,
    #: and when it runs unless another call joins it (None: not in the record).
    first: float | None = None
    last: float | None = None
    due: float | None = None
    #: Seconds until it is due (0: due; its run waits for its message, or for a run that
    #: holds the name).
    runs_in: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


#: The fields of a burst record read (never its call: arguments, maybe secret and large).
BURST_FIELDS = ("id", "first", "last", "due", "calls")


@dataclass
class Flow:
    """What holds a name's next start back besides a holder: its rate (``rate``: when the
    next start is allowed, and the seconds until then) and a pending debounce burst."""

    next_start: float | None = None
    rate_wait: float | None = None
    burst: Burst | None = None

    @classmethod
    def read(cls, rate: Any, burst: Any, now: Callable[[], float], problems: list[str]) -> Flow:
        """From the rate key's GET and the burst record's HMGET of :data:`BURST_FIELDS`
        answers (anyone may have written either: what is not fenced's goes to
        ``problems``); ``now`` is the server's clock, asked only when one is found."""
        flow = cls()
        if isinstance(rate, Exception):
            problems.append(f"rate: {rate}")
        elif rate is not None:
            micros = _number(rate, "rate", problems)
            if micros is not None and (wait := micros / 1e6 - now()) > 0:
                flow.next_start, flow.rate_wait = micros / 1e6, wait
        if isinstance(burst, Exception):
            problems.append(f"debounce: {burst}")
        elif isinstance(burst, (list, tuple)) and any(v is not None for v in burst):
            flow.burst = _burst(dict(zip(BURST_FIELDS, burst, strict=False)), now, problems)
        return flow

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``rate`` and ``burst`` (None: nothing pending)."""
        rate = None
        if self.next_start is not None:
            rate = {"next_start": self.next_start, "wait": self.rate_wait}
        return {"rate": rate, "burst": self.burst.as_dict() if self.burst else None}


def _burst(found: dict[str, Any], now: Callable[[], float], problems: list[str]) -> Burst | None:
    if found["id"] is None:
        problems.append("debounce: a burst record without a task id")
        return None
    times = {
        part: None if ms is None else ms / 1000
        for part in ("first", "last", "due")
        for ms in [_number(found[part], f"debounce {part}", problems)]
    }
    due = times["due"]
    return Burst(
        readable(found["id"]),
        _number(found["calls"], "debounce calls", problems),
        times["first"],
        times["last"],
        due,
        None if due is None else max(0.0, due - now()),
    )


@dataclass
class ClaimInfo:
    """One held claim (or one in its cooldown window): who holds it, for how long, and
    how its previous run ended."""

    name: str
    holder: Holder | None
    #: Seconds since the holder's run started (None: not found in its records).
    age: float | None = None
    expires_in: float | None = None
    fence: int | None = None
    #: Its skips in a row: since a run of it last started or ended ok.
    skips: int = 0
    #: How the name's previous run ended, and when (read from its records).
    last_outcome: str | None = None
    last_finished: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: What of the claim's keys could not be read (a fence that is not an integer...).
    unreadable: str | None = None
    #: Seconds left of the cooldown window a run that ended ok started (None: none).
    cooldown_left: float | None = None
    #: How many holders the name may have at once (as last acquired), and each holder
    #: by slot; ``holder`` is the first of them.
    limit: int = 1
    slots: list[tuple[int, Holder]] = field(default_factory=list)
    #: The name's enqueue marker (``claim_enqueue``): the task id of the message it
    #: holds for, and the seconds it has left (None: no marker).
    queued: str | None = None
    queued_left: float | None = None
    #: The beat (``fenced.celery.beat``) whose leader holds this claim, or None.
    beat: str | None = None
    #: Its rate's next start and a pending debounce burst.
    flow: Flow = field(default_factory=Flow)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the secret part of the token shortened)."""
        own = ("age", "expires_in", "fence", "skips", "last_outcome", "last_finished", "extra")
        middle = {key: getattr(self, key) for key in (*own, "unreadable")}
        return _as_dict(self, {}, middle, self.beat)


def _as_dict(
    claim: ClaimInfo | ClaimReport, head: dict[str, Any], middle: dict[str, Any], beat: Any
) -> dict[str, Any]:
    """The JSON-ready form of a listed or a shown claim: the fields both have, in this
    order, ``head`` after the name and ``middle`` between the holders and the cooldown."""
    return {
        "name": claim.name,
        **head,
        "holder": claim.holder.as_dict() if claim.holder else None,
        "limit": claim.limit,
        "slots": [{"slot": i, **h.as_dict()} for i, h in claim.slots],
        **middle,
        "cooldown_left": claim.cooldown_left,
        "queued": None
        if claim.queued is None
        else {"task_id": claim.queued, "expires_in": claim.queued_left},
        "beat": beat,
        **claim.flow.as_dict(),
    }


def _marker(value: Any, problems: list[str]) -> str | None:
    """An enqueue marker's task id as text (None: no marker, or one of another type)."""
    if isinstance(value, Exception):
        problems.append(f"queued: {value}")
        return None
    return None if value is None else readable(value)


def _queue_pending(pipe: Any, keys: ClaimKeys) -> Any:
    """Queue on a pipeline what :func:`_pending` reads: the cooldown's PTTL, the enqueue
    marker's GET and PTTL, the rate key's GET, the burst record's HMGET. The pipeline."""
    pipe.pttl(keys.cooldown)
    pipe.get(keys.queued)
    pipe.pttl(keys.queued)
    pipe.get(keys.rate)
    pipe.hmget(keys.debounce, BURST_FIELDS)
    return pipe


def _pending(
    answers: Sequence[Any], now: Callable[[], float], problems: list[str], marker: list[str]
) -> dict[str, Any]:
    """The cooldown, enqueue marker and flow fields of a ClaimInfo or a ClaimReport, from
    the answers :func:`_queue_pending` queued; what is not fenced's goes to ``problems``
    (the marker's to ``marker``)."""
    cooldown, mark, mark_pttl, rate, burst = answers
    flow = Flow.read(rate, burst, now, problems)
    queued = _marker(mark, marker)
    left = _left(mark_pttl) if queued is not None else None
    return {"cooldown_left": _left(cooldown), "queued": queued, "queued_left": left, "flow": flow}


#: What :func:`_pending` finds for a name with nothing pending.
_IDLE = {"cooldown_left": None, "queued": None, "queued_left": None, "flow": Flow()}


def _lock_keys(client: Any, namespace: str, part: str = "lock") -> Iterator[str | bytes]:
    """The keys ``part`` of every name under ``namespace`` (its glob characters escaped)."""
    return scan_keys(client, re.sub(r"([*?\[\]\\])", r"\\\1", namespace) + ":{*}:" + part)


def _left(pttl: Any) -> float | None:
    """A PTTL answer as seconds left, None for a key that is gone (or never expires)."""
    left = int_or_none(pttl)
    return left / 1000 if left is not None and left > 0 else None


def _pipeline(client: Any) -> tuple[Any, bool]:
    """A pipeline, and whether it reads the server's clock in the same round trip.

    A cluster pipeline refuses TIME (it goes to no key's slot), and every node has a
    clock of its own: :func:`_clocks` asks each primary instead.
    """
    pipe = client.pipeline(transaction=False)
    if is_cluster(client):
        return pipe, False
    pipe.time()
    return pipe, True


def _clocks(client: Any, results: list[Any], timed: bool) -> Callable[[str], float]:
    """The clock (epoch seconds) of the server that stamped a key's records, by key."""
    if timed:
        secs, micros = results.pop(0)
        now = int(secs) + int(micros) / 1e6
        return lambda key: now
    times = server_times(client)
    latest = max(times.values())  # a key whose slot moved since: any clock will do
    return lambda key: times.get(node_of(client, key), latest)


def list_claims(client: Any, namespace: str = "fenced") -> list[ClaimInfo]:
    """Every claim held now under a namespace, every one in its cooldown window, every
    name marked at enqueue (``claim_enqueue``: a message for it is queued), every one
    whose rate holds its next start back and every one with a pending debounce burst,
    sorted by name.

    What cannot be read (a key name or a value that is not UTF-8, a key of the wrong
    type, a fence that is not an integer) is listed with ``unreadable`` saying what,
    after the rest has been read as usual.
    """
    names: set[str] = set()
    foreign: dict[str, ClaimInfo] = {}
    for part in ("lock", "cooldown", "slot:*", "queued", "rate", "debounce"):
        for key in _lock_keys(client, namespace, part):
            name = ClaimKeys.name_from_key(key, namespace)
            if name and isinstance(key, bytes):
                # Its other keys cannot be named from the text: shown, not read.
                foreign[name] = _unread(name, "the key name is not UTF-8")
            elif name:
                names.add(name)
    ordered = sorted(names)
    infos: list[ClaimInfo] = []
    for start in range(0, len(ordered), BATCH):
        infos += _read_batch(client, ordered[start : start + BATCH], namespace)
    missing = [
        i for i in infos if i.age is None and i.holder is not None and i.holder.unreadable is None
    ]
    if missing:
        _find_starts(client, missing, namespace)
    _find_beats(client, infos, namespace)
    return sorted(infos + list(foreign.values()), key=lambda info: info.name)


def _find_beats(client: Any, infos: list[ClaimInfo], namespace: str) -> None:
    """Mark the claims that are a beat's leader claim (``beat:NAME`` with the beat's
    entries beside it): one round trip, only when such names are listed."""
    found = [(info, beat) for info in infos if (beat := beat_of(info.name)) is not None]
    if not found:
        return
    pipe = client.pipeline(transaction=False)
    for info, _beat in found:
        pipe.exists(ClaimKeys(namespace, info.name).beat)
    for (info, beat), there in zip(found, pipe.execute(raise_on_error=False), strict=True):
        if there == 1:
            info.beat = beat


def _unread(name: str, why: str) -> ClaimInfo:
    """A claim found held whose lease could not be read at all."""
    return ClaimInfo(name, Holder.unknown(why), unreadable=why)


def _read_batch(client: Any, names: list[str], namespace: str) -> list[ClaimInfo]:
    pipe, timed = _pipeline(client)
    for name in names:
        keys = ClaimKeys(namespace, name)
        pipe.get(keys.lock)
        pipe.pttl(keys.lock)
        pipe.get(keys.fence)
        queue_read(pipe, keys, LS_RUNS)
        pipe.get(keys.skips)  # after the records, as consecutive_skips reads them
        _queue_pending(pipe, keys)
        pipe.hgetall(keys.slots)  # last: _read_slots finds it there
    try:
        results = pipe.execute(raise_on_error=False)
    except UnicodeDecodeError:
        # A client that decodes replies met bytes that are not text, and the batch is
        # lost with them: read claim by claim, to list all but the one at fault.
        if len(names) == 1:
            return [_unread(names[0], NOT_TEXT)]
        return [info for name in names for info in _read_batch(client, [name], namespace)]
    clock = _clocks(client, results, timed)
    per = 12
    slotted = _read_slots(client, names, results, namespace, per)
    infos: list[ClaimInfo] = []
    for i, name in enumerate(names):
        token, pttl, fence, listed, streamed, skips, *answers = results[per * i : per * (i + 1) - 1]
        limit, slots = slotted.get(name, (1, []))
        keys = ClaimKeys(namespace, name)
        problems: list[str] = []
        now = functools.partial(clock, keys.records)
        pending = _pending(answers, now, problems, problems)
        if token is None and not slots and not problems and pending == _IDLE:
            continue  # released (its window ended, its marker cleared...) since the scan
        fence_int = _number(fence, "fence", problems)
        holder = lock_holder("lock", token, pttl, fence_int)
        if limit > 1:
            holder = slots[0][1] if slots else None
            fence_int = holder.fence if holder else fence_int
        elif holder is not None:
            slots = [(0, holder)]
        info = ClaimInfo(
            name=name,
            holder=holder,
            expires_in=holder.expires_in if holder else None,
            fence=fence_int,
            skips=skip_streak(_number(skips, "skips", problems) or 0, listed),
            limit=limit,
            slots=slots,
            **pending,
        )
        problems += read_problems(listed, streamed)
        _apply_runs(info, (listed, streamed), LS_RUNS, clock(keys.records))
        info.unreadable = "; ".join(problems) or None
        infos.append(info)
    return infos


def _number(value: Any, what: str, problems: list[str]) -> int | None:
    """A counter's value; what it holds instead of an integer goes to ``problems``."""
    number = int_or_none(value)
    if number is None and value is not None:
        problems.append(f"{what} {readable(value)[:40]!r} is not an integer")
    return number


def _limit_of(fences: Any) -> int:
    """The limit a name was last acquired with, from its slots' hash (1 without one, or
    when the hash is not what fenced writes)."""
    limit = _slot_fences(fences).get("limit")
    return 1 if limit is None else max(1, min(limit, MAX_LIMIT))


def _slot_fences(fences: Any) -> dict[str, int | None]:
    """The slots' hash, field by field as text (empty when it is not a hash)."""
    by_slot = fences if isinstance(fences, dict) else {}
    return {readable(k): int_or_none(v) for k, v in by_slot.items()}


def _read_slots(
    client: Any, names: list[str], results: list[Any], namespace: str, per: int
) -> dict[str, tuple[int, list[tuple[int, Holder]]]]:
    """The limit and the holders by slot of each name acquired with a limit above 1 (one
    more round trip, only when there are such names)."""
    limits = {name: _limit_of(results[per * i + per - 1]) for i, name in enumerate(names)}
    limits = {name: limit for name, limit in limits.items() if limit > 1}
    if not limits:
        return {}
    pipe = client.pipeline(transaction=False)
    for name, limit in limits.items():
        queue_slots(pipe, ClaimKeys(namespace, name), limit)
    answers = pipe.execute(raise_on_error=False)
    out = {}
    for name, limit in limits.items():
        *leases, fence, fences = answers[: 2 * limit + 2]
        del answers[: 2 * limit + 2]
        out[name] = (limit, slot_holders(leases, fence, fences))
    return out


def _apply_runs(info: ClaimInfo, replies: Sequence[Any], count: int, now: float) -> None:
    """What the newest ``count`` runs, as :func:`queue_read` read them, say of a claim (a
    key of another type is read as none: the first look names it)."""
    listed, streamed = ([] if isinstance(r, Exception) else r for r in replies)
    runs = from_entries(info.name, listed, count, streamed=streamed)
    token = info.holder.token if info.holder else None
    # The runs of a name's other holders (slots) are running, not unfinished.
    holding = {h.token for _i, h in info.slots}
    for run in runs:
        if run.token == token:
            if run.started is not None and info.age is None:
                info.age = max(0.0, now - run.started)
                info.extra = run.extra
            continue
        if run.token in holding:
            continue
        if info.last_outcome is None and run.outcome != "skipped":
            # A run of another token that never recorded its end did not finish.
            info.last_outcome = "unfinished" if run.outcome == "running" else run.outcome
            info.last_finished = run.finished


def _find_starts(client: Any, infos: list[ClaimInfo], namespace: str) -> None:
    """Second look, deeper into the records, for runs whose start lies behind many skips."""
    pipe, timed = _pipeline(client)
    names = [ClaimKeys(namespace, info.name) for info in infos]
    for keys in names:
        queue_read(pipe, keys, MAX_RECORDS)
    try:
        results = pipe.execute(raise_on_error=False)
    except UnicodeDecodeError:  # a client that decodes replies: the first look stands
        return
    clock = _clocks(client, results, timed)
    for i, (info, keys) in enumerate(zip(infos, names, strict=True)):
        _apply_runs(info, results[2 * i : 2 * i + 2], MAX_RECORDS, clock(keys.records))


@dataclass
class ClaimReport:
    """A claim's current holder (if any) and its runs, newest first."""

    name: str
    namespace: str
    holder: Holder | None
    runs: list[RunRecord]
    #: Seconds left of the cooldown window a run that ended ok started (None: none).
    cooldown_left: float | None = None
    #: How many holders the name may have at once (as last acquired), and each holder
    #: by slot; ``holder`` is the first of them.
    limit: int = 1
    slots: list[tuple[int, Holder]] = field(default_factory=list)
    #: The name's enqueue marker: the queued message's task id and its seconds left.
    queued: str | None = None
    queued_left: float | None = None
    #: The beat (``fenced.celery.beat``) whose leader claim this is: its status, the
    #: leader being :attr:`holder`; None for any other claim.
    beat: BeatStatus | None = None
    #: Its rate's next start and a pending debounce burst.
    flow: Flow = field(default_factory=Flow)
    #: Its skips in a row: since a run of it last started or ended ok.
    skips: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        runs = {"skips": self.skips, "runs": [run.as_dict() for run in self.runs]}
        beat = None if self.beat is None else beat_dict(self.beat)
        return _as_dict(self, {"namespace": self.namespace}, runs, beat)


def _slots_hash(client: Any, keys: ClaimKeys) -> Any:
    """The name's slots hash, or None when its key holds something else."""
    try:
        return client.hgetall(keys.slots)
    except redis.ResponseError:  # WRONGTYPE: not fenced's; read as a plain claim
        return None


def show_claim(
    client: Any, name: str, *, namespace: str = "fenced", limit: int = 20
) -> ClaimReport:
    """The holder and the run records of one claim.

    One round trip: every key of a name shares its hash tag, so a Cluster pipeline goes
    to the one node that holds them all.
    """
    keys = ClaimKeys.of(name, namespace)
    pipe = queue_read(queue_slots(client.pipeline(transaction=False), keys), keys, limit)
    pipe.get(keys.skips)  # after the records, as consecutive_skips reads them
    answers = _read(client, keys, _queue_pending(pipe, keys))
    if answers is None:
        # A client that decodes replies met bytes that are not text, and the whole answer
        # is lost with them: read part by part, to show what can be read.
        return _show_apart(client, keys, limit)
    *leases, fence, fences, listed, streamed, skips = answers[:-5]
    most = _limit_of(fences)
    # The plain claim: its holder's fence is the counter's.
    holder = lock_holder(keys.lock, leases[0], leases[1], fence) if most == 1 else None
    # A key of another type (WRONGTYPE): someone else's, one unreadable run names it.
    runs = from_replies(keys, listed, streamed, limit)
    slots = slot_holders(leases, fence, fences)
    report = _report(keys, slots, most, holder, runs, answers[-5:], client)
    report.skips = skip_streak(int_or_none(skips) or 0, listed)
    return report


def _with_beat(client: Any, keys: ClaimKeys, report: ClaimReport) -> ClaimReport:
    """A beat's leader claim (``beat:NAME`` with the beat's entries beside it): the
    report with the beat's status, in one round trip more; any other name as it is."""
    beat = beat_of(keys.name)
    if beat is None:
        return report
    try:
        entries, tick, upcoming = read_state(client, keys)
    except (redis.ResponseError, UnicodeDecodeError):  # not a hash fenced wrote
        return report
    if entries or tick is not None:
        report.beat = of_state(beat, report.holder, entries, tick, upcoming)
    return report


def _server_clock(client: Any, keys: ClaimKeys) -> Callable[[], float]:
    """The clock (epoch seconds) of the server that holds a name's keys, asked once and
    only when called (one more round trip; on a cluster, one per primary)."""

    @functools.cache
    def now() -> float:
        with reachable(client, f"read the clock of claim {keys.name!r}", keys.name):
            return _clocks(client, [], False)(keys.lock)

    return now


def _get(client: Any, command: str, *args: Any) -> Any:
    """One reply, or the error it is (a key of another type, bytes that are not text)."""
    try:
        return client.execute_command(command, *args)
    except (redis.ResponseError, UnicodeDecodeError) as exc:
        return redis.ResponseError(str(exc))


def _show_apart(client: Any, keys: ClaimKeys, limit: int) -> ClaimReport:
    """:func:`show_claim` in a round trip per part, each read on its own terms."""
    slots = read_slots(client, keys.name, namespace=keys.namespace)
    most = _limit_of(_slots_hash(client, keys))
    holder = read_holder(client, keys.name, namespace=keys.namespace) if most == 1 else None
    runs = history(client, keys.name, limit=limit, namespace=keys.namespace)
    pending = (
        client.pttl(keys.cooldown),
        _get(client, "GET", keys.queued),
        client.pttl(keys.queued),
        _get(client, "GET", keys.rate),
        _get(client, "HMGET", keys.debounce, *BURST_FIELDS),
    )
    report = _report(keys, slots, most, holder, runs, pending, client)
    report.skips = consecutive_skips(client, keys.name, namespace=keys.namespace)
    return report


def _report(
    keys: ClaimKeys,
    slots: list[tuple[int, Holder]],
    most: int,
    holder: Holder | None,
    runs: list[RunRecord],
    pending: Sequence[Any],
    client: Any,
) -> ClaimReport:
    """A report from the answers about one name (``pending``: those of
    :func:`_queue_pending`), with a beat's status when it is a beat's leader claim."""
    if most == 1:  # a plain claim: its lease, or what stands in a slot above 0
        slots = [(0, holder)] if holder else [s for s in slots if s[0]]
    problems: list[str] = []
    marker: list[str] = []
    fields = _pending(pending, _server_clock(client, keys), problems, marker)
    if marker:  # a marker key of another type: shown as the runs key's would be
        runs = [*runs, RunRecord(keys.name, UNREADABLE, unreadable=f"{keys.queued}: {pending[1]}")]
    # What the rate key or the burst record hold that fenced never wrote, shown likewise.
    runs += [RunRecord(keys.name, UNREADABLE, unreadable=problem) for problem in problems]
    most = max(most, max((i + 1 for i, _h in slots), default=1))
    holder = slots[0][1] if slots else None
    report = ClaimReport(keys.name, keys.namespace, holder, runs, limit=most, slots=slots, **fields)
    return _with_beat(client, keys, report)


def beat_status(client: Any, name: str, *, namespace: str = "fenced") -> BeatStatus:
    """The leader of beat ``name`` (its fence), its last tick and each entry's last due."""
    claim = claim_of(name)
    keys = ClaimKeys.of(claim, namespace)
    leader = read_holder(client, claim, namespace=namespace)
    return of_state(name, leader, *read_state(client, keys))


def read_holder(client: Any, name: str, *, namespace: str = "fenced") -> Holder | None:
    """The current holder of a claim, or None when nobody holds it (one round trip)."""
    keys = ClaimKeys.of(name, namespace)
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.lock)
    pipe.pttl(keys.lock)
    pipe.get(keys.fence)
    answers = _read(client, keys, pipe)
    return Holder.unknown(NOT_TEXT) if answers is None else lock_holder(keys.lock, *answers)


def _read(client: Any, keys: ClaimKeys, pipe: Any) -> list[Any] | None:
    """A pipeline's answers about one claim (errors among them), or None when a client
    that decodes replies met bytes that are not text."""
    with reachable(client, f"read claim {keys.name!r}", keys.name):
        try:
            answers: list[Any] = pipe.execute(raise_on_error=False)
        except UnicodeDecodeError:
            return None
    return answers


def lock_holder(where: str, token: Any, pttl: Any, fence: Any) -> Holder | None:
    """The holder of a lease (a plain claim's, or one slot's: ``where``, named in what
    cannot be read) from the GET and PTTL answers of its key and its fence."""
    if token is None:
        return None
    if isinstance(token, Exception):  # e.g. WRONGTYPE: not a string, not a token
        return Holder.unknown(f"{where}: {token}")
    return Holder.parse(token, int_or_none(pttl), int_or_none(fence))


def read_slots(
    client: Any, name: str, *, namespace: str = "fenced", limit: int = MAX_LIMIT
) -> list[tuple[int, Holder]]:
    """Every holder of a name, by slot (a name held by up to ``limit`` at once), in slot
    order; one round trip. ``limit`` defaults to the most a name may have."""
    keys = ClaimKeys.of(name, namespace)
    answers = _read(client, keys, queue_slots(client.pipeline(transaction=False), keys, limit))
    if answers is None:
        return [(0, Holder.unknown(NOT_TEXT))]
    return slot_holders(answers[:-2], *answers[-2:])


def queue_slots(pipe: Any, keys: ClaimKeys, limit: int = MAX_LIMIT) -> Any:
    """Queue on a pipeline what :func:`slot_holders` reads: each slot's GET and PTTL, the
    fence counter, the slots' hash (in that order). The pipeline."""
    for i in range(limit):
        pipe.get(keys.slot(i))
        pipe.pttl(keys.slot(i))
    pipe.get(keys.fence)
    pipe.hgetall(keys.slots)
    return pipe


def slot_holders(leases: Sequence[Any], fence: Any, fences: Any) -> list[tuple[int, Holder]]:
    """Holders from the GET and PTTL answers of each slot, the fence counter and the
    slots' hash (a slot's fence; slot 0 without one holds the counter's)."""
    # Any of them may hold what fenced never wrote there: read, never fail.
    slot_fences = _slot_fences(fences)
    found = []
    for i, (token, pttl) in enumerate(zip(leases[::2], leases[1::2], strict=False)):
        minted = slot_fences.get(str(i))
        if minted is None and i == 0:
            minted = int_or_none(fence)
        holder = lock_holder(f"slot {i}", token, pttl, minted)
        if holder is not None:
            found.append((i, holder))
    return found


def operator() -> str:
    """Who is at the keyboard: user@host, for the record of a manual release."""
    return f"{claimed_user()}@{socket.gethostname()}"


def release_slot(slots: list[tuple[int, Holder]], token_prefix: str = "") -> int:
    """The slot a release by hand clears: the holder whose token starts with the prefix
    (of several), else the one holder's, else 0 (the plain claim's key).

    Several holders and no prefix is for the caller to refuse: it cannot know which.
    """
    if len(slots) > 1:
        return next((i for i, h in slots if h.token.startswith(token_prefix)), 0)
    return slots[0][0] if slots else 0


def force_release(
    client: Any,
    name: str,
    *,
    reason: str | None = None,
    namespace: str = "fenced",
    by: str | None = None,
    token_prefix: str = "",
    slot: int = 0,
    task_id: str | None = None,
    pid: int | None = None,
    host: str | None = None,
    outcome: str | None = None,
    max_records: int = MAX_RECORDS,
    idle_ttl: float | None = IDLE_TTL,
    **data: Any,
) -> Holder | None:
    """Clear a claim whatever its token; with ``task_id``/``pid``, only such a holder's.

    For a supervisor that knows the holder is gone (a killed process) or an operator:
    ``by`` names who (default: user@host of this process) and ``reason`` why, in the
    holder's run record and on the ``fenced.audit`` log. ``pid`` matches a holder
    process on ``host`` (default: this host); ``slot`` names one holder of a name held
    by several at once (see ``read_slots``). ``outcome`` (e.g. ``"aborted"``) ends the
    holder's run record; without it the record says ``released``. Returns the holder
    cleared (as read just before: how long its lease had left, its fence), or None.
    """
    keys = ClaimKeys.of(name, namespace)
    by = by or operator()
    record = encode_release(reason, by=by, **data)
    answer: Any = None
    before: Holder | None = None
    outcome_seen = "error"
    try:
        # Read first, so the answer can say how long the lease had left and its fence.
        if slot == 0:
            before = read_holder(client, keys.name, namespace=namespace)
        else:
            before = dict(read_slots(client, keys.name, namespace=namespace)).get(slot)
        with reachable(client, f"release claim {keys.name!r}", keys.name):
            answer = FORCE_RELEASE(
                client,
                [keys.slot(slot), keys.records, keys.fence],
                [
                    token_prefix,
                    record,
                    max_records,
                    task_id or "",
                    outcome or "",
                    holder_filter(host, pid),
                    int(idle_ttl * 1000) if idle_ttl else 0,
                ],
            )
        outcome_seen = "released" if answer[0] else "not_held"
    except ClaimUnavailable:
        outcome_seen = "unreachable"
        raise
    except redis.ResponseError as exc:
        corrupt = _lease.LeaseStore(client, keys, DEFAULT).find_corrupt_key()
        if corrupt is None:
            raise
        # The script clears the lease before it writes the record: say which step failed.
        gone = before is not None and not client.exists(keys.slot(slot))
        doing = "record the release of claim" if gone else "release claim"
        raise _lease.corrupt_key_error(keys.name, *corrupt, exc, doing=doing) from exc
    finally:
        # Logged whatever happened: the run records are capped and anyone with Redis
        # access can rewrite it, so operators ship this line somewhere else.
        # Whatever the keys held: an audit line is written even for garbage.
        text, fence = (readable(v) for v in answer) if answer else ("", "")
        _audit.force_released(
            keys.name,
            token_prefix=short_token(text or token_prefix) or None,
            fence=int_or_none(fence) if text else None,
            by=by,
            reason=reason,
            outcome=outcome_seen,
        )
    if not text:
        return None
    cleared = Holder.parse(text)
    if before is not None and before.token == cleared.token:
        return before
    return cleared


# KEYS[1] a name's enqueue marker: deleted. Returns the task id it held (nil: none); a key
# of another type is an error reply, and is left alone.
_UNQUEUE = Script(
    "unqueue",
    """
local held = redis.call('GET', KEYS[1])
if held then redis.call('DEL', KEYS[1]) end
return held
""",
)


def list_queued(client: Any, namespace: str = "fenced") -> list[str]:
    """The names marked at enqueue (``claim_enqueue``) under a namespace, sorted; a key
    whose name is not UTF-8 cannot be named back (``fenced ls`` shows it as unreadable)."""
    keys = _lock_keys(client, namespace, "queued")  # a name not UTF-8 comes as bytes
    names = {ClaimKeys.name_from_key(key, namespace) for key in keys if isinstance(key, str)}
    return sorted(name for name in names if name)


def clear_queued(
    client: Any,
    name: str,
    *,
    namespace: str = "fenced",
    by: str | None = None,
    reason: str | None = None,
) -> str | None:
    """Delete a name's enqueue marker (``claim_enqueue``): the task id it held, or None.

    The next ``apply_async`` of the name publishes again. For a message that will never
    run (a purged queue, a revoked task), whose marker would otherwise block the name
    until ``claim_enqueue_ttl``; a message still queued runs as it would have (the
    claim skips a second run while one runs). Logged on ``fenced.audit``.
    """
    keys = ClaimKeys.of(name, namespace)
    outcome = "error"
    held: Any = None
    try:
        with reachable(client, f"clear the enqueue marker of {keys.name!r}", keys.name):
            try:
                held = _UNQUEUE(client, [keys.queued], [])
            except redis.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                kind = readable(client.type(keys.queued))
                raise ConfigError(
                    f"{keys.queued} is a {kind}, not fenced's enqueue marker: left alone "
                    "(delete it by hand if nothing else owns it)",
                    name=keys.name,
                ) from None
        outcome = "not_marked" if held is None else "cleared"
    except ClaimUnavailable:
        outcome = "unreachable"
        raise
    finally:
        _audit.unqueued(
            keys.name,
            task_id=None if held is None else readable(held),
            by=by or operator(),
            reason=reason,
            outcome=outcome,
        )
    return None if held is None else readable(held)
