"""`fenced web` in a real browser: the command as a subprocess (uvicorn) on a real
redis-server, driven through headless Chromium (Debian's chromium and chromium-driver;
Selenium Manager is kept offline and never downloads a browser or a driver).

With FENCED_SCREENSHOT=1 the test saves the page to docs/dashboard.png.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from _wait import wait_for
from fenced import Claim, records
from fenced.testing import RedisServer, find_binary, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "browser-test-token"
REFRESH = 0.5
ROOT = Path(__file__).resolve().parent.parent

MISSING = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(path)]

# Outside CI a missing browser or driver is a skip that says how to install both; in CI
# (CI set, as .ci/run installs them) the tests run and fail, so they never stop silently.
pytestmark = pytest.mark.skipif(
    bool(MISSING) and not os.environ.get("CI"),
    reason=f"no headless browser: {' and '.join(MISSING)} absent (apt-get install chromium "
    "chromium-driver); in CI (CI set) these tests run and fail instead",
)


@pytest.fixture(scope="module")
def web(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`fenced web --allow-release` on a free port, serving redis_server; its base URL."""
    token_file = tmp_path_factory.mktemp("web") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with serving(
        redis_server.url, "--allow-release", "--token-file", str(token_file),
        "--alert-after-skips", "3",
    ) as base:  # fmt: skip
        yield base


@contextmanager
def serving(url: str, *options: str) -> Iterator[str]:
    """`fenced web` on a free port, serving the Redis at url; its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "fenced.cli", "web", "--redis", url, "--port", str(port),
            "--refresh", str(REFRESH), *options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(base + "/api/config", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    try:
        wait_for("fenced web to answer", up, timeout=30, every=0.1, proc=proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium, offline: explicit binary and driver, no Selenium Manager."""
    before = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager: never download anything
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--no-first-run",
        "--disable-sync", "--window-size=1280,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        if before is None:
            del os.environ["SE_OFFLINE"]
        else:
            os.environ["SE_OFFLINE"] = before


def seed_history(r: Any) -> None:
    """Runs of every kind on a second claim, for the page to show beside the test's own."""
    for outcome in ("ok", "failed", "lost", "ok"):
        claim = Claim(r, "backup:db", ttl=10, records=True, heartbeat=False)
        claim.acquire()
        time.sleep(0.3)
        claim.release(outcome=outcome)
    holder = Claim(r, "backup:db", ttl=30, records=True, heartbeat=False)
    holder.acquire()
    for _ in range(4):  # skipped by a second holder: past --alert-after-skips 3
        assert not Claim(r, "backup:db", ttl=10, records=True, heartbeat=False).acquire()
        time.sleep(0.1)


def message(driver: Any, saying: str = "") -> str:
    """The release form's message once there is one (holding ``saying``), else ""."""
    text: str = driver.find_element("id", "release-message").text
    return text if text != "releasing…" and saying in text else ""


