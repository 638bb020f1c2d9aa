"""Heartbeat ingestion of one healer for a simulated 12,288-rank job (or 131,072 through relays), written as JSON.

Run:  .venv/bin/python bench/healer_ingest.py [--nodes 1536] [--ranks-per-node 8] [--seconds 20]
      [--clients 2] [--per-relay 0] [--rules stale|default] [--out bench/results/healer_ingest.json]
      e.g. --nodes 16384 --per-relay 128 --out bench/results/healer_ingest_131k.json

With --per-relay K the nodes reach the healer through relays of K nodes each (`megaheal relay`): one request
per relay per second. Relay 0 is a real relay process fed by its K nodes (its CPU and RSS are reported); the other
relays are simulated by the load processes, which post the batches such a relay would.

A real `megaheal healer` (SQLite, the heartbeat_stale rule or with --rules default the shipped rule set, detection
every second) receives one heartbeat batch per node per second over HTTP, from --clients load processes (asyncio,
8 keep-alive connections each) that post each node's batch at its own slot in every second. Batches are built with
the sidecar's structs (all rank fields), and each second every rank reports the next step (so that the detectors
that learn from new steps, and the straggler and collective-slowdown windows, do their real work under load too).
Measured over the window after a warm-up:
- records/s and batches/s the healer accepted (its own counters), against the offered rate;
- the healer's CPU share (of one core, from /proc) and its peak RSS;
- detection cycle p50/p99 inside the loaded healer (histogram_quantile over its own histogram), and exactly
  over 200 cycles of the same detector on a 12,288-rank table in this process (no load);
- HTTP latency p50/p99 seen by the load processes, and failures.
Targets: keeps up at 1 Hz, p99 cycle < 100 ms, RSS < 1 GiB. NOTE: the load processes share this machine's
cores with the healer; their CPU is reported too.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import math
import multiprocessing as mp
import os
import platform
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ground import procfs  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"

# ---- load ----------------------------------------------------------------------------------------------------


def node_body(node: int, ranks_per_node: int, job: str = "bench") -> bytes:
    """One node's batch, built and encoded with the sidecar's own structs (wire/telemetry.py), every field set."""
    from wire.telemetry import HEARTBEAT_SCHEMA, GpuEntry, HeartbeatBatch, RankEntry, encode_batch

    ranks = []
    for local in range(ranks_per_node):
        rank = node * ranks_per_node + local
        ranks.append(RankEntry(
            job=job, rank=rank, pid=10000 + rank, local_rank=local, world_size=12288,
            mesh={"pp": rank % 4, "dp": rank // 32, "tp": rank % 8}, alive=True, last_seen_age_s=0.31, dropped=0,
            events={"checkpoint_saved": 3}, last_event=None, step=1200, step_time=1.7e9, step_seconds=0.91,
            phases={"data_wait": 0.01, "forward_backward": 0.7, "dp_reduce": 0.12, "grad_norm_clip": 0.01,
                    "optimizer": 0.07},
            loss=2.31, grad_norm=0.82, nonfinite={}, tokens_per_second=41000.0, mfu=0.41,
            dp_reduce_enter_ns=123456789012, dp_reduce_lag_s=0.002, max_rss_mib=20480.0, proc_state="S"))
    gpus = [GpuEntry(gpu=g, uuid=f"GPU-{node:04d}-{g}", last_xid=None, xid_counts={}) for g in range(8)]
    return encode_batch(HeartbeatBatch(schema=HEARTBEAT_SCHEMA, node=f"node-{node:04d}", seq=0, sent_at=time.time(),
                                       nvml="ok", ranks=ranks, gpus=gpus))


def relay_body(relay: int, per_relay: int, ranks_per_node: int) -> bytes:
    """What a relay of `per_relay` nodes posts each second (exporters/relay.py, by the relay's own code: its nodes'
    ranks by column), every node's batch half an interval old."""
    from wire.relay import columns_of, encode_relay
    from wire.telemetry import decode_batch

    nodes = range(relay * per_relay, (relay + 1) * per_relay)
    return encode_relay(columns_of(f"relay-{relay:04d}", 0, time.time(),
                                   [(0.5, decode_batch(node_body(n, ranks_per_node))) for n in nodes]))


