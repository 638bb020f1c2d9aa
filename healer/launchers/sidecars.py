"""One telemetry sidecar per node for the local backend, in this process: the real exporters.sidecar.Sidecar,
each with its own rank socket, and its heartbeat batches handed to the healer's table directly instead of
over HTTP (a remote node's sidecar posts the same batches to /v1/heartbeats).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from exporters.schema import HeartbeatBatch
from exporters.sidecar import Sidecar


class NodeSidecars:
    def __init__(self, nodes: list[str], socket_dir: Path | None = None, nvml: dict[str, Any] | None = None) -> None:
        """`nvml`: per node, the NVML handle its sidecar reads (default none: these "nodes" share one machine, whose
        GPUs, if any, belong to no single one of them)."""
        # NOTE: AF_UNIX paths are limited to 107 bytes: a short directory of our own, not the run directory.
        self._dir = socket_dir or Path(tempfile.mkdtemp(prefix="mh-sock-"))
        nvml = nvml or {}
        self.sidecars = {n: Sidecar(Sidecar.Config(node=n, socket_path=str(self._dir / f"{n}.sock"),
                                                   metrics_addr="127.0.0.1:0"), nvml=nvml.get(n)) for n in nodes}
        self._seq = 0

    @property
    def sockets(self) -> dict[str, str]:
        return {n: s.cfg.socket_path for n, s in self.sidecars.items()}

    def start(self) -> None:
        for s in self.sidecars.values():
            s.start()

    def stop(self) -> None:
        for s in self.sidecars.values():
            s.stop()

    def batches(self) -> list[HeartbeatBatch]:
        self._seq += 1
        return [s.heartbeat_batch(self._seq, time.time()) for s in self.sidecars.values()]
