"""Several ``celery beat`` processes, one leader: ``celery -A proj beat -S
fenced.celery.beat:Scheduler`` (or ``beat_scheduler = "fenced.celery.beat:Scheduler"``).

Every beat process reads ``beat_schedule`` as Celery's own scheduler does. One of them
leads: it holds a fenced claim (``beat:<fenced_beat_name>``) that the process's
heartbeat renews; the others stand by and poll, and one of them takes the claim within
a lease of the leader's death, pause or partition. Only the leader sends, and only
what the ``BEAT_DISPATCH`` script grants: that script checks, in one step, that the
leader's token still holds the claim under its fence, that the entry's due time comes
after the one stored in Redis (by at least half the gap back to the schedule's previous
due time) and is not in the future of Redis's clock, and stores it. So every (entry,
due time) is granted once across all beats, a leader that wakes from a pause sends
nothing, a leader whose clock runs ahead cannot move the schedule on, and a new leader
continues the schedule where the last one left it (the due times live in Redis, not in
a beat). A call the script answered whose reply was lost is answered the same when
redis-py sends it again. A granted tick is sent with a task id made of the beat, the
entry and the due time (:func:`task_id`): a tick sent again after a crash is the same
task.

Settings: ``fenced_beat_name`` (default: the app's main name), ``fenced_beat_ttl``
(the leader's lease, seconds, default 10), ``fenced_beat_alarm_after`` (log an error
when no beat led for this long, default three leases); the Redis is the app's claims
Redis (``fenced_redis_url``), under ``fenced_namespace``. An entry's ``options`` may
carry ``fenced_catch_up`` (``"skip"``, ``"latest"``, ``"all"``) and
``fenced_catch_up_window`` (seconds): see :class:`CatchUp`. With ``fenced_metrics`` on,
the beat counts ticks sent and refused, whether it leads and its alarms
(:class:`fenced.metrics.BeatMetrics`), served on ``fenced_beat_metrics_port`` when set.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery import beat
from celery.schedules import crontab, schedule

from .._beat import BeatStatus, EntryState, claim_of, read_state, task_id
from .._beat import at as _at
from .._claim import Claim
from .._errors import ClaimUnavailable, ConfigError
from .._inspect import beat_status as status
from .._lease import ClaimKeys, check_namespace, check_timing, ms_or_none
from .._scripts import BEAT_DISPATCH, BEAT_SENT
from . import _metrics
from ._options import lock_redis

__all__ = [
    "CATCH_UP",
    "BeatOptions",
    "BeatStatus",
    "CatchUp",
    "EntryState",
    "Scheduler",
    "min_gap",
    "next_due",
    "plan",
    "previous_due",
    "status",
    "task_id",
]

log = logging.getLogger("fenced.beat")

#: What a leader does with due times that passed while no beat led.
CATCH_UP = ("skip", "latest", "all")
#: The most runs of one entry that ``"all"`` sends for one gap.
ALL_LIMIT = 1000
#: The entry options fenced reads (and removes before the task is sent).
ENTRY_OPTIONS = ("fenced_catch_up", "fenced_catch_up_window")
#: The setting of the port a beat process serves its metrics on.
METRICS_PORT = "fenced_beat_metrics_port"
#: How far ahead of Redis's clock (ms) a due time may be and still be granted: the
#: clocks of hosts kept by NTP agree far better. ``BEAT_DISPATCH`` holds the same number.
AHEAD_MS = 1000
#: How far back :func:`previous_due` looks for a calendar's previous due time (ms):
#: past a Feb 29 (eight years at most, over 2100).
LOOK_BACK_MS = 16 * 366 * 86_400_000
_UTC = timezone.utc


# -- options ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BeatOptions:
    """A beat's settings, checked once when the scheduler is made."""

    name: str
    ttl: float = 10.0
    alarm_after: float | None = None
    namespace: str = "fenced"
    #: Where the beat serves ``/metrics`` (None: nowhere; a worker's ``-B`` beat shows
    #: in the worker's own in multiprocess mode).
    metrics_port: int | None = None

    @classmethod
    def of(cls, app: Any) -> BeatOptions:
        """The ``fenced_beat_*`` settings of an app (and its ``fenced_namespace``)."""
        conf = app.conf
        ttl = conf.get("fenced_beat_ttl")
        opts = cls(
            name=str(conf.get("fenced_beat_name") or app.main or "celery"),
            ttl=10.0 if ttl is None else ttl,
            alarm_after=conf.get("fenced_beat_alarm_after"),
            namespace=conf.get("fenced_namespace") or "fenced",
            metrics_port=conf.get(METRICS_PORT),
        )
        opts.check()
        port = opts.metrics_port
        if port is not None and not _metrics.settings(app)[0]:
            raise ConfigError(
                f"{METRICS_PORT}={port!r} serves the beat's metrics, which are off: set "
                f"{_metrics.SETTING} = True (or FENCED_METRICS=1) as well"
            )
        return opts

    def check(self) -> None:
        """Refuse a ttl or alarm time that cannot work, naming the setting."""
        check_timing(self.ttl, None, names=("fenced_beat_ttl", ""))
        check_namespace(self.namespace)
        ClaimKeys.of(self.claim, self.namespace)
        alarm = self.alarm_after
        if alarm is not None and (
            isinstance(alarm, bool) or not isinstance(alarm, (int, float)) or alarm <= 0
        ):
            raise ConfigError(f"fenced_beat_alarm_after={alarm!r} must be seconds > 0")
        if self.metrics_port is not None:
            _metrics.check_port(self.metrics_port, METRICS_PORT, 9809)

    @property
    def claim(self) -> str:
        """The name of the leader's claim."""
        return claim_of(self.name)

    @property
    def alarm(self) -> float:
        """Seconds without a leader before an error is logged."""
        return float(self.alarm_after) if self.alarm_after is not None else 3 * self.ttl

    @property
    def poll(self) -> float:
        """How often a stand-by tries to take the lead."""
        return self.ttl / 5


