"""The store a warm pool's plans go through, listening only where it is told to.

torch's TCPStore server binds every interface whatever host it is given (`TCPStore("127.0.0.1", 0, is_master=True)`
listens on `*`): a pool meant for the loopback was reachable from the network, and its plans name what the workers
load. The server here takes a socket bound to that host alone (TCPStore's `master_listen_fd`).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class BoundStore:
    """A TCPStore server listening on `host` only (an ephemeral port), and the socket it listens on."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, 0))
            self._socket.listen(1024)
            self.port = int(self._socket.getsockname()[1])
            # NOTE: the store takes the descriptor; the socket object is kept so that it is not closed under it
            self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False, timeout=timeout,
                                       master_listen_fd=self._socket.fileno())
        except BaseException:
            self._socket.close()
            raise
