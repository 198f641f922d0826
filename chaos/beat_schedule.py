"""The beat lane's schedule, shared by its Celery app (chaos/beat_app.py) and its checker.

Three entries, each sent by fenced's beat scheduler to a worker that notes every run:

==================  ==========================================  =====================
entry               schedule                                    catch-up
==================  ==========================================  =====================
``tick-1s``         every second                                ``all``: every tick
``cron-seconds``    a crontab firing at uneven seconds           ``skip`` (default)
                    (:data:`SECONDS`: gaps of 1 to 15 s)
``cron-minutes``    ``crontab(minute=...)``: gaps of 1 and 2 min ``skip`` (default)
==================  ==========================================  =====================

Celery's ``crontab`` has minute granularity; :class:`SecondsCrontab` is a crontab whose
due times fall on given seconds of every minute (its ``remaining_delta``, which fenced's
scheduler reads, as it reads a crontab's), so that an uneven calendar fires many times
in a short run.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from celery.schedules import crontab, schedule

__all__ = ["BEAT_NAME", "BEAT_TTL", "ENTRIES", "SECONDS", "SecondsCrontab", "entries"]

#: The beat's name (``fenced_beat_name``): its claim is ``beat:chaos``, its task ids
#: ``fenced-beat:chaos:<entry>:<due ms>``.
BEAT_NAME = "chaos"
#: The leader's lease (``fenced_beat_ttl``), seconds.
BEAT_TTL = 1.5
#: The seconds of every minute ``cron-seconds`` is due at: gaps 2, 1, 4, 8, 1, 3, 11, 15, 15.
SECONDS = (0, 2, 3, 7, 15, 16, 19, 30, 45)
#: The minutes of every hour ``cron-minutes`` is due at: gaps of 1 and 2 minutes.
MINUTES = ",".join(str(m) for m in range(60) if m % 3 != 2)


class SecondsCrontab(crontab):
    """A crontab due at :data:`SECONDS` of every minute."""

    def __init__(self, seconds: tuple[int, ...] = SECONDS, **kw: Any) -> None:
        super().__init__(**kw)
        self.seconds = tuple(sorted(seconds))

    def remaining_delta(
        self, last_run_at: datetime, tz: Any = None, ffwd: Any = None
    ) -> tuple[datetime, Any, datetime]:
        """From ``last_run_at`` to the next of its seconds after it (ms dropped)."""
        base = last_run_at.replace(microsecond=0)
        for s in (*self.seconds, 60 + self.seconds[0]):
            due = base.replace(second=0) + timedelta(seconds=s)
            if due > last_run_at:
                return last_run_at, due - last_run_at, self.now()
        raise AssertionError("unreachable")  # pragma: no cover

    def __reduce__(self) -> Any:
        return (self.__class__, (self.seconds,), None)

    def __repr__(self) -> str:
        return f"<SecondsCrontab: {self.seconds}>"


def entries() -> dict[str, dict[str, Any]]:
    """Each entry's schedule and catch-up (``fenced_catch_up``)."""
    return {
        "tick-1s": {"schedule": schedule(1.0), "catch_up": "all"},
        "cron-seconds": {"schedule": SecondsCrontab(), "catch_up": "skip"},
        "cron-minutes": {"schedule": crontab(minute=MINUTES), "catch_up": "skip"},
    }


ENTRIES = tuple(entries())
