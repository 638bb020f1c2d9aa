"""What the run's mutual TLS costs a heartbeat batch, side by side with the plain HTTP + token it replaced, written
as JSON.

Run:  .venv/bin/python bench/control_tls.py [--requests 400] [--out bench/results/control_tls.json]

One report endpoint (healer/runner/reports.py, the healer's ingest routes on a heartbeat table) in this process,
served plain and over the run's TLS (healer/launchers/run_authority.py). A client posts one node's batch (8 ranks)
--requests times: plain, over TLS on a new connection each time, and over TLS on one kept connection as the agents'
forwarder keeps it (exporters/heartbeat.py, ground/tls.py PeerConnection). For each mode this records the wall time per request (median, p99) and the CPU this process spent per request (client and
server together: both run here). The CPU per request is what a healer pays per host and interval; at a 1 s
interval, 1,000 hosts cost 1,000 x that per second.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ground.httpclient import request_json  # noqa: E402
from ground.tls import PeerConnection, PeerTls  # noqa: E402
from healer.launchers.run_authority import RunAuthority  # noqa: E402
from healer.observe.heartbeats import HeartbeatTable  # noqa: E402
from healer.runner.reports import ReportServer  # noqa: E402
from healer.service.api import TableIngest, ingest_app  # noqa: E402
from wire.telemetry import HeartbeatBatch, RankEntry  # noqa: E402

TOKEN = "bench-control-tls-token-0123456789"


def _batch() -> dict[str, Any]:
    ranks = [RankEntry(job="bench", rank=r, pid=1000 + r, local_rank=r, world_size=8, alive=True, last_seen_age_s=0.1,
                       step=7, step_time=time.time(), step_seconds=0.25) for r in range(8)]
    import msgspec

    return msgspec.to_builtins(HeartbeatBatch(schema=1, node="n1", seq=1, sent_at=time.time(), ranks=ranks))


def _run(url: str, requests: int, tls: PeerTls | None, kept: bool = False) -> dict[str, float]:
    body = _batch()
    headers = {"Authorization": f"Bearer {TOKEN}"} if tls is None else {}
    connection = PeerConnection(tls) if kept and tls is not None else None
    raw = json.dumps(body).encode()

    def post() -> None:
        if connection is not None:
            status = connection.request("POST", f"{url}/v1/heartbeats", raw, {"Content-Type": "application/json"},
                                        5.0, 4096)[0]
            assert status == 202, status
        else:
            request_json("POST", f"{url}/v1/heartbeats", body, headers, 5.0, tls)

    for _ in range(20):  # warm-up
        post()
    walls = []
    cpu0 = time.process_time()
    for _ in range(requests):
        t0 = time.perf_counter()
        post()
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    walls.sort()
    return {"median_ms": round(statistics.median(walls) * 1e3, 3),
            "p99_ms": round(walls[int(0.99 * (len(walls) - 1))] * 1e3, 3),
            "cpu_ms_per_request": round(cpu / requests * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--out", default="bench/results/control_tls.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        authority = RunAuthority.of_run(Path(tmp) / "launcher")
        host = PeerTls(authority.host("n1").client(), "healer")
        plain = ReportServer(ingest_app(TableIngest(HeartbeatTable()), TOKEN))
        tls = ReportServer(ingest_app(TableIngest(HeartbeatTable()), TOKEN),
                           tls=authority.healer().server(require_peer=False))
        try:
            tls_url = tls.start()
            results = {"plain HTTP, token": _run(plain.start(), args.requests, None),
                       "mutual TLS 1.3, host certificate, a new connection each": _run(tls_url, args.requests, host),
                       "mutual TLS 1.3, host certificate, connection kept (the forwarder's)":
                           _run(tls_url, args.requests, host, kept=True)}
        finally:
            plain.stop()
            tls.stop()
    out = {"requests": args.requests, "batch_ranks": 8,
           "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "python": platform.python_version(),
           "load_average_1m": round(os.getloadavg()[0], 2),
           "modes": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
