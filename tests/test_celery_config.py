"""ClaimedTask without a worker: definition-time checks, settings, the lock Redis, and
runs called directly or eagerly in this process (including interrupts)."""

from __future__ import annotations

import pickle
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import celery
import pytest
from celery import Celery

from _wait import wait_for
from fenced import Claim, ClaimHeld, ClaimLost, ConfigError, NotOwner, records
from fenced._lease import ClaimKeys, new_token
from fenced.celery import ClaimedTask, lock_redis, metrics, signals
from fenced.celery._options import _lock_redis
from fenced.testing import RedisServer


@pytest.fixture(scope="module")
def unix_server() -> Iterator[RedisServer]:
    """The apps' claims Redis, on a unix socket so that lock_redis() is tested with a
    unix:// URL (and its socket timeouts) too; conftest's ``redis_server`` is TCP, and
    its ``server`` would run each of these tests once per redis-server binary."""
    with RedisServer(unix=True) as server:
        yield server


@pytest.fixture
def app(unix_server: RedisServer) -> Iterator[Celery]:
    unix_server.client().flushall()
    app = Celery("fenced_config_tests", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = unix_server.url
    app.conf.fenced_claim_ttl = 3
    app.finalize()  # tasks are built (and checked) as they are defined
    yield app


@pytest.fixture
def r(unix_server: RedisServer) -> Any:
    """Decoded, on the apps' claims Redis (the conftest ``r`` is on ``server``)."""
    return unix_server.client(decode_responses=True)


# -- definition time ------------------------------------------------------------------------


def test_template_field_without_argument_fails_at_definition(app: Celery) -> None:
    with pytest.raises(ConfigError, match=r"names layer, but task \S+ has no argument") as info:

        @app.task(shared=False, base=ClaimedTask, bind=True, claim="rebuild:{tenant}:{layer}")
        def rebuild(self: Any, tenant: str) -> None: ...

    assert "it has: tenant" in str(info.value)  # not self: bind=True skips it


def test_unbound_task_fields_are_the_functions_arguments(app: Celery) -> None:
    @app.task(shared=False, base=ClaimedTask, claim="rebuild:{tenant}")
    def rebuild(tenant: str) -> str:
        return tenant

    assert rebuild.claim_name_for(("acme",), {}) == "rebuild:acme"
    with pytest.raises(ConfigError, match="names self"):

        @app.task(shared=False, base=ClaimedTask, claim="rebuild:{self}")
        def bad(tenant: str) -> None: ...


def test_lazy_app_fails_when_the_task_is_first_used(unix_server: RedisServer) -> None:
    lazy = Celery("fenced_lazy", set_as_current=False, broker="memory://")

    @lazy.task(shared=False, base=ClaimedTask, bind=True, claim="rebuild:{layer}")
    def rebuild(self: Any, tenant: str) -> None: ...

    with pytest.raises(ConfigError, match="names layer"):
        rebuild.name  # noqa: B018 - evaluating the task builds its class


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({}, "has no claim"),
        ({"claim": ""}, "claim template is empty"),
        ({"claim": 42}, "must be a template"),
        ({"claim": "x:{t.attr}"}, "only plain argument names"),
        ({"claim": "x:{t}", "claim_ttl": 0}, "claim_ttl=0 is not a positive number"),
        ({"claim": "x:{t}", "claim_ttl": 6, "claim_refresh_every": 6}, "must be below claim_ttl"),
        ({"claim": "x:{t}", "claim_on_busy": "queue"}, "claim_on_busy='queue' is not one of"),
        ({"claim": "x:{t}", "claim_on_busy": "wait"}, "should not block its worker.*'retry'"),
        ({"claim": "x:{t}", "claim_alert_after_skips": -1}, "whole number of skips"),
        ({"claim": "x:{t}", "claim_on_skips_exceeded": "log"}, "is not callable"),
        ({"claim": "x:{t}", "claim_interrupt": "yes"}, "must be True or False"),
        ({"claim": "x:{t}", "claim_namespace": "a{b}"}, "namespace"),
    ],
)
def test_bad_options_fail_at_definition_naming_the_fix(
    app: Celery, options: dict[str, Any], fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix) as info:

        @app.task(shared=False, base=ClaimedTask, bind=True, **options)
        def task(self: Any, t: str) -> None: ...

    assert isinstance(info.value, ValueError)


