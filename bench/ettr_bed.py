"""ETTR on the multi-host test bed: a training run of --minutes with a fault every --every seconds (a crash, a host's
death, a hang, a NaN, a bit flip, in rotation), under megaheal (warm, deploy/slurm/megaheal.sbatch) and under plain
`srun torchrun --max-restarts 3`, one after the other in one run, written as JSON.

Run (root: it brings up bench/recovery_hosts.py's 4-host bed, prefix mhb, and takes it down at the end):
    sudo .venv/bin/python bench/ettr_bed.py [--minutes 20] [--every 150] [--systems megaheal_warm,torchrun_max_restarts_3]
        [--keep] [--out bench/results/ettr_bed.json]

The job is recovery_hosts.py's: configs/demo.yaml at global_batch 24 on 3 hosts x 2 ranks (pp 2, dp 3), a checkpoint
every 5 steps (warm: a snapshot at each); megaheal has the bed's fourth host as its spare. A calibration run of plain
torchrun, fault-free, gives the pace (seconds per step) first.

The faults, at `every` x k seconds after the job's first step (k = 1, 2, ...), in this rotation:
- crash: rank CRASH_RANK's process is SIGKILLed;
- host_death: the host of rank HOST_RANK (never hosts[0], the batch host) dies (testbed.faults.kill_host); it is
  repaired and powered on again REVIVE_AFTER_S later, as a repaired host returns to a cluster;
- hang: rank HANG_RANK's process is SIGSTOPped: it holds its sockets and answers no collective;
- nan: the batch the job trains at that time (by the calibrated pace) poisons the weights (inject_nan_at_sample);
- bitflip: from the step the job trains at that time, every forward pass of hosts[2]'s ranks flips the top exponent
  bit of one matmul output (inject_matmul_flips, rate 1: a GPU that computes wrong from then on).
The nan and bitflip are set at the job's start, by step (the trainer plays them), so they strike when the job reaches
that step: later than their slot when earlier faults cost time. Both systems get the same steps.

ETTR = productive time / the window (--minutes from the job's first step). Productive time = the steps the run kept
(its final lineage: a step trained again after a rollback replaces the earlier one; a step whose loss is not finite
or whose update was skipped by the re-runs is not productive) x a step's time: `ettr` at the run's own pace (rank 0's
median step over the window, as the simulator counts), `ettr_at_calibrated_pace` at the fault-free torchrun's
(megaheal's own overhead on these 2 cores counted as lost too, and the machine's drift between the two runs). A run
that ends before the window does is productive no more: a person would have to come. `--remeasure DIR` measures a
kept run again (its directories and the JSON it wrote), as this version of the script counts.
The restart budget is raised to 12 an hour (--rules): the default's 5 is for real failure rates (Llama 3: one
interruption every ~3 hours at 16k GPUs); this bench packs 8 faults into 20 minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: replace bench/ (first on the path), as bench/runbooks.py does
sys.path.insert(1, str(REPO / "bench"))

import recovery_hosts as rh

from testbed import faults
from testbed.bed import Bed
from testbed.dcgm import URL, Exporters
from testbed.job import SlurmJob, job_env, step_records

ROTATION = ("crash", "host_death", "hang", "nan", "bitflip")
CRASH_RANK, HANG_RANK, HOST_RANK = 5, 3, 2
REVIVE_AFTER_S = 60.0
IN_FLIGHT = 2
"""Steps rank 0 may still record after a fault struck: the pipeline's ranks finish what they had in flight."""
LATE_S = 60.0
"""How long a crash or hang waits for a process of its rank when it is due during a restart."""
GLOBAL_BATCH = 24
STEPS = 1_000_000  # never reached: the window ends the run
BUDGET = "remediation:\n  budget: {max_restarts: 12, window: 1h, backoff: 0s, max_backoff: 5m}\n"
LIVE = ("crash", "host_death", "hang")
"""The faults the bench strikes itself, on the clock; the others the trainer plays at a step."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What both systems run through: the slots, the calibrated pace they were placed by, and the trainer's part."""

    slots: list[Slot]
    pace_s: float
    extra: list[str]


