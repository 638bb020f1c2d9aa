"""Who sent a rank datagram, as the kernel says, and whom the sidecar listens to.

SO_PEERCRED names the peer of a connected stream socket; a datagram socket has no peer, so the sidecar's socket
sets SO_PASSCRED and the kernel attaches the sender's pid, uid and gid to every datagram (SCM_CREDENTIALS,
unix(7)). A sender cannot choose them: naming another pid needs CAP_SYS_ADMIN, another uid CAP_SETUID.

A datagram is taken only from a process of the sidecar's own user (or root, who could do anything anyway) and
only when the pid it claims in its envelope is the pid that sent it. So another local user cannot add ranks,
forge a NaN loss (which makes the healer roll the job back) or grow the series, and a process of our user cannot
speak for a pid it is not.

NOTE: the kernel's pid is the sender's as seen from the sidecar's PID namespace (0 when the sender is not visible
there): the sidecar must share the ranks' PID namespace, as its liveness checks already require.
NOTE: "a live pid": the kernel names the process that sent the datagram, so it was alive when it sent it. The pid
is not looked up in /proc again on receipt: a rank that raises sends its exception event and exits at once, and
that last event (what the crash detector names the cause by) must not be lost to the race.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
CREDENTIALS_SPACE = socket.CMSG_SPACE(_UCRED.size)
"""Ancillary buffer size recvmsg needs for one SCM_CREDENTIALS message."""
ROOT = 0


@dataclass(frozen=True, slots=True)
class Credentials:
    """The sender of one datagram, as the kernel attached it."""

    pid: int
    uid: int
    gid: int


def pass_credentials(sock: socket.socket) -> None:
    """Have the kernel attach the sender's credentials to every datagram `sock` receives. Set it before bind, so
    that no datagram arrives without them."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)


def credentials(ancdata: Iterable[tuple[int, int, bytes]]) -> Credentials | None:
    """The SCM_CREDENTIALS of one recvmsg's ancillary data, or None when it carries none."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return Credentials(*_UCRED.unpack_from(data))
    return None


class SenderPolicy:
    """Whether a datagram's sender may speak for the rank record it sent."""

    def __init__(self, uid: int | None = None) -> None:
        self.uid = os.geteuid() if uid is None else uid

    def refuse_sender(self, creds: Credentials | None) -> tuple[str, str] | None:
        """None when this sender may send records at all (checked before decoding: a stranger's bytes are not even
        parsed); else (reason, message): a short key to count by and a sentence for the log."""
        if creds is None:
            return "no-credentials", "the datagram carries no sender credentials (SO_PASSCRED is not set?)"
        if creds.uid not in (self.uid, ROOT):
            return "other-user", (f"sent by uid {creds.uid} (pid {creds.pid}); this sidecar takes records only from "
                                  f"uid {self.uid}, the user it runs as (run the ranks as that user)")
        if creds.pid == 0:
            return "other-pid-namespace", ("the sender is outside this sidecar's PID namespace: run the sidecar in "
                                           "the ranks' PID namespace (same host, or hostPID for both)")
        return None

    @staticmethod
    def refuse_claim(sender_pid: int, claimed_pid: int) -> tuple[str, str] | None:
        """None when the record's envelope names the pid that sent it; else (reason, message)."""
        if sender_pid != claimed_pid:
            return "pid-mismatch", (f"the record claims pid {claimed_pid} but pid {sender_pid} sent it (or the "
                                    "sidecar and the ranks are in different PID namespaces)")
        return None
