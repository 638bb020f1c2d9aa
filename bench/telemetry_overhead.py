"""What telemetry costs training, and what the sidecar costs its node, written as JSON.

Run:  .venv/bin/python bench/telemetry_overhead.py [--pairs 3] [--steps 25]
      [--out bench/results/telemetry_overhead.json]

- step time with telemetry on against off: 4-rank tiny-dp4 jobs, off and on interleaved in pairs in
  one run of this script (the order flips every pair: off-on, on-off, ..., so drift cancels); per pair
  the ratio of median step times (after warm-up); reported: the median ratio and its spread. Target:
  overhead <= 1%. On a shared 2-core machine the spread is wider than 1%, so the JSON also gives the
  overhead implied by the measured per-record cost (send p50 / median step time).
- cost of one record send (RankClient.step) in microseconds: to a live sidecar, to no sidecar.
- the sidecar at 8 ranks: a real 8-rank job (tiny-3d) scraped every second, then 8 simulated ranks
  at 10 steps/s each; CPU share of one core and RSS of the sidecar process (targets: <= 2%, <= 150 MiB).
- /metrics scrape latency (p50, p99) with 8 ranks.

Training reaches the sidecar only once the trainer hands its records to exporters.client.RankClient;
the JSON says whether it did (`records_received`), so a run before that wiring is not mistaken for one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from exporters.client import SOCKET_ENV, RankClient  # noqa: E402
from ground import procfs  # noqa: E402
from tests.exporters.helpers import step_record  # noqa: E402 - a record shaped like the trainer's

# ---------------------------------------------------------------- helpers


def sidecar(sock: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from megaheal.cli import app; app()", "sidecar", "--node", "bench",
         "--socket", str(sock), "--metrics-addr", f"127.0.0.1:{port}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 30
    while not scrape(port):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"sidecar did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc


def scrape(port: int) -> str:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    st = procfs.stat(pid)
    assert st is not None, f"the training job (pid {pid}) exited during the run"
    return st.cpu_seconds


def rss_mib(pid: int) -> float:
    rss = procfs.rss_bytes(pid)
    assert rss is not None, f"the training job (pid {pid}) exited during the run"
    return rss / 2**20


def train(config: str, nproc: int, steps: int, run_dir: Path, sock: Path | None) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.pop(SOCKET_ENV, None)
    if sock is not None:
        env[SOCKET_ENV] = str(sock)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "train", "--config", str(REPO / "configs" / f"{config}.yaml"), "--run-dir", str(run_dir),
            "--set", f"steps={steps}", "--set", f"log_every={steps}"]
    proc = subprocess.run(argv, cwd=REPO, env=env, timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (run_dir / "ranks" / "0.jsonl").read_text().splitlines()]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


# ---------------------------------------------------------------- measurements


def step_time_on_off(tmp: Path, pairs: int, steps: int, warmup: int) -> dict:
    sock, port = tmp / "ab.sock", free_port()
    proc = sidecar(sock, port, tmp / "ab-sidecar.log")
    ratios, medians = [], {"off": [], "on": []}
    try:
        for i in range(pairs):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                records = train("tiny-dp4", 4, steps, tmp / f"ab-{i}-{mode}", sock if mode == "on" else None)
                medians[mode].append(statistics.median(r["step_seconds"] for r in records[warmup:]))
            ratios.append(medians["on"][-1] / medians["off"][-1])
            print(f"pair {i}: off {medians['off'][-1]:.4f} s, on {medians['on'][-1]:.4f} s, "
                  f"ratio {ratios[-1]:.4f}", flush=True)
        received = metric(scrape(port), "megaheal_sidecar_received_total")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return {
        "config": "tiny-dp4", "ranks": 4, "pairs": pairs, "steps": steps, "warmup_steps_skipped": warmup,
        "median_step_seconds_off": medians["off"], "median_step_seconds_on": medians["on"],
        "ratio_on_over_off": ratios, "ratio_median": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)], "overhead_target": 0.01,
        "records_received": received,
    }


def send_cost(tmp: Path, n: int = 5000) -> dict:
    record = step_record(10, rank=0)
    sock, port = tmp / "cost.sock", free_port()
    proc = sidecar(sock, port, tmp / "cost-sidecar.log")
    out = {}
    try:
        for name, path in (("live_sidecar", sock), ("no_sidecar", tmp / "absent.sock")):
            client = RankClient(str(path), "bench", 0, 0, 1, {"pp": 0, "dp": 0, "tp": 0})
            client.hello()
            times = []
            for _ in range(n):
                t0 = time.perf_counter_ns()
                client.step(record)
                times.append((time.perf_counter_ns() - t0) / 1e3)
                if name == "live_sidecar":
                    time.sleep(0.0002)  # let the sidecar keep up, as it does at real step rates
            out[name] = {"sends": n, "sent": client.sent, "dropped": client.dropped,
                         "us_p50": percentile(times, 0.5), "us_p99": percentile(times, 0.99),
                         "us_max": max(times)}
            client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return out


def sidecar_at_8_ranks(tmp: Path, steps: int) -> dict:
    sock, port = tmp / "eight.sock", free_port()
    proc = sidecar(sock, port, tmp / "eight-sidecar.log")
    scrapes: list[float] = []
    stop = threading.Event()

    def scraper() -> None:  # Prometheus' part: one scrape per second
        while not stop.wait(1.0):
            t0 = time.perf_counter()
            if scrape(port):
                scrapes.append((time.perf_counter() - t0) * 1e3)

    thread = threading.Thread(target=scraper, daemon=True)
    try:
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        thread.start()
        records = train("tiny-3d", 8, steps, tmp / "eight", sock)
        real = {"config": "tiny-3d", "ranks": 8, "steps": steps, "wall_seconds": time.monotonic() - t0,
                "cpu_share_of_one_core": (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0),
                "rss_mib": rss_mib(proc.pid), "step_seconds_median": statistics.median(
                    r["step_seconds"] for r in records[3:]),
                "ranks_on_metrics": len([line for line in scrape(port).splitlines()
                                         if line.startswith("megaheal_step{")])}
        # A faster job: 8 ranks at 10 steps/s each (simulated clients), for 20 s.
        clients = [RankClient(str(sock), "sim", r, r, 8, {"pp": 0, "dp": r, "tp": 0}) for r in range(8)]
        cpu0, t0, step = cpu_seconds(proc.pid), time.monotonic(), 0
        while time.monotonic() - t0 < 20:
            for c in clients:
                c.step(step_record(step, rank=c.rank))
            step += 1
            time.sleep(max(0.0, t0 + step * 0.1 - time.monotonic()))
        simulated = {"ranks": 8, "steps_per_second_per_rank": 10, "seconds": time.monotonic() - t0,
                     "cpu_share_of_one_core": (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0),
                     "rss_mib": rss_mib(proc.pid), "dropped": sum(c.dropped for c in clients),
                     "sent": sum(c.sent for c in clients)}
    finally:
        stop.set()
        thread.join()
        proc.terminate()
        proc.wait(timeout=10)
    return {"real_job": real, "simulated_10hz": simulated, "targets": {"cpu_share": 0.02, "rss_mib": 150},
            "scrape_ms": {"n": len(scrapes), "p50": percentile(scrapes, 0.5), "p99": percentile(scrapes, 0.99)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "telemetry_overhead.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {
            "benchmark": "telemetry_overhead",
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "loadavg_at_start": os.getloadavg()},
            "send_cost": send_cost(tmp),
            "step_time_on_off": step_time_on_off(tmp, args.pairs, args.steps, args.warmup),
            "sidecar_at_8_ranks": sidecar_at_8_ranks(tmp, 20),
        }
    on_off = results["step_time_on_off"]
    on_off["overhead_implied_by_send_cost"] = (
        results["send_cost"]["live_sidecar"]["us_p50"] * 1e-6 / statistics.median(on_off["median_step_seconds_off"]))
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
