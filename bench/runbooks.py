"""Wall time of every shipped runbook on this machine (4 ranks on CPU), written as JSON.

Run:  .venv/bin/python bench/runbooks.py [--repeats 1] [--out bench/results/runbooks.json]
      sudo .venv/bin/python bench/runbooks.py --testbed [--repeats 3] [--out bench/results/runbooks_testbed.json]

Each runbook runs as an operator would run it, `megaheal diagnose NAME --json`, in a fresh
process: the wall time includes interpreter start, imports and the ranks' set-up. It also times
the restart-triage budget: collectives-quick, then the loopback and host steps, as one runbook;
the target is <= 15 s so that triage fits inside a restart. Baselines are not used (a scratch
baseline file), so verdicts reflect the checks' absolute rules only.

With --testbed (root) it brings up a 4-host bed of its own (testbed/, prefix mhb) and runs the
runbooks across its hosts, one rank per host, through srun inside `salloc -N4`: collectives-quick
gives busbw across the veth links; then one host's link is limited by tbf to a tenth of the median
pair busbw and network-triage is timed until it names that host (target <= 15 s, as on one host).
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# NOTE: replace (not prepend to) sys.path[0]: it is bench/, where this file would shadow the runbooks package.
sys.path[0] = str(REPO)

from runbooks.spec import LIBRARY, shipped_runbooks  # noqa: E402

MEGAHEAL = [sys.executable, "-c", "from megaheal.cli import app; app()"]
TRIAGE_TARGET_S = 15.0


def run_once(runbook: str, baselines: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*MEGAHEAL, "diagnose", runbook, "--json", "--baselines", str(baselines)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - t0
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"wall_s": wall, "exit_code": proc.returncode, "error": proc.stderr[-2000:]}
    return {
        "wall_s": wall,
        "exit_code": proc.returncode,
        "verdict": out["verdict"],
        "summary": out["summary"],
        "steps": {s["step"]: {"seconds": s["seconds"], "status": s["status"]} for s in out["steps"]},
        "busbw_gb_s": {
            f"{m['labels']['collective']}/{m['labels']['size']}": round(m["value"], 4)
            for s in out["steps"]
            for m in s["measurements"]
            if m["name"] == "busbw"
        },
    }


def triage_runbook(directory: Path) -> Path:
    """collectives-quick's step, then loopback and host as in node-health, as one runbook file."""
    import yaml

    quick = yaml.safe_load((LIBRARY / "collectives-quick.yaml").read_text())
    node = yaml.safe_load((LIBRARY / "node-health.yaml").read_text())
    extra = [dict(s, parallel=False) for s in node["steps"] if s["check"] in ("loopback", "host")]
    for step in extra:
        step.get("params", {}).pop("fail_on_gpu_holders", None)
    path = directory / "restart-triage.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "restart-triage",
                "description": "bench: quick triage before a restart",
                "steps": quick["steps"] + extra,
            },
            sort_keys=False,
        )
    )
    return path


