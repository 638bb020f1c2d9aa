"""A warm pool's store listens where it is told, not on every interface: torch's own TCPStore server, given
127.0.0.1, listens on all of them, and a pool's plans name what its workers load."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from inprocess.store import BoundStore

pytestmark = pytest.mark.unit


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_pools_store_is_reached_on_its_address_only_where_torchs_own_is_reached_on_any() -> None:
    bound = BoundStore("127.0.0.1", timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("plan/0", "p")
    assert bound.store.get("plan/0") == b"p"
    assert not reachable("127.0.0.2", bound.port)  # another address of this host: nothing listens there
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert reachable("127.0.0.2", plain.port), "torch's own store no longer listens everywhere: simplify BoundStore"
