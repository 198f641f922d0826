"""One rule for what a client argument may be: a redis-py client, or a URL of any form.

Pure parsing first, then each form against a real server it names: TCP with an ACL
user, a unix socket, TLS (when this machine's redis-server and openssl can do it), and
``fenced_redis_client`` factories for Celery and the command line. The Sentinel and
Cluster forms are exercised against real groups in ``test_ha_*``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from _clock import ManualClock
from fenced import Claim, ClaimUnavailable, ConfigError, exclusive
from fenced._client import client_from_setting, connect, describe_client, parse_url, redact
from fenced.celery import ClaimedTask, lock_redis
from fenced.store import RedisPointer
from fenced.testing import RedisServer, find_binary, free_port

FENCED = [sys.executable, "-m", "fenced.cli"]
#: A client that tries once: failures are the same as after redis-py's retries, sooner.
ONCE = Retry(NoBackoff(), 0)

# -- parsing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "topology", "hosts", "db", "user", "password"),
    [
        ("redis://localhost:6379/1", "standalone", [("localhost", 6379)], 1, None, None),
        ("redis://h", "standalone", [("h", 6379)], 0, None, None),
        ("rediss://al:p%40ss@h:6380/2", "standalone", [("h", 6380)], 2, "al", "p@ss"),
        ("redis://:pw@h/0", "standalone", [("h", 6379)], 0, None, "pw"),
        ("redis://[::1]:7000/3", "standalone", [("::1", 7000)], 3, None, None),
        ("redis://h/?db=4", "standalone", [("h", 6379)], 4, None, None),
        ("unix:///run/r.sock?db=5", "standalone", [], 5, None, None),
        (
            "redis+sentinel://u:pw@s1:26379,s2/mymaster/6",
            "sentinel",
            [("s1", 26379), ("s2", 26379)],
            6,
            "u",
            "pw",
        ),
        (
            "redis+cluster://n1:7000,n2:7001/",
            "cluster",
            [("n1", 7000), ("n2", 7001)],
            0,
            None,
            None,
        ),
        ("rediss+cluster://:pw@n1:7000", "cluster", [("n1", 7000)], 0, None, "pw"),
    ],
)
def test_every_url_form_is_read(
    url: str,
    topology: str,
    hosts: list[tuple[str, int]],
    db: int,
    user: str | None,
    password: str | None,
) -> None:
    parsed = parse_url(url)
    assert (parsed.topology, parsed.hosts, parsed.db) == (topology, hosts, db)
    assert (parsed.username, parsed.password) == (user, password)
    assert parsed.tls == url.startswith("rediss")


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("redis://host:6379/abc", "database 'abc' must be a number"),
        ("redis://host:6379/0/1", "database '0/1' must be a number"),
        ("http://alice:AlicePw@host/0", "scheme must be one of"),
        ("host:6379", "no scheme: write redis://host:6379"),
        ("redis://h/0?sockettimeout=5", "unknown option 'sockettimeout'"),
        # A typo of a plain option is shown as typed, with the option it meant.
        ("redis://h/0?socket_timout=5", r"socket_timout=5'.*did you mean socket_timeout\?"),
        # A typo of a secret one keeps its value masked.
        ("redis://h/0?passwrod=S3", r"passwrod=\*\*\*'.*did you mean password\?"),
        ("redis://h/0?socket_timeout=soon", "socket_timeout='soon' is not a valid value"),
        ("redis://h:99999/0", "no valid port"),
        ("redis://h1,h2/0", "names one server"),
        ("redis+cluster://h:7000/2", "only database 0"),
        ("redis+sentinel://h:26379/", "ends in /service"),
        ("redis+sentinel://h:26379/m/x", "database 'x' must be a number"),
        ("unix://relative.sock", "absolute socket path"),
        ("redis://h/0#frag", "'#' is not part"),
        ("", "non-empty string"),
    ],
)
def test_bad_urls_name_the_fix(url: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix):
        parse_url(url)


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        # urllib reads these as the scheme redis with a path and no host, redis-py refuses
        # them as having no scheme: the message names what is missing, and the URL meant.
        (
            "redis:/127.0.0.1:6379/11",
            "a slash is missing after 'redis:': write redis://127.0.0.1:6379/11",
        ),
        ("rediss:/h:6380/0", "a slash is missing after 'rediss:': write rediss://h:6380/0"),
        ("Redis:/h/0", "a slash is missing after 'Redis:': write redis://h/0"),
        (
            "redis+sentinel:/s1,s2/m/0",
            "missing after 'redis+sentinel:': write redis+sentinel://s1,s2/m/0",
        ),
        ("redis:host:6379", "'//' is missing after 'redis:': write redis://host:6379"),
        ("redis//host:6379/1", "the ':' is missing after 'redis': write redis://host:6379/1"),
        ("redis:\\\\host/0", "'redis:\\\\' is not 'redis://': write redis://host/0"),
        ("unix:/run/redis.sock", "'//' is missing after 'unix:': write unix:///run/redis.sock"),
        # redis-py takes this one for localhost:6379/0, whatever the host written.
        ("redis:///host:6379/1", "3 slashes after 'redis:', not 2: write redis://host:6379/1"),
        ("redis:///0", "names no server: write e.g. redis://localhost:6379/0"),
        # No scheme at all: a host (one named like the scheme, too) and its port.
        ("localhost:6379/0", "no scheme: write redis://localhost:6379/0 (rediss:// for TLS)"),
        ("redis:6379", "no scheme: write redis://redis:6379 "),
        ("10.0.0.5", "no scheme: write redis://10.0.0.5 "),
        ("redis", "names no server: write e.g. redis://localhost:6379/0"),
        ("redis:", "names no server: write e.g. redis://localhost:6379/0"),
    ],
)
def test_near_miss_urls_name_what_is_missing(url: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    text = str(info.value)
    assert fix in text, text
    assert "\n" not in text and "scheme must be one of" not in text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis:/:S3cret@h:6379/0", "redis:/:***@h:6379/0"),
        ("redis:alice:S3cret@h", "redis:alice:***@h"),
        (":S3cret@h:6379", ":***@h:6379"),
        ("redis//h/0?password=S3cret", "redis//h/0?password=***"),
    ],
)
def test_near_miss_urls_are_printed_without_their_passwords(url: str, shown: str) -> None:
    assert redact(url) == shown
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert "S3cret" not in str(info.value) and "write " in str(info.value), info.value


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://alice:S3cret@h:6379/0", "redis://alice:***@h:6379/0"),
        ("redis://:S3cret@h/0", "redis://:***@h/0"),
        ("redis://h/0?password=S3cret&db=1", "redis://h/0?password=***&db=1"),
        ("unix://:S3cret@/tmp/r.sock", "unix://:***@/tmp/r.sock"),
        (
            "redis+sentinel://u:S3cret@s1,s2/m/0?sentinel_password=S3cret",
            "redis+sentinel://u:***@s1,s2/m/0?sentinel_password=***",
        ),
        ("http://alice:S3cret@host/0", "http://alice:***@host/0"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_urls_are_printed_without_their_passwords(url: str, shown: str) -> None:
    assert redact(url) == shown
    with pytest.raises(ConfigError) as info:
        parse_url(url + "&bogus=1" if "?" in url else url + "?bogus=1")
    assert "S3cret" not in str(info.value)


def test_client_arguments_are_checked_when_given() -> None:
    with pytest.raises(ConfigError, match="no Redis given"):
        Claim(None, "x")
    with pytest.raises(ConfigError, match="object is not a Redis client"):
        Claim(object(), "x")
    with pytest.raises(ConfigError, match="asyncio client"):
        Claim(redis.asyncio.Redis(), "x")
    with pytest.raises(ConfigError, match="database 'abc'"):
        Claim("redis://localhost:6379/abc", "x")
    with pytest.raises(ConfigError, match="not a Redis client"):
        exclusive(name="x", redis=42)
    with pytest.raises(ConfigError, match="names no server"):
        RedisPointer("redis", "x")  # a string that is not a URL


# -- each form against a real server --------------------------------------------------


def test_one_url_one_client_and_claims_take_urls(redis_server: RedisServer) -> None:
    url = redis_server.url
    assert connect(url) is connect(url)  # one pool per URL (and options) per process
    claim = Claim(url, "from-a-url", ttl=5)
    with claim:
        assert (claim.fence or 0) > 0
    assert describe_client(connect(url)) == f"redis://127.0.0.1:{redis_server.port}/0"


def test_clients_with_other_option_objects_are_other_clients(redis_server: RedisServer) -> None:
    """Options are part of the key by identity: a policy freed and another made at its
    address (same repr) never gets the first one's cached client."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = redis_server.url + "?client_name=keyed"
    made = []
    for retries in range(20):
        policy = Retry(NoBackoff(), retries)
        client = connect(url, retry=policy)
        assert client.connection_pool.connection_kwargs["retry"].get_retries() == retries
        assert connect(url, retry=policy) is client
        made.append(client)
        del policy, client  # the cache keeps the policy: its address is not reused
    assert len({id(c) for c in made}) == 20


