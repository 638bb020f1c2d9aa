"""The flight recorder's last collectives of this rank, dumped on request: which collective of which process group
the rank entered last and which it is still in, for the healer to compare across ranks when a job hangs.

PyTorch records every collective in a ring buffer when TORCH_FR_BUFFER_SIZE (or, for NCCL, the older
TORCH_NCCL_TRACE_BUFFER_SIZE) is above 0: gloo's as well as NCCL's. A hung rank cannot be asked from its own main
thread (it is blocked in the collective, or spinning), so a daemon thread watches for a request file, `<pid>.fr-request`
in the phase directory (wire/phase_now.py: the node agent's, on the host's scratch disk), and answers with
`<pid>.fr.json`, written whole (a temporary file renamed over it). Polling a path twice a second costs one stat(2); the
dump itself runs only when asked. Without the buffer or the directory nothing is started.

The answer, per process group (by its name, the same on every rank): its description and ranks, the sequence number
of the last collective the rank enqueued and of the last that completed, and the operations still in flight.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wire.recorder_files import answer_path, request_path

BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
POLL_S = 0.5
MAX_IN_FLIGHT = 8
"""In-flight operations kept per group, newest last (a rank is blocked in at most a few at once)."""

log = logging.getLogger(__name__)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    for name in BUFFER_ENVS:
        value = environ.get(name, "")
        if value.strip():
            return value.strip().isdigit() and int(value) > 0
    return False


def _raw_dumps() -> list[dict[str, Any]]:
    """What each flight recorder of this build holds: gloo's (and any non-NCCL backend's), then NCCL's."""
    from torch._C import _distributed_c10d as c10d

    out = []
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            out.append(json.loads(dump(True, False)))
        except (RuntimeError, ValueError):  # NOTE: a CUDA build without NCCL initialised raises; gloo's still counts
            continue
    return out


def completed_collectives() -> int | None:
    """How many collectives this rank's process groups have completed, all groups together, read from the flight
    recorders' status alone (no entries: ~0.07 ms for gloo with 2,000 recorded, against ~24 ms for a dump with them).
    It only grows while the job makes progress: what megaheal/rank/progress.py reports for a script that reports no
    steps of its own. None: no recorder of this build has a status to give."""
    from torch._C import _distributed_c10d as c10d

    total, found = 0, False
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            status = json.loads(dump(False, False)).get("pg_status") or {}
        except (RuntimeError, ValueError):  # NOTE: as in _raw_dumps: NCCL's raises where it was never initialised
            continue
        for st in status.values():
            found = True
            total += max(0, int(st.get("last_completed_collective", -1)))
    return total if found else None


def _groups() -> dict[str, dict[str, Any]]:
    """Name -> description and global ranks of every process group this rank made."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    out = {}
    for pg, name in list(_world.pg_names.items()):
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):
            continue
        out[name] = {"desc": getattr(pg, "group_desc", "") or "", "ranks": sorted(ranks)}
    return out


def summary(dumps: list[dict[str, Any]], groups: dict[str, dict[str, Any]], now_ns: int) -> dict[str, Any]:
    """Per process group: last enqueued and completed collective and the operations in flight (see the module)."""
    out: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        return out.setdefault(name, {**groups.get(name, {"desc": "", "ranks": []}), "in_flight": []})

    for d in dumps:
        entries = [e for e in d.get("entries") or [] if isinstance(e.get("process_group"), list) and e["process_group"]]
        # NOTE: the status is keyed by the group's id, which is this process's own count of its groups; the entries
        # carry the id and the name, and the name is what every member of a group shares.
        names = {str(e.get("pg_id")): str(e["process_group"][0]) for e in entries}
        for pg_id, st in (d.get("pg_status") or {}).items():
            if str(pg_id) not in names:
                continue  # no collective of it left in the buffer: nothing recent to compare
            g = group(names[str(pg_id)])
            g["last_enqueued"] = int(st.get("last_enqueued_collective", -1))
            g["last_completed"] = int(st.get("last_completed_collective", -1))
        for e in entries:
            if e.get("retired"):
                continue
            group(str(e["process_group"][0]))["in_flight"].append({
                "op": str(e.get("profiling_name", "?")).split(":", 1)[-1], "seq": int(e.get("collective_seq_id", 0)),
                "p2p_seq": int(e.get("p2p_seq_id", 0)), "p2p": bool(e.get("is_p2p")),
                "for_s": round(max(0, now_ns - int(e.get("time_created_ns", now_ns))) / 1e9, 3)})
    for g in out.values():
        g["in_flight"] = g["in_flight"][-MAX_IN_FLIGHT:]
    return {"groups": out, "at": now_ns / 1e9}


class FlightRecorderDumper:
    """The daemon thread that answers dump requests for this rank process."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-fr-dump", daemon=True)

    @classmethod
    def from_env(cls, directory: str | None) -> FlightRecorderDumper | None:
        import torch.distributed as dist  # NOTE: here, not above: the node agent reads the answers without torch

        if not directory or not enabled() or not dist.is_initialized():
            return None
        dumper = cls(directory)
        dumper._thread.start()
        return dumper

    def _run(self) -> None:
        request = request_path(self.directory, self.pid)
        while not self._stop.wait(POLL_S):
            if request.exists():
                self.answer()
                request.unlink(missing_ok=True)

    def answer(self) -> None:
        try:
            body = json.dumps(summary(_raw_dumps(), _groups(), time.time_ns()))
            target = answer_path(self.directory, self.pid)
            tmp = target.with_suffix(".tmp")
            tmp.write_text(body)
            tmp.replace(target)
        except (OSError, RuntimeError, ValueError):
            # Telemetry: a dump that cannot be written costs the evidence, never the training.
            log.warning("flight recorder: cannot answer a dump request", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)  # NOTE: not in a dump when the interpreter finalises (see progress.py)
        for path in (request_path(self.directory, self.pid), answer_path(self.directory, self.pid)):
            path.unlink(missing_ok=True)
