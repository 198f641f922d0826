"""A worker process: compete for the claim, work in steps, write under the fence.

``python -m chaos.worker --id w3 --lane fenced --front claim --lock-url URL`` (the
harness starts them; the rest of the settings come in ``CHAOS_SHARED``). Front ends:

- ``claim``: ``fenced.Claim``, alternating the explicit form (``acquire()``, ``steps``,
  ``release()``, whose answer is logged) and the ``with Claim(...)`` form;
- ``exclusive``: a function under ``@fenced.exclusive``. The decorator hands the
  function no claim, so the function reads its fence with ``read_holder`` and checks,
  before each step, that the lease in Redis is still its own;
- ``lock``: redis-py's ``Lock``, the baseline, used as carefully as it allows: a thread
  renews it every ttl/3 with ``reacquire()``, the work stops between steps once a
  renewal is refused or none was confirmed within the ttl, and writes carry no fence.

Every event goes to this process's own log (see ``chaos.events``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any

import redis
import redis.exceptions
import redis.lock

from fenced import (
    Claim,
    ClaimHeld,
    ClaimLost,
    ClaimUnavailable,
    Skipped,
    exclusive,
    read_holder,
)

from .config import Shared
from .events import EventLog
from .stores import Stores

__all__ = ["Work", "main"]


class Work:
    """One holder's work: steps, each checked first, each followed by three writes."""

    def __init__(self, shared: Shared, log: EventLog, stores: Stores) -> None:
        self.shared = shared
        self.log = log
        self.stores = stores
        self.holds = 0
        self.rng = random.Random()

    def next_hold(self) -> int:
        """A number for the next holding of this process."""
        self.holds += 1
        return self.holds

    def holding(self, hold: int, fence: int | None, check: Callable[[], None]) -> None:
        """Work in steps: check, work (sleep), write everywhere. ClaimLost ends it, logged."""
        for step in range(self.shared.steps):
            before = time.monotonic()
            try:
                check()
            except ClaimLost as exc:
                self.log.emit("lost", hold=hold, how="check", reason=str(exc)[:200])
                raise
            # Logged with the time taken *before* check() passed: the claim was held then.
            self.log.emit("step", t=before, hold=hold, step=step, fence=fence)
            try:
                time.sleep(self.rng.uniform(self.shared.step_min, self.shared.step_max))
                for store in self.stores.names:
                    self.write(hold, step, store, fence)
            except ClaimLost as exc:
                # Celery's interrupt (ClaimInterrupted) lands wherever the work is.
                self.log.emit("lost", hold=hold, how="interrupted", reason=str(exc)[:200])
                raise

    def write(self, hold: int, step: int, store: str, fence: int | None) -> None:
        """One write, logged before and after (a process killed between leaves no result)."""
        wid = f"{self.log.fixed['w']}.{os.getpid()}.{hold}.{step}"
        t0 = self.log.emit("writing", hold=hold, store=store, wid=wid, fence=fence)
        try:
            accepted = self.stores.write(store, wid, fence)
        except ClaimLost:
            raise  # an interrupt (Celery's ClaimInterrupted) stops the work; no result
        except Exception as exc:
            self.log.emit(
                "write", hold=hold, store=store, wid=wid, fence=fence, t0=t0,
                result="error", error=repr(exc)[:200],
            )  # fmt: skip
            return
        self.log.emit(
            "write", hold=hold, store=store, wid=wid, fence=fence, t0=t0,
            result="accepted" if accepted else "stale",
        )  # fmt: skip