def test_class_based_tasks_and_abstract_bases(app: Celery, r: Any) -> None:
    class Quick(ClaimedTask):  # an abstract base: options, no run, no claim yet
        claim_ttl = 5

    class Rebuild(Quick):
        name = "rebuild.class"
        # The option as a class attribute, as the decorator's claim= arrives: the class
        # moves it to claim_template, and in a run self.claim is the held Claim.
        claim = "rebuild:{tenant}"  # type: ignore[assignment]

        def run(self, tenant: str, fail: bool = False) -> float:
            return cast(Claim, self.claim).ttl

    task = app.register_task(Rebuild())
    assert task("acme") == 5.0
    with pytest.raises(ConfigError, match="has no claim"):

        class Missing(Quick):
            def run(self) -> None: ...


def test_callable_claim_name(app: Celery, r: Any) -> None:
    @app.task(
        shared=False, base=ClaimedTask, bind=True, claim=lambda args, kwargs: f"feed:{args[0]}"
    )
    def fetch(self: ClaimedTask, url: str) -> str:
        return self.claim.name

    assert fetch("https://example.org/feed").startswith("feed:https")
    history = records.history(r, fetch.claim_name_for(("https://example.org/feed",), {}))
    assert history[0].outcome == "ok" and history[0].extra["template"].endswith("<lambda>")


# -- settings and the lock Redis ------------------------------------------------------------


def test_no_lock_redis_is_a_clear_error_on_first_use(
    monkeypatch: pytest.MonkeyPatch, unix_server: RedisServer
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    bare = Celery("fenced_bare", set_as_current=False, broker=unix_server.url)
    bare.finalize()

    @bare.task(shared=False, base=ClaimedTask, bind=True, claim="x:{t}")
    def task(self: Any, t: str) -> None: ...

    with pytest.raises(ConfigError, match=r"fenced_redis_url.*FENCED_REDIS_URL"):
        task("a")
    monkeypatch.setenv("FENCED_REDIS_URL", unix_server.url)
    assert lock_redis(bare).ping()


def test_each_app_gets_its_own_client(app: Celery, unix_server: RedisServer) -> None:
    other = Celery("fenced_other", set_as_current=False)
    with RedisServer() as second:
        other.conf.fenced_redis_url = second.url
        assert lock_redis(app) is lock_redis(app)
        assert lock_redis(other) is not lock_redis(app)
        kwargs = lock_redis(other).connection_pool.connection_kwargs
        assert kwargs["port"] == second.port


def test_the_lock_redis_follows_settings_changed_after_its_first_use(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = lock_redis(app)
    assert lock_redis(app) is first
    with RedisServer() as second, RedisServer() as third:
        app.conf.fenced_redis_url = second.url
        assert lock_redis(app).connection_pool.connection_kwargs["port"] == second.port
        app.conf.update(fenced_redis_url=None)
        monkeypatch.setenv("FENCED_REDIS_URL", third.url)
        assert lock_redis(app).connection_pool.connection_kwargs["port"] == third.port
        lock_redis_before = lock_redis(app)
        # A new settings object: the client is the one the settings now give.
        app.config_from_object({"fenced_redis_url": second.url})
        assert lock_redis(app) is _lock_redis(app) is not lock_redis_before


def test_the_lock_redis_follows_changed_client_options_for_the_same_url(app: Celery) -> None:
    first = lock_redis(app)
    assert first.connection_pool.connection_kwargs["socket_timeout"] == 5.0
    app.conf.fenced_redis_options = {"socket_timeout": 7.5}
    second = lock_redis(app)
    assert second is not first
    assert second.connection_pool.connection_kwargs["socket_timeout"] == 7.5
    assert lock_redis(app) is second
    app.conf.fenced_redis_options = {"socket_timeout": 9.0}
    assert lock_redis(app).connection_pool.connection_kwargs["socket_timeout"] == 9.0
    # A new settings object with the same URL and other options: a client with those.
    url = app.conf.fenced_redis_url
    app.config_from_object({"fenced_redis_url": url, "fenced_redis_options": {"client_name": "c"}})
    kwargs = lock_redis(app).connection_pool.connection_kwargs
    assert kwargs["client_name"] == "c" and kwargs["socket_timeout"] == 5.0
    assert lock_redis(app).ping()


def test_options_are_resolved_when_the_task_is_built(app: Celery) -> None:
    @app.task(shared=False, base=ClaimedTask, bind=True, claim="x:{t}")
    def task(self: Any, t: str) -> None: ...

    # What tools such as the doctor read: the option, and the lease from the settings.
    assert task.claim_template == "x:{t}"
    assert task.claim_ttl == 3 and task.claim_on_busy == "skip"
    assert task.claim_alert_after_skips == 5 and task.claim_namespace == "fenced"
    # Outside a run there is no claim, and self.claim does not pretend there is one.
    with pytest.raises(NotOwner, match="claim_template"):
        task.claim  # noqa: B018
    app.conf.fenced_claim_on_busy = "later"
    with pytest.raises(ConfigError, match="claim_on_busy='later'"):

        @app.task(shared=False, base=ClaimedTask, bind=True, claim="x:{t}")
        def bad_setting(self: Any, t: str) -> None: ...


def test_settings_give_defaults_and_options_win(app: Celery, r: Any) -> None:
    app.conf.fenced_namespace = "maps"
    app.conf.fenced_claim_refresh_every = 0.5

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="x:{t}")
    def from_settings(self: Any, t: str) -> tuple[float, float, str]:
        return self.claim.ttl, self.claim.refresh_every, self.claim.namespace

    @app.task(
        shared=False, base=ClaimedTask, bind=True, claim="y:{t}", claim_ttl=9, claim_namespace="own"
    )
    def own(self: Any, t: str) -> tuple[float, float, str]:
        return self.claim.ttl, self.claim.refresh_every, self.claim.namespace

    assert from_settings("a") == (3.0, 0.5, "maps")
    assert own("a") == (9.0, 0.5, "own")
    assert r.exists(ClaimKeys.of("x:a", "maps").records)


# -- runs in this process -------------------------------------------------------------------


def test_direct_call_runs_under_the_claim_and_records_it(app: Celery, r: Any) -> None:
    seen: list[Any] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="rebuild:{tenant}:{layer}")
    def rebuild(self: Any, tenant: str, layer: str, note: str = "") -> int:
        seen.append((self.claim.name, self.claim.held, self.claim.task_id))
        return int(self.claim.fence)

    fence = rebuild("acme", layer="roads")
    assert seen == [("rebuild:acme:roads", True, None)]
    run = records.last(r, "rebuild:acme:roads")
    assert run is not None and run.outcome == "ok" and run.fence == fence
    assert run.extra["task"] == rebuild.name
    assert run.extra["template"] == "rebuild:{tenant}:{layer}"
    assert run.extra["args"] == {"tenant": "acme", "layer": "roads"}
    assert rebuild.claim_template == "rebuild:{tenant}:{layer}"  # the option


