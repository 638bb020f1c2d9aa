"""Recovery across hosts on the multi-host test bed: megaheal under Slurm, warm and cold, against plain
`srun torchrun --max-restarts 3` on the same 3 hosts, for five faults, side by side in one run, written as JSON.

Run (root: it brings up a 4-host bed of its own, prefix mhb, and takes it down at the end, also on failure):
    sudo .venv/bin/python bench/recovery_hosts.py [--faults host_death,partition,gpu_fault,hang,control_host]
        [--systems megaheal_warm,megaheal_cold,torchrun_max_restarts_3] [--repeats 1] [--cap 180] [--keep]
        [--out bench/results/recovery_hosts.json]

The job: configs/demo.yaml, steps=--steps, global_batch=24, a checkpoint every 5 steps (warm: a snapshot at each),
3 hosts x 2 ranks (pp 2, dp 3); every host serves a dcgm-exporter exposition on its loopback (testbed/dcgm.py).
- megaheal_warm / megaheal_cold: deploy/slurm/megaheal.sbatch (with and without --warm, --dcgm-url) on the bed's
  4 hosts (3 training, 1 spare; the healer on hosts[0], its watcher on another host).
- megaheal_replica: the same script and model, as 3 replica groups of one host each (train/ft/: dp 2 inside each
  group, `ft.enabled`; no pipeline, which replica groups do not take), the Lighthouse beside the healer: a fault of one host replaces its group alone while the
  other two train on. Its MTTR is when the spare's group trained its first step (the job at full strength again);
  `stall_s` is the longest wait of the groups that never stopped, `trained_meanwhile` the steps they trained
  between the fault and that first step.
- torchrun: `salloc -N3 srun --nodes=3 --ntasks-per-node=1 torchrun --nnodes 3 --nproc-per-node 2 --max-restarts 3`
  with c10d rendezvous on hosts[0] and `--resume auto`, so a restart resumes from the newest checkpoint.
Once every rank passed step 12 the fault hits (all times wall-clock, time.time()):
- host_death: hosts[1] dies (testbed.faults.kill_host: link down, every process SIGKILLed);
- partition: hosts[1]'s link is cut (restored once the job recovered or the cap passed);
- gpu_fault: hosts[1]'s GPU falls off the bus (Xid 79 in its dcgm-exporter; torchrun reads no GPU health);
- hang: rank 2 (on hosts[1]) spins in its forward pass at step 12, injected by the config (inject_hangs): the fault
  time is its mark file's;
- control_host: hosts[0] dies, the host running megaheal's batch script and healer (torchrun's rendezvous host).
Measured from the fault:
- detection: megaheal: the incident's detected time (control_host: the watcher's handover); torchrun: the first line
  from srun or torchrun's agents that reacts (a worker group failed or restarted, srun reporting a task or node
  failure);
- MTTR: the first step record (RUN_DIR/ranks/*.jsonl, field `time`) of the next attempt: by a process that did not
  train before the fault, or of a later attempt (a warm restart's survivors keep their pids); past --cap seconds the
  run is recorded as not recovered, with the reason;
- lost steps: the highest step recorded before the fault's attempt ended, minus the step the next attempt resumed
  from (its first step - 1); finished: the job trained to its last step;
- megaheal's stages, from its incident and journal: detection, decision (detected -> restart ordered), restart
  (ordered -> the new attempt started), state transfer (warm: the slowest replaced rank's state, as it reported),
  first step (started -> MTTR).
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

from ground import slurm  # noqa: E402
from testbed import faults  # noqa: E402
from testbed.bed import Bed  # noqa: E402
from testbed.dcgm import URL, Exporters  # noqa: E402
from testbed.job import SlurmJob, job_env, step_records, wait_step  # noqa: E402
from wire.run_paths import RunPaths  # noqa: E402

BED = Bed.Config(hosts=4, prefix="mhb", subnet="10.223.0.0/24", slurmctld_port=6871)
FAULT_STEP = 12
DEMO_AT_DP3 = "global_batch=24"  # what deploy/slurm/megaheal.sbatch runs the demo at; torchrun gets the same
CHECKPOINT_EVERY = 5
FAULTS = ("host_death", "partition", "gpu_fault", "hang", "control_host")
HANG_RANK = 2  # on hosts[1]
HANG = f'inject_hangs=[{{"mode":"spin","at_step":{FAULT_STEP},"rank":{HANG_RANK}}}]'
# What plain torchrun's agents print when they react themselves (torch.distributed.elastic), and what Slurm's srun
# and salloc print when the scheduler reacts for them (a node failure ends the step and revokes the allocation).
TORCHRUN_REACTION = re.compile(r"Worker group FAILED|restart(ing)? worker group|failed \(exitcode"
                               r"|RendezvousTimeoutError|rendezvous.*(timed out|closed)", re.IGNORECASE)
SLURM_REACTION = re.compile(r"srun: error|salloc: error|Node failure|allocation \d+ has been revoked"
                            r"|task \d+: (Exited|Killed|Terminated)|CANCELLED|Job step aborted", re.IGNORECASE)


# ---- the fault and what the records say about it -------------------------------------------------------------

def inject(bed: Bed, fault: str, exporters: Exporters, run_dir: Path) -> float:
    """The fault, now (a hang: already injected by the config); when it struck."""
    if fault == "hang":
        mark = run_dir / "chaos" / f"hang-spin-step{FAULT_STEP}-rank{HANG_RANK}.fired"
        wait_until(mark.exists, 120, every_s=0.1)
        return mark.stat().st_mtime
    at = time.time()
    if fault == "host_death":
        faults.kill_host(bed, bed.hosts[1])
    elif fault == "partition":
        faults.cut_link(bed, bed.hosts[1])
    elif fault == "gpu_fault":
        exporters.gpu_falls_off_the_bus(bed.hosts[1].name)
    else:
        faults.kill_host(bed, bed.hosts[0])
    return at


def fault_step(fault: str) -> int:
    """The step every rank passes before the fault (a hang fires at FAULT_STEP itself)."""
    return FAULT_STEP - 1 if fault == "hang" else FAULT_STEP


def recovery_from_records(run_dir: Path, fault_at: float) -> dict[str, Any]:
    """The first step of the next attempt (by a pid that recorded nothing before the fault, or of a later attempt:
    a warm restart keeps its survivors' pids) and the steps lost."""
    records = step_records(run_dir)
    old = [r for r in records if r["time"] <= fault_at]
    pids = {r["pid"] for r in old}
    attempt = max((int(r.get("attempt") or 0) for r in old), default=0)
    new = sorted((r for r in records if r["time"] > fault_at and
                  (r["pid"] not in pids or int(r.get("attempt") or 0) > attempt)), key=lambda r: r["time"])
    before = [r for r in records if r["pid"] in pids and int(r.get("attempt") or 0) == attempt]
    highest = max((r["step"] for r in before), default=None)
    out: dict[str, Any] = {"step_at_fault": max((r["step"] for r in old), default=None),
                           "highest_step_before": highest, "mttr_s": None, "first_step_after": None,
                           "lost_steps": None, "last_step": max((r["step"] for r in records), default=None),
                           "first_step_after_at": None}
    if new:
        first = new[0]
        out.update(mttr_s=round(first["time"] - fault_at, 3), first_step_after=first["step"],
                   lost_steps=highest - (first["step"] - 1) if highest is not None else None,
                   first_step_after_at=first["time"])
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

REPLICA_GROUPS = ("parallel.pp=1 parallel.dp=2 parallel.microbatches=1 ft.enabled=true ft.groups=3 ft.min_groups=2 "
                  "ft.timeout_s=5")
"""The demo's model as 3 replica groups, one a host of 2 data-parallel ranks (a pipeline cannot take part:
train/ft/config.py); global_batch 24 splits over 3 or 2 groups x 2 ranks."""


def megaheal_run(bed: Bed, fault: str, workdir: Path, steps: int, cap_s: float, warm: bool,
                 groups: bool = False) -> dict[str, Any]:
    exporters = Exporters(bed, workdir / "dcgm")
    args = f"--dcgm-url {URL}" + (" --warm" if warm else "")
    extra = " ".join([*([HANG] if fault == "hang" else []), *([REPLICA_GROUPS] if groups else [])])
    job = SlurmJob.submit(bed, workdir, steps, args=args, extra_set=extra)
    successor: str | None = None
    try:
        job.wait_step(fault_step(fault), 600)
        fault_at = inject(bed, fault, exporters, job.run_dir)
        if groups:
            return replica_result(bed, job, fault_at, steps, cap_s)
        recovered = wait_until(lambda: recovered_yet(job.run_dir, fault_at) or job.proc.poll() is not None, cap_s)
        if fault == "partition":
            faults.restore_link(bed, bed.hosts[1])
        if fault == "control_host":
            # The watcher handed the run to a successor job: its end is the run's.
            handover = RunPaths(job.run_dir).launcher / "handover.json"
            if wait_until(handover.exists, cap_s):
                successor = json.loads(handover.read_text())["successor"]
                recovered = wait_until(lambda: recovered_yet(job.run_dir, fault_at), cap_s)
        ended = wait_until(lambda: job_ended(job, successor), max(60.0, 4.0 * steps))
        result = recovery_from_records(job.run_dir, fault_at)
        result.update(megaheal_incident(job, fault_at, bed.hosts[0 if fault == "control_host" else 1].name))
        if successor is not None:
            handed = json.loads((RunPaths(job.run_dir).launcher / "handover.json").read_text())
            result.update(handover={k: (round(v - fault_at, 3) if k in ("lapsed_at", "handed_at") else v)
                                    for k, v in handed.items()})
            # NOTE: the watcher's handover is when the loss was known and acted on; the successor's incident opens
            # once that job runs (its detection is then the successor's scheduling and start).
            result.update(detection_s=result["handover"]["handed_at"],
                          incident_opened_s=result.get("detection_s"))
        out = job.text()
        result.update(stages=stages(job, result), recovered=result["mttr_s"] is not None, successor=successor,
                      finished=ended and "outcome: finished" in out and result["last_step"] == steps - 1,
                      attempts=job.attempts(), nodes_by_attempt={a: job.attempt(a)["nodes"] for a in job.attempts()},
                      notes=[] if recovered else [f"no step of a new attempt within {cap_s:.0f} s of the fault"],
                      output_tail=out.splitlines()[-8:])
        return result
    finally:
        exporters.stop()
        job.stop()
        if successor is not None and slurm.job_state(successor) in ("PENDING", "RUNNING", "CONFIGURING"):
            slurm.cancel(successor)


def replica_result(bed: Bed, job: SlurmJob, fault_at: float, steps: int, cap_s: float) -> dict[str, Any]:
    """A job of replica groups after its fault: when the spare's group trained (the job at full strength again), how
    long the groups that never stopped waited, and what they trained meanwhile."""
    spare = bed.hosts[3].name

    def joined() -> dict[str, Any] | None:
        return next((r for r in sorted(step_records(job.run_dir), key=lambda r: r["time"])
                     if r["time"] > fault_at and r.get("node") == spare), None)

    wait_until(lambda: joined() is not None or job.proc.poll() is not None, cap_s)
    ended = wait_until(lambda: job.proc.poll() is not None, max(60.0, 4.0 * steps))
    first = joined()
    survivor = sorted((r for r in step_records(job.run_dir) if r["rank"] == 0), key=lambda r: r["time"])
    before = [r for r in survivor if r["time"] <= fault_at]
    after = [r for r in survivor if r["time"] > fault_at]
    gaps = [b["time"] - a["time"] for a, b in zip(survivor, survivor[1:]) if b["time"] > fault_at]
    meanwhile = [r for r in after if first is None or r["time"] < first["time"]]
    highest = max((r["step"] for r in before), default=None)
    result: dict[str, Any] = {
        "step_at_fault": highest, "mttr_s": round(first["time"] - fault_at, 3) if first else None,
        "first_step_after": after[0]["step"] if after else None,
        # NOTE: what the groups that never stopped trained again: a step they had committed is never redone
        "lost_steps": (highest + 1 - after[0]["step"]) if after and highest is not None else None,
        "stall_s": round(max(gaps), 3) if gaps else None, "trained_meanwhile": len(meanwhile),
        "spare_first_step": first["step"] if first else None,
        "last_step": max((r["step"] for r in survivor), default=None)}
    result.update(megaheal_incident(job, fault_at, bed.hosts[1].name))
    out = job.text()
    result.update(recovered=first is not None, attempts=job.attempts(),
                  regroups=[{k: e[k] for k in ("left", "started")} for e in job.journal() if e["event"] == "regrouped"],
                  finished=ended and "outcome: finished" in out and result["last_step"] == steps - 1,
                  notes=[] if first else [f"the spare's group trained no step within {cap_s:.0f} s of the fault"],
                  output_tail=out.splitlines()[-8:])
    return result


def job_ended(job: SlurmJob, successor: str | None) -> bool:
    if successor is not None:
        return slurm.job_state(successor) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
    return job.proc.poll() is not None


def stages(job: SlurmJob, result: dict[str, Any]) -> dict[str, float | None]:
    """Where megaheal's time to recover went (seconds): detection, decision, restart (ordered -> started), the
    warm state transfer (the slowest rank's own count, 'memory step N in X s') and the first step after the
    start."""
    inc = result.get("incident") or {}
    transfer = None
    readies = [e for e in job.journal() if e["event"] == "warm-ready"]
    if readies and inc.get("kind"):
        said = [float(m.group(1)) for v in readies[-1].get("resumed", {}).values()
                if (m := re.search(r" in ([0-9.]+) s$", v))]
        transfer = max(said) if said else None
    started = next((e["at"] for e in job.journal() if e["event"] == "start" and e.get("attempt") ==
                    max(job.attempts())), None)
    first = result.get("first_step_after_at")

    def gap(a: float | None, b: float | None) -> float | None:
        return round(b - a, 3) if a is not None and b is not None else None

    det, dec, rst = result.get("detection_s"), inc.get("decided_s"), inc.get("restarted_s")
    return {"detection_s": det, "decision_s": gap(det, dec), "restart_s": gap(dec, rst),
            "state_transfer_s": transfer, "first_step_s": gap(started, first)}


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


def torchrun_argv(bed: Bed, run_dir: Path, steps: int, rdzv_id: str, extra: tuple[str, ...] = ()) -> list[str]:
    """As healer/agent/rank_start.py's torchrun_argv builds it, but with torchrun's own restarts and a fixed host set."""
    hosts = [h.name for h in bed.hosts[:3]]
    # parallel.dp: megaheal derives it from the hosts that train (3 x 2 ranks / pp 2); torchrun needs it given.
    overrides = [f"steps={steps}", *DEMO_AT_DP3.split(), f"parallel.dp={len(hosts)}", *extra,
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
    extra = (HANG,) if fault == "hang" else ()
    proc = subprocess.Popen(torchrun_argv(bed, run_dir, steps, workdir.name, extra), cwd=REPO, env=job_env(bed),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Lines(proc, workdir / "salloc.log")
    # NOTE: served for the gpu_fault's sake alone (torchrun reads no GPU health: the fault goes unseen).
    exporters = Exporters(bed, workdir / "dcgm")
    try:
        wait_step(run_dir, proc, fault_step(fault), 600, output=out.text)
        fault_at = inject(bed, fault, exporters, run_dir)
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
                      notes=torchrun_notes(result, own, out, fault_at, cap_s, ended_at)
                      if fault != "gpu_fault" or result["mttr_s"] is not None else
                      ["torchrun reads no GPU health: the Xid went unseen, and the job trained on to its end on the "
                       "GPU that fell off the bus (here a file; on a real one its ranks would die with it)"])
        result["output_tail"] = out.text().splitlines()[-10:]
        return result
    finally:
        exporters.stop()
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

SYSTEMS = {"megaheal_replica": lambda *a: megaheal_run(*a, warm=False, groups=True),
           "megaheal_warm": lambda *a: megaheal_run(*a, warm=True),
           "megaheal_cold": lambda *a: megaheal_run(*a, warm=False),
           "torchrun_max_restarts_3": torchrun_run}


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

    staged = [r["stages"] for r in runs if r.get("stages")]
    stage_medians = {k: round(statistics.median(v), 3) for k in (staged[0] if staged else {})
                     if (v := [st[k] for st in staged if st.get(k) is not None])}
    return {"detection_s": med("detection_s"), "mttr_s": med("mttr_s"), "lost_steps": med("lost_steps"),
            "stall_s": med("stall_s"), "trained_meanwhile": med("trained_meanwhile"),
            "stages": stage_medians,
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
        "caveat": "one shared 2-core machine: other work (other sessions' test runs and beds) may run meanwhile, "
                  "so absolute times carry that load (see loadavg per run); compare the systems within a run",
        "setup": {"bed": BED.to_payload(), "job": f"configs/demo.yaml steps={args.steps} {DEMO_AT_DP3} "
                  f"checkpoint every {CHECKPOINT_EVERY}", "ranks": "3 hosts x 2 ranks (pp 2, dp 3); megaheal: +1 spare",
                  "targets": {"host_death and gpu_fault": "MTTR <= detection + 10 s, lost steps <= one snapshot "
                              f"interval ({CHECKPOINT_EVERY})", "hang": "MTTR <= detection + 5 s",
                              "control_host": "first step <= 120 s after the fault"},
                  "fault_after_step": FAULT_STEP, "victim": "hosts[1] (a training host)", "cap_s": args.cap,
                  "repeats": args.repeats, "torchrun_argv": torchrun_argv(Bed(BED), Path("RUN_DIR"), args.steps, "ID")},
    }
    tmp = Path(tempfile.mkdtemp(prefix="mh-recovery-hosts-", dir="/var/tmp"))
    bed = Bed(BED)
    bed.down()  # whatever a killed run left
    try:
        bed.up()
        os.environ["SLURM_CONF"] = job_env(bed)["SLURM_CONF"]  # NOTE: this process's own scontrol calls (ground.slurm)
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
        take_down(bed, tmp, args.keep)
    write_results(results, Path(args.out))
    return 0


def take_down(bed: Bed, tmp: Path, keep: bool) -> None:
    """The bed down, and the run directories under `tmp` removed unless kept (then printed)."""
    bed.down()
    if keep:
        print("run directories kept in", tmp)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def write_results(results: dict[str, Any], out: Path) -> None:
    """`results` as JSON at `out`, with the machine's load at the end (what says how loaded the run was)."""
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