@dataclass(frozen=True, slots=True)
class Slot:
    at_s: float
    kind: str
    step: int | None = None
    """nan, bitflip: the step they are set at (the calibrated pace x at_s)."""


def schedule(window_s: float, every_s: float, pace_s: float) -> list[Slot]:
    slots, k = [], 1
    while k * every_s < window_s:
        kind = ROTATION[(k - 1) % len(ROTATION)]
        at = k * every_s
        slots.append(Slot(at, kind, None if kind in LIVE else round(at / pace_s)))
        k += 1
    return slots


def trainer_faults(slots: list[Slot], bed: Bed) -> list[str]:
    """The `--set` items that make the trainer play the nan and bitflip slots (at most one of each: the trainer
    takes one NaN sample; a bitflip host flips from its first step on)."""
    items = []
    nan = next((s.step for s in slots if s.kind == "nan" and s.step is not None), None)
    flip = next((s.step for s in slots if s.kind == "bitflip" and s.step is not None), None)
    if nan is not None:
        items.append(f"inject_nan_at_sample={nan * GLOBAL_BATCH}")
    if flip is not None:
        items.append(f'inject_matmul_flips=[{{"node":"{bed.hosts[2].name}","from_step":{flip},"rate":1.0}}]')
    return items


# ---- striking a fault ------------------------------------------------------------------------------------------

def live_pid(run_dir: Path, rank: int) -> tuple[int, str] | None:
    """The pid and host of `rank`'s newest record whose process is alive (None while a restart has none)."""
    for r in sorted((r for r in step_records(run_dir) if r["rank"] == rank), key=lambda r: -r["time"]):
        try:
            os.kill(r["pid"], 0)
        except ProcessLookupError:
            continue
        return r["pid"], str(r.get("node") or "")
    return None


def strike(bed: Bed, kind: str, run_dir: Path) -> dict[str, Any]:
    """A live fault, now: what was hit, and when (`at`: a crash or hang due during a restart waits for its rank)."""
    if kind in ("crash", "hang"):
        rank = CRASH_RANK if kind == "crash" else HANG_RANK
        # A restart still under way has no process of the rank yet: the fault waits for the next one.
        rh.wait_until(lambda: live_pid(run_dir, rank) is not None, LATE_S, every_s=0.2)
        found = live_pid(run_dir, rank)
        if found is None:
            return {"at": time.time(), "missed": f"no live process of rank {rank} within {LATE_S:.0f} s"}
        pid, node = found
        os.kill(pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
        return {"at": time.time(), "pid": pid, "node": node, "rank": rank}
    names = [h.name for h in bed.hosts]
    newest = max((r for r in step_records(run_dir) if r["rank"] == HOST_RANK), key=lambda r: r["time"], default=None)
    # Rank HOST_RANK's host, or hosts[1] (a training host of the first attempt) where that is the batch host.
    node = newest["node"] if newest is not None and newest.get("node") in names[1:] else names[1]
    at = time.time()
    faults.kill_host(bed, node)
    return {"at": at, "node": node}


def drive(bed: Bed, run_dir: Path, ended: Any, slots: list[Slot], window_s: float) -> tuple[float, list[dict]]:
    """Strike the live faults on the clock from the job's first step, revive dead hosts, until the window closed or
    the job ended; (the first step's time, what was struck)."""
    rh.wait_until(lambda: step_records(run_dir) or ended(), 900, every_s=0.2)
    records = step_records(run_dir)
    if not records:
        raise RuntimeError("the job ended before its first step")
    t0 = min(r["time"] for r in records)
    events: list[tuple[float, str, Slot | str]] = [(t0 + s.at_s, "strike", s) for s in slots if s.kind in LIVE]
    struck: list[dict[str, Any]] = []
    while events:
        events.sort(key=lambda e: e[0])
        at, what, arg = events.pop(0)
        if not until(at, ended):
            break
        if what == "revive":
            faults.revive_host(bed, str(arg))
            continue
        assert isinstance(arg, Slot)
        hit = {"kind": arg.kind, "slot_s": arg.at_s, **strike(bed, arg.kind, run_dir)}
        struck.append(hit)
        print(f"  {hit['at'] - t0:7.1f} s  {arg.kind}: {hit}", flush=True)
        if arg.kind == "host_death" and "node" in hit:
            events.append((hit["at"] + REVIVE_AFTER_S, "revive", hit["node"]))
    until(t0 + window_s, ended)
    return t0, struck


def until(at: float, ended: Any) -> bool:
    """Wait until wall-clock time `at` (the records' clock: a monotonic wait ran late by the length of a pause of
    this virtual machine); False if the job ended first."""
    while time.time() < at:
        if ended():
            return False
        time.sleep(min(0.2, max(0.0, at - time.time())))
    return not ended()


# ---- what the records say --------------------------------------------------------------------------------------

def kept_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Rank 0's final lineage: each step's last record, a record of step s dropping every later step recorded
    before it (a rollback or a restart from an older state trains them again)."""
    kept: dict[int, dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: r["time"]):
        for s in [s for s in kept if s >= r["step"]]:
            del kept[s]
        kept[r["step"]] = r
    return kept


def productive(r: dict[str, Any]) -> bool:
    return math.isfinite(float(r["loss"])) and r.get("rerun") in (None, "transient")


def own_pace(records: list[dict[str, Any]]) -> float | None:
    """The median time between rank 0's consecutive steps of one process and attempt."""
    ordered = sorted(records, key=lambda r: r["time"])
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(ordered)
            if b["step"] == a["step"] + 1 and a["pid"] == b["pid"] and a.get("attempt") == b.get("attempt")]
    return statistics.median(gaps) if gaps else None


