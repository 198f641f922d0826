"""What every front end shares: a busy `with` never runs its body, an abandoned claim
expires, reading state never acts."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest

from fenced import Claim, ClaimHeld, ClaimLost, ConfigError
from fenced._heartbeat import heartbeat
from fenced._lease import short_token


def test_with_a_busy_claim_raises_claim_held_and_never_runs_the_body(r: Any) -> None:
    holder = Claim(r, "busy-with", ttl=5)
    assert holder.acquire()
    ran = []
    with pytest.raises(ClaimHeld) as info, Claim(r, "busy-with", ttl=5):
        ran.append(True)
    assert ran == []
    err = info.value
    assert err.name == "busy-with"
    assert err.fence == holder.fence
    assert err.expires_in is not None and 0 < err.expires_in <= 5
    assert "busy-with" in str(err)
    holder.release()


def test_the_skip_idiom_is_explicit(r: Any) -> None:
    holder = Claim(r, "skip-idiom", ttl=5)
    assert holder.acquire()
    ran = []
    other = Claim(r, "skip-idiom", ttl=5)
    if other.acquire():
        with other:
            ran.append("other")
    assert (
        ran == [] and other.holder is not None and other.holder.token == short_token(holder.token)
    )
    holder.release()
    # A claim already acquired enters without a second acquire and releases on exit.
    if other.acquire():
        with other as same:
            assert same is other and other.held
            ran.append("other")
    assert ran == ["other"]
    assert r.get(other.key) is None


def test_a_claim_nobody_references_stops_being_renewed(r: Any) -> None:
    def abandon() -> str:
        # A short lease: Redis drops it 0.3 s after the last renewal (every 0.1 s).
        claim = Claim(r, "abandoned", ttl=0.3)
        assert claim.acquire()
        key: str = claim.key
        return key  # the claim goes out of scope, never released

    key = abandon()
    gc.collect()
    deadline = time.monotonic() + 5
    while r.get(key) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.get(key) is None, "an abandoned claim is still renewed"
    assert not any(c.name == "abandoned" for c in heartbeat().claims())


def test_an_abandoned_claim_in_a_reference_cycle_expires_after_gc(r: Any) -> None:
    class Job:
        def __init__(self) -> None:
            self.claim = Claim(r, "abandoned-cycle", ttl=0.3, on_lost=self.lost)

        def lost(self, _claim: Claim) -> None:
            pass

    def run() -> str:
        job = Job()
        assert job.claim.acquire()
        raise RuntimeError(job.claim.key)

    with pytest.raises(RuntimeError) as info:
        run()
    key = str(info.value)
    del info
    gc.collect()
    deadline = time.monotonic() + 5
    while r.get(key) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.get(key) is None


def test_reading_state_never_fires_callbacks(r: Any) -> None:
    now = [100.0]
    fired: list[Claim] = []
    c = Claim(r, "read-only", ttl=10, heartbeat=False, on_lost=fired.append, clock=lambda: now[0])
    assert c.acquire()
    now[0] += 20
    for _ in range(3):
        assert c.lost is True
        assert c.held is False
        assert not c
        assert c.expires_in == 0.0
        repr(c)
    assert fired == []
    with pytest.raises(ClaimLost):
        c.check()
    assert fired == [c]
    with pytest.raises(ClaimLost):
        c.check()
    assert fired == [c], "a lost claim fires on_lost once"
    c.release()


@pytest.mark.parametrize(
    "kwargs",
    [{"ttl": 10, "refresh_every": 0}, {"ttl": -1}, {"ttl": 5, "refresh_every": 5}],
)
def test_timing_is_checked_by_one_validator(r: Any, kwargs: dict[str, Any]) -> None:
    from fenced._lease import check_timing

    with pytest.raises(ConfigError) as direct:
        check_timing(kwargs["ttl"], kwargs.get("refresh_every"))
    with pytest.raises(ConfigError) as via_claim:
        Claim(r, "timing", **kwargs)
    assert str(direct.value) in str(via_claim.value)