def test_unix_socket_url(server: RedisServer) -> None:
    assert server.socket_path
    client = connect(f"unix://{server.socket_path}?db=3")
    with Claim(client, "over-a-socket", ttl=5):
        on_db3 = redis.Redis(unix_socket_path=server.socket_path, db=3)
        assert on_db3.exists("fenced:{over-a-socket}:lock") == 1


@pytest.fixture
def acl_server() -> Iterator[RedisServer]:
    """A server whose default user is off: only alice (a password) may connect."""
    with RedisServer() as srv:
        admin = srv.client()
        admin.execute_command("ACL", "SETUSER", "alice", "on", ">Al1ce:pw", "~*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")
        yield srv


def test_acl_user_and_password_in_the_url(acl_server: RedisServer, fake_time: ManualClock) -> None:
    port = acl_server.port
    url = f"redis://alice:Al1ce%3Apw@127.0.0.1:{port}/0"
    claim = Claim(url, "as-alice", ttl=1, refresh_every=0.2, clock=fake_time)
    with claim:
        # The heartbeat's own connections log in as alice too.
        fake_time.run(1.5)
        assert claim.held
    # One try: redis-py retries a refused login for seconds, to the same end.
    bad = Claim(connect(f"redis://alice:wrong@127.0.0.1:{port}/0", retry=ONCE), "as-alice", ttl=1)
    with pytest.raises(ClaimUnavailable, match="invalid username-password"):
        bad.acquire()