def measure(run_dir: Path, t0: float, window_s: float, plan: Plan, struck: list[dict[str, Any]]) -> dict[str, Any]:
    ranks0 = [r for r in step_records(run_dir) if r["rank"] == 0 and t0 <= r["time"] <= t0 + window_s]
    kept = kept_steps(ranks0)
    good = [r for r in kept.values() if productive(r)]
    pace = own_pace(ranks0)
    # NOTE: the pace before the first fault compares the systems' overheads (the healer, its agents and standbys
    # share these 2 cores with the ranks); it is no baseline for ETTR: the machine's own speed drifts by more over a
    # run (a megaheal run here trained its first 150 s at 0.49 s a step and its window at a median of 0.43).
    first = t0 + min((s.at_s for s in plan.slots), default=window_s)
    calm = own_pace([r for r in ranks0 if r["time"] < first])
    last = max((r["time"] for r in ranks0), default=t0)
    return {"window_s": window_s, "records": len(ranks0), "kept_steps": len(kept), "productive_steps": len(good),
            "last_step": max(kept, default=None), "trained_until_s": round(last - t0, 1),
            "pace_s": round(pace, 4) if pace else None, "calibrated_pace_s": round(plan.pace_s, 4),
            "pace_before_first_fault_s": round(calm, 4) if calm else None,
            "ettr": round(len(good) * pace / window_s, 4) if pace else None,
            "ettr_at_calibrated_pace": round(len(good) * plan.pace_s / window_s, 4),
            "faults": fault_costs(ranks0, t0, plan.slots, struck, pace)}


