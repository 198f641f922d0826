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
