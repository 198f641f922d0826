"""Which Redis a claim talks to: one rule for every front end.

A client argument (``Claim``, ``@exclusive``, ``RedisPointer``, Celery's
``fenced_redis_url``, the command line's ``--redis``) is either a redis-py client, used
as it is, or a URL, turned into a client here. The URL forms:

- ``redis://[[user]:password@]host[:port][/db]`` and ``rediss://…`` (TLS), and
  ``unix://[[user]:password@]/path/to/socket[?db=N]``: a single server;
- ``redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db]`` (and
  ``rediss+sentinel://``): the master a Sentinel group names, found again after a
  failover. ``?sentinel_password=…`` (and ``sentinel_username``) when the sentinels
  require their own credentials;
- ``redis+cluster://[[user]:password@]host:port[,host:port…][/]`` (and
  ``rediss+cluster://``): a Redis Cluster, reached through any of its nodes.

Query parameters name client options (``socket_timeout=5``, ``ssl_ca_certs=/path``,
``ssl_cert_reqs=required``, ``client_name=…``) for every form. Anything a URL cannot
say (client certificates in memory, a custom retry policy, a credential provider) is
a client built by the caller: ``fenced_redis_client`` names a callable that returns one.

Every URL fenced prints goes through :func:`redact` first.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from ._errors import ClaimUnavailable, ConfigError

__all__ = [
    "SCHEMES",
    "client_from_setting",
    "connect",
    "connect_async",
    "describe_client",
    "is_cluster",
    "node_client",
    "parse_url",
    "probe_client",
    "redact",
    "refresh_slots",
    "require_async",
]

log = logging.getLogger("fenced")

#: The URL schemes fenced understands, and the topology each names.
SCHEMES = {
    "redis": "standalone",
    "rediss": "standalone",
    "unix": "standalone",
    "redis+sentinel": "sentinel",
    "rediss+sentinel": "sentinel",
    "redis+cluster": "cluster",
    "rediss+cluster": "cluster",
}

EXAMPLES = (
    "redis://localhost:6379/1, rediss://user:password@host:6380/0, "
    "unix:///run/redis.sock?db=1, redis+sentinel://h1:26379,h2:26379/mymaster/1, "
    "redis+cluster://h1:7000,h2:7001/"
)

# A scheme fenced knows, then what was typed for its "://" (some of it, or more, or
# backslashes): the near misses a user types (redis:/host, redis:host:6379, redis//host),
# which urllib reads as a scheme and a path with no host, and redis-py refuses as having
# no scheme (or, redis:///host, takes for localhost:6379/0).
_NEAR = re.compile(
    "(?i)("
    + "|".join(re.escape(s) for s in sorted(SCHEMES, key=len, reverse=True))
    + r")(:*)([/\\]*)"
)
# host:port[/db] (a host named like a scheme too: redis:6379 is the server "redis").
_PORT_DB = re.compile(r"\d+(?:/\d*)?(?:\?.*)?", re.DOTALL)
# A server given without a scheme: [credentials@]host[:port][/db][?options].
_BARE = re.compile(
    r"(?:[^@/?#]*@)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z][\w.-]*|\d{1,3}(?:\.\d{1,3}){3})"
    r"(?::\d+)?(?:/\d*)?(?:\?.*)?",
    re.DOTALL,
)

#: What follows ``scheme://`` in an example of each topology.
_EXAMPLE_SERVERS = {
    "standalone": "localhost:6379/0",
    "sentinel": "localhost:26379/mymaster/0",
    "cluster": "localhost:7000/",
}

# Query parameters and how to read them (the rest are refused, so a typo is not lost).
_FLOAT = ("socket_timeout", "socket_connect_timeout")
_INT = ("health_check_interval", "max_connections")
_BOOL = ("socket_keepalive", "ssl_check_hostname", "decode_responses")
_TEXT = (
    "client_name",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_min_version",
)
_SENTINEL_ONLY = ("sentinel_password", "sentinel_username")
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_CERT_REQS = ("none", "optional", "required")
_TLS_VERSIONS = ("TLSv1_2", "TLSv1_3")


def _tls_version(text: str) -> Any:
    import ssl

    return ssl.TLSVersion[{v.lower(): v for v in _TLS_VERSIONS}[text.lower()]]


# redis-py checks some options only when it first connects (and then with a traceback):
# these are read here, so a bad value is a ConfigError naming the option.
_READ: dict[str, Callable[[str], Any]] = {
    **dict.fromkeys(_FLOAT, float),
    **dict.fromkeys(_INT, int),
    **dict.fromkeys(_BOOL, lambda text: _FLAGS[text.lower()]),
    "ssl_cert_reqs": dict(zip(_CERT_REQS, _CERT_REQS, strict=True)).__getitem__,
    "ssl_min_version": _tls_version,
}
#: What a value of an option with a fixed set of values may be, for the message.
_CHOICES = {
    **dict.fromkeys(_BOOL, ("true", "false")),
    "ssl_cert_reqs": _CERT_REQS,
    "ssl_min_version": _TLS_VERSIONS,
}
#: Query options whose values are printed (every other value is shown as ***).
_PLAIN_PARAMS = frozenset((*_FLOAT, *_INT, *_BOOL, *_TEXT, "db", "username", "sentinel_username"))
_ALL_PARAMS = (*_PLAIN_PARAMS, "password", *_SENTINEL_ONLY)


def _meant(key: str) -> str | None:
    """The option a mistyped ``key`` most likely meant, if one is close."""
    close = difflib.get_close_matches(key, _ALL_PARAMS, n=1, cutoff=0.8)
    return close[0] if close else None


def _plain(key: str) -> bool:
    """A query value that holds no secret: a known plain option, or a typo of one."""
    return key in _PLAIN_PARAMS or _meant(key) in _PLAIN_PARAMS


class RedisURL:
    """A parsed Redis URL: its topology, addresses, credentials and options."""

    __slots__ = ("db", "hosts", "options", "password", "raw", "scheme", "service", "username")

    def __init__(self, raw: str, scheme: str) -> None:
        self.raw = raw
        self.scheme = scheme
        self.hosts: list[tuple[str, int]] = []
        self.service: str | None = None
        self.db = 0
        self.username: str | None = None
        self.password: str | None = None
        self.options: dict[str, Any] = {}

    @property
    def topology(self) -> str:
        return SCHEMES[self.scheme]

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"bad Redis URL {redact(url)!r}: {why}")


def _read_options(url: str, query: str, topology: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    known: tuple[str, ...] = (*_FLOAT, *_INT, *_BOOL, *_TEXT, "username", "password")
    known += _SENTINEL_ONLY if topology == "sentinel" else ()
    known += ("db",) if topology != "cluster" else ()
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in known:
            meant = _meant(key)
            fix = (
                f"did you mean {meant}?" if meant in known else f"known: {', '.join(sorted(known))}"
            )
            raise _bad(url, f"unknown option {key!r}; {fix}")
        try:
            options[key] = _READ.get(key, str)(value)
        except (KeyError, ValueError):
            choices = _CHOICES.get(key)
            hint = f": give one of {', '.join(choices)}" if choices else ""
            raise _bad(url, f"option {key}={value!r} is not a valid value{hint}") from None
    return options


def _read_db(url: str, text: str) -> int:
    if not re.fullmatch(r"\d+", text):
        raise _bad(url, f"the database {text!r} must be a number such as /0 or /1")
    return int(text)


def _read_hosts(url: str, netloc: str, default_port: int) -> list[tuple[str, int]]:
    hosts = []
    for part in netloc.split(","):
        part = part.strip()
        match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d*))?", part)
        if not part or match is None:
            raise _bad(url, f"{part!r} is not a host or host:port")
        host = match.group(1) or match.group(3)
        port = match.group(2) or match.group(4)
        if port is not None and (not port or not 0 < int(port) < 65536):
            raise _bad(url, f"{part!r} has no valid port")
        hosts.append((host, int(port) if port else default_port))
    return hosts


def parse_url(url: str) -> RedisURL:
    """Read a Redis URL of any form fenced accepts; ConfigError naming the fix otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"a Redis URL must be a non-empty string (examples: {EXAMPLES})")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if not _ or scheme not in SCHEMES:
        raise _bad(
            url,
            _near_miss(url.strip())
            or f"the scheme must be one of {', '.join(sorted(SCHEMES))} (examples: {EXAMPLES})",
        )
    if scheme != "unix" and rest.startswith("/"):
        # redis:///host (redis-py reads it as the default server, localhost:6379/0).
        raise _bad(url, _slash_too_many(scheme, rest))
    parsed = RedisURL(url, scheme)
    topology = SCHEMES[scheme]
    # The credentials end at the last '@'; what they hold must be percent-encoded, so a
    # password is never taken for a path, a query or a host (and never printed).
    creds, at, rest = rest.rpartition("@")
    if at:
        if any(ch in creds for ch in "/?#"):
            raise _bad(
                url,
                "percent-encode '/', '?', '#' and '@' in the user name and password "
                "(%2F, %3F, %23, %40)",
            )
        user, colon, password = creds.partition(":")
        parsed.username = unquote(user) or None
        parsed.password = unquote(password) if colon else None
    rest, _, query = rest.partition("?")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise _bad(url, "a '#' is not part of a Redis URL (percent-encode it as %23)")
    if scheme == "unix":
        hosts, slash, path = "", "/", rest
        if not path.startswith("/"):
            raise _bad(url, "a unix URL names an absolute socket path: unix:///path/to/sock")
    else:
        hosts, slash, path = rest.partition("/")
    options = _read_options(url, query, topology)
    for key in ("username", "password"):
        if key in options and not options[key]:
            raise _bad(url, f"{key}= is empty: give a value or leave the option out")
    parsed.username = options.pop("username", parsed.username)
    parsed.password = options.pop("password", parsed.password)
    if not parsed.tls and any(key.startswith("ssl_") for key in options):
        raise _bad(url, "ssl_* options need TLS: use rediss:// (or rediss+sentinel://, ...)")
    db_option = options.pop("db", None)
    db_path = ""  # the database the path names
    if scheme == "unix":
        parsed.service = path  # the socket path
    elif topology == "sentinel":
        parsed.hosts = _read_hosts(url, hosts, 26379)
        parts = [p for p in path.split("/") if p] if slash else []
        if not parts or len(parts) > 2:
            raise _bad(url, "a Sentinel URL ends in /service or /service/db, e.g. /mymaster/0")
        parsed.service = unquote(parts[0])
        db_path = parts[1] if len(parts) == 2 else ""
    else:
        parsed.hosts = _read_hosts(url, hosts, 6379)
        db_path = path.strip("/") if slash else ""
        if topology == "standalone" and len(parsed.hosts) != 1:
            raise _bad(url, "redis:// names one server (use redis+sentinel:// or redis+cluster://)")
        if topology == "cluster" and db_path not in ("", "0"):
            raise _bad(url, "a Redis Cluster has only database 0: end the URL in / or /0")
    if db_path and db_option is not None:
        raise _bad(url, "the database is named twice (path and ?db=): keep one")
    if db_path or db_option is not None:
        parsed.db = _read_db(url, db_path or db_option)
    parsed.options = options
    return parsed


