"""fenced.testing's servers: a port picked for a server and taken by another process
before the server binds it is picked again; a port given, or kept since, is not."""

from __future__ import annotations

import socket
import subprocess

import pytest

from _wait import wait_for
from fenced.testing import RedisServer


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_picked_port_taken_before_the_start_is_picked_again() -> None:
    server = RedisServer()
    taken = server.port
    squatter = subprocess.Popen(
        [server.binary, "--port", str(taken), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for("the squatter to listen", lambda: _answers(taken), proc=squatter)
        with server:
            assert server.port != taken
            # The server answering is this one, not the squatter on the first port.
            assert server.proc is not None
            assert server.client().info("server")["process_id"] == server.proc.pid
            # Its address is its own from now on: a restart keeps it.
            port = server.port
            server.restart()
            assert server.port == port
    finally:
        squatter.kill()
        squatter.wait()


def test_a_given_port_is_never_picked_again() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        server = RedisServer(port=port)
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start(timeout=5)
        assert server.port == port
        server.stop()


def test_a_proxy_holds_the_reply_of_the_one_marked_request() -> None:
    """``hold_reply_to``: the marked command lands, its reply is held on its connection
    only (another connection goes on), and delivered when healed; None disarms."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from fenced.testing import TcpProxy

    with RedisServer() as srv, TcpProxy(srv.port) as proxy:
        direct = srv.client(decode_responses=True)
        held: list[bool] = []
        proxy.hold_reply_to(b"marked-key", lambda: held.append(True))
        once = Retry(NoBackoff(), 0)  # a timeout is the test's answer, not a retry's cue
        client = redis.Redis(port=proxy.port, socket_timeout=0.5, retry=once, decode_responses=True)
        other = redis.Redis(port=proxy.port, socket_timeout=5, decode_responses=True)
        assert client.set("plain", "1")  # not marked: answered
        with pytest.raises(redis.TimeoutError):
            client.set("marked-key", "landed")
        assert held == [True]
        assert direct.get("marked-key") == "landed"  # the command ran
        assert other.set("marked-key", "again") and other.get("plain") == "1"
        proxy.hold_reply_to(b"plain")
        proxy.hold_reply_to(None)  # disarmed before any request passed
        assert other.get("plain") == "1"
        client.close()
        other.close()
        direct.close()
