"""The servers behind one client: a plain client is one server, a cluster client many.

Commands about keys go through the client as they are (a cluster client routes each to
its slot's master). Commands about a whole server — SCAN, TIME, INFO, CONFIG — answer
for one node only, so whatever must see every claim or every server asks each primary
on its own: :func:`primaries` gives them as plain clients, named ``host:port``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._client import is_cluster
from ._scripts import as_text

__all__ = ["is_cluster", "node_of", "primaries", "scan_keys", "server_times"]


def _address(client: Any) -> str:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if kwargs.get("path"):
        return str(kwargs["path"])
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def primaries(client: Any) -> list[tuple[str, Any]]:
    """(``host:port``, a plain client on it) for every primary; the client itself if plain."""
    if not is_cluster(client):
        return [(_address(client), client)]
    nodes = sorted(client.get_primaries(), key=lambda node: node.name)
    return [(node.name, client.get_redis_connection(node)) for node in nodes]


def node_of(client: Any, key: str) -> str:
    """The name of the primary that serves ``key`` (as :func:`primaries` names it)."""
    if not is_cluster(client):
        return _address(client)
    return str(client.get_node_from_key(key).name)


def scan_keys(client: Any, match: str, count: int = 1000) -> Iterator[str | bytes]:
    """Every key matching the glob ``match``, on every primary, each once (SCAN, not KEYS).

    Keys come as text; a key whose name is not UTF-8 (someone else's) comes as bytes.
    """
    seen: set[str | bytes] = set()
    for _, node in primaries(client):
        for key in node.scan_iter(match=match, count=count):
            try:
                text: str | bytes = as_text(key)
            except UnicodeDecodeError:
                text = bytes(key)
            if text not in seen:  # SCAN may return a key more than once
                seen.add(text)
                yield text


def server_times(client: Any) -> dict[str, float]:
    """Each primary's clock (Redis TIME, in epoch seconds), by name."""
    found: dict[str, float] = {}
    for name, node in primaries(client):
        seconds, micros = node.time()
        found[name] = int(seconds) + int(micros) / 1e6
    return found
