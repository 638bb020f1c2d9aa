"""Clock offset of this host: an SNTP query to a named server, or the kernel's own NTP state.

Why it matters: rank timelines from different nodes (the straggler evidence) are only comparable
when the clocks agree. Both probes are in-process (a UDP packet; the adjtimex(2) system call with
no modes set, which only reads) so no command is run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import socket
import struct
import time
from dataclasses import dataclass
from datetime import timedelta

NTP_EPOCH_OFFSET = 2208988800  # seconds from 1900-01-01 (NTP) to 1970-01-01 (Unix)
TIME_ERROR = 5  # adjtimex return value: clock not synchronised
STA_UNSYNC = 0x0040
_SERVER = re.compile(r"^(?P<host>[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:]+\])(?::(?P<port>\d{1,5}))?$")


@dataclass(frozen=True, slots=True)
class ClockReading:
    """What could be learnt about this host's clock."""

    source: str
    """"sntp:<server>" or "kernel"."""
    synchronized: bool | None
    """Kernel NTP state (None when the source does not say)."""
    offset_s: float | None
    """Local clock minus reference, seconds (None when unknown)."""
    error_bound_s: float | None
    """The source's own error estimate: SNTP round-trip delay / 2, or the kernel's esterror."""


def parse_server(server: str) -> tuple[str, int]:
    """ "host", "host:port" or "[v6]:port" -> (host, port); anything else is a ValueError."""
    match = _SERVER.match(server)
    if not match or not 0 < int(match.group("port") or 123) < 65536:
        raise ValueError(f"ntp_server must be HOST or HOST:PORT, got {server!r}")
    return match.group("host").strip("[]"), int(match.group("port") or 123)


def sntp_offset(server: str, timeout: timedelta) -> ClockReading:
    """One SNTPv4 exchange (RFC 4330): offset = ((t1 - t0) + (t2 - t3)) / 2."""
    host, port = parse_server(server)
    request = bytearray(48)
    request[0] = (0 << 6) | (4 << 3) | 3  # LI 0, version 4, mode 3 (client)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout.total_seconds())
        t0 = time.time()
        sock.sendto(bytes(request), (host, port))
        data, _ = sock.recvfrom(512)
        t3 = time.time()
    if len(data) < 48:
        raise OSError(f"short SNTP reply from {server} ({len(data)} bytes)")
    t1 = _ntp_time(data[32:40])
    t2 = _ntp_time(data[40:48])
    offset = ((t1 - t0) + (t2 - t3)) / 2
    delay = (t3 - t0) - (t2 - t1)
    # Positive offset means the server is ahead; report local minus reference.
    return ClockReading(source=f"sntp:{server}", synchronized=None, offset_s=-offset, error_bound_s=max(delay, 0.0) / 2)


def _ntp_time(raw: bytes) -> float:
    seconds, fraction = struct.unpack("!II", raw)
    return seconds - NTP_EPOCH_OFFSET + fraction / 2**32


def ntp_timestamp(unix: float) -> bytes:
    """Unix time as an NTP timestamp (for building replies, e.g. in tests)."""
    seconds = int(unix) + NTP_EPOCH_OFFSET
    return struct.pack("!II", seconds, int((unix % 1) * 2**32))


class _Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_usec", ctypes.c_long)]


class _Timex(ctypes.Structure):
    # struct timex from <sys/timex.h>; ctypes applies the same alignment padding as C.
    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("constant", ctypes.c_long),
        ("precision", ctypes.c_long),
        ("tolerance", ctypes.c_long),
        ("time", _Timeval),
        ("tick", ctypes.c_long),
        ("ppsfreq", ctypes.c_long),
        ("jitter", ctypes.c_long),
        ("shift", ctypes.c_int),
        ("stabil", ctypes.c_long),
        ("jitcnt", ctypes.c_long),
        ("calcnt", ctypes.c_long),
        ("errcnt", ctypes.c_long),
        ("stbcnt", ctypes.c_long),
        ("tai", ctypes.c_int),
        ("_reserved", ctypes.c_int * 11),
    ]


def kernel_clock() -> ClockReading:
    """The kernel's NTP discipline state via adjtimex(2) (read-only: modes = 0)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    tx = _Timex()
    state = libc.adjtimex(ctypes.byref(tx))
    if state < 0:
        raise OSError(ctypes.get_errno(), "adjtimex failed")
    synced = state != TIME_ERROR and not tx.status & STA_UNSYNC
    return ClockReading(
        source="kernel", synchronized=synced, offset_s=None, error_bound_s=tx.esterror / 1e6 if synced else None
    )