def test_long_argument_values_are_recorded_as_digests(app: Celery, r: Any) -> None:
    @app.task(shared=False, base=ClaimedTask, bind=True, claim="ingest:{path}")
    def ingest(self: ClaimedTask, path: str) -> str:
        return self.claim.name

    long_path = "s3://bucket/" + "x" * 200
    name = ingest(long_path)
    run = records.last(r, name)
    assert run is not None and run.extra["args"]["path"].startswith("h1-")
    # Beside the digest, a readable head of the value: what the run was about.
    assert run.extra["arg_text"] == {"path": "s3://bucket/" + "x" * 27 + "…"}


def test_skip_result_shape_and_alert(app: Celery, r: Any) -> None:
    calls: list[dict[str, Any]] = []
    received: list[dict[str, Any]] = []

    def on_signal(sender: Any, **kw: Any) -> None:
        received.append(kw)

    @app.task(
        shared=False,
        base=ClaimedTask,
        bind=True,
        claim="rebuild:{layer}",
        claim_alert_after_skips=2,
        claim_on_skips_exceeded=lambda **kw: calls.append(kw),
    )
    def rebuild(self: Any, layer: str) -> str:
        return "ran"

    signals.claim_skips_exceeded.connect(on_signal)
    holder = Claim(r, "rebuild:roads", ttl=10, task_id="holder-1")
    assert holder.acquire()
    token = holder.token
    try:
        before = metrics["skips_exceeded"]
        results = [rebuild("roads") for _ in range(3)]
    finally:
        holder.release()
        signals.claim_skips_exceeded.disconnect(on_signal)
    first = results[0]
    assert set(first) == {"status", "reason", "claim", "holder", "expires_in", "skips"}
    assert first["status"] == "skipped" and first["reason"] == "already running"
    assert first["claim"] == "rebuild:roads" and first["holder"]["task_id"] == "holder-1"
    # The secret part is not shown; what is shown is a prefix `fenced release --token` takes.
    assert token and token.startswith(first["holder"]["token"])
    assert 0 < len(first["holder"]["token"]) < len(token)
    assert 0 < first["expires_in"] <= 10
    assert [res["skips"] for res in results] == [1, 2, 3]
    assert [c["skips"] for c in calls] == [2] and calls[0]["sender"] is rebuild
    assert [s["skips"] for s in received] == [2] and received[0]["name"] == "rebuild:roads"
    assert metrics["skips_exceeded"] == before + 1
    assert rebuild("roads") == "ran"


