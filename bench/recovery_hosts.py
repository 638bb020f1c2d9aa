"""Recovery across hosts on the multi-host test bed: megaheal under Slurm against plain
`srun torchrun --max-restarts 3` on the same 3 hosts, for a host death and a partition, written as JSON.

Run (root: it brings up a 4-host bed of its own, prefix mhb, and takes it down at the end, also on failure):
    sudo .venv/bin/python bench/recovery_hosts.py [--faults host_death,partition] [--repeats 1] [--cap 180]
                                                  [--keep] [--out bench/results/recovery_hosts.json]

The job: configs/demo.yaml, steps=--steps, global_batch=24, a checkpoint every 5 steps, 3 hosts x 2 ranks (pp 2, dp 3).
- megaheal: deploy/slurm/megaheal.sbatch on the bed's 4 hosts (3 training, 1 spare; the healer on hosts[0]).
- torchrun: `salloc -N3 srun --nodes=3 --ntasks-per-node=1 torchrun --nnodes 3 --nproc-per-node 2 --max-restarts 3`
  with c10d rendezvous on hosts[0] and `--resume auto`, so a restart resumes from the newest checkpoint.
Once every rank passed step 12, the fault hits hosts[1] (a training host): host_death = testbed.faults.kill_host
(link down, every process of the host SIGKILLed); partition = testbed.faults.cut_link (restored once the job
recovered or the cap passed). Measured from the fault (all wall-clock times, time.time()):
- detection: megaheal: the incident's detected time; torchrun: the first line from srun or torchrun's agents that
  reacts (a worker group failed or restarted, srun reporting a task or node failure);
- MTTR: the first step record (RUN_DIR/ranks/*.jsonl, field `time`) written by a process that did not train before
  the fault, i.e. by the next attempt; past --cap seconds the run is recorded as not recovered, with the reason;
- lost steps: the highest step recorded before the fault's attempt ended, minus the step the next attempt resumed
  from (its first step - 1); finished: the job trained to its last step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # NOTE: replace bench/ (first on the path), as bench/runbooks.py does

from testbed import faults  # noqa: E402
from testbed.bed import Bed  # noqa: E402
from testbed.job import SlurmJob, job_env, step_records, wait_step  # noqa: E402

BED = Bed.Config(hosts=4, prefix="mhb", subnet="10.223.0.0/24", slurmctld_port=6871)
FAULT_STEP = 12
DEMO_AT_DP3 = "global_batch=24"  # what deploy/slurm/megaheal.sbatch runs the demo at; torchrun gets the same
CHECKPOINT_EVERY = 5
FAULTS = ("host_death", "partition")
# What plain torchrun's agents print when they react themselves (torch.distributed.elastic), and what Slurm's srun
# and salloc print when the scheduler reacts for them (a node failure ends the step and revokes the allocation).
TORCHRUN_REACTION = re.compile(r"Worker group FAILED|restart(ing)? worker group|failed \(exitcode"
                               r"|RendezvousTimeoutError|rendezvous.*(timed out|closed)", re.IGNORECASE)
SLURM_REACTION = re.compile(r"srun: error|salloc: error|Node failure|allocation \d+ has been revoked"
                            r"|task \d+: (Exited|Killed|Terminated)|CANCELLED|Job step aborted", re.IGNORECASE)


# ---- the fault and what the records say about it -------------------------------------------------------------

def inject(bed: Bed, fault: str) -> float:
    victim = bed.hosts[1]
    at = time.time()
    if fault == "host_death":
        faults.kill_host(bed, victim)
    else:
        faults.cut_link(bed, victim)
    return at


def recovery_from_records(run_dir: Path, fault_at: float) -> dict[str, Any]:
    """The first step of the next attempt (a pid that recorded nothing before the fault) and the steps lost."""
    records = step_records(run_dir)
    before = {r["pid"] for r in records if r["time"] <= fault_at}
    old = [r for r in records if r["pid"] in before]
    new = sorted((r for r in records if r["pid"] not in before and r["time"] > fault_at), key=lambda r: r["time"])
    highest = max((r["step"] for r in old), default=None)
    out: dict[str, Any] = {"step_at_fault": max((r["step"] for r in old if r["time"] <= fault_at), default=None),
                           "highest_step_before": highest, "mttr_s": None, "first_step_after": None,
                           "lost_steps": None, "last_step": max((r["step"] for r in records), default=None)}
    if new:
        first = new[0]
        out.update(mttr_s=round(first["time"] - fault_at, 3), first_step_after=first["step"],
                   lost_steps=highest - (first["step"] - 1) if highest is not None else None)
    return out


def recovered_yet(run_dir: Path, fault_at: float) -> bool:
    return recovery_from_records(run_dir, fault_at)["mttr_s"] is not None


def wait_until(probe: Any, timeout_s: float, every_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(every_s)
    return False


# ---- megaheal --------------------------------------------------------------------------------------------------

def megaheal_run(bed: Bed, fault: str, workdir: Path, steps: int, cap_s: float) -> dict[str, Any]:
    job = SlurmJob.submit(bed, workdir, steps)
    try:
        job.wait_step(FAULT_STEP, 600)
        fault_at = inject(bed, fault)
        recovered = wait_until(lambda: recovered_yet(job.run_dir, fault_at) or job.proc.poll() is not None, cap_s)
        if fault == "partition":
            faults.restore_link(bed, bed.hosts[1])
        try:
            rc = job.proc.wait(max(60.0, 4.0 * steps))
        except subprocess.TimeoutExpired:
            rc = None
        result = recovery_from_records(job.run_dir, fault_at)
        result.update(megaheal_incident(job, fault_at, bed.hosts[1].name))
        out = job.text()
        result.update(recovered=result["mttr_s"] is not None, job_exit=rc,
                      finished=rc == 0 and "outcome: finished" in out and result["last_step"] == steps - 1,
                      attempts=job.attempts(), nodes_by_attempt={a: job.attempt(a)["nodes"] for a in job.attempts()},
                      notes=[] if recovered else [f"no step of a new attempt within {cap_s:.0f} s of the fault"],
                      output_tail=out.splitlines()[-8:])
        return result
    finally:
        job.stop()


def megaheal_incident(job: SlurmJob, fault_at: float, victim: str) -> dict[str, Any]:
    """The healer's own account: the first incident that names the victim (else the first one), its times made
    relative to the fault (the store keeps aware UTC datetimes; the timeline gives epoch seconds)."""
    incidents = job.incidents()
    named = [i for i in incidents if victim in i["suspect_nodes"]]
    if not incidents:
        return {"detection_s": None, "incident": None, "incidents": 0}
    inc = (named or incidents)[0]

    def since(t: float | None) -> float | None:
        return round(t - fault_at, 3) if t is not None else None

    return {"detection_s": since(inc["detected_at"]), "incidents": len(incidents),
            "incident": {"kind": inc["kind"], "summary": inc["summary"], "suspect_nodes": inc["suspect_nodes"],
                         "action": inc["action"], "state": inc["state"], "resume_step": inc["resume_step"],
                         "diagnosed_s": since(inc["diagnosed_at"]), "decided_s": since(inc["decided_at"]),
                         "restarted_s": since(inc["remediated_at"]), "recovered_s": since(inc["recovered_at"]),
                         "lost_steps": inc["lost_steps"]}}


# ---- plain srun torchrun ---------------------------------------------------------------------------------------

class Lines:
    """A process's output, line by line, each with the wall-clock time it arrived; also written to `log`."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc, log), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str], log: Path) -> None:
        assert proc.stdout is not None
        with log.open("w") as f:
            for line in proc.stdout:
                self.lines.append((time.time(), line.rstrip("\n")))
                f.write(line)
                f.flush()

    def first(self, pattern: re.Pattern[str], after: float) -> tuple[float, str] | None:
        return next(((t, s) for t, s in list(self.lines) if t > after and pattern.search(s)), None)

    def text(self) -> str:
        return "\n".join(s for _, s in list(self.lines))


