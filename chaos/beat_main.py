"""``python -m chaos.beat_main -A chaos.beat_app beat ...``: ``celery`` with this
process's wall clock offset, as a host whose clock runs ahead.

The offset (seconds) is read from the file named by ``CHAOS_CLOCK_FILE`` (missing or
empty: 0), again at most every 0.1 s, so that the nemesis can move the clock of a
running beat. ``time.time`` is replaced before Celery and fenced are imported: every
reader of this process's wall clock sees the offset (``datetime.now`` reads the system
clock directly and does not; fenced's scheduler reads ``time.time``).
"""

from __future__ import annotations

import os
import sys
import time

_real_time = time.time
_path = os.environ.get("CHAOS_CLOCK_FILE", "")
_cache = [0.0, -1.0]  # offset, monotonic time it was read


def offset() -> float:
    """This process's clock offset now, in seconds."""
    now = time.monotonic()
    if now - _cache[1] >= 0.1:
        _cache[1] = now
        try:
            with open(_path) as f:
                text = f.read().strip()
            _cache[0] = float(text) if text else 0.0
        except (OSError, ValueError):
            _cache[0] = 0.0
    return _cache[0]


def skewed_time() -> float:
    """The wall clock, ahead by :func:`offset`."""
    return _real_time() + offset()


def main() -> None:
    if _path:
        time.time = skewed_time
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *sys.argv[1:]]
    celery_main()


if __name__ == "__main__":
    main()