def test_eager_apply_and_raise_policy(app: Celery, r: Any) -> None:
    @app.task(shared=False, base=ClaimedTask, bind=True, claim="pub:{x}", claim_on_busy="raise")
    def publish(self: Any, x: str) -> str | None:
        return self.request.id  # type: ignore[no-any-return]

    result = publish.apply(args=("a",), task_id="eager-1")
    assert result.get() == "eager-1"
    holder = Claim(r, "pub:a", ttl=10)
    assert holder.acquire()
    try:
        with pytest.raises(ClaimHeld) as info:
            publish("a")
    finally:
        holder.release()
    err = pickle.loads(pickle.dumps(info.value))
    assert isinstance(err, ClaimHeld) and err.name == "pub:a" and err.expires_in


def test_a_traced_run_calls_the_body_as_a_plain_task_and_keeps_a_mixins_call(
    app: Celery, r: Any
) -> None:
    seen: list[Any] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="traced:{x}")
    def traced(self: Any, x: str, *, note: str = "") -> str:
        # The tracer's own request, as a plain task's body sees it (no second push).
        seen.append(
            (self.request.id, self.request.args, self.request.kwargs, len(self.request_stack.stack))
        )
        return str(self.claim.name)

    assert traced.apply(("a",), {"note": "n"}, task_id="t-1").get() == "traced:a"
    assert seen == [("t-1", ("a",), {"note": "n"}, 1)]
    assert traced("b") == "traced:b"  # a direct call pushes its own request
    assert seen[-1] == (None, ("b",), {}, 1)

    calls: list[tuple[Any, ...]] = []

    class Counting(celery.Task[Any, Any]):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return super().__call__(*args, **kwargs)

    class Mixed(ClaimedTask, Counting):
        name = "traced.mixed"
        claim = "mixed:{x}"  # type: ignore[assignment]

        def run(self, x: str) -> str:
            return str(cast(Claim, self.claim).name)

    mixed = app.register_task(Mixed())
    assert mixed.apply(("a",)).get() == "mixed:a"
    assert calls == [("a",)]  # a __call__ after ClaimedTask's is never skipped
    assert records.last(r, "mixed:a").outcome == "ok"  # type: ignore[union-attr]


def _intrude(r: Any, name: str, started: threading.Event) -> None:
    started.wait(10)
    r.set(ClaimKeys.of(name).lock, new_token("someone-else"), px=10_000)


def test_lost_claim_interrupts_the_main_thread_while_it_sleeps(app: Celery, r: Any) -> None:
    started = threading.Event()
    finished: list[bool] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="sleep:{k}", claim_ttl=1.5)
    def sleeper(self: Any, k: str) -> None:
        started.set()
        time.sleep(20)
        finished.append(True)

    threading.Thread(target=_intrude, args=(r, "sleep:main", started), daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(ClaimLost, match="interrupted"):
        sleeper("main")
    assert time.monotonic() - t0 < 15  # woken, not slept out
    assert not finished
    assert records.last(r, "sleep:main").outcome == "lost"  # type: ignore[union-attr]


def test_lost_claim_interrupts_a_worker_thread(app: Celery, r: Any) -> None:
    started = threading.Event()
    outcome: list[BaseException | str] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="spin:{k}", claim_ttl=1.5)
    def spinner(self: Any, k: str) -> str:
        started.set()
        until = time.monotonic() + 20
        while time.monotonic() < until:
            time.sleep(0.01)
        return "finished"

    def target() -> None:
        try:
            outcome.append(spinner("thread"))
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=target)
    worker.start()
    _intrude(r, "spin:thread", started)
    worker.join(15)
    assert not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ClaimLost)
    assert records.last(r, "spin:thread").outcome == "lost"  # type: ignore[union-attr]