def fault_costs(ranks0: list[dict[str, Any]], t0: float, slots: list[Slot], struck: list[dict[str, Any]],
                pace_s: float | None) -> list[dict[str, Any]]:
    """Each fault: when it struck (s from the first step; a trainer-played one: when the step it is set at began),
    `regained_s`: until rank 0 recorded a productive step of the final lineage past the step it had reached +
    IN_FLIGHT (the steps a pipelined job may finish after the fault; None: never), and `cost_s`: that less what those
    steps take at the run's pace."""
    ordered = sorted(ranks0, key=lambda r: r["time"])
    kept = kept_steps(ranks0)
    out = []
    for slot in slots:
        if slot.kind in LIVE:
            hit = next((h for h in struck if h["slot_s"] == slot.at_s), None)
            if hit is None:
                out.append({"kind": slot.kind, "slot_s": slot.at_s, "struck": False})
                continue
            at, what = hit["at"], {k: v for k, v in hit.items() if k not in ("kind", "slot_s", "at")}
        else:
            assert slot.step is not None, slot  # schedule() sets the step of every slot the trainer plays
            before = next((r for r in ordered if r["step"] == slot.step - 1), None)
            if before is None:
                out.append({"kind": slot.kind, "slot_s": slot.at_s, "step": slot.step, "struck": False})
                continue
            at, what = before["time"], {"step": slot.step}
        reached = max((r["step"] for r in ordered if r["time"] <= at), default=-1)
        # NOTE: a step of the final lineage: one trained after the fault and later undone (a rollback's, or taken
        # back for a convicted host's taint) did not regain anything.
        past = next((r for r in ordered if r["time"] > at and r["step"] > reached + IN_FLIGHT and productive(r)
                     and kept.get(r["step"]) is r), None)
        regained = cost = None
        if past is not None:
            regained = past["time"] - at
            cost = regained - (past["step"] - reached) * pace_s if pace_s else None
        out.append({"kind": slot.kind, "slot_s": slot.at_s, "struck": True, "at_s": round(at - t0, 1), **what,
                    "step_reached": reached, "regained_s": round(regained, 1) if regained is not None else None,
                    "cost_s": round(cost, 1) if cost is not None else None})
    return out


# ---- the systems -----------------------------------------------------------------------------------------------

def megaheal_warm(bed: Bed, workdir: Path, window_s: float, plan: Plan) -> dict[str, Any]:
    rules = workdir / "remediation.yaml"
    workdir.mkdir(parents=True)
    rules.write_text(BUDGET)
    exporters = Exporters(bed, workdir / "dcgm")
    job = SlurmJob.submit(bed, workdir, STEPS, extra_set=" ".join(plan.extra),
                          args=f"--dcgm-url {URL} --warm --rules {REPO / 'configs' / 'rules' / 'default.yaml'} "
                               f"--rules {rules}")
    try:
        t0, struck = drive(bed, job.run_dir, lambda: job.proc.poll() is not None, plan.slots, window_s)
        ended_early = job.proc.poll() is not None
        job.stop()
        result = {"ended_early": ended_early, "output_tail": job.text().splitlines()[-8:]}
        incidents = job.incidents()
        result["incidents"] = [{k: i.get(k) for k in ("kind", "summary", "suspect_nodes", "action", "state",
                                                        "restart_mode", "resume_step")}
                               | {"detected_s": round(i["detected_at"] - t0, 1) if i.get("detected_at") else None}
                               for i in incidents]
        result["pages"] = sum(1 for i in incidents if "page" in str(i.get("action")) or i.get("state") == "escalated")
        result["attempts"] = job.attempts()
        return {**measure(job.run_dir, t0, window_s, plan, struck), **result}
    finally:
        exporters.stop()
        job.stop()


