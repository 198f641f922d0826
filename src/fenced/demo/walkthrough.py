"""A short walkthrough of one claim's life on an embedded Redis, printed as it happens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging.handlers import BufferingHandler

from .. import Claim, ClaimLost
from ..testing import RedisServer, available_binaries


class _Records(BufferingHandler):
    """Keeps what fenced logs, so the tour can say it in its own words."""

    def take(self) -> list[str]:
        taken = [f"{r.levelname} {r.getMessage()}" for r in self.buffer]
        self.buffer.clear()
        return taken


@contextmanager
def _fenced_log() -> Iterator[_Records]:
    """Route the ``fenced`` logger here for the tour (not to stderr, where a loss the
    tour provokes on purpose would read as a stray warning)."""
    logger = logging.getLogger("fenced")
    handler = _Records(capacity=1_000_000)  # never flushed: the tour takes what it kept
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved


def run(say: Callable[[str], None] = print) -> int:
    """Two claims contend for one resource; returns 0 when every expectation held."""
    binaries = available_binaries()
    binary = binaries.get("bundled") or binaries.get("system")
    failures = 0

    def expect(ok: bool, what: str) -> None:
        nonlocal failures
        say(("  ok    " if ok else "  FAIL  ") + what)
        failures += 0 if ok else 1

    with _fenced_log() as logged, RedisServer(binary, unix=True) as server:
        say(f"embedded redis-server {server.version()} at {server.url}")
        r = server.client()
        a = Claim(r, "rebuild:incidents", ttl=1.0)
        b = Claim(r, "rebuild:incidents", ttl=1.0)
        expect(a.acquire(), f"worker A acquires 'rebuild:incidents' (fence {a.fence})")
        expect(not b.acquire(), f"worker B is refused: held by {b.holder}")
        say("  ..    A works for 3 s, three times the 1 s ttl; the heartbeat renews it")
        time.sleep(3.0)
        expect(a.held and r.pttl(a.key) > 0, "A still holds the claim")
        expect(a.release(), "A releases (compare-and-delete on its own token)")
        expect(b.acquire(), f"B acquires (fence {b.fence} > {a.fence})")
        expect((b.fence or 0) > (a.fence or 0), "the fence only goes up")
        expect(logged.take() == [], "nothing logged so far")
        say("  ..    an operator overwrites B's lease with another token")
        r.set(b.key, "someone-else", px=5000)
        try:
            b.refresh()
            b.check()
            expect(False, "B notices its lease was taken")
        except ClaimLost:
            expect(True, "B notices its lease was taken: ClaimLost")
        lines = logged.take()
        lost = [line for line in lines if line.startswith("WARNING") and "lost" in line]
        expect(len(lost) == 1 == len(lines), "fenced logs the loss once, as a warning:")
        for line in lines:
            say(f"          {line}")
        expect(not b.release(), "B's release leaves the other holder's lease alone")
        expect(r.get(b.key) == b"someone-else", "the other holder still holds it")
        for line in logged.take():
            expect(False, f"nothing else logged: {line}")
    say("all expectations held" if failures == 0 else f"{failures} expectation(s) failed")
    return 0 if failures == 0 else 1
