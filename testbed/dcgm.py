"""A dcgm-exporter exposition on each host of the bed: what `megaheal run --dcgm-url` reads there, and the GPU fault
a test or bench injects by rewriting one host's (no GPU here; the format and labels are dcgm-exporter's).

Each host serves its file with Python's http.server on its own loopback (127.0.0.1:9400, dcgm-exporter's port),
inside its network namespace, so `http://127.0.0.1:9400/metrics` is each host's own, as on a cluster.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

from testbed.bed import Bed

PORT = 9400
URL = f"http://127.0.0.1:{PORT}/metrics"
XID_FALLEN_OFF_THE_BUS = 79


def exposition(host: str, xid: int = 0) -> str:
    """One H100 of `host` as dcgm-exporter serves it: healthy, or with `xid` as its last Xid."""
    uuid = f"GPU-{zlib.crc32(host.encode()):08x}-0000-4000-8000-000000000000"
    labels = (f'gpu="0",UUID="{uuid}",pci_bus_id="00000000:18:00.0",device="nvidia0",'
              f'modelName="NVIDIA H100 80GB HBM3",Hostname="{host}",DCGM_FI_DRIVER_VERSION="550.90.07"')
    fields = {"DCGM_FI_DEV_GPU_TEMP": ("gauge", 41), "DCGM_FI_DEV_GPU_UTIL": ("gauge", 97),
              "DCGM_FI_DEV_FB_USED": ("gauge", 61234), "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("counter", 0),
              "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("counter", 0), "DCGM_FI_DEV_ROW_REMAP_PENDING": ("gauge", 0),
              "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("gauge", 0)}
    lines = []
    for name, (kind, value) in fields.items():
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
    xid_labels = labels + (f',err_code="{xid}",err_msg="GPU has fallen off the bus"' if xid else "")
    lines += ["# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.",
              "# TYPE DCGM_FI_DEV_XID_ERRORS gauge", f"DCGM_FI_DEV_XID_ERRORS{{{xid_labels}}} {xid}"]
    return "\n".join(lines) + "\n"


class Exporters:
    """The bed's expositions: `files[host]` is what that host serves; `stop()` ends every server."""

    def __init__(self, bed: Bed, root: Path) -> None:
        self.files: dict[str, Path] = {}
        self._servers: list[subprocess.Popen[bytes]] = []
        for host in bed.hosts:
            where = root / host.name
            where.mkdir(parents=True, exist_ok=True)
            (where / "metrics").write_text(exposition(host.name))
            self.files[host.name] = where / "metrics"
            self._servers.append(subprocess.Popen(
                [*bed.enter(host), sys.executable, "-m", "http.server", str(PORT), "--bind", "127.0.0.1",
                 "--directory", str(where)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def gpu_falls_off_the_bus(self, host: str) -> None:
        self.files[host].write_text(exposition(host, XID_FALLEN_OFF_THE_BUS))

    def stop(self) -> None:
        for server in self._servers:
            server.kill()
            server.wait(10)
        self._servers.clear()
