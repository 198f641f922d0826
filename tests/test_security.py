"""SECURITY.md: linked from the README, and its Redis ACL users are what fenced needs.

The ACL lines are read from SECURITY.md itself. Each listed command must be one the
source sends (a Lua ``redis.call`` or a client call), every command a script calls
must be listed, and the claim, record, pointer, lock and operator paths must run on a
real server as those users, with the scripts flushed first so the reload path runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

import fenced
from fenced import Claim, records
from fenced._inspect import force_release, list_claims, show_claim
from fenced.doctor import check_redis
from fenced.store import RedisPointer
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SECURITY = ROOT / "SECURITY.md"
SOURCE = ROOT / "src" / "fenced"
PASSWORD = "acl-test-password"  # a throwaway server's


def _acl_lines() -> dict[str, str]:
    """The ``ACL SETUSER`` lines of SECURITY.md, by user name."""
    text = SECURITY.read_text()
    found = re.findall(r"^ACL SETUSER (\S+) (.*)$", text, flags=re.MULTILINE)
    return dict(found)


def _commands(rule: str) -> set[str]:
    return {word[1:].lower() for word in rule.split() if word.startswith("+")}


def _source_text() -> str:
    return "\n".join(p.read_text() for p in sorted(SOURCE.rglob("*.py")))


def _script_commands(text: str) -> set[str]:
    return {c.lower() for c in re.findall(r"redis\.call\('([A-Za-z]+)'", text)}


def _client_commands(text: str) -> set[str]:
    """Commands sent by client calls: ``client.xrevrange(``, ``execute_command("WAIT"``..."""
    receiver = r"(?:client|pipe|node|self\.redis|self\.client)"
    methods = set(re.findall(receiver + r"\.([a-z_]+)\(", text))
    methods |= {c.lower() for c in re.findall(r'execute_command\("([A-Z]+)"', text)}
    aliases = {"scan_iter": "scan", "script_load": "script|load", "config_get": "config|get"}
    return {aliases.get(m, m) for m in methods}


def test_security_md_exists_and_the_readme_links_it() -> None:
    assert SECURITY.is_file()
    readme = (ROOT / "README.md").read_text()
    assert "](SECURITY.md)" in readme
    assert "## Security" in readme


def test_every_listed_command_is_one_fenced_sends_and_every_script_command_is_listed() -> None:
    acl = _acl_lines()
    assert set(acl) == {"fenced-worker", "fenced-operator"}
    worker, operator = _commands(acl["fenced-worker"]), _commands(acl["fenced-operator"])
    assert worker <= operator
    text = _source_text()
    in_scripts = _script_commands(text)
    assert {"set", "lpush", "xadd", "incr", "pexpire"} <= in_scripts  # the reading finds them
    sent = in_scripts | _client_commands(text)
    assert operator - sent == set(), "listed in SECURITY.md, but fenced never sends it"
    assert in_scripts - worker == set(), "called by a script, but missing from SECURITY.md"


def _as(server: RedisServer, user: str, rule: str) -> Any:
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", user, "reset")
    admin.execute_command("ACL", "SETUSER", user, *rule.replace("CHANGE-ME", PASSWORD).split())
    admin.script_flush()  # a restarted server: the scripts are loaded again
    return redis.Redis(port=server.port, username=user, password=PASSWORD)


def _work(client: Any) -> None:
    """What workers do: claims with records, skips, reruns, renewals, pointers, locks."""
    a = Claim(client, "acl:job", ttl=10, heartbeat=False, records=True)
    b = Claim(client, "acl:job", ttl=10, heartbeat=False, records=True)
    assert a.acquire() and a.refresh()
    assert not b.acquire(request_rerun="again")
    assert fenced.read_holder(client, "acl:job") is not None
    assert a.release()
    assert {run.outcome for run in records.history(client, "acl:job")} == {"ok", "skipped"}
    with Claim(client, "acl:done", ttl=10, task_id="t-1", redelivery_window=60) as c:
        assert c.held
    ptr = RedisPointer(client, "acl:ptr")
    ptr.swap("s3://bucket/a", fence=1)
    assert ptr.read() is not None and ptr.history()
    lock = fenced.Lock(client, "fenced:acl-lock", timeout=10)
    assert lock.acquire(blocking=False)
    assert lock.extend(5)
    lock.release()


def _operate(client: Any) -> None:
    """What operators do: list, show, release by hand, ask the doctor."""
    holder = Claim(client, "acl:stuck", ttl=30, heartbeat=False, records=True)
    assert holder.acquire()
    assert [info.name for info in list_claims(client)] == ["acl:stuck"]
    assert show_claim(client, "acl:stuck").holder is not None
    assert force_release(client, "acl:stuck", reason="acl test", by="ops") is not None
    for finding in check_redis(client):
        assert "NOPERM" not in f"{finding.what} {finding.why}", finding


@pytest.mark.parametrize("user, work", [("fenced-worker", _work), ("fenced-operator", _operate)])
def test_each_role_works_with_exactly_the_commands_listed(
    own_server: RedisServer, user: str, work: Callable[[Any], None]
) -> None:
    rule = _acl_lines()[user]
    work(_as(own_server, user, rule))


def test_a_command_missing_from_the_list_is_noticed(own_server: RedisServer) -> None:
    rule = _acl_lines()["fenced-worker"].replace(" +lpush", "")
    # A script's refusal reaches the caller as ClaimUnavailable (fail closed).
    refused = (redis.exceptions.ResponseError, fenced.FencedError)
    with pytest.raises(refused, match="can't run this command"):
        _work(_as(own_server, "fenced-worker", rule))
