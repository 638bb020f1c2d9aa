"""Abort a generation's process group from another thread, so that no rank waits in it for a peer that moved on.

On NCCL that is `_abort_process_group` (it aborts the communicators). Gloo has no such thing: `abort()` and
`shutdown()` return, but an all-gather blocked on a live peer stays blocked (measured here, torch 2.13: released
only by the collective timeout, or when the peer's sockets close, which a peer's `destroy_process_group` does not
do while its modules still hold the group). What does wake it is its own connections ending: the process group's
TCP sockets are shut down here (shutdown(2) on a duplicate, so gloo still owns and closes the descriptors), and
every operation on them fails at once with "Connection closed". The group's sockets are the TCP sockets opened
since the generation began, told apart from the process's others by their inodes.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch.distributed as dist

FD_DIR = Path("/proc/self/fd")


def _socket_fds() -> dict[int, str]:
    """fd -> the inode name ('socket:[123]') of every socket this process has open."""
    out: dict[int, str] = {}
    for entry in FD_DIR.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:"):
            out[int(entry.name)] = target
    return out


def open_sockets() -> frozenset[str]:
    """The inode names of every socket this process has open now."""
    return frozenset(_socket_fds().values())


class GenerationSockets:
    """Taken just before a generation's process group is made; `abort()` ends what that group opened since.

    `keep`: the sockets never to end (a warm worker's own connections to its pool's store, taken when it started):
    then every other TCP connection counts as the generation's, what was open when it began included. NOTE: a
    snapshot at the generation's start once held a rank's own gloo connections (1 socket shut down where its peers
    shut 4 to 9), and that rank stayed in a reduce-scatter of the aborted generation while its peers waited for it
    in the next one's rendezvous (`make demo`, after a warm rollback). Whatever else is open then is a leftover of
    an older generation, as dead as the one aborted."""

    def __init__(self, keep: frozenset[str] | None = None) -> None:
        self.before = set(keep if keep is not None else open_sockets())

    def opened_since(self) -> list[int]:
        return [fd for fd, inode in _socket_fds().items() if inode not in self.before]

    def abort(self, backend: str) -> int:
        """Make every collective of the generation fail now; returns how many sockets were shut down."""
        if backend != "gloo" and dist.is_initialized():
            dist.distributed_c10d._abort_process_group()
            return 0
        closed = 0
        for fd in self.opened_since():
            try:
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                # NOTE: never gloo's listening socket: its accept thread ends the process when accept fails.
                if (dup.type == socket.SOCK_STREAM and dup.family in (socket.AF_INET, socket.AF_INET6)
                        and not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    dup.shutdown(socket.SHUT_RDWR)
                    closed += 1
            except OSError:
                pass  # not connected, or already closed
            finally:
                dup.close()
        return closed


TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def describe_sockets(keep: frozenset[str] | set[str]) -> list[str]:
    """This process's TCP sockets as the kernel sees them (ports, state, queues), each marked kept or not: what a
    rank that cannot leave an aborted generation says before it exits, so the connection it waits on can be told."""
    mine = {inode.removeprefix("socket:[").removesuffix("]"): (fd, inode) for fd, inode in _socket_fds().items()}
    lines = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[9] in mine:
                fd, inode = mine[f[9]]
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in (f[1], f[2]))
                tx, rx = f[4].split(":")
                lines.append(f"fd {fd} {table} port {local} -> {remote} {TCP_STATES.get(f[3], f[3])} tx_queue "
                             f"{int(tx, 16)} rx_queue {int(rx, 16)}{' (kept)' if inode in keep else ''}")
    return lines