def _near_miss(url: str) -> str | None:
    """What is wrong with a URL close to one fenced reads, and the URL to write instead
    (its password as ***); None when it is not close to one."""
    m = _NEAR.match(url)
    if m is None or not (m[2] or m[3]):
        if url.lower() in SCHEMES:  # "redis": a scheme and nothing else
            return f"it names no server: write e.g. {_example(url.lower())}"
        return _no_scheme(url)
    scheme, colons, slashes, rest = m[1].lower(), m[2], m[3], url[m.end() :]
    if colons == ":" and not slashes and _PORT_DB.fullmatch(rest):
        return _no_scheme(url)  # redis:6379 is port 6379 of the server "redis"
    if not rest:
        return f"it names no server: write e.g. {_example(scheme)}"
    want = "///" if scheme == "unix" else "//"  # unix:// and an absolute path
    fix = f"write {redact(f'{scheme}:{want}{rest}')}"
    if colons == ":" and want.startswith(slashes):
        missing = len(want) - len(slashes)
        what = "a slash is" if missing == 1 else f"'{want[:missing]}' is"
        return f"{what} missing after '{m[1]}:': {fix}"
    if not colons and slashes == want:
        return f"the ':' is missing after '{m[1]}': {fix}"
    return f"'{m[0]}' is not '{scheme}:{want}': {fix}"