def summarise(runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {"wall_s_median": statistics.median(walls), "wall_s_all": walls, "last": runs[-1]}


# ---------------------------------------------------------------------------- on the test bed


def run_on_bed(bed, runbook: str, baselines: Path) -> dict:
    """`salloc -N<all> megaheal diagnose RUNBOOK --nodes <all hosts> --json`, timed from the operator's side."""
    hosts = ",".join(h.name for h in bed.hosts)
    env = bed.env({k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"})
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = ["salloc", "--quiet", f"--nodes={len(bed.hosts)}", f"--nodelist={hosts}", *MEGAHEAL,
            "diagnose", runbook, "--nodes", hosts, "--json", "--baselines", str(baselines)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    out = json.loads(proc.stdout)
    measured = [m for s in out["steps"] for m in s["measurements"]]
    return {
        "wall_s": wall,
        "exit_code": proc.returncode,
        "verdict": out["verdict"],
        "summary": out["summary"],
        "suspects": [{"kind": s["kind"], "name": s["name"], "reason": s["reason"]} for s in out["suspects"]],
        "busbw_gb_s": {f"{m['labels']['collective']}/{m['labels']['size']}": round(m["value"], 4)
                       for m in measured if m["name"] == "busbw"},
        "pair_busbw_gb_s": {m["labels"]["pair"]: round(m["value"], 4) for m in measured if m["name"] == "pair_busbw"},
    }


def bench_testbed(repeats: int) -> dict:
    from testbed import faults
    from testbed.bed import Bed

    bed = Bed(Bed.Config(hosts=4, prefix="mhb", subnet="10.217.0.0/24", slurmctld_port=6857))
    bed.down()
    bed.up()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            baselines = Path(tmp) / "baselines.json"  # never written: no baselines
            quick = [run_on_bed(bed, "collectives-quick", baselines) for _ in range(repeats)]
            healthy = [run_on_bed(bed, "network-triage", baselines) for _ in range(repeats)]
            pairs = [v for r in healthy for v in r["pair_busbw_gb_s"].values()]
            slow = bed.hosts[2]
            rate_bytes = statistics.median(pairs) * 1e9 / 10
            faults.slow_link(bed, slow, int(rate_bytes * 8))
            slowed = [run_on_bed(bed, "network-triage", baselines) for _ in range(repeats)]
    finally:
        bed.down()
    named = [any(s["kind"] == "node" and s["name"] == slow.name for s in r["suspects"]) for r in slowed]
    walls = [r["wall_s"] for r in slowed]
    return {
        "hosts": [h.name for h in bed.hosts],
        "ranks": "one per host, gloo over veth pairs on one bridge",
        "collectives_quick": {"wall_s_median": statistics.median(r["wall_s"] for r in quick),
                              "busbw_gb_s_median": {k: statistics.median(r["busbw_gb_s"][k] for r in quick)
                                                    for k in quick[0]["busbw_gb_s"]}, "runs": quick},
        "network_triage_healthy": {"wall_s_median": statistics.median(r["wall_s"] for r in healthy),
                                   "pair_busbw_gb_s_median": statistics.median(pairs), "runs": healthy},
        "network_triage_slow_link": {
            "slow_host": slow.name,
            "tbf_rate_gb_s": rate_bytes / 1e9,
            "named_every_time": all(named),
            "wall_s_median": statistics.median(walls),
            "wall_s_all": walls,
            "target_s": TRIAGE_TARGET_S,
            "within_target": statistics.median(walls) <= TRIAGE_TARGET_S,
            "runs": slowed,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="[default: bench/results/runbooks.json, or runbooks_testbed.json]")
    parser.add_argument("--testbed", action="store_true", help="across the 4 hosts of a namespace bed (root)")
    args = parser.parse_args()
    if args.testbed:
        out = Path(args.out or REPO / "bench" / "results" / "runbooks_testbed.json")
        results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "loadavg_at_start": os.getloadavg()}, "testbed": bench_testbed(args.repeats)}
        results["machine"]["loadavg_at_end"] = os.getloadavg()
        out.write_text(json.dumps(results, indent=2) + "\n")
        tb = results["testbed"]
        print(json.dumps({"busbw_gb_s": tb["collectives_quick"]["busbw_gb_s_median"],
                          "slow_link": {k: v for k, v in tb["network_triage_slow_link"].items() if k != "runs"}},
                         indent=2))
        print(f"wrote {out}")
        return
    args.out = args.out or str(REPO / "bench" / "results" / "runbooks.json")
    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg(),
        },
        "runbooks": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        baselines = Path(tmp) / "baselines.json"  # never written: no baselines
        for name in [*shipped_runbooks(), str(triage_runbook(Path(tmp)))]:
            label = Path(name).stem
            runs = [run_once(name, baselines) for _ in range(args.repeats)]
            results["runbooks"][label] = summarise(runs)
            last = runs[-1]
            print(
                f"{label:18s} {results['runbooks'][label]['wall_s_median']:6.1f} s  exit {last['exit_code']}  "
                f"{last.get('summary', last.get('error', ''))[:110]}",
                flush=True,
            )
    triage = results["runbooks"]["restart-triage"]
    results["restart_triage"] = {
        "runbook": "collectives-quick + loopback + host",
        "wall_s": triage["wall_s_median"],
        "steps_s": {k: v["seconds"] for k, v in triage["last"].get("steps", {}).items()},
        "target_s": TRIAGE_TARGET_S,
        "within_target": triage["wall_s_median"] <= TRIAGE_TARGET_S,
    }
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["restart_triage"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
