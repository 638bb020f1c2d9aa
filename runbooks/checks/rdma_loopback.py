"""RDMA loopback with perftest's `ib_write_bw`: server and client on this node, through the NIC.

This exercises the NIC, its PCIe link and the driver without the fabric. It runs only where the
tool is on PATH and /sys/class/infiniband lists a device; otherwise it is skipped with the reason.
Device names are taken only from what /sys lists and passed as separate argv items.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ground.commands import run_command

IB_SYSFS = Path("/sys/class/infiniband")
_DEVICE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class RdmaResult:
    device: str
    gbit_s: float | None
    error: str | None = None


def available_devices(sysfs: Path = IB_SYSFS) -> list[str]:
    if not sysfs.is_dir():
        return []
    return sorted(p.name for p in sysfs.iterdir() if _DEVICE.match(p.name))


def skip_reason(devices: list[str]) -> str | None:
    if shutil.which("ib_write_bw") is None:
        return "ib_write_bw (perftest) not found on PATH"
    if not devices:
        return f"no RDMA device under {IB_SYSFS}"
    return None


def parse_bw_average(output: str) -> float | None:
    """Average bandwidth in Gbit/s from ib_write_bw's result table (--report_gbits or MB/sec)."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "BW average" not in line:
            continue
        # Columns are separated by runs of spaces; header names contain single spaces ("BW average[Gb/sec]").
        headers = re.split(r"\s{2,}", line.strip())
        column = next(j for j, h in enumerate(headers) if h.startswith("BW average"))
        for row in lines[i + 1 :]:
            fields = row.split()
            if fields and all(re.match(r"^[\d.]+$", f) for f in fields) and len(fields) > column:
                value = float(fields[column])
                return value if "Gb/sec" in headers[column] else value * 8 / 1000
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback(device: str, duration: timedelta, timeout: timedelta) -> RdmaResult:
    """One ib_write_bw server/client pair on `device`, client connecting to this host."""
    if device not in available_devices():
        raise ValueError(f"RDMA device {device!r} is not listed under {IB_SYSFS}")
    port = str(_free_port())
    base = [
        "ib_write_bw",
        "-d",
        device,
        "-p",
        port,
        "-D",
        str(max(1, int(duration.total_seconds()))),
        "--report_gbits",
        "-F",
    ]
    server = subprocess.Popen(base, shell=False, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # the server must listen before the client connects
        client = run_command([*base, "127.0.0.1"], timeout)
    finally:
        try:
            server.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()
    if not client.ok:
        return RdmaResult(device=device, gbit_s=None, error=(client.err or client.out).strip()[-300:])
    value = parse_bw_average(client.out)
    return RdmaResult(device=device, gbit_s=value, error=None if value is not None else "no result table in output")