def _example(scheme: str) -> str:
    """A URL of the scheme, for a message."""
    if scheme == "unix":
        return "unix:///run/redis.sock"
    return f"{scheme}://{_EXAMPLE_SERVERS[SCHEMES[scheme]]}"


def _no_scheme(url: str) -> str | None:
    """A server named without a scheme (host:6379): the redis:// URL of it, else None."""
    if not _BARE.fullmatch(url):
        return None
    return f"it has no scheme: write {redact('redis://' + url)} (rediss:// for TLS)"


def _slash_too_many(scheme: str, rest: str) -> str:
    after = rest.lstrip("/")
    server = re.split("[/?]", after.rpartition("@")[2], maxsplit=1)[0]
    if not server or server.isdigit():
        return f"it names no server: write e.g. {_example(scheme)}"
    count = len(rest) - len(after) + 2
    return f"{count} slashes after '{scheme}:', not 2: write {redact(f'{scheme}://{after}')}"


def redact(url: str) -> str:
    """A URL fit to print: its password, and every query value that may be secret, as ***.

    Whatever precedes the last '@' is taken for credentials, so an unencoded '/', '?'
    or '#' in a password is masked too; query values are shown only for the options
    known to hold no secret.
    """
    try:
        scheme, sep, rest = url.partition("://")
        if not sep:
            # Mistyped (redis:/:pw@host, :pw@host:6379): what precedes the last '@' is
            # still taken for credentials.
            near = _NEAR.match(url)
            cut = near.end() if near and (near[2] or near[3]) else 0
            scheme, rest = url[:cut], url[cut:]
        creds, at, rest = rest.rpartition("@")
        shown = ""
        if at:
            user, colon, _password = creds.partition(":")
            if any(ch in user for ch in "/?#"):
                user = "***"
            shown = f"{user}:***@" if colon else f"{user}@"
        head, q, query = rest.partition("?")
        if q:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, v if _plain(k) else "***") for k, v in pairs], safe="*/:")
        return f"{scheme}{sep}{shown}{head}{q}{query}"
    except Exception:  # never let a message fail over its URL
        return "<a Redis URL>"