@dataclass(frozen=True)
class CatchUp:
    """What a leader sends of an entry's due times that passed while nobody led.

    ``skip`` (the default): the latest of them runs when it is at most ``window`` late
    (default: two leases, so a failover delays a tick instead of dropping it), the
    rest are dropped; ``latest``: the latest runs however late (one run for the gap);
    ``all``: each within ``window`` (default an hour) runs, oldest first, at most
    :data:`ALL_LIMIT`. The schedule goes on from the latest in every case.
    """

    mode: str = "skip"
    window: float = 0.0

    @classmethod
    def of(cls, options: Mapping[str, Any], ttl: float, where: str) -> CatchUp:
        """An entry's ``fenced_catch_up`` and ``fenced_catch_up_window`` options."""
        mode = options.get("fenced_catch_up") or "skip"
        if mode not in CATCH_UP:
            raise ConfigError(
                f"{where}: fenced_catch_up={mode!r} is not one of {', '.join(CATCH_UP)}"
            )
        window = options.get("fenced_catch_up_window")
        if window is None:
            window = 3600.0 if mode == "all" else 2 * ttl
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
            raise ConfigError(f"{where}: fenced_catch_up_window={window!r} must be seconds >= 0")
        return cls(mode, float(window))


# -- due times: no I/O ----------------------------------------------------------------


def _ms(when: datetime) -> int:
    return round(when.timestamp() * 1000)


def _interval_ms(sched: Any) -> int | None:
    """The period of a plain interval schedule, in ms (None for calendars)."""
    if type(sched) is schedule:
        every: timedelta = getattr(sched, "run_every")  # noqa: B009 (not in Celery's stubs)
        return max(1, round(every.total_seconds() * 1000))
    return None