def torchrun_argv(bed: Bed, run_dir: Path, steps: int, rdzv_id: str) -> list[str]:
    """As healer/agent/node.py's torchrun_argv builds it, but with torchrun's own restarts and a fixed host set."""
    hosts = [h.name for h in bed.hosts[:3]]
    # parallel.dp: megaheal derives it from the hosts that train (3 x 2 ranks / pp 2); torchrun needs it given.
    overrides = [f"steps={steps}", *DEMO_AT_DP3.split(), f"parallel.dp={len(hosts)}",
                 f"checkpoint.every_steps={CHECKPOINT_EVERY}"]
    return ["salloc", f"--nodes={len(hosts)}", f"--nodelist={','.join(hosts)}", "--job-name=torchrun-bench",
            "srun", f"--nodes={len(hosts)}", "--ntasks-per-node=1",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:29400", "--rdzv-id", rdzv_id,
            "--max-restarts", "3", "--monitor-interval", "0.2",
            "-m", "train", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), "--resume", "auto",
            *[a for item in overrides for a in ("--set", item)]]


def torchrun_run(bed: Bed, fault: str, workdir: Path, steps: int, cap_s: float) -> dict[str, Any]:
    run_dir = workdir / "run"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(torchrun_argv(bed, run_dir, steps, workdir.name), cwd=REPO, env=job_env(bed),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Lines(proc, workdir / "salloc.log")
    try:
        wait_step(run_dir, proc, FAULT_STEP, 600, output=out.text)
        fault_at = inject(bed, fault)
        wait_until(lambda: recovered_yet(run_dir, fault_at) or proc.poll() is not None, cap_s)
        ended_at = time.time() if proc.poll() is not None else None
        result = recovery_from_records(run_dir, fault_at)
        if result["mttr_s"] is not None:
            try:
                proc.wait(max(60.0, 4.0 * steps))  # let it finish, to see whether it does
            except subprocess.TimeoutExpired:
                pass
            result = recovery_from_records(run_dir, fault_at)
        own, slurm = out.first(TORCHRUN_REACTION, fault_at), out.first(SLURM_REACTION, fault_at)
        reaction = min((r for r in (own, slurm) if r), default=None)
        result.update(detection_s=round(reaction[0] - fault_at, 3) if reaction else None,
                      detected_by=reaction[1] if reaction else None,
                      torchrun_reacted_s=round(own[0] - fault_at, 3) if own else None,
                      slurm_reacted_s=round(slurm[0] - fault_at, 3) if slurm else None,
                      recovered=result["mttr_s"] is not None,
                      allocation_ended_s=round(ended_at - fault_at, 3) if ended_at else None,
                      job_exit=proc.poll(), finished=proc.poll() == 0 and result["last_step"] == steps - 1,
                      notes=torchrun_notes(result, own, out, fault_at, cap_s, ended_at))
        result["output_tail"] = out.text().splitlines()[-10:]
        return result
    finally:
        stop_allocation(bed, proc, out)


def torchrun_notes(result: dict[str, Any], own: tuple[float, str] | None, out: Lines, fault_at: float, cap_s: float,
                   ended_at: float | None) -> list[str]:
    notes = [] if own else ["torchrun's agents never reacted themselves: the surviving workers blocked in the "
                            "collective (gloo timeout: train's dist_timeout_s, 600 s)"]
    if result["mttr_s"] is not None:
        return notes
    after = [s for t, s in out.lines if t > fault_at]
    why = (f"the allocation ended {ended_at - fault_at:.0f} s after the fault, without a new step (plain salloc: "
           "Slurm ends a job on a node failure; torchrun cannot leave the host out in any case)"
           if ended_at else f"no step of restarted workers within the cap ({cap_s:.0f} s)")
    rdzv = [s for s in after if "rendezvous" in s.lower() or "rdzv" in s.lower()]
    return [*notes, why, *([f"last rendezvous line: {rdzv[-1][:300]}"] if rdzv else []),
            *([f"last line: {after[-1][:300]}"] if after else ["nothing printed after the fault"])]


def stop_allocation(bed: Bed, proc: subprocess.Popen[str], out: Lines) -> None:
    granted = re.search(r"Granted job allocation (\d+)", out.text())
    if proc.poll() is None and granted:
        subprocess.run(["scancel", granted.group(1)], env=job_env(bed), capture_output=True, timeout=30)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(30)


# ---- the runs and the summary ----------------------------------------------------------------------------------

SYSTEMS = {"megaheal": megaheal_run, "torchrun_max_restarts_3": torchrun_run}


def one(bed: Bed, system: str, fault: str, workdir: Path, steps: int, cap_s: float) -> dict[str, Any]:
    started = time.time()
    try:
        result = SYSTEMS[system](bed, fault, workdir, steps, cap_s)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON; the other runs still go
        result = {"recovered": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
    finally:
        faults.clear(bed)  # revive the dead host, link up, jobs cancelled, drains resumed
    result.update(run_dir=str(workdir), wall_s=round(time.time() - started, 1), loadavg=os.getloadavg())
    return result


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    return {"detection_s": med("detection_s"), "mttr_s": med("mttr_s"), "lost_steps": med("lost_steps"),
            "recovered": [bool(r.get("recovered")) for r in runs], "finished": [bool(r.get("finished")) for r in runs],
            "detection_s_all": [r.get("detection_s") for r in runs], "mttr_s_all": [r.get("mttr_s") for r in runs],
            "lost_steps_all": [r.get("lost_steps") for r in runs],
            "notes": sorted({n for r in runs for n in r.get("notes", []) + ([r["error"]] if "error" in r else [])})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cap", type=float, default=180.0, help="seconds after the fault to wait for a new step")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery_hosts.json"))
    args = parser.parse_args()
    chosen = [f for f in args.faults.split(",") if f]
    if unknown := set(chosen) - set(FAULTS):
        parser.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": os.getloadavg()},
        "caveat": "one shared 2-core machine: other work (other sessions' test runs and beds) ran meanwhile, "
                  "so absolute times carry that load (see loadavg per run); compare the two systems within a run",
        "setup": {"bed": BED.to_payload(), "job": f"configs/demo.yaml steps={args.steps} {DEMO_AT_DP3} "
                  f"checkpoint every {CHECKPOINT_EVERY}", "ranks": "3 hosts x 2 ranks (pp 2, dp 3); megaheal: +1 spare",
                  "fault_after_step": FAULT_STEP, "victim": "hosts[1] (a training host)", "cap_s": args.cap,
                  "repeats": args.repeats, "torchrun_argv": torchrun_argv(Bed(BED), Path("RUN_DIR"), args.steps, "ID")},
    }
    tmp = Path(tempfile.mkdtemp(prefix="mh-recovery-hosts-", dir="/var/tmp"))
    bed = Bed(BED)
    bed.down()  # whatever a killed run left
    try:
        bed.up()
        for fault in chosen:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems.split(",") if s}
            for n in range(args.repeats):
                for system in runs:
                    r = one(bed, system, fault, tmp / f"{fault}-{system}-{n}", args.steps, args.cap)
                    runs[system].append(r)
                    print(fault, system, n, json.dumps({k: v for k, v in r.items() if k != "output_tail"}),
                          flush=True)
            results[fault] = {s: {"median": summary(rs), "runs": rs} for s, rs in runs.items()}
    finally:
        bed.down()
        if args.keep:
            print("run directories kept in", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