def _build(parsed: RedisURL, options: Mapping[str, Any], *, asyncio: bool = False) -> Any:
    """The client a parsed URL names: redis-py's, or with ``asyncio`` redis.asyncio's."""
    # The two families take the same arguments.
    base = "redis.asyncio" if asyncio else "redis"
    family, cluster, sentinels = (
        importlib.import_module(base + m) for m in ("", ".cluster", ".sentinel")
    )

    kwargs: dict[str, Any] = {**parsed.options, **options}
    sentinel_auth = {
        key.removeprefix("sentinel_"): kwargs.pop(key) for key in _SENTINEL_ONLY if key in kwargs
    }
    if parsed.username:
        kwargs["username"] = parsed.username
    if parsed.password is not None:
        kwargs["password"] = parsed.password
    if parsed.scheme == "unix":
        return family.Redis(unix_socket_path=parsed.service, db=parsed.db, **kwargs)
    if parsed.tls:
        kwargs["ssl"] = True
    if parsed.topology == "standalone":
        host, port = parsed.hosts[0]
        return family.Redis(host=host, port=port, db=parsed.db, **kwargs)
    if parsed.topology == "sentinel":
        # The sentinels get the TLS and timeout settings, and their own credentials.
        sentinel_kwargs = {
            k: v for k, v in kwargs.items() if k not in ("username", "password", "db")
        }
        # A sentinel that does not answer must not hold up finding the master.
        sentinel_kwargs.setdefault("socket_timeout", 1.0)
        sentinel_kwargs.setdefault("socket_connect_timeout", 1.0)
        sentinel_kwargs.update(sentinel_auth)
        sentinel = sentinels.Sentinel(parsed.hosts, sentinel_kwargs=sentinel_kwargs, **kwargs)
        return sentinel.master_for(parsed.service, db=parsed.db)
    kwargs.pop("max_connections", None)
    nodes = [cluster.ClusterNode(h, p) for h, p in parsed.hosts]
    return cluster.RedisCluster(startup_nodes=nodes, **kwargs)