def test_interrupt_can_be_turned_off(app: Celery, r: Any) -> None:
    started = threading.Event()
    finished: list[bool] = []

    @app.task(
        shared=False,
        base=ClaimedTask,
        bind=True,
        claim="calm:{k}",
        claim_ttl=1.5,
        claim_interrupt=False,
    )
    def calm(self: Any, k: str) -> str:
        started.set()
        # Works on till the heartbeat has found the lease taken (a renewal, 0.5 s).
        wait_for("the claim to be declared lost", lambda: self.claim.lost, 15)
        finished.append(True)
        return "finished"

    threading.Thread(target=_intrude, args=(r, "calm:x", started), daemon=True).start()
    with pytest.raises(ClaimLost, match="lost while the task ran"):
        calm("x")  # not interrupted, but its end is not reported as a success
    assert finished == [True]


def test_the_earlier_option_name_still_works_and_says_its_new_name(app: Celery, r: Any) -> None:
    with pytest.warns(DeprecationWarning, match="claim_on_conflict is now claim_on_busy"):

        @app.task(
            shared=False, base=ClaimedTask, bind=True, claim="old:{x}", claim_on_conflict="raise"
        )
        def old(self: Any, x: str) -> str:
            return x

    assert old.claim_on_busy == "raise"
    holder = Claim(r, old.claim_name_for(("a",), {}), ttl=5)
    assert holder.acquire()
    with pytest.raises(ClaimHeld):
        old("a")
    holder.release()


def test_a_skip_is_the_same_skipped_result_as_everywhere_else(app: Celery, r: Any) -> None:
    from fenced import Skipped

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="same:{x}")
    def task(self: Any, x: str) -> str:
        return x

    holder = Claim(r, "same:a", ttl=5)
    assert holder.acquire()
    result = task("a")
    expected = Skipped.of(holder_view(r, "same:a")).as_dict()
    assert result.keys() == expected.keys()
    assert result["status"] == "skipped" and result["claim"] == "same:a"
    held = holder_view(r, "same:a").holder
    assert held is not None
    assert result["holder"]["pid"] == held.pid
    # is_skipped() knows the result, the dict, and nothing that merely looks alike.
    from fenced import is_skipped

    assert is_skipped(result) and is_skipped(Skipped.of(holder_view(r, "same:a")))
    assert task("b") == "b" and not is_skipped("b")
    assert not is_skipped({"status": "skipped"}) and not is_skipped(None)
    holder.release()


def holder_view(r: Any, name: str) -> Claim:
    """A claim that lost the race for ``name``: what a skip saw."""
    seen = Claim(r, name, ttl=5)
    assert not seen.acquire()
    return seen


def test_a_finished_task_id_is_found_however_many_runs_came_after(app: Celery, r: Any) -> None:
    ran: list[str] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="busy-name:{x}")
    def job(self: ClaimedTask, x: str) -> str:
        ran.append(str(self.request.id))
        return "done"

    job.apply(("a",), task_id="first")
    for i in range(110):  # other runs of the same claim, in between
        job.apply(("a",), task_id=f"other-{i}")
    job.apply(("a",), task_id="first", retries=1)  # the message comes back
    assert ran.count("first") == 1
    assert len(ran) == 111


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ({"claim_ttll": 5}, "did you mean claim_ttl?"),
        ({"fenced_on_busy": "raise"}, "did you mean claim_on_busy?"),
        ({"claim_whenever": "soon"}, "the options are: claim_ttl, claim_refresh_every"),
    ],
)
def test_an_unknown_claim_option_is_refused_when_the_task_is_defined(
    given: dict[str, Any], fix: str
) -> None:
    # Kept silently, a typo would define fine and do nothing.
    app = Celery("fenced_unknown_option", set_as_current=False, broker="memory://")
    with pytest.raises(ConfigError, match=rf"unknown option {next(iter(given))}; {re.escape(fix)}"):

        @app.task(shared=False, base=ClaimedTask, claim="x:{a}", **given)
        def job(a: str) -> None:
            pass

        app.finalize()


def test_an_unknown_fenced_setting_is_refused_when_the_task_is_bound() -> None:
    app = Celery("fenced_unknown_setting", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_urll = "redis://127.0.0.1:1/0"

    @app.task(shared=False, base=ClaimedTask, claim="x:{a}")
    def job(a: str) -> None:
        pass

    with pytest.raises(
        ConfigError, match="unknown setting fenced_redis_urll; did you mean fenced_redis_url"
    ):
        app.finalize()
        job.name  # noqa: B018 (builds the task)
