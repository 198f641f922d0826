"""Property test: no interleaving lets release or refresh touch another token's lease."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from fenced import Claim
from fenced.testing import RedisServer

N = 3


def _text(v: Any) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


@pytest.fixture
def machine_server(server: RedisServer) -> RedisServer:
    return server


def test_interleavings(machine_server: RedisServer) -> None:
    client = machine_server.client()

    class Interleavings(RuleBasedStateMachine):
        """Three claims on one name, plus an outsider that expires and steals the lease."""

        @initialize()
        def setup(self) -> None:
            client.flushall()
            self.claims = [Claim(client, "prop", ttl=30, heartbeat=False) for _ in range(N)]
            self.key = self.claims[0].key
            self.fences: list[int] = []

        def value(self) -> str | None:
            return _text(client.get(self.key))

        @rule(i=st.integers(0, N - 1))
        def acquire(self, i: int) -> None:
            c = self.claims[i]
            if c.held:
                return
            before = self.value()
            got = c.acquire()
            assert got == (before is None)
            if got:
                assert self.value() == c.token
                assert c.fence is not None
                assert not self.fences or c.fence > self.fences[-1]
                self.fences.append(c.fence)
            else:
                assert self.value() == before

        @rule(i=st.integers(0, N - 1))
        def release(self, i: int) -> None:
            c = self.claims[i]
            before = self.value()
            released = c.release()
            after = self.value()
            if before is not None and before != c.token:
                assert after == before, "release touched another token's lease"
                assert not released
            if released:
                assert before == c.token and after is None

        @rule(i=st.integers(0, N - 1))
        def refresh(self, i: int) -> None:
            c = self.claims[i]
            before, ttl_before = self.value(), client.pttl(self.key)
            ok = c.refresh()
            if before != c.token:
                assert not ok
                assert self.value() == before
                assert client.pttl(self.key) <= ttl_before or ttl_before < 0

        @rule()
        def expire(self) -> None:
            client.delete(self.key)

        @rule(n=st.integers(0, 9))
        def steal(self, n: int) -> None:
            client.set(self.key, f"outsider-{n}", px=30_000)

        @invariant()
        def at_most_one_believes_and_is_right(self) -> None:
            value = self.value() if hasattr(self, "key") else None
            for c in getattr(self, "claims", []):
                if c.held and c.token != value:
                    # It may still believe (no refresh yet), but it must find out on refresh.
                    assert not c.refresh()

    Interleavings.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    Interleavings.TestCase().runTest()