def _tls_files(tmp: Path) -> dict[str, str] | None:
    """A CA and a server certificate for 127.0.0.1, made with openssl; None without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=tmp, capture_output=True, check=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=fenced-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return {name: str(tmp / name) for name in ("ca.crt", "server.crt", "server.key")}


def test_tls_url(tmp_path: Path, fake_time: ManualClock) -> None:
    binary = find_binary()
    if b"tls-cert-file" not in Path(binary).read_bytes():
        pytest.skip(f"{binary} was built without TLS")
    files = _tls_files(tmp_path)
    if files is None:
        pytest.skip("openssl is needed to make a test certificate")
    port = free_port()
    extra = [
        "--tls-port", str(port), "--tls-cert-file", files["server.crt"],
        "--tls-key-file", files["server.key"], "--tls-ca-cert-file", files["ca.crt"],
        "--tls-auth-clients", "no",
    ]  # fmt: skip
    with RedisServer(binary, extra=extra):
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={files['ca.crt']}&ssl_cert_reqs=required"
        claim = Claim(url, "over-tls", ttl=1, refresh_every=0.2, clock=fake_time)
        with claim:
            fake_time.run(1.5)  # renewed through the heartbeat's own TLS connections
            assert claim.held
        assert describe_client(claim.redis).startswith("rediss://127.0.0.1")
        # A client that does not trust the CA is refused.
        untrusting = Claim(
            connect(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required", retry=ONCE), "x", ttl=1
        )
        with pytest.raises(Exception, match=r"(?i)certificate|ssl"):
            untrusting.acquire()


# -- fenced_redis_client ----------------------------------------------------------------


@pytest.fixture
def factory_module(tmp_path: Path, redis_server: RedisServer) -> Iterator[str]:
    """An importable module whose ``make`` returns a client with custom settings."""
    (tmp_path / "lockstore_factory.py").write_text(
        textwrap.dedent(
            f"""
            import redis

            def make():
                return redis.Redis(host="127.0.0.1", port={redis_server.port}, db=4,
                                   client_name="from-the-factory")
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    yield str(tmp_path)
    sys.path.remove(str(tmp_path))
    sys.modules.pop("lockstore_factory", None)


def test_fenced_redis_client_for_celery(factory_module: str, redis_server: RedisServer) -> None:
    app = Celery("fenced_factory", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_client = "lockstore_factory:make"
    app.conf.fenced_redis_url = "redis://never-used:1/0"  # the factory comes first
    app.finalize()
    client = lock_redis(app)
    assert client.connection_pool.connection_kwargs["db"] == 4
    assert lock_redis(app) is client

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="factory:{t}")
    def task(self: Any, t: str) -> int:
        return int(self.claim.fence > 0)

    assert task("a") == 1
    on_db4 = redis.Redis(port=redis_server.port, db=4)
    assert on_db4.exists("fenced:{factory:a}:fence") == 1


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("lockstore_factory:nothing", "cannot be loaded"),
        ("no_such_module_here:make", "cannot be loaded"),
        ("justaname", "must name a callable"),
        ("builtins:object", "gave no usable client"),
    ],
)
def test_bad_fenced_redis_client_names_the_fix(factory_module: str, value: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix):
        client_from_setting(value)