_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
# Client classes that passed connect()'s checks (a synchronous execute_command).
_SYNC_CLIENTS: set[type] = set()
_cache_lock = threading.Lock()


def _keyed(value: Any) -> Any:
    """An option as part of a cache key: a hashable object itself (the key keeps it
    alive, so no other object can take its address and its repr), else its repr."""
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def connect(target: Any, *, what: str = "claims", **options: Any) -> Any:
    """A client for ``target``: a redis-py client as it is, or one built from a URL.

    Clients built from one URL (with the same options) are shared within the process:
    each has a connection pool, and redis-py pools reconnect in a forked child.
    """
    if isinstance(target, str):
        parsed = parse_url(target)
        key = (target, tuple(sorted((k, _keyed(v)) for k, v in options.items())))
        with _cache_lock:
            client = _cache.get(key)
        if client is not None:
            return client
        # Built outside the lock: a cluster client asks its nodes when made, and one
        # that does not answer must not hold up clients of other URLs.
        try:
            client = _build(parsed, options)
        except (TypeError, ValueError) as exc:
            raise _bad(target, str(exc)) from None
        except Exception as exc:
            if not _unreachable(exc):
                raise
            raise ClaimUnavailable(
                f"cannot reach Redis at {redact(target)} ({exc}); nothing was started (fail closed)"
            ) from exc
        with _cache_lock:
            return _cache.setdefault(key, client)
    if target is None:
        raise ConfigError(
            f"no Redis given for {what}: pass a redis-py client or a URL such as "
            "'redis://localhost:6379/0'"
        )
    if type(target) in _SYNC_CLIENTS and "execute_command" not in vars(target):
        return target  # checked below before (a claim checks its client on every run)
    evalsha = getattr(target, "evalsha", None)
    if evalsha is None or not callable(evalsha):
        raise ConfigError(
            f"{type(target).__name__} is not a Redis client: pass a redis-py client "
            f"(redis.Redis, redis.cluster.RedisCluster, Sentinel.master_for(...)) or a URL "
            f"such as {EXAMPLES.split(', ')[0]}"
        )
    if inspect.iscoroutinefunction(getattr(target, "execute_command", None)):
        raise ConfigError(
            f"{type(target).__name__} is an asyncio client: pass a synchronous redis-py "
            "client here (redis.Redis), or use fenced.aio with redis.asyncio clients"
        )
    if hasattr(target, "__dict__") and "execute_command" not in vars(target):
        _SYNC_CLIENTS.add(type(target))
    return target