def torchrun(bed: Bed, workdir: Path, window_s: float, plan: Plan) -> dict[str, Any]:
    run_dir = workdir / "run"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(rh.torchrun_argv(bed, run_dir, STEPS, workdir.name, tuple(plan.extra)), cwd=REPO,
                            env=job_env(bed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = rh.Lines(proc, workdir / "salloc.log")
    try:
        t0, struck = drive(bed, run_dir, lambda: proc.poll() is not None, plan.slots, window_s)
        ended = proc.poll()
        result = measure(run_dir, t0, window_s, plan, struck)
        result.update(ended_early=ended is not None, job_exit=ended, output_tail=out.text().splitlines()[-10:])
        return result
    finally:
        rh.stop_allocation(bed, proc, out)


def calibrate(bed: Bed, workdir: Path, seconds: float) -> dict[str, Any]:
    """Plain torchrun with no fault for `seconds` after its first step: the pace of a step (rank 0's median)."""
    run_dir = workdir / "run"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(rh.torchrun_argv(bed, run_dir, STEPS, workdir.name), cwd=REPO, env=job_env(bed),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = rh.Lines(proc, workdir / "salloc.log")
    try:
        t0, _ = drive(bed, run_dir, lambda: proc.poll() is not None, [], seconds)
        ranks0 = [r for r in step_records(run_dir) if r["rank"] == 0 and r["time"] <= t0 + seconds]
        pace = own_pace(ranks0)
        if pace is None:
            raise RuntimeError(f"the calibration run trained no two steps:\n{out.text()[-2000:]}")
        return {"pace_s": round(pace, 4), "steps": len(ranks0), "seconds": seconds,
                "mean_s": round(seconds / max(1, len(ranks0)), 4)}
    finally:
        rh.stop_allocation(bed, proc, out)


SYSTEMS = {"megaheal_warm": megaheal_warm, "torchrun_max_restarts_3": torchrun}


def remeasure(kept: Path, out: Path) -> None:
    """The measures of each system's kept run, again, from its run directory and what `out` says of its faults."""
    results = json.loads(out.read_text())
    setup = results["setup"]
    slots = [Slot(**s) for s in setup["schedule"]]
    plan = Plan(slots, setup["calibration"]["pace_s"], setup["trainer_faults"])
    for system in SYSTEMS:
        run_dir = kept / system / "run"
        if system not in results or not run_dir.is_dir():
            continue
        t0 = min(r["time"] for r in step_records(run_dir))
        struck = [{**{k: v for k, v in f.items() if k not in ("at_s", "struck", "regained_s", "cost_s",
                                                                "step_reached")}, "at": t0 + f["at_s"]}
                  for f in results[system]["faults"] if f.get("struck") and f["kind"] in LIVE]
        results[system].update(measure(run_dir, t0, setup["window_s"], plan, struck))
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=150.0, help="seconds between faults")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--calibrate", type=float, default=60.0, help="seconds of the fault-free calibration run")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "ettr_bed.json"))
    parser.add_argument("--remeasure", metavar="DIR", help="measure the runs kept in DIR (--keep) again into --out")
    args = parser.parse_args()
    if args.remeasure:
        remeasure(Path(args.remeasure), Path(args.out))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    window_s = args.minutes * 60
    tmp = Path(tempfile.mkdtemp(prefix="mh-ettr-bed-", dir="/var/tmp"))
    bed = Bed(rh.BED)
    bed.down()
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": os.getloadavg()},
        "caveat": "one shared 2-core machine: compare the systems within a run; each system's ETTR is its own",
    }
    try:
        bed.up()
        os.environ["SLURM_CONF"] = job_env(bed)["SLURM_CONF"]
        calibration = calibrate(bed, tmp / "calibration", args.calibrate)
        faults.clear(bed)
        slots = schedule(window_s, args.every, calibration["pace_s"])
        plan = Plan(slots, calibration["pace_s"], trainer_faults(slots, bed))
        results["setup"] = {"bed": rh.BED.to_payload(), "window_s": window_s, "every_s": args.every,
                            "job": f"configs/demo.yaml {rh.DEMO_AT_DP3} checkpoint every {rh.CHECKPOINT_EVERY}",
                            "calibration": calibration, "schedule": [asdict(s) for s in slots],
                            "trainer_faults": plan.extra, "revive_after_s": REVIVE_AFTER_S,
                            "megaheal_budget": BUDGET.strip(), "goal": "megaheal ETTR >= 0.95"}
        print("calibration", calibration, "schedule", [(s.at_s, s.kind, s.step) for s in slots], flush=True)
        for system in systems:
            started = time.time()
            try:
                r = SYSTEMS[system](bed, tmp / system, window_s, plan)
            except Exception as exc:  # noqa: BLE001 - recorded; the other system still runs
                r = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
            finally:
                faults.clear(bed)
            r.update(wall_s=round(time.time() - started, 1), loadavg=os.getloadavg())
            results[system] = r
            print(system, json.dumps({k: v for k, v in r.items() if k != "output_tail"}), flush=True)
    finally:
        rh.take_down(bed, tmp, args.keep)
    rh.write_results(results, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
