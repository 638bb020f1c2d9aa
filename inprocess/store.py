"""The store a warm pool's plans go through, listening only where it is told to.

torch's TCPStore server binds every interface whatever host it is given (`TCPStore("127.0.0.1", 0, is_master=True)`
listens on `*`): a pool meant for the loopback was reachable from the network. The server here takes a socket bound
to that host alone (TCPStore's `master_listen_fd`). It still takes writes from any client that reaches it there, so
what goes through it is sealed with the pool's key (wire/warm_seal.py).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class BoundStore:
    """A TCPStore server listening on `host` only (an ephemeral port)."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening.bind((host, 0))
            listening.listen(1024)
            self.port = int(listening.getsockname()[1])
            self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False, timeout=timeout,
                                       master_listen_fd=listening.fileno())
        except BaseException:
            listening.close()
            raise
        # NOTE: the store owns the descriptor from here on and closes it. Left to the socket object too, whichever
        # was collected first closed it under the other: the test process aborted (a fresh make test) as the
        # store's server loop found its listening descriptor gone.
        listening.detach()