def next_steps(request: bytes, second: int) -> bytes:
    """`request` with every rank at step 1200 + second (the same length: Content-Length holds)."""
    if second == 0:
        return request
    column = request.find(b'"step":"')
    if column < 0:  # a node's batch: one "step" per rank entry
        return request.replace(b'"step":1200', b'"step":%d' % (1200 + second))
    # A relay's batch by column (wire/relay.py): the step column is n little-endian int64s in base64.
    start = column + len(b'"step":"')
    end = request.index(b'"', start)
    n = len(base64.b64decode(request[start:end])) // 8
    return request[:start] + base64.b64encode(struct.pack(f"<{n}q", *[1200 + second] * n)) + request[end:]


def client(port: int, senders: list[int], ranks_per_node: int, seconds: float, start_at: float, out: Any,
           connections: int = 8, per_relay: int = 0) -> None:
    """One load process: `connections` keep-alive connections, each posting its share of the senders' batches at
    their slots in every second (asyncio, so the rate does not hinge on one request's latency). A sender is a
    node (per_relay 0: its own batch to /v1/heartbeats) or a relay of per_relay nodes (/v1/heartbeats/relayed)."""
    import asyncio

    async def one(conn_nodes: list[tuple[float, bytes]], stats: dict[str, Any], t0: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        second = 0
        while True:
            for offset, request in conn_nodes:
                due = t0 + second + offset
                if due - t0 >= seconds:
                    writer.close()
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -0.5:
                    stats["late"] += 1
                began = time.perf_counter()
                # NOTE: every batch one step further on each second (same digits, same length), so that the
                # detectors that learn from new steps do their real work in the loaded healer too.
                writer.write(next_steps(request, second))
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
                await reader.readexactly(length)
                stats["latencies"].append(time.perf_counter() - began)
                stats["sent"] += 1
                if not head.startswith(b"HTTP/1.1 202"):
                    stats["failed"] += 1
                    stats["first_failure"] = stats.get("first_failure") or head[:200].decode(errors="replace")
            second += 1

    async def run() -> dict[str, Any]:
        requests = []
        path = "/v1/heartbeats/relayed" if per_relay else "/v1/heartbeats"
        for n in senders:
            body = relay_body(n, per_relay, ranks_per_node) if per_relay else node_body(n, ranks_per_node)
            requests.append((n / total, (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                               f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                                               f"Content-Length: {len(body)}\r\n\r\n").encode() + body))
        stats: dict[str, Any] = {"sent": 0, "failed": 0, "late": 0, "latencies": []}
        t0 = time.perf_counter() + max(0.0, start_at - time.time())
        # NOTE: fewer senders than connections leaves some without any: those would spin without ever awaiting.
        await asyncio.gather(*(one(sorted(requests[i::connections]), stats, t0) for i in range(connections)
                               if requests[i::connections]))
        return stats

    total = max(senders) + 1
    cpu0 = time.process_time()
    stats = asyncio.run(run())
    stats["cpu_s"] = time.process_time() - cpu0
    out.put(stats)


# ---- measuring the healer ------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    st = procfs.stat(pid)
    assert st is not None, f"the healer (pid {pid}) exited during the run"
    return st.cpu_seconds


def proc_rss_mib(pid: int) -> tuple[float, float]:
    """Resident memory now and at its highest so far (the kernel's high-water mark)."""
    rss, hwm = procfs.rss_bytes(pid), procfs.peak_rss_bytes(pid)
    assert rss is not None and hwm is not None, f"the healer (pid {pid}) exited during the run"
    return rss / 2**20, hwm / 2**20


def scrape(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    return conn.getresponse().read().decode()


def counter(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def buckets(text: str) -> list[tuple[float, float]]:
    out = []
    for le, value in re.findall(r'^megaheal_healer_detection_cycle_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        out.append((float("inf") if le == "+Inf" else float(le), float(value)))
    return sorted(out)


def histogram_quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over the increase between two scrapes (linear within a bucket)."""
    inc = [(le, a - dict(before).get(le, 0.0)) for le, a in after]
    total = inc[-1][1] if inc else 0
    if total <= 0:
        return None
    rank, lower, prev = q * total, 0.0, 0.0
    for le, count in inc:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - prev) / max(count - prev, 1e-12)
        lower, prev = le, count
    return lower


def cycles_by_bucket(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> dict[str, int]:
    """How many of the window's cycles fell in each bucket of the healer's histogram ("50-75": over 50 ms, up to 75),
    the empty ones left out: with a cycle a second a window's p99 is its slowest cycle, and this says how many were
    near it."""
    was = dict(before)
    out, lower, prev = {}, 0.0, 0.0
    for le, count in after:
        count -= was.get(le, 0.0)
        if count - prev:
            upper = "inf" if math.isinf(le) else f"{1000 * le:g}"
            out[f"{1000 * lower:g}-{upper}"] = int(count - prev)
        lower, prev = le, count
    return out


def exact_cycles(nodes: int, ranks_per_node: int, rules: str = "stale") -> dict[str, Any]:
    """One detection cycle (the tick's view and every detector of the rule set) on a full table, in this process
    and unloaded: exact percentiles. Between cycles every node's batch comes again one step further on (untimed),
    so that the detectors that learn from new steps do their real work each cycle."""
    from healer.decide.rules import DetectorCondition, load_rule_set
    from healer.detect.heartbeat_stale import HeartbeatStale
    from healer.detect.registry import default_registry
    from healer.observe.heartbeats import HeartbeatTable
    from healer.observe.history import HistoryPool
    from healer.observe.jobview import TickView

    if rules == "stale":
        detectors = [HeartbeatStale(HeartbeatStale.Config())]
    else:
        registry = default_registry()
        detectors = [registry.resolve(r.condition.detector)(r.condition.params)
                     for r in load_rule_set([REPO / "configs" / "rules" / "default.yaml"]).rules
                     if isinstance(r.condition, DetectorCondition)]
    pool = HistoryPool.for_detectors(detectors)  # as the healer's engine shares it among its detectors
    bodies = [node_body(n, ranks_per_node) for n in range(nodes)]
    table = HeartbeatTable()
    times, released, per_detector = [], [], {type(d).name: 0.0 for d in detectors}
    # NOTE: the whole rule set for 25 cycles: collective_slowdown learns its baseline over its first 3 windows of 5
    # steps and only then does its steady work at each window's close (with 12 cycles it never got there).
    cycles = 50 if rules == "stale" else 25
    for cycle in range(cycles + 2):
        step = b'"step":%d' % (1200 + cycle)
        for body in bodies:
            table.ingest(body.replace(b'"step":1200', step))
        started = time.perf_counter()
        view, now = TickView.of(table, pool), time.time()
        for d in detectors:
            t = time.perf_counter()
            d.evaluate(view, now)
            if cycle >= 2:  # the first two fill the detectors' histories
                per_detector[type(d).name] += time.perf_counter() - t
        if cycle >= 2:
            times.append(time.perf_counter() - started)
        # NOTE: as the service does (healer/service/app.py, _detect_once), the view goes once the cycle's decisions
        # are made, untimed by the cycle. In the service, the heartbeats replaced while it lived are freed then; here
        # nothing is replaced while it lives (the next ingest frees them), so view_release_ms is the tuples' cost only.
        t = time.perf_counter()
        del view
        if cycle >= 2:
            released.append(time.perf_counter() - t)
    times.sort()
    return {"p50_ms": round(1000 * times[len(times) // 2], 2),
            "p99_ms": round(1000 * times[max(0, int(len(times) * 0.99) - 1)], 2), "cycles": len(times),
            "ranks": len(table), "rules": rules,
            "view_release_ms_mean": round(1000 * sum(released) / len(released), 2),
            "mean_ms_by_detector": {k: round(1000 * v / len(times), 2) for k, v in per_detector.items()}}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1536)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--per-relay", type=int, default=0,
                    help="nodes per relay (0: every node posts to the healer itself); relay 0 is a real `megaheal "
                         "relay` fed by its nodes, the others post pre-built relay batches")
    ap.add_argument("--rules", choices=["stale", "default"], default="stale",
                    help="stale: the heartbeat_stale rule alone; default: the shipped rule set (every detector)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "healer_ingest.json"))
    args = ap.parse_args()

    from tests.healer.services import free_port, wait_for

    tmp = Path(tempfile.mkdtemp(prefix="megaheal-bench-"))
    (tmp / "rules.yaml").write_text("- name: stale\n  when: {detector: heartbeat_stale, after: 30s}\n")
    rules = tmp / "rules.yaml" if args.rules == "stale" else REPO / "configs" / "rules" / "default.yaml"
    port = free_port()
    (tmp / "healer.yaml").write_text(json.dumps({
        "listen": f"127.0.0.1:{port}", "db": f"sqlite:///{tmp / 'h.db'}", "rules": [str(rules)]}))
    env = {**os.environ, "MEGAHEAL_TOKEN": TOKEN, "XDG_STATE_HOME": str(tmp)}
    healer = subprocess.Popen([str(Path(sys.executable).parent / "megaheal"), "healer", "--config",
                               str(tmp / "healer.yaml")], env=env, stdout=(tmp / "healer.log").open("w"),
                              stderr=subprocess.STDOUT)
    relay = None
    try:
        wait_for("the healer", lambda: _ready(port), 60)
        if args.per_relay:
            if args.nodes % args.per_relay:
                raise SystemExit(f"--nodes {args.nodes} is not a multiple of --per-relay {args.per_relay}")
            relay_port = free_port()
            (tmp / "token").write_text(TOKEN)
            (tmp / "token").chmod(0o600)
            relay = subprocess.Popen([str(Path(sys.executable).parent / "megaheal"), "relay", "--healer-url",
                                      f"http://127.0.0.1:{port}", "--token-file", str(tmp / "token"), "--name",
                                      "relay-0000", "--listen", f"127.0.0.1:{relay_port}",
                                      "--max-nodes", str(args.per_relay)],
                                     stdout=(tmp / "relay.log").open("w"), stderr=subprocess.STDOUT)
            wait_for("the relay", lambda: _ready(relay_port, "/healthz"), 60)
            result = run_load(args, port, healer.pid, (relay_port, relay.pid))
        else:
            result = run_load(args, port, healer.pid)
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait(20)
        healer.terminate()
        healer.wait(20)
    result["detection_cycle_isolated"] = exact_cycles(args.nodes, args.ranks_per_node, args.rules)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _ready(port: int, path: str = "/readyz") -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False


def run_load(args: argparse.Namespace, port: int, pid: int, relay: tuple[int, int] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    total = args.warmup + args.seconds
    start_at = time.time() + 3.0  # time for every client to build its bodies
    if relay is None:
        senders = list(range(args.nodes))
        procs = [ctx.Process(target=client, args=(port, senders[i::args.clients], args.ranks_per_node, total,
                                                  start_at, out)) for i in range(args.clients)]
    else:
        # Relays 1.. are simulated (their pre-built batches); relay 0 is real, fed its nodes' own batches.
        senders = list(range(1, args.nodes // args.per_relay))
        procs = [ctx.Process(target=client, args=(port, senders[i::args.clients], args.ranks_per_node, total,
                                                  start_at, out, 8, args.per_relay)) for i in range(args.clients)
                 if senders[i::args.clients]]
        procs.append(ctx.Process(target=client, args=(relay[0], list(range(args.per_relay)), args.ranks_per_node,
                                                      total, start_at, out, 4)))
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at - time.time()) + args.warmup)
    text0, cpu0, wall0 = scrape(port), proc_cpu_s(pid), time.monotonic()
    relay_cpu0 = proc_cpu_s(relay[1]) if relay else 0.0
    peak_rss = relay_rss = 0.0
    while time.monotonic() - wall0 < args.seconds:
        time.sleep(0.5)
        peak_rss = max(peak_rss, proc_rss_mib(pid)[0])
        relay_rss = max(relay_rss, proc_rss_mib(relay[1])[0]) if relay else 0.0
    text1, cpu1, wall1 = scrape(port), proc_cpu_s(pid), time.monotonic()
    relay_cpu1 = proc_cpu_s(relay[1]) if relay else 0.0
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    window = wall1 - wall0
    records = (counter(text1, "megaheal_healer_heartbeat_records_total")
               - counter(text0, "megaheal_healer_heartbeat_records_total")) / window
    batches = (counter(text1, "megaheal_healer_heartbeat_batches_total")
               - counter(text0, "megaheal_healer_heartbeat_batches_total")) / window
    b0, b1 = buckets(text0), buckets(text1)
    latencies = [x for r in results for x in r["latencies"]]
    offered_records = args.nodes * args.ranks_per_node
    p99 = histogram_quantile(0.99, b0, b1)
    out_json = {
        "bench": "healer_ingest", "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "job": {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "ranks": offered_records,
                "batch_hz_per_node": 1.0},
        "window_s": round(window, 2), "clients": args.clients, "rules": args.rules,
        "relays": None if relay is None else {
            "nodes_per_relay": args.per_relay, "relays": args.nodes // args.per_relay,
            "healer_requests_per_s": args.nodes // args.per_relay,
            "relay_batches_per_s": round((counter(text1, "megaheal_healer_relay_batches_total")
                                          - counter(text0, "megaheal_healer_relay_batches_total")) / window, 1),
            "real_relay": {"cpu_share_of_one_core": round((relay_cpu1 - relay_cpu0) / window, 3),
                           "rss_mib_peak": round(relay_rss, 1)},
            "note": "relay 0 is a real `megaheal relay` fed by its nodes; the others are simulated by the load "
                    "processes posting pre-built relay batches (on a cluster each relay runs on a host of its group)"},
        "offered": {"batches_per_s": args.nodes, "records_per_s": offered_records},
        "accepted": {"batches_per_s": round(batches, 1), "records_per_s": round(records, 1),
                     "fraction_of_offered": round(records / offered_records, 4)},
        "healer": {"cpu_share_of_one_core": round((cpu1 - cpu0) / window, 3), "rss_mib_peak": round(peak_rss, 1),
                   "rss_mib_hwm": round(proc_rss_mib(pid)[1], 1),
                   "tracked_ranks": counter(text1, "megaheal_healer_tracked_ranks")},
        "detection_cycle_loaded": {"p50_ms": _ms(histogram_quantile(0.5, b0, b1)), "p99_ms": _ms(p99),
                                   "cycles": int(b1[-1][1] - dict(b0).get(float("inf"), 0.0)) if b1 else 0,
                                   "method": "histogram_quantile over the healer's own histogram",
                                   "cycles_by_bucket_ms": cycles_by_bucket(b0, b1)},
        "http": {"requests": sum(r["sent"] for r in results), "failed": sum(r["failed"] for r in results),
                 "first_failure": next((r["first_failure"] for r in results if r.get("first_failure")), None),
                 "late_over_500ms": sum(r["late"] for r in results),
                 "latency_p50_ms": round(1000 * pct(latencies, 0.5), 2),
                 "latency_p99_ms": round(1000 * pct(latencies, 0.99), 2),
                 "load_clients_cpu_share": round(sum(r["cpu_s"] for r in results) / total, 3)},
        "targets": {"keeps_up_at_1hz": records >= 0.98 * offered_records, "p99_cycle_under_100ms": p99 is not None and p99 < 0.1,
                    "rss_under_1gib": peak_rss < 1024},
    }
    return out_json


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


if __name__ == "__main__":
    main()