def probe_client(url: str, timeout: float, **options: Any) -> Any:
    """A client of its own for ``url`` (never shared), for one quick question: it waits
    at most ``timeout`` seconds to connect and for each answer, and never retries. The
    caller closes it."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    quick = {
        **options,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    return _build(parse_url(url), quick)


def require_async(target: Any, what: str, instead: str) -> Any:
    """``target`` when it is a ``redis.asyncio`` client, else ConfigError naming the fix."""
    if target is None or not inspect.iscoroutinefunction(getattr(target, "execute_command", None)):
        raise ConfigError(
            f"{type(target).__name__} is not a redis.asyncio client: pass one to {what} "
            "(e.g. redis.asyncio.from_url('redis://localhost:6379/0')), or use "
            f"{instead} with a synchronous client or a URL"
        )
    return target


def connect_async(url: str, **options: Any) -> Any:
    """A new ``redis.asyncio`` client for a URL of any form (one per event loop: its
    connections belong to the loop that uses them)."""
    parsed = parse_url(url)
    try:
        return _build(parsed, options, asyncio=True)
    except (TypeError, ValueError) as exc:
        raise _bad(url, str(exc)) from None


def client_from_setting(value: Any, *, setting: str = "fenced_redis_client") -> Any:
    """The client a ``fenced_redis_client`` setting gives: a callable, or its dotted path.

    A dotted path is ``package.module:attribute`` (or ``package.module.attribute``). The
    callable is called with no arguments and must return a synchronous redis-py client;
    a client object given directly is used as it is.
    """
    target = value
    if isinstance(value, str):
        module_name, colon, attr = value.partition(":")
        if not colon:
            module_name, _, attr = value.rpartition(".")
        if not module_name or not attr:
            raise ConfigError(
                f"{setting}={value!r} must name a callable as 'package.module:function'"
            )
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"{setting}={value!r} cannot be loaded ({exc}): name a callable as "
                "'package.module:function' importable by this process"
            ) from None
    if callable(target) and not hasattr(target, "evalsha"):
        made: Callable[[], Any] = target
        try:
            target = made()
        except Exception as exc:
            if _unreachable(exc):
                raise ClaimUnavailable(f"{setting}={value!r} could not reach Redis: {exc}") from exc
            raise ConfigError(f"{setting}={value!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return connect(target, what=setting)
    except ConfigError as exc:
        raise ConfigError(f"{setting} gave no usable client: {exc.message}") from None


def _unreachable(exc: BaseException) -> bool:
    """Whether making a client failed for want of an answering Redis."""
    from redis.exceptions import ConnectionError, RedisClusterException

    return isinstance(exc, (ConnectionError, RedisClusterException, OSError))


def is_cluster(client: Any) -> bool:
    """Whether a client is a Redis Cluster client (its nodes are renewed apart)."""
    return hasattr(client, "get_primaries") and hasattr(client, "nodes_manager")


def describe_client(client: Any) -> str:
    """Where a client points, fit to print (no password), for error messages."""
    try:
        if is_cluster(client):
            nodes = client.get_primaries() or client.get_nodes()
            hosts = ",".join(f"{n.host}:{n.port}" for n in nodes[:3])
            more = ",…" if len(nodes) > 3 else ""
            return f"redis+cluster://{hosts}{more}/"
        pool = getattr(client, "connection_pool", None)
        if pool is not None and hasattr(pool, "service_name"):
            manager = getattr(pool, "sentinel_manager", None)
            sentinels = getattr(manager, "sentinels", [])
            hosts = ",".join(
                "{host}:{port}".format(**s.connection_pool.connection_kwargs) for s in sentinels[:3]
            )
            db = pool.connection_kwargs.get("db", 0)
            return f"redis+sentinel://{hosts}/{pool.service_name}/{db}"
        kw = getattr(pool, "connection_kwargs", {}) or {}
        if "path" in kw:
            where = f"unix://{kw['path']}"
        else:
            tls = "SSL" in getattr(pool, "connection_class", type).__name__
            scheme = "rediss" if tls else "redis"
            where = f"{scheme}://{kw.get('host', '?')}:{kw.get('port', 6379)}"
        return f"{where}/{kw.get('db', 0)}"
    except Exception:
        return type(client).__name__


# -- routing to a cluster's nodes -------------------------------------------------------


def node_client(client: Any, key: str) -> Any:
    """The client of the one server that holds ``key``: a cluster's node, else the client.

    On a cluster this reads the client's slot map (no round trip); a map that is out of
    date is answered with MOVED, and :func:`refresh_slots` brings it up to date.
    """
    if not is_cluster(client):
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


_refreshed: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_refresh_lock = threading.Lock()
#: A cluster's slot map is read again at most this often on behalf of fenced.
SLOT_REFRESH_INTERVAL = 0.5


def refresh_slots(client: Any) -> None:
    """Read a cluster's slot map again (after MOVED, or a node that stopped answering).

    At most once per :data:`SLOT_REFRESH_INTERVAL` per client; errors are left to the
    next try (the claims it serves are retried, and declared lost only at their deadline).
    """
    if not is_cluster(client):
        return
    now = time.monotonic()
    with _refresh_lock:
        if now - _refreshed.get(client, -math.inf) < SLOT_REFRESH_INTERVAL:
            return
        _refreshed[client] = now
    try:
        client.nodes_manager.initialize()
    except Exception as exc:  # a cluster with no node answering: try again later
        log.warning("fenced: could not read the cluster's slot map: %s", exc)
