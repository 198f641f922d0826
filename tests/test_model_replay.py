"""The model's traces replayed on the real scripts, step by step, on a real Redis.

``make model`` simulates spec/fenced.qnt and writes 200 traces of its replay
configuration (restarts, idle expiry of the fence, operator releases, pauses, failovers
with and without replicas) and 100 of holders paused past their lease (their writes
landing late) to spec/traces/. Each step is sent to Redis as the code
sends it (ACQUIRE, REFRESH, RELEASE, FORCE_RELEASE, a RedisPointer swap, the beat's
BEAT_DISPATCH and BEAT_SENT) or to a FilePointer, and after every step the replay
compares what the model says with what Redis and the stores hold: the lease's holder,
whether each call was granted, refused or accepted, the order of the fences granted,
which holder each pointer last accepted, and the beat entry's stored due time, fence
and state.

What the replay does itself, for want of a clock it can move and of a replica it can
lose writes on: a lease the model says has expired is deleted (Redis would expire it),
a restart deletes the claim's lease and fence (what a Redis without persistence forgets
of them), the fence key's idle expiry deletes the fence key, and the replica is a copy
of the name's keys (DUMP) taken whenever the model's replica catches up: a failover puts
that copy back (RESTORE) in place of what the master had since. A grant, renewal, swap
or release the replica acknowledged (``replicas=1``) takes the copy after it; a grant it
did not is given back, as the claim gives it back (RELEASE).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fenced import ClaimOptions, StaleFence
from fenced._lease import ClaimKeys, LeaseCalls, granted_reply, new_token, released
from fenced._scripts import BEAT_DISPATCH, BEAT_SENT, FORCE_RELEASE, as_text
from fenced.store import FilePointer, RedisPointer
from fenced.testing import RedisServer
from model_itf import action, live_lease, load, picks, trace_files

FILES = trace_files()
#: The beat's entry, and the ms between two of the model's due times (its dispatch asks
#: for a gap of one step: a due time is granted only after the stored one).
ENTRY = "e"
STEP_MS = 1000

pytestmark = pytest.mark.skipif(
    not FILES, reason="no model traces in spec/traces: run `make model` to write them"
)


class Replay:
    """One trace's real counterpart: the model's tokens as real ones, their fences."""

    def __init__(self, client: Any, namespace: str, directory: Path) -> None:
        self.client = client
        self.keys = ClaimKeys.of("model", namespace=namespace)
        self.calls = LeaseCalls(self.keys, ClaimOptions(ttl=60))
        self.tokens: dict[int, str] = {}
        self.fences: dict[int, int] = {}  # model token -> real fence
        self.model_fences: dict[int, int] = {}  # model token -> model fence
        self.directory = directory
        self.store = FilePointer(directory / "store")
        self.pointer = RedisPointer(client, "model", namespace=namespace)
        k = self.keys
        self.replicated = [k.lock, k.fence, k.pointer, k.pointer_log, k.beat]
        # Tokens whose grant the replay gave back (RELEASE wrote a note the model has not).
        self.given_back: set[int] = set()
        self.replica: dict[str, bytes] = {}
        # Due time 0 of the model, in ms: long enough ago that every due time the trace
        # asks for is behind Redis's clock (the script refuses one more than 1 s ahead).
        seconds, micros = client.time()
        self.base_ms = int(seconds) * 1000 + int(micros) // 1000 - 10**8

    def notes(self) -> list[str]:
        """The release notes' keys, one per token granted."""
        return [self.keys.released(token) for token in self.tokens.values()]

    def copy_to_replica(self) -> None:
        """The replica catches up: a copy of the name's keys as the master has them."""
        self.replica = {}
        for key in [*self.replicated, *self.notes()]:
            dumped = self.client.dump(key)
            if dumped is not None:
                self.replica[key] = dumped

    def fail_over(self) -> None:
        """The replica is promoted: the master's keys become the copy."""
        self.client.delete(*self.replicated, *self.notes())
        for key, dumped in self.replica.items():
            self.client.restore(key, 0, dumped)

    def holder(self) -> str | None:
        value = self.client.get(self.keys.lock)
        return None if value is None else as_text(value)

    def token_of(self, real: str | None) -> int:
        """The model token of a real one (0 for none)."""
        if real is None:
            return 0
        found = [t for t, tok in self.tokens.items() if tok == real]
        assert found, f"Redis holds a lease of a token the model never granted: {real}"
        return found[0]

    def step(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        """Send one step of the model to Redis (or a store) and compare the answer."""
        name = action(after)
        chosen = picks(after)
        p = chosen.get("p", "")
        me = before["procs"].get(p, {})
        # With replicas, what the replica acknowledged it has, with all before it.
        acknowledged = after["cfg"]["replicas"] > 0 and chosen.get("acked", False)
        if name == "acquire":
            self.acquire(before, after, p)
        elif name == "renew":
            token = me["token"]
            reply = self.send(self.calls.refresh_call(self.tokens[token]))
            extended = live_lease(before) == token
            assert (reply == 1) == extended, f"REFRESH answered {reply!r}, model: {extended}"
            assert (after["procs"][p]["token"] != 0) == extended
        elif name == "landWrite":
            self.land(before, after, me["pending"])
        elif name in ("release", "releaseRetry"):
            # A retry (its first reply lost) is the same call again: the note answers it.
            token = me["token"] if name == "release" else me["retry"]
            call = self.calls.release_call(self.tokens[token], "", "ok", self.fences[token])
            ours = released(self.send(call))[0]
            expected = after["lastRelease"]["answer"]
            assert ours == expected, f"{name.upper()} of {token}: {ours}, model: {expected}"
        elif name == "forceRelease":
            k = self.keys
            answer = FORCE_RELEASE(
                self.client, [k.lock, k.records, k.fence], ["", "", 1000, "", "", "", 0]
            )
            deleted = self.token_of(as_text(answer[0]) or None)
            assert deleted == live_lease(before), "FORCE_RELEASE deleted another lease"
        elif name == "restart":
            forgotten = (self.keys.lock, self.keys.fence, self.keys.beat, *self.notes())
            self.client.delete(*forgotten)
            for key in forgotten:
                self.replica.pop(key, None)
        elif name == "idleExpire":
            self.client.delete(self.keys.fence)
        elif name == "failover":
            self.fail_over()
        elif name == "clockBack":
            raise AssertionError(f"{name} is not in the replay configuration")
        elif name == "dispatch":
            self.dispatch(before, after, p, int(chosen["back"]))
        elif name == "sendTick":
            tick = me["tick"]
            value = f"{self.due_ms(tick['due'])}:{self.real_fence(tick['fence'])}:pending"
            marked = BEAT_SENT(self.client, [self.keys.beat], [ENTRY, value])
            expected = after["master"]["beatState"] != before["master"]["beatState"]
            assert (marked == 1) == expected, f"BEAT_SENT marked {marked}, model: {expected}"
        # tick, expireLocally, startWrite, takeOver, checkTick, crash: nothing to send
        if name == "replicate" or (acknowledged and after["replica"] == after["master"]):
            self.copy_to_replica()
        self.compare(after)

    def send(self, call: Any) -> Any:
        script, keys, args = call
        return script(self.client, keys, args)

    def acquire(self, before: dict[str, Any], after: dict[str, Any], p: str) -> None:
        model_token = int(before["nextToken"])
        token = new_token()
        reply = granted_reply(self.send(self.calls.acquire_call(token, "", "", "", None)))
        free = live_lease(before) == 0
        assert (int(reply[0]) == 1) == free, f"ACQUIRE answered {reply!r}, model free: {free}"
        if not free:
            return
        fence = int(reply[1])
        model_fence = int(after["master"]["fence"])
        if after["procs"][p]["token"] == 0:
            # Not acknowledged by the replica: the claim gives the grant back.
            self.tokens[model_token] = token
            self.given_back.add(model_token)
            self.send(self.calls.release_call(token, "", "lost", fence))
            return
        # The order of the fences is the model's: each new one above every earlier one.
        for t, earlier in self.fences.items():
            assert (earlier < fence) == (self.model_fences[t] < model_fence), (
                f"fence order: {t}@{earlier} then {model_token}@{fence} on Redis, "
                f"{self.model_fences[t]} then {model_fence} in the model"
            )
        self.tokens[model_token] = token
        self.fences[model_token] = fence
        self.model_fences[model_token] = model_fence

    def due_ms(self, due: int) -> int:
        return self.base_ms + due * STEP_MS

    def real_fence(self, model_fence: int) -> int:
        """The real fence of the grant the model gave ``model_fence``."""
        found = [t for t, f in self.model_fences.items() if f == model_fence]
        assert len(found) == 1, f"grants of model fence {model_fence} replayed: {found}"
        return self.fences[found[0]]

    def dispatch(self, before: dict[str, Any], after: dict[str, Any], p: str, back: int) -> None:
        """BEAT_DISPATCH of the entry's next due time, as the leader asks for it."""
        me = before["procs"][p]
        due = max(1, before["master"]["beatDue"] + 1 - back)
        token = me["token"]
        # As the beat sends it: the name's idle expiry (the script gives the beat's key it).
        args = [self.tokens[token], str(self.fences[token]), str(self.calls.opts.idle_ms),
                new_token(), ENTRY, str(self.due_ms(due)), str(STEP_MS)]  # fmt: skip
        k = self.keys
        answer = BEAT_DISPATCH(self.client, [k.lock, k.fence, k.beat], args)
        leads = live_lease(before) == token and before["master"]["fence"] == me["fence"]
        assert (int(answer[0]) == 1) == leads, f"BEAT_DISPATCH answered {answer!r}, leads: {leads}"
        granted = after["procs"][p]["tick"]["due"] != 0
        if leads:
            assert (int(answer[3]) == 1) == granted, (
                f"BEAT_DISPATCH of due {due} granted {answer[3]}, model: {granted}"
            )

    def land(self, before: dict[str, Any], after: dict[str, Any], write: dict[str, Any]) -> None:
        accepted = after["refused"] == before["refused"]
        target = self.target(write["token"])
        if not Path(target).exists():
            Path(target).write_text(target)  # the output, written before its swap
        fence = self.fences[write["token"]]
        sink = self.store if write["dest"] == "store" else self.pointer
        try:
            sink.swap(target, fence=fence)
            landed = True
        except StaleFence:
            landed = False
        assert landed == accepted, f"{write['dest']} swap at {fence}: {landed}, model: {accepted}"

    def target(self, token: int) -> str:
        """What a holder publishes: its own output file."""
        return str(self.directory / f"t{token}")

    def compare(self, after: dict[str, Any]) -> None:
        """What Redis and the stores hold, against the model's state."""
        expected = live_lease(after)
        real = self.holder()
        if real is not None and expected == 0:
            # The model's lease ran out: Redis would have expired the key by now.
            token = self.token_of(real)
            assert token == after["master"]["lease"], f"lease {token} held, model: free"
            assert after["master"]["expires"] <= after["now"], "a live lease is gone"
            self.client.delete(self.keys.lock)
            real = None
        assert self.token_of(real) == expected, f"holder {self.token_of(real)}, model {expected}"
        stored = self.store.read()
        want = after["store"]["token"]
        assert (stored.target if stored else None) == (self.target(want) if want else None)
        published = self.pointer.read()
        want = after["master"]["ptrToken"]
        assert (published.target if published else None) == (self.target(want) if want else None)
        noted = {t for t in self.tokens if t not in self.given_back
                 and self.client.exists(self.keys.released(self.tokens[t]))}  # fmt: skip
        assert noted == set(after["master"]["notes"]), (
            f"release notes of {sorted(noted)}, model: {after['master']['notes']}"
        )
        beat = after["master"]
        entry = self.client.hget(self.keys.beat, f"entry:{ENTRY}")
        if not beat["beatState"]:
            assert entry is None, f"beat entry {entry!r}, model: none"
        else:
            value = (f"{self.due_ms(beat['beatDue'])}:{self.real_fence(beat['beatFence'])}:"
                     f"{beat['beatState']}")  # fmt: skip
            assert as_text(entry) == value, f"beat entry {entry!r}, model: {value}"


@pytest.mark.parametrize("path", FILES, ids=[p.name.split(".")[0] for p in FILES])
def test_trace_replays_on_the_scripts(
    path: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Every step of the trace gets the model's answer from the real scripts."""
    states = load(path)
    replay = Replay(redis_server.client(), f"fm-{path.name.split('.')[0]}", tmp_path)
    for i in range(1, len(states)):
        try:
            replay.step(states[i - 1], states[i])
        except AssertionError as exc:
            raise AssertionError(f"{path.name}, step {i} ({action(states[i])}): {exc}") from exc