def test_dashboard_in_a_browser(redis_server: RedisServer, web: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    r = redis_server.client()
    r.flushall()
    seed_history(r)
    browser.get(web + "/")
    wait_for("the page to list backup:db", lambda: rows(browser).get("backup:db"), timeout=10)
    assert "alert" in rows(browser)["backup:db"]
    assert "Loading" not in browser.find_element(By.ID, "claims").text  # replaced by data

    claim = Claim(r, "export:acme", ttl=30, records=True)
    with claim:
        start = time.monotonic()
        wait_for("the held claim to appear", lambda: rows(browser).get(claim.name), timeout=10)
        assert time.monotonic() - start < REFRESH + 2.0
        click_row(browser, claim.name)
        wait_for(
            "the running run on the timeline",
            lambda: browser.find_elements(By.CSS_SELECTOR, "#timeline rect.run.running"),
            timeout=10,
        )
        form = browser.find_element(By.ID, "release")
        assert form.is_displayed()
        browser.find_element(By.ID, "release-reason").send_keys("holder is gone")
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the refusal without a token", lambda: message(browser), timeout=10)
        assert "refused (401)" in said
        browser.find_element(By.ID, "release-token").send_keys("not-the-token")
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the refusal of a wrong token", lambda: message(browser, "403"), timeout=10)
        assert "wrong token" in said
        assert claim.held  # nothing was released
        browser.find_element(By.ID, "release-token").clear()
        browser.find_element(By.ID, "release-reason").clear()
        if os.environ.get("FENCED_SCREENSHOT") == "1":
            click_row(browser, "backup:db")  # the claim with runs of every kind
            wait_for(
                "the runs of backup:db",
                lambda: browser.find_elements(By.CSS_SELECTOR, "#timeline rect.run.failed"),
                timeout=10,
            )
            browser.save_screenshot(str(ROOT / "docs" / "dashboard.png"))
            click_row(browser, claim.name)
    wait_for(
        "a finished run on the timeline",
        lambda: browser.find_elements(By.CSS_SELECTOR, "#timeline rect.run.ok"),
        timeout=10,
    )
    wait_for("the released claim to leave the table", lambda: claim.name not in rows(browser))

    # With the token, the page clears a claim: recorded as released, with the reason.
    click_row(browser, "backup:db")
    browser.find_element(By.ID, "release-reason").send_keys("seed holder is gone")
    browser.find_element(By.ID, "release-token").send_keys(TOKEN)
    browser.find_element(By.ID, "release-button").click()
    said = wait_for("the release", lambda: message(browser, "released"), timeout=10)
    assert "released 'backup:db'" in said
    wait_for(
        "the released run on the timeline",
        lambda: browser.find_elements(By.CSS_SELECTOR, "#timeline rect.run.released"),
        timeout=10,
    )
    released = [run for run in records.history(r, "backup:db") if run.outcome == "released"]
    assert [run.reason for run in released] == ["seed holder is gone"]
    wait_for("backup:db to leave the table", lambda: "backup:db" not in rows(browser))

    # Nothing the page did was blocked (a CSP violation is an error in the console); the
    # refused releases are the only failed requests.
    logged = browser.get_log("browser")
    errors = [e["message"] for e in logged if e["level"] == "SEVERE"]
    assert all("/release - Failed to load resource" in m for m in errors), errors


def test_a_name_held_by_several_in_a_browser(
    redis_server: RedisServer, web: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.select import Select

    r = redis_server.client()
    r.flushall()
    first, second = (
        Claim(r, "pool", ttl=30, limit=2, records=True, heartbeat=False) for _ in range(2)
    )
    assert first.acquire() and second.acquire()
    try:
        # A link whose claim part is not percent-encoding: the page works on.
        browser.get(web + "/#claim=%E0%A4")
        browser.refresh()  # a new page, not the hash of the last test's
        row = wait_for("the pool's row", lambda: rows(browser).get("pool"), timeout=10)
        assert "2/2 slots held" in row and "slot 0:" in row and "slot 1:" in row

        click_row(browser, "pool")
        slots = wait_for(
            "each holder of the pool",
            lambda: len(browser.find_elements(By.CSS_SELECTOR, "#detail-slots li")) == 2,
            timeout=10,
        )
        assert slots
        holders = Select(browser.find_element(By.ID, "release-holder"))
        prefix = str(second.token)[:8]
        assert (
            [o.get_attribute("value") for o in holders.options]
            == [
                "",  # nothing chosen: the page never picks a holder for the operator
                str(first.token)[:8],
                prefix,
            ]
        )
        browser.find_element(By.ID, "release-reason").send_keys("second worker is gone")
        browser.find_element(By.ID, "release-token").send_keys(TOKEN)
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the refusal", lambda: message(browser, "choose"), timeout=10)
        assert first.refresh() and second.refresh()
        holders.select_by_value(prefix)
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the release", lambda: message(browser), timeout=10)
        assert "released 'pool'" in said, said
        released = [run for run in records.history(r, "pool") if run.outcome == "released"]
        assert [run.token for run in released] == [prefix]
        assert first.refresh() and not second.refresh()
    finally:
        browser.find_element(By.ID, "release-token").clear()
        browser.find_element(By.ID, "release-reason").clear()
        first.release()
        second.release()


def test_a_rate_a_pending_burst_and_a_replaced_run_in_a_browser(
    redis_server: RedisServer, web: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    from test_cli import pending

    r = redis_server.client()
    r.flushall()
    pending(r)
    old = Claim(r, "sync:replaced", ttl=30, records=True, heartbeat=False)
    new = Claim(r, "sync:replaced", ttl=30, records=True, heartbeat=False, task_id="t-new")
    assert old.acquire() and new.replace()
    try:
        browser.get(web + "/")
        browser.refresh()  # a new page, not the hash of the last test's
        row = wait_for("the rated name", lambda: rows(browser).get("sync:rated"), timeout=10)
        assert "rate limited: next start in 59m" in row, row
        row = wait_for("the burst", lambda: rows(browser).get("digest:acme"), timeout=10)
        assert "burst pending: 3 calls, runs in 4m" in row and "(task task-0)" in row, row

        def detail() -> str:
            return str(browser.find_element(By.ID, "detail-holder").text)

        click_row(browser, "sync:rated")
        wait_for("the rate in the detail", lambda: "rate limited until" in detail(), timeout=10)
        click_row(browser, "sync:replaced")
        said = f"replaced by {str(new.token)[:8]} ("
        wait_for(
            "the replaced run in the runs table",
            lambda: said in browser.find_element(By.ID, "runs").text,
            timeout=10,
        )
    finally:
        new.release()


def test_a_release_aimed_at_a_holder_that_finished_leaves_the_next_one(
    redis_server: RedisServer, browser: Any, tmp_path: Path
) -> None:
    # The operator sees X; X finishes and Y takes the name before the click. The page
    # is redrawn only on the hour here: the release names the X it still shows.
    from selenium.webdriver.common.by import By

    r = redis_server.client()
    r.flushall()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    x = Claim(r, "nightly", ttl=60, records=True, heartbeat=False, task_id="run-x")
    assert x.acquire()
    shown = str(x.token)[:8]

    def holder() -> str:
        return str(browser.find_element(By.ID, "detail-holder").text)

    def target() -> str:
        return str(browser.find_element(By.ID, "release-target").text)

    with serving(
        redis_server.url, "--allow-release", "--token-file", str(token_file), "--refresh", "3600"
    ) as base:
        browser.get(base + "/#claim=nightly")
        browser.refresh()  # a new page, not the hash of the last test's
        wait_for("the holder on the page", lambda: "task run-x" in holder(), timeout=10)
        browser.find_element(By.ID, "release-reason").send_keys("x is hung")
        browser.find_element(By.ID, "release-token").send_keys(TOKEN)
        assert x.release()
        y = Claim(r, "nightly", ttl=60, records=True, heartbeat=False, task_id="run-y")
        assert y.acquire()
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the answer", lambda: message(browser), timeout=10)
        assert y.refresh(), said  # Y still holds
        assert "refused (409): the holder changed" in said and shown in said, said
        assert not [run for run in records.history(r, "nightly") if run.outcome == "released"]

        # The refusal redraws the form: it now aims at Y, and clears Y.
        now = str(y.token)[:8]
        wait_for("the new holder in the form", lambda: now in target(), timeout=10)
        browser.find_element(By.ID, "release-button").click()
        said = wait_for("the release", lambda: message(browser, "released"), timeout=10)
        assert not y.refresh()
        released = [run for run in records.history(r, "nightly") if run.outcome == "released"]
        assert [run.token for run in released] == [now]


def test_the_page_says_when_the_holder_changes_under_the_form(
    redis_server: RedisServer, web: str, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    r = redis_server.client()
    r.flushall()
    x = Claim(r, "hourly", ttl=60, records=True, heartbeat=False)
    assert x.acquire()
    try:
        browser.get(web + "/#claim=hourly")
        browser.refresh()
        wait_for(
            "the holder in the form",
            lambda: str(x.token)[:8] in browser.find_element(By.ID, "release-target").text,
            timeout=10,
        )
        browser.find_element(By.ID, "release-reason").send_keys("x is hung")
        assert x.release()
        said = wait_for("the notice", lambda: message(browser, "holder changed"), timeout=10)
        assert (
            str(x.token)[:8] in said
            and "nothing to clear" in browser.find_element(By.ID, "release-target").text
        )
    finally:
        browser.find_element(By.ID, "release-reason").clear()


def test_a_name_marked_at_enqueue_shows_its_queued_task(
    redis_server: RedisServer, web: str, browser: Any
) -> None:
    from fenced._lease import ClaimKeys
    from fenced.celery._enqueue import MARK

    r = redis_server.client()
    r.flushall()
    assert MARK(r, [ClaimKeys.of("feed:acme").queued], ["task-1", 600_000, ""]) is None
    browser.get(web + "/")
    browser.refresh()
    row = wait_for("the marked name's row", lambda: rows(browser).get("feed:acme"), timeout=10)
    assert "queued: task task-1" in row and "more" in row, row
    r.delete(ClaimKeys.of("feed:acme").queued)
    wait_for("the row to go", lambda: "feed:acme" not in rows(browser), timeout=10)


def test_a_beat_leader_claim_shows_the_beat(
    redis_server: RedisServer, web: str, browser: Any
) -> None:
    from test_celery_beat import T0, Wall, _app, _scheduler

    redis_server.client().flushall()
    wall = Wall(T0)
    sched = _scheduler(_app(redis_server, a={}), wall)
    sched.tick()  # leads
    wall.ms = T0 + 60_010
    sched.tick()  # sends the tick due at +60 s
    try:
        browser.get(web + "/#claim=beat%3Aunit")
        browser.refresh()
        row = wait_for("the beat's row", lambda: rows(browser).get("beat:unit"), timeout=10)
        assert "beat leader (fenced beat unit)" in row, row

        def shown() -> str | None:
            text: str = browser.find_element("id", "detail-beat").text
            return text or None

        text = wait_for("the beat's status", shown, timeout=10)
        assert "leader of beat unit" in text and "(fenced beat unit)" in text, text
        assert "a: last due 2026-01-15T08:01:00+00:00 sent" in text, text
        assert "next 2026-01-15T08:02:00+00:00" in text, text
    finally:
        sched.close()


def test_the_page_says_when_redis_hangs_and_recovers(browser: Any) -> None:
    # A Redis that refuses is a 503 the page shows (test_web.py stops and restarts one);
    # one that answers nothing leaves a request open, and the page says that too.
    from selenium.webdriver.common.by import By

    def says(text: str, bad: bool) -> bool:
        node = browser.find_element(By.ID, "status")
        return text in node.text and ("bad" in (node.get_attribute("class") or "")) == bad

    with RedisServer(find_binary()) as server, serving(server.url) as base:
        Claim(server.client(), "nightly", ttl=60, heartbeat=False).acquire()
        browser.get(base + "/")
        wait_for("the claim", lambda: rows(browser).get("nightly"), timeout=10)

        server.pause()  # a Redis that answers nothing: the request hangs
        try:
            wait_for("the wait said", lambda: says("no answer for", True), timeout=10)
        finally:
            server.resume()
        wait_for("the page to recover", lambda: says("updated", False), timeout=10)


def rows(driver: Any) -> dict[str, str]:
    """The claims table as name -> the row's class and text, read in one go (the table
    is redrawn at every refresh: element references go stale)."""
    found = driver.execute_script(
        "return Array.from(document.querySelectorAll('#claims tbody tr'))"
        ".map(tr => [tr.dataset.name, tr.className + ' | ' + tr.textContent])"
    )
    return dict(found)


def click_row(driver: Any, name: str) -> None:
    """Click a claim's row, again if a refresh replaced it under the click."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def click() -> bool:
        for row in driver.find_elements(By.CSS_SELECTOR, "#claims tbody tr"):
            try:
                if row.get_attribute("data-name") == name:
                    row.click()
                    return True
            except StaleElementReferenceException:
                return False
        return False

    wait_for(f"a click on the row of {name}", click, timeout=10)
