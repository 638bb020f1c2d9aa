"""What a rank that cannot leave an aborted generation says of its sockets before it exits (inprocess/abort.py):
every TCP socket it holds, as the kernel sees it, with the ones the abort keeps marked."""

from __future__ import annotations

import socket

import pytest

from inprocess.abort import describe_sockets, open_sockets

pytestmark = pytest.mark.unit


def test_each_tcp_socket_is_described_with_its_state_and_the_kept_ones_are_marked() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        kept = open_sockets()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                lines = describe_sockets(kept)
                mine = client.getsockname()[1]
    assert any(f"port {port} -> 0 LISTEN" in line and line.endswith("(kept)") for line in lines), lines
    assert any(f"port {mine} -> {port} ESTABLISHED" in line and "(kept)" not in line for line in lines), lines