def next_due(sched: Any, last_ms: int) -> int:
    """The first due time of a schedule after ``last_ms`` (ms since the epoch).

    The same for every beat that asks: an interval adds its period, a crontab moves to
    its next matching minute; any other schedule is asked how long from now, and the
    answer is rounded to the second.
    """
    every = _interval_ms(sched)
    if every is not None:
        return last_ms + every
    last = _at(last_ms)
    if isinstance(sched, crontab):
        start, delta, _now = sched.remaining_delta(last)
        due = _ms(start + delta)
    else:
        now = datetime.now(_UTC)
        due = round((now + sched.remaining_estimate(last)).timestamp()) * 1000
    return due if due > last_ms else last_ms + 1000


def _missed(sched: Any, last_ms: int, now_ms: int, since_ms: int) -> tuple[list[int], int]:
    """The due times after ``last_ms`` up to ``now_ms`` that are at or after
    ``since_ms`` (at most :data:`ALL_LIMIT`, the newest), and the latest of all."""
    every = _interval_ms(sched)
    if every is not None:
        latest = last_ms + ((now_ms - last_ms) // every) * every
        first = max(last_ms + every, latest - (ALL_LIMIT - 1) * every)
        if since_ms > first:
            first += math.ceil((since_ms - first) / every) * every
        return list(range(first, latest + 1, every)), latest
    found: list[int] = []
    due = next_due(sched, last_ms)
    latest = due
    for _ in range(100 * ALL_LIMIT):
        if due > now_ms:
            break
        latest = due
        if due >= since_ms:
            found.append(due)
        due = next_due(sched, due)
    return found[-ALL_LIMIT:], latest


def plan(sched: Any, last_ms: int, now_ms: int, catch_up: CatchUp) -> tuple[list[int], int | None]:
    """What a leader does for one entry at ``now_ms``: the due times to send, oldest
    first, and a due time to store as passed over without a run (or None)."""
    if next_due(sched, last_ms) > now_ms:
        return [], None
    window_ms = round(catch_up.window * 1000)
    since = last_ms if catch_up.mode == "latest" else now_ms - window_ms
    found, latest = _missed(sched, last_ms, now_ms, since)
    if catch_up.mode == "all" and found:
        return found, None
    if catch_up.mode == "latest" or (found and found[-1] == latest):
        return [latest], None
    return [], latest


def previous_due(sched: Any, due_ms: int) -> int | None:
    """The latest due time of a schedule before its due time ``due_ms`` (None when it
    has none within :data:`LOOK_BACK_MS`): the one :func:`next_due` goes on from to
    reach ``due_ms``."""
    every = _interval_ms(sched)
    if every is not None:
        return due_ms - every
    # next_due(t) moves on with t: the previous due time is the earliest t whose next
    # due time is not before due_ms. Doubling back from due_ms finds a t before it,
    # halving then finds it to the ms (next_due(lo) < due_ms <= next_due(hi)).
    hi, span = due_ms - 1, 60_000
    while next_due(sched, due_ms - span) >= due_ms:
        hi = due_ms - span
        if span > LOOK_BACK_MS:
            return None
        span *= 2
    lo = due_ms - span
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if next_due(sched, mid) < due_ms:
            lo = mid
        else:
            hi = mid
    return hi


def min_gap(sched: Any, due_ms: int) -> int:
    """The shortest time allowed between the last run of an entry and its run due at
    ``due_ms``: half the gap back to the schedule's previous due time (a crontab's
    gaps differ: Friday comes one day after Thursday, Monday three after Friday)."""
    before = previous_due(sched, due_ms)
    return 0 if before is None else (due_ms - before) // 2


def gaps(sched: Any, runs: Sequence[int]) -> list[int]:
    """:func:`min_gap` of each of an entry's due times in a row (as :func:`plan`
    returns them: each after the one before it, which is its previous due time)."""
    return [
        min_gap(sched, due) if i == 0 else (due - runs[i - 1]) // 2 for i, due in enumerate(runs)
    ]


# -- the scheduler ----------------------------------------------------------------------


class Scheduler(beat.Scheduler):
    """Celery's scheduler, led by one of many beat processes under a fenced claim."""

    #: Time seams for tests: this host's wall clock (due times follow Redis's clock
    #: where this one runs ahead: :meth:`_clock_seen`), and the clock of the leaderless
    #: alarm.
    wall = staticmethod(time.time)
    clock = staticmethod(time.monotonic)

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.fenced = BeatOptions.of(app)
        self._claim: Claim | None = None
        self._keys = ClaimKeys.of(self.fenced.claim, self.fenced.namespace)
        self._catch_up: dict[str, CatchUp] = {}
        # The last time this process saw a leader (itself or another), for the alarm.
        self._led_at = self.clock()
        self._alarmed_at: float | None = None
        # The last tick of each entry this leader published (the value stored for it).
        self._published: dict[str, str] = {}
        # How far (ms) this process's clock ran ahead of Redis's at the last dispatch.
        self._ahead_ms = 0
        # Each entry's next due time as this leader last wrote it to Redis.
        self._shown: dict[str, int] = {}
        _start_metrics(app, self.fenced)
        super().__init__(app, *args, **kwargs)
        self._count("leading", False)

    # -- Celery's Scheduler interface ---------------------------------------------------

    def setup_schedule(self) -> None:
        """Celery's entries (``beat_schedule``), each entry's catch-up checked now."""
        super().setup_schedule()
        for name in self.schedule:
            self._catch_up_of(name)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Lead or stand by; as the leader, send what is due. Seconds until the next tick."""
        try:
            if not self._lead():
                self._alarm_if_leaderless()
                return self._capped(self.fenced.poll)
            self._led_at = self.clock()
            return self._tick_as_leader()
        except (ClaimUnavailable, *_UNREACHABLE) as exc:
            claim = self._claim
            if claim is not None and claim.held:
                # Nobody else can lead before its lease ends: a blip costs no failover.
                log.warning(
                    "fenced beat %s: Redis unreachable (%s): still leading while its lease "
                    "holds (%.1f s left)",
                    self.fenced.name,
                    exc,
                    claim.expires_in,
                )
            else:
                if claim is not None:  # its lease ended during this tick
                    self._step_down("its lease was lost")
                log.warning(
                    "fenced beat %s: Redis unreachable (%s): standing by", self.fenced.name, exc
                )
                self._alarm_if_leaderless()
        except Exception:
            # Anything else (a value in Redis fenced did not write): the lead goes to
            # another beat, and this one stays up as a stand-by.
            log.exception("fenced beat %s: tick failed; giving up the lead", self.fenced.name)
            self._give_up_lead()
        return self._capped(self.fenced.poll)

    def is_due(self, entry: Any) -> tuple[bool, float]:
        """Whether an entry is due by its last due time (as Redis held it at the last
        tick), and the seconds until it is next."""
        last = entry.last_run_at
        last_ms = _ms(last if last.tzinfo else last.replace(tzinfo=_UTC))
        wait = (next_due(entry.schedule, last_ms) - self._now_ms()) / 1000
        return wait <= 0, max(wait, 0.0) or self.fenced.poll

    def sync(self) -> None:
        """Nothing to keep: the schedule's state lives in Redis."""

    def close(self) -> None:
        """Give the lead up at once (shutdown, SIGTERM), then close as Celery does."""
        self._give_up_lead()
        super().close()

    def _give_up_lead(self) -> None:
        claim = self._lose_lead()
        if claim is not None:
            try:
                if claim.release():
                    log.info("fenced beat %s: gave up the lead", self.fenced.name)
            except Exception as exc:  # the lease then ends within its ttl
                log.warning("fenced beat %s: could not give up the lead: %s", self.fenced.name, exc)

    @property
    def info(self) -> str:
        """What ``celery beat`` prints at start."""
        return f"fenced: leader claim {self.fenced.claim!r}, lease {self.fenced.ttl:g}s"

    def _capped(self, wait: float) -> float:
        """At most Celery's ``beat_max_loop_interval``."""
        return min(wait, float(self.max_interval or wait))

    def _now_ms(self) -> int:
        """The time due times are compared with: this process's clock, less how far it
        was seen to run ahead of Redis's."""
        return round(self.wall() * 1000) - self._ahead_ms

    def _clock_seen(self, sent_ms: int, tick_ms: int) -> None:
        """Redis ran the dispatch at ``tick_ms`` (its clock), after this process's clock
        read ``sent_ms``: this clock runs ahead by at least the difference."""
        was, self._ahead_ms = self._ahead_ms, max(0, sent_ms - tick_ms)
        if self._ahead_ms > AHEAD_MS >= was:
            log.warning(
                "fenced beat %s: this host's clock runs %.1f s ahead of Redis's: due "
                "times follow Redis's clock",
                self.fenced.name,
                self._ahead_ms / 1000,
            )
        elif was > AHEAD_MS >= self._ahead_ms:
            log.info("fenced beat %s: this host's clock agrees with Redis's", self.fenced.name)

    # -- leading -----------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        """Whether this process holds the lead (by its local deadline)."""
        return self._claim is not None and self._claim.held

    def _lead(self) -> bool:
        claim = self._claim
        if claim is not None:
            if claim.held:
                return True
            self._step_down("its lease was lost")
        claim = Claim(
            lock_redis(self.app),
            self.fenced.claim,
            ttl=self.fenced.ttl,
            namespace=self.fenced.namespace,
            records=False,
            label="beat",
        )
        # One try that counts no skip: a stand-by's poll is not a skipped run.
        if not claim.acquire(blocking=True, timeout=0):
            if claim.holder is not None:
                self._led_at = self.clock()
                self._alarmed_at = None
            return False
        self._claim = claim
        self._count("leading", True)
        log.info("fenced beat %s: leading, fence %s", self.fenced.name, claim.fence)
        return True

    def _lose_lead(self) -> Claim | None:
        """Forget the lead (what it was granted and showed); the claim it held."""
        claim, self._claim = self._claim, None
        self._published.clear()
        self._shown.clear()
        self._count("leading", False)
        return claim

    def _step_down(self, why: str) -> None:
        claim = self._lose_lead()
        if claim is not None:
            log.warning(
                "fenced beat %s: no longer leading (fence %s): %s; standing by",
                self.fenced.name,
                claim.fence,
                why,
            )

    def _alarm_if_leaderless(self) -> None:
        now = self.clock()
        alarm = self.fenced.alarm
        if now - self._led_at < alarm:
            return
        if self._alarmed_at is not None and now - self._alarmed_at < alarm:
            return
        self._alarmed_at = now
        log.error(
            "fenced beat %s: no beat has led for %.0f s: nothing is being sent",
            self.fenced.name,
            now - self._led_at,
        )
        self._count("leaderless")

    # -- metrics -----------------------------------------------------------------------

    def _count(self, what: str, *more: Any) -> None:
        """Count on the beat metrics (``leading``: set whether it leads), when
        fenced.metrics is installed in this process (never imports it)."""
        installed = _metrics.installed()
        if installed is not None:
            getattr(installed.beat, what)(self.fenced.name, *more)

    # -- the leader's tick -------------------------------------------------------------

    def _tick_as_leader(self) -> float:
        claim = self._claim
        assert claim is not None and claim.token is not None
        client = lock_redis(self.app)
        stored, _tick, _upcoming = read_state(client, self._keys)
        now_ms = self._now_ms()
        # Granted ticks not known to be sent, a predecessor's or this leader's own (its
        # publish failed, or the script's answer never came): sent again, as the same
        # task ids. Its own that it published are marked sent again.
        resend: dict[str, str] = {}
        sent: dict[str, str] = {}
        for name, held in stored.items():
            if held.state == "pending" and name in self.schedule:
                mine = self._published.get(name) == held.raw
                (sent if mine else resend)[name] = held.raw
        triples: list[tuple[str, int, str]] = []
        for name, entry in self.schedule.items():
            state = stored.get(name)
            if state is None:
                triples.append((name, now_ms, "skip"))  # first seen: its cadence starts now
                continue
            entry.last_run_at = state.due
            runs, passed = plan(entry.schedule, state.due_ms, now_ms, self._catch_up_of(name))
            if passed is not None:
                triples.append((name, passed, "skip"))
            triples.extend(
                (name, due, str(gap)) for due, gap in zip(runs, gaps(entry.schedule, runs))
            )
        sent_ms = round(self.wall() * 1000)
        answer = self._dispatch(client, claim, triples)
        if answer is None:
            for name, _due, gap in triples:
                if gap != "skip":
                    self._count("refused", name)
            self._step_down("the dispatch script refused its token")
            return self._capped(self.fenced.poll)
        previous, tick, granted = answer
        self._clock_seen(sent_ms, tick)
        if previous is not None and self._new_leader(stored):
            silent = (tick - previous) / 1000
            if silent > self.fenced.alarm:
                log.error(
                    "fenced beat %s: no beat led for %.0f s before this one",
                    self.fenced.name,
                    silent,
                )
                self._count("leaderless")
        for name, value in resend.items():
            if self._send(name, EntryState.parse(value), claim):
                sent[name] = value
        for (name, due, gap), ok in zip(triples, granted, strict=True):
            if gap == "skip":
                if ok and name in stored:
                    log.info(
                        "fenced beat %s: %s passed over (due %s)", self.fenced.name, name, _at(due)
                    )
                continue
            if ok:
                value = f"{due}:{claim.fence}:pending"
                if self._send(name, EntryState.parse(value), claim):
                    sent[name] = value
        if sent:
            BEAT_SENT(client, [self._keys.beat], [x for pair in sent.items() for x in pair])
        # Each entry's last due time as stored now; the next wake counts every due time
        # asked for, granted or not, but one ahead of Redis's clock (asked again now that
        # this clock is known to run ahead).
        last = {name: state.due_ms for name, state in stored.items()}
        asked = dict(last)
        ahead = False
        for (name, due, gap), ok in zip(triples, granted, strict=True):
            if not ok and due > tick + AHEAD_MS:
                ahead = True
                continue
            asked[name] = max(due, asked.get(name, due))
            if ok or gap == "skip":
                last[name] = max(due, last.get(name, due))
        self._show_next(client, claim, last)
        if ahead:
            return self._capped(min(self.fenced.poll, 0.1))
        waits = [
            (next_due(e.schedule, asked[n]) - now_ms) / 1000
            for n, e in self.schedule.items()
            if n in asked
        ]
        return max(self._capped(min([self.fenced.poll, *waits])), 0.01)

    def _show_next(self, client: Any, claim: Claim, last: Mapping[str, int]) -> None:
        """Write each entry's next due time where ``fenced beat`` reads it, when it
        changed: for people to read (the dispatch script decides what is sent)."""
        changed: dict[str, int] = {}
        for name, entry in self.schedule.items():
            if name in last:
                due = next_due(entry.schedule, last[name])
                if self._shown.get(name) != due:
                    changed[name] = due
        if changed and claim.held:
            client.hset(self._keys.beat, mapping={f"next:{n}": d for n, d in changed.items()})
            self._shown.update(changed)

    def _new_leader(self, stored: Mapping[str, EntryState]) -> bool:
        claim = self._claim
        return claim is not None and not any(s.fence == claim.fence for s in stored.values())

    def _catch_up_of(self, name: str) -> CatchUp:
        if name not in self._catch_up:  # an entry added after start (Celery's add())
            entry = self.schedule[name]
            self._catch_up[name] = CatchUp.of(
                entry.options or {}, self.fenced.ttl, f"beat_schedule[{name!r}]"
            )
        return self._catch_up[name]

    def _dispatch(
        self, client: Any, claim: Claim, triples: Sequence[tuple[str, int, str]]
    ) -> tuple[int | None, int, list[int]] | None:
        """The script's answer: the previous tick (server ms), this one, and each
        triple's grant; None when the lead is no longer this claim's."""
        # A new id per call: redis-py's retry of this call sends the same one.
        call = secrets.token_hex(8)
        args: list[Any] = [claim.token, str(claim.fence), str(claim.options.idle_ms), call]
        for triple in triples:
            args.extend(triple)
        keys = [self._keys.lock, self._keys.fence, self._keys.beat]
        answer = BEAT_DISPATCH(client, keys, args)
        if int(answer[0]) != 1:
            return None
        # The previous tick as stored: what a writer of the claims' Redis planted there
        # reads as none (the silence it would measure is unknown), never as an error.
        previous = ms_or_none(answer[1])
        return previous, int(answer[2]), [int(x) for x in answer[3:]]

    def _send(self, name: str, state: EntryState | None, claim: Claim) -> bool:
        """Publish one granted tick; False when it could not be sent (retried next tick)."""
        entry = self.schedule.get(name)
        if entry is None or state is None:
            return True  # the entry left the schedule: nothing to send
        if not claim.held:
            # Paused past the lease since the grant: a new leader sends it instead.
            self._count("refused", name)
            return False
        options = {k: v for k, v in (entry.options or {}).items() if k not in ENTRY_OPTIONS}
        options["headers"] = {**options.get("headers", {}), "celery_beat_task": True}
        options["task_id"] = task_id(self.fenced.name, name, state.due_ms)
        args = tuple(_evaluated(v) for v in entry.args or ())
        kwargs = {k: _evaluated(v) for k, v in (entry.kwargs or {}).items()}
        log.info("Scheduler: Sending due task %s (%s) due %s", name, entry.task, state.due)
        try:
            task = self.app.tasks.get(str(entry.task))
            if task is not None:
                task.apply_async(args, kwargs, producer=self.producer, **options)
            else:
                self.send_task(entry.task, args, kwargs, producer=self.producer, **options)
        except Exception as exc:
            log.error("fenced beat %s: could not send %s: %s", self.fenced.name, name, exc)
            return False
        self._published[name] = state.raw
        self._count("dispatched", name)
        return True


_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)

#: The ports this process serves the beat's metrics on (one server per port).
_serving: set[int] = set()
_serving_lock = threading.Lock()


def _start_metrics(app: Any, opts: BeatOptions) -> None:
    """With ``fenced_metrics`` on: fenced.metrics installed in this process, and
    ``/metrics`` served on ``fenced_beat_metrics_port`` when it is set."""
    if not _metrics.settings(app)[0]:
        return
    from .. import metrics

    if metrics.installed() is None:
        metrics.install()
    port = opts.metrics_port
    if port is None:
        return
    with _serving_lock:
        if port in _serving:
            return
        where = _metrics.address(app)
        try:
            metrics.serve(port, where)
        except OSError as exc:
            log.error("fenced beat %s: metrics are not served on port %d: %s", opts.name, port, exc)
            return
        _serving.add(port)
    log.info("fenced beat %s: metrics served on port %d (address %s)", opts.name, port, where)


def _evaluated(value: Any) -> Any:
    """An entry's argument as sent: a ``celery.beat.BeatLazyFunc`` is called, as Celery does."""
    lazy = getattr(beat, "BeatLazyFunc", None)
    return value() if lazy is not None and isinstance(value, lazy) else value
