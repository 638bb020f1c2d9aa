"""Xid errors since a point in time, read from the kernel log (/dev/kmsg).

NVML event sets only deliver Xids that happen while someone is registered (that is the node
sidecar's job); a diagnosis after the fact needs the history, which the driver writes to the
kernel log as "NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.".
/dev/kmsg is read directly (non-blocking, one record per read), so no command is run.
"""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass

_XID = re.compile(
    r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})[^)]*\): (?P<code>\d+)(?P<rest>.*)"
)


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One Xid the driver logged."""

    bus: str
    """PCI bus as the driver logs it, normalised: "0000:3b:00"."""
    code: int
    message: str
    monotonic_s: float
    """CLOCK_MONOTONIC time of the log record, seconds."""


def parse_kmsg_record(record: str) -> XidEvent | None:
    """An Xid from one /dev/kmsg record ("prio,seq,usec,flags;message"), or None."""
    header, sep, message = record.partition(";")
    if not sep:
        return None
    match = _XID.search(message)
    if not match:
        return None
    fields = header.split(",")
    try:
        usec = int(fields[2])
    except (IndexError, ValueError):
        return None
    return XidEvent(
        bus=match.group("bus").lower(), code=int(match.group("code")), message=message.strip(), monotonic_s=usec / 1e6
    )


def normalise_bus(pci_bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" -> "0000:3b:00", the form the driver logs."""
    domain, _, rest = pci_bus_id.lower().partition(":")
    return f"{domain[-4:]}:{rest.rsplit('.', 1)[0]}"


def read_kmsg(window_s: float, path: str = "/dev/kmsg") -> list[XidEvent]:
    """Xids logged in the last `window_s` seconds; raises OSError when the log cannot be read."""
    since = time.clock_gettime(time.CLOCK_MONOTONIC) - window_s
    events = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        while True:
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                break  # end of the buffer
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records were overwritten while we read; carry on with the next
                raise
            if not raw:
                break
            event = parse_kmsg_record(raw.decode(errors="replace").split("\n", 1)[0])
            if event is not None and event.monotonic_s >= since:
                events.append(event)
    finally:
        os.close(fd)
    return events