class Worker:
    """The loop of one worker process."""

    def __init__(self, args: argparse.Namespace, shared: Shared) -> None:
        self.args = args
        self.shared = shared
        self.stopping = threading.Event()
        self.log = EventLog(
            os.path.join(shared.log_dir, f"{args.id}.{os.getpid()}.jsonl"),
            w=args.id,
            lane=args.lane,
            front=args.front,
            pid=os.getpid(),
        )
        self.work = Work(shared, self.log, Stores(shared, args.lane))
        # A socket timeout as Celery's lock client has: long enough to see a grant that
        # arrives late, short enough not to hang on a dead connection.
        self.client = redis.Redis.from_url(
            args.lock_url, socket_timeout=5.0, socket_connect_timeout=5.0
        )
        self.rng = random.Random()

    def stop(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()

    def run(self) -> None:
        self.log.emit("started", lock_url=self.args.lock_url)
        front = self.args.front
        loop: Callable[[int], bool] = (
            self.exclusive_once()
            if front == "exclusive"
            else self.claim_once
            if front == "claim"
            else self.lock_once
        )
        n = 0
        while not self.stopping.is_set():
            n += 1
            try:
                held = loop(n)
            except ClaimUnavailable as exc:
                self.log.emit("unavailable", error=str(exc)[:200])
                held = False
                time.sleep(self.rng.uniform(0.05, 0.15))
            # Busy: look again soon. After a holding: step back, let others have a turn.
            time.sleep(self.rng.uniform(0.02, 0.08) if not held else self.rng.uniform(0.05, 0.2))
        self.log.emit("stopped")

    # -- Claim --------------------------------------------------------------------------

    def claim_once(self, _n: int) -> bool:
        claim = Claim(self.client, self.shared.name, ttl=self.shared.ttl)
        # One holding in each form, in turn.
        if self.work.holds % 2 == 0:
            return self._explicit(claim)
        return self._with(claim)

    def _explicit(self, claim: Claim) -> bool:
        sent = time.monotonic()
        if not claim.acquire():
            return False
        hold = self.work.next_hold()
        self.log.emit("acquired", hold=hold, fence=claim.fence, sent=sent, form="explicit")
        try:
            self.work.holding(hold, claim.fence, claim.check)
        except ClaimLost:
            pass
        finally:
            self.log.emit("releasing", hold=hold)
            released = claim.release()
            self.log.emit("released", hold=hold, ok=released)
        return True

    def _with(self, claim: Claim) -> bool:
        sent = time.monotonic()
        hold = 0
        try:
            with claim:
                hold = self.work.next_hold()
                self.log.emit("acquired", hold=hold, fence=claim.fence, sent=sent, form="with")
                try:
                    self.work.holding(hold, claim.fence, claim.check)
                except ClaimLost:
                    pass  # logged; the block ends and releases with the outcome "lost"
                self.log.emit("releasing", hold=hold)
        except ClaimHeld:
            return False
        except ClaimLost as exc:
            # The block finished, but the claim had been lost meanwhile.
            self.log.emit("lost", hold=hold, how="with-exit", reason=str(exc)[:200])
            self.log.emit("released", hold=hold, ok=False)
            return True
        # The block ended without ClaimLost: the claim says the work ran under it.
        self.log.emit("released", hold=hold, ok=True)
        return True

    # -- @exclusive ---------------------------------------------------------------------

    def exclusive_once(self) -> Callable[[int], bool]:
        name, client, pid = self.shared.name, self.client, os.getpid()
        state: dict[str, Any] = {}

        @exclusive(name, redis=client, ttl=self.shared.ttl, on_busy="skip")
        def job() -> str:
            state["acked"] = time.monotonic()
            hold = state["hold"] = self.work.next_hold()
            try:
                holder = read_holder(client, name)
            except ClaimUnavailable:
                holder = None
            fence = holder.fence if holder is not None and holder.pid == pid else None
            self.log.emit("acquired", t=state["acked"], hold=hold, fence=fence, sent=state["sent"])
            if fence is None:
                self.log.emit("lost", hold=hold, how="holder-changed")
                state["lost"] = True
                return "lost"

            def check() -> None:
                try:
                    now = read_holder(client, name)
                except ClaimUnavailable as exc:
                    raise ClaimLost(f"cannot read the holder: {exc}", name=name) from exc
                if now is None or now.pid != pid or now.fence != fence:
                    raise ClaimLost(f"the holder is now {now}", name=name)

            try:
                self.work.holding(hold, fence, check)
            except ClaimLost:
                state["lost"] = True
                return "lost"
            self.log.emit("releasing", hold=hold)
            return "done"

        def once(_n: int) -> bool:
            state.clear()
            state["sent"] = time.monotonic()
            try:
                result = job()
            except ClaimLost as exc:
                # The function returned, but the claim was lost while it ran.
                if not state.get("lost"):
                    self.log.emit(
                        "lost", hold=state.get("hold", 0), how="wrapper", reason=str(exc)[:200]
                    )
                self.log.emit("released", hold=state.get("hold", 0), ok=False)
                return True
            if isinstance(result, Skipped):
                return False
            # No ClaimLost: the decorator says the function ran under its claim.
            self.log.emit("released", hold=state.get("hold", 0), ok=True)
            return True

        return once

    # -- redis-py Lock (the baseline) ---------------------------------------------------

    def lock_once(self, _n: int) -> bool:
        ttl = self.shared.ttl
        lock = redis.lock.Lock(self.client, self.shared.lock_name, timeout=ttl, thread_local=False)
        sent = time.monotonic()
        token = f"{uuid.uuid4().hex}:{os.getpid()}"
        try:
            if not lock.acquire(blocking=False, token=token):
                return False
        except redis.exceptions.RedisError as exc:
            raise ClaimUnavailable(f"lock: {exc!r}", name=self.shared.lock_name) from exc
        hold = self.work.next_hold()
        self.log.emit("acquired", hold=hold, fence=None, sent=sent)
        lost = threading.Event()
        done = threading.Event()
        confirmed = [sent]  # when the last confirmed renewal (or the acquire) was sent

        def renew() -> None:
            while not done.wait(ttl / 3):
                asked = time.monotonic()
                try:
                    lock.reacquire()
                    confirmed[0] = asked
                except redis.exceptions.LockNotOwnedError:
                    lost.set()
                    return
                except redis.exceptions.RedisError:
                    pass  # not refused: try again; the deadline below still holds

        renewer = threading.Thread(target=renew, daemon=True)
        renewer.start()

        def check() -> None:
            if lost.is_set() or time.monotonic() >= confirmed[0] + ttl:
                raise ClaimLost("the lock was lost", name=self.shared.lock_name)

        try:
            self.work.holding(hold, None, check)
        except ClaimLost:
            pass
        finally:
            self.log.emit("releasing", hold=hold)
            done.set()
            renewer.join()
            try:
                lock.release()
                released = True
            except redis.exceptions.RedisError:
                released = False
            self.log.emit("released", hold=hold, ok=released)
        return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m chaos.worker")
    parser.add_argument("--id", required=True)
    parser.add_argument("--lane", choices=("fenced", "lock"), required=True)
    parser.add_argument("--front", choices=("claim", "exclusive", "lock"), required=True)
    parser.add_argument("--lock-url", required=True)
    args = parser.parse_args(argv)
    worker = Worker(args, Shared.from_env())
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    worker.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