def test_cli_takes_a_client_factory_and_redacts_bad_urls(
    factory_module: str, redis_server: RedisServer
) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_REDIS")}
    env["PYTHONPATH"] = os.pathsep.join([factory_module, env.get("PYTHONPATH", "")])
    env["FENCED_REDIS_CLIENT"] = "lockstore_factory:make"
    done = subprocess.run(
        [*FENCED, "run", "via-factory", "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ran" in done.stdout
    assert redis.Redis(port=redis_server.port, db=4).exists("fenced:{via-factory}:fence") == 1
    bad = subprocess.run(
        [*FENCED, "ls", "--redis", "redis://alice:Hunter2@127.0.0.1:6379/abc"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "Hunter2" not in bad.stderr + bad.stdout
    assert "database 'abc' must be a number" in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line, no traceback


def test_cli_names_the_fix_of_a_near_miss_url() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_REDIS")}
    bad = subprocess.run(
        [*FENCED, "ls", "--redis", "redis:/:Hunter2@127.0.0.1:6379/11"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr == (
        "fenced: bad Redis URL 'redis:/:***@127.0.0.1:6379/11': a slash is missing after "
        "'redis:': write redis://:***@127.0.0.1:6379/11\n"
    )


def test_a_cluster_with_no_node_answering_fails_closed() -> None:
    port = free_port()
    with pytest.raises(
        ClaimUnavailable, match=rf"cannot reach Redis at redis\+cluster://127.0.0.1:{port}/"
    ):
        Claim(f"redis+cluster://127.0.0.1:{port}/?socket_connect_timeout=0.5", "x")


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:top/S3cret@host:6379/0",
        "redis://user:top?S3cret@host:6379/0",
        "redis://:top#S3cret@host:6379/0",
        "unix://user:top?S3cret@/tmp/redis.sock",
        "redis+sentinel://user:top/S3cret@h1:26379/mymaster/0",
        "redis://h/0?pasword=S3cret",  # a misspelt secret option
    ],
)
def test_a_refused_url_never_shows_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_url(url)
    assert "S3cret" not in str(info.value)
    assert "top" not in str(info.value)
    assert "S3cret" not in redact(url)


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("redis://host/1?db=2", "named twice"),
        ("redis+sentinel://h/m/1?db=2", "named twice"),
        ("redis+cluster://:pw@h1:7000/?password", "password= is empty"),
        ("redis://h/0?ssl_cert_reqs=required", "need TLS: use rediss://"),
    ],
)
def test_urls_that_would_connect_elsewhere_than_written_are_refused(url: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=fix):
        parse_url(url)


def test_every_entry_point_fails_closed_when_no_cluster_node_answers() -> None:
    import os

    port = free_port()
    url = f"redis+cluster://127.0.0.1:{port}/?socket_connect_timeout=0.5"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_REDIS")}
    for args in (["ls"], ["show", "x"], ["run", "x", "--", "true"]):
        done = subprocess.run(
            [*FENCED, *args[:1], "--redis", url, *args[1:]],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 69, (args, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback


def test_a_claim_name_that_is_not_a_str_says_so(redis_server: RedisServer) -> None:
    with pytest.raises(ConfigError, match=r"a claim name is a str, not int \(123\)"):
        Claim(redis_server.url, 123)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="claim name is empty"):
        Claim(redis_server.url, "")


def test_a_client_made_from_a_url_serves_a_forked_child_and_the_parent_alike(
    redis_server: RedisServer, fake_time: ManualClock
) -> None:
    """connect() keeps one client per URL in the process; a prefork worker's children
    inherit it. The child must get connections of its own, and leave the parent's be."""
    import os

    client = connect(redis_server.url)
    parent = Claim(redis_server.url, "parent", ttl=1.0, refresh_every=0.2, clock=fake_time)
    assert parent.acquire()
    pid = os.fork()
    if pid == 0:  # the child: the same cached client, its own connections
        code = 1
        try:
            child = Claim(redis_server.url, "child", ttl=5)
            assert child.redis is client
            assert child.acquire() and child.release()
            code = 0
        finally:
            os._exit(code)
    statuses: list[int] = []

    def child_ended() -> bool:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            statuses.append(status)
        return bool(ended)

    # The parent's lease is renewed meanwhile, in real time, as the child works.
    fake_time.keep_pace("the child", child_ended)
    assert os.waitstatus_to_exitcode(statuses[0]) == 0
    fake_time.run(1.5)  # past the parent's ttl: still renewed over its own connections
    assert parent.held and client.pttl(parent.key) > 0
    assert parent.release()
