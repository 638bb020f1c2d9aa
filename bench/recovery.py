"""Recovery benchmark: megaheal's healer (embedded, as `megaheal run` runs it), restarting warm and cold, against
plain `torchrun --max-restarts 3` on the same job (configs/demo.yaml, 4 ranks, checkpoints every 5 steps), written
as JSON.

Run:  .venv/bin/python bench/recovery.py [--faults crash,hang,user-script] [--modes warm,cold] [--ettr-minutes 10]
                                         [--crash-every 150] [--out bench/results/recovery.json]

For each fault (crash: SIGKILL of rank 3; hang: SIGSTOP of rank 1; hang-spin, hang-data, hang-collective,
hang-syscall: rank 1 hangs by itself in step 10 as train/hang_faults.py plays it), injected once the job has done 10
steps:
- detection latency: fault -> the incident (megaheal) / the agent's restart of its workers (torchrun);
- MTTR: fault -> the first step record of the resumed job, and where it went: detection, diagnosis (cold: the job
  stopped, node-health; warm: node-health-live beside the survivors), the restart order, then startup to the first
  step (cold: new processes, imports, rendezvous, the checkpoint from disk; warm: a new group and the state from
  the ranks' memory, `state_s`, then the step);
- for hangs, naming: the rank the incident names, how, and fault -> named (detection plus the look at every rank's
  stack, state and phase through the node agents).
`user-script`: a crash of a user's own plain DDP script, unchanged, integrated (megaheal.rank), wrapped for in-process
restart (megaheal.rank.restartable, --warm) and under torchrun --max-restarts 3 (bench/recovery_user_script.py).
A crash runs once per restart mode (--modes: warm, the job's ranks are workers that outlive an attempt with a standby
per host; cold, every restart new processes); a hang restarts cold in either, so it runs once. torchrun cannot see a
hang before the process group's timeout (600 s here), so its hang run is cut off at `--hang-cap` seconds and
reported as not detected. With --ettr-minutes M (0: skip), it also runs megaheal for M minutes per mode with a
crash every --crash-every seconds and reports the goodput ledger's ETTR.
Targets (2-core CPU, 4 ranks): crash detected <= 2 s, hang <= 2 x p99 step + 5 s, crash MTTR <= 3 s, ETTR >= 95%
(10 minutes, a crash every 2.5 minutes; --checkpoint-every sets its save interval in steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from wire import journal
from wire.run_paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ground import procfs
from healer.launchers.warm_control import WarmSettings
from healer.ledger.goodput import compute
from healer.runner.build import JobSpec, build_job
from healer.runner.build import shipped_rules as rule_set
from healer.runner.chaos import HANG_KINDS
from healer.runner.loop import SelfHealingJob

SIGNALS = {"crash": (3, signal.SIGKILL), "hang": (1, signal.SIGSTOP)}
HANG_RANK = 1
"""The rank that plays each of chaos's HANG_KINDS (train/hang_faults.py) at FAULT_STEP, as SIGSTOP hits it."""
FAULT_STEP = 10
ETTR_VICTIMS = (3, 1, 2, 0)
"""The ranks the ETTR run kills in turn: n2, n1, n2, n1 (ranks 0-1 on n1, 2-3 on n2)."""


def hang_override(fault: str) -> str:
    return f"inject_hangs=[{{mode: {HANG_KINDS[fault]}, at_step: {FAULT_STEP}, rank: {HANG_RANK}}}]"


def hang_started(run_dir: Path) -> float | None:
    """When the rank began its hang: the mark it leaves just before (run_dir/chaos/*.fired)."""
    marks = sorted((run_dir / "chaos").glob("*.fired")) if (run_dir / "chaos").is_dir() else []
    return marks[0].stat().st_mtime if marks else None


# ---- megaheal ----------------------------------------------------------------------------------------------

def megaheal_job(run_dir: Path, steps: int, max_restarts: int = 5, extra: tuple[str, ...] = (),
                 warm: bool = False, checkpoint_every: int = 5) -> SelfHealingJob:
    spec = JobSpec(job="bench", config=str(REPO / "configs" / "demo.yaml"), run_dir=run_dir,
                   overrides=(f"steps={steps}", f"checkpoint.every_steps={checkpoint_every}", *extra),
                   rules=rule_set(max_restarts=max_restarts, hang={"floor": "5s"}),
                   warm=WarmSettings(standbys=1) if warm else None)
    job = build_job(spec)
    job.start()
    return job


def current_steps(job: SelfHealingJob) -> list[int]:
    a = job.sup.attempt
    if a is None:
        return []
    return [b.step for b in job.table.ranks() if b.entry.pid in a.ranks and b.step is not None]


def warm_state_s(run_dir: Path, attempt: int | None) -> float | None:
    """The slowest rank's time to form its group and take its state in warm attempt `attempt` (the coordinator's
    journal, "warm-ready": each worker's "memory step N in S s")."""
    for e in journal.read(RunPaths(run_dir).journal):
        if isinstance(e, journal.WarmReady) and e.attempt == attempt:
            times = [float(m.group(1)) for v in e.resumed.values() if (m := re.search(r"in ([0-9.]+) s$", v))]
            return max(times) if times else None
    return None


def megaheal_fault(fault: str, workdir: Path, warm: bool = False) -> dict[str, object]:
    run_dir = workdir / f"megaheal-{fault}-{'warm' if warm else 'cold'}"
    played = fault in HANG_KINDS
    job = megaheal_job(run_dir, 30, extra=(hang_override(fault),) if played else (), warm=warm)
    fired: dict[str, float] = {}

    def hook(j: SelfHealingJob) -> None:
        steps = current_steps(j)
        if not played and not fired and len(steps) == 4 and min(steps) >= FAULT_STEP:
            rank, sig = SIGNALS[fault]
            j.remediator.signal_rank(rank, sig)
            fired["at"] = time.time()

    outcome = job.run(timedelta(minutes=5), on_tick=hook)
    incidents = job.incidents()
    inc = incidents[0] if incidents else None
    job.close()
    if played and (started := hang_started(run_dir)) is not None:
        fired["at"] = started
    stacks = inc.evidence.get("stacks") if inc else None
    detection = round(inc.detected_at - fired["at"], 3) if inc and "at" in fired else None

    def since(t0: float | None, t1: float | None) -> float | None:
        return round(t1 - t0, 3) if t0 is not None and t1 is not None else None

    # Where the MTTR went: detection, then diagnosing the suspect node (cold: the attempt stopped, node-health; warm:
    # node-health-live beside the survivors), then starting the next attempt (warm: waiting for the standby and
    # publishing the plan), then its startup to the first step (cold: imports, rendezvous, checkpoint load; warm:
    # a new group and the state from the peers' memory, `state_s`, then the step itself).
    attempt_after = inc.attempt + 1 if inc and inc.attempt is not None else None
    return {"outcome": outcome, "kind": inc.kind if inc else None, "summary": inc.summary if inc else None,
            "restart_mode": inc.restart_mode if inc else None, "restart_why": inc.restart_why if inc else None,
            "resumed_from": inc.resumed_from if inc else None,
            "state_s": warm_state_s(run_dir, attempt_after) if inc and inc.restart_mode == "warm" else None,
            "detection_s": since(fired.get("at"), inc.detected_at) if inc else None,
            "mttr_s": since(fired.get("at"), inc.recovered_at) if inc else None,
            "stop_and_diagnosis_s": since(inc.detected_at, inc.decided_at) if inc else None,
            "verdict": inc.verdict if inc else None,
            "restart_s": since(inc.decided_at, inc.remediated_at) if inc else None,
            "startup_to_first_step_s": since(inc.remediated_at, inc.recovered_at) if inc else None,
            "hang_timeout_s": inc.evidence.get("timeout_s") if inc else None,
            "p99_step_s": inc.evidence.get("p99_step_s") if inc else None,
            # Naming the culprit: the ranks are looked at (stacks, states, phases) as the incident is first acted on.
            "suspect_ranks": inc.suspect_ranks if inc else None,
            "named_by": inc.evidence.get("suspected_by") if inc else None,
            "stacks_took_s": stacks.get("took_s") if isinstance(stacks, dict) else None,
            "named_s": round(detection + stacks["took_s"], 3)
            if detection is not None and isinstance(stacks, dict) and "took_s" in stacks else None,
            "lost_steps": inc.lost_steps if inc else None}


# ---- plain torchrun ------------------------------------------------------------------------------------------

def last_record(run_dir: Path) -> dict[str, object] | None:
    path = run_dir / "ranks" / "0.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def torchrun_fault(fault: str, workdir: Path, hang_cap_s: float) -> dict[str, object]:
    run_dir = workdir / f"torchrun-{fault}"
    played = fault in HANG_KINDS
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "3", "--monitor-interval", "0.2", "-m", "train", "--config", "configs/demo.yaml",
            "--run-dir", str(run_dir), "--resume", "auto", "--set", "steps=30", "--set", "checkpoint.every_steps=5",
            *(["--set", hang_override(fault)] if played else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    run_dir.mkdir(parents=True, exist_ok=True)
    agent_log = open(run_dir / "torchrun.log", "wb")  # noqa: SIM115 - closed below, after the agent is gone
    agent = subprocess.Popen(argv, cwd=REPO, env=env, stdout=agent_log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    result: dict[str, object] = {"outcome": None, "detection_s": None, "mttr_s": None}
    try:
        fired_at = None
        workers: set[int] = set()
        deadline = time.time() + 300
        while time.time() < deadline and agent.poll() is None:
            rec = last_record(run_dir)
            kids = set(procfs.children(agent.pid))
            if fired_at is None:
                workers = kids
                if played:
                    fired_at = hang_started(run_dir)  # the rank hangs by itself at FAULT_STEP
                elif rec is not None and int(rec["step"]) >= FAULT_STEP:  # type: ignore[call-overload]
                    rank, sig = SIGNALS[fault]
                    victim = next(p for p in kids if procfs.worker_rank(p) == rank)
                    os.kill(victim, sig)
                    fired_at = time.time()
            else:
                if result["detection_s"] is None and kids and not kids & workers:
                    result["detection_s"] = round(time.time() - fired_at, 3)  # new workers: it restarted
                if rec is not None and rec["time"] > fired_at + 0.0 and result["detection_s"] is not None:  # type: ignore[operator]
                    result["mttr_s"] = round(float(rec["time"]) - fired_at, 3)  # type: ignore[arg-type]
                    result["outcome"] = "recovered"
                    break
                if time.time() - fired_at > hang_cap_s:
                    break
            time.sleep(0.1)
        if result["outcome"] is None and fired_at is not None:
            waited = time.time() - fired_at
            result["outcome"] = (f"not detected within {waited:.0f} s (gloo timeout 600 s)"
                                 if result["detection_s"] is None else
                                 f"restarted its workers but no step resumed within {waited:.0f} s")
    finally:
        for pid in [agent.pid, *procfs.descendants(agent.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        agent.wait(30)
        agent_log.close()
        result["agent_exit"] = agent.returncode
        result["agent_log_tail"] = (run_dir / "torchrun.log").read_text(errors="replace").splitlines()[-6:]
    return result


# ---- ETTR ----------------------------------------------------------------------------------------------------

def ettr_run(workdir: Path, minutes: float, every_s: float, warm: bool, checkpoint_every: int) -> dict[str, object]:
    run_dir = workdir / f"megaheal-ettr-{'warm' if warm else 'cold'}"
    job = megaheal_job(run_dir, 100000, max_restarts=100, warm=warm, checkpoint_every=checkpoint_every)
    start = time.time()
    faults: list[float] = []

    def hook(j: SelfHealingJob) -> None:
        if time.time() - start >= every_s * (len(faults) + 1) and len(current_steps(j)) == 4:
            # NOTE: the victims take turns on the two hosts: three crashes on one host within the lemon window make
            # it a lemon, and the policy rightly leaves it out (the job then trains on one host).
            j.remediator.signal_rank(ETTR_VICTIMS[len(faults) % len(ETTR_VICTIMS)], signal.SIGKILL)
            faults.append(time.time())

    job.run(timedelta(minutes=minutes), on_tick=hook)
    incidents = [i.to_payload() for i in job.incidents()]
    job.close()
    ledger = compute(run_dir, incidents)
    modes = [i.get("restart_mode") for i in incidents]
    mttr = sorted(round(i["recovered_at"] - i["detected_at"], 3) for i in incidents if i.get("recovered_at"))
    return {"minutes": minutes, "crash_every_s": every_s, "checkpoint_every_steps": checkpoint_every,
            "faults": len(faults), "incidents": len(incidents),
            "restarts": {m: modes.count(m) for m in ("warm", "cold")}, "detect_to_recovered_s": mttr,
            "ettr": ledger.ettr, "seconds": ledger.seconds, "steps_done": ledger.steps_done,
            "lost_steps": ledger.lost_steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default="crash,hang," + ",".join(HANG_KINDS))
    parser.add_argument("--hang-cap", type=float, default=90.0)
    parser.add_argument("--ettr-minutes", type=float, default=10.0)
    parser.add_argument("--crash-every", type=float, default=150.0, help="ETTR run: seconds between crashes")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="ETTR run: steps between checkpoints")
    parser.add_argument("--modes", default="warm,cold", help="megaheal's restart modes to run a crash and ETTR in")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    args = parser.parse_args()
    results: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                                  "targets": {"crash_detection_s": 2, "hang_detection": "2 x p99 step + 5 s",
                                              "crash_mttr_s": 3, "ettr": 0.95}}
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"warm", "cold"}:
        parser.error(f"--modes: warm and/or cold, got {args.modes!r}")
    tmp = tempfile.mkdtemp(prefix="mh-recovery-")
    try:
        for fault in [f for f in args.faults.split(",") if f]:
            if fault == "user-script":  # a user's own DDP script four ways (bench/recovery_user_script.py)
                from recovery_user_script import user_script_row

                results[fault] = user_script_row()
                continue
            # A hang restarts cold in a warm job too (its processes cannot be trusted): one megaheal run for it.
            runs = {f"megaheal_{m}": megaheal_fault(fault, Path(tmp), warm=m == "warm")
                    for m in (modes if fault == "crash" else ["cold"])}
            results[fault] = runs | {"torchrun_max_restarts_3": torchrun_fault(fault, Path(tmp), args.hang_cap)}
            print(fault, json.dumps(results[fault]), flush=True)
        if args.ettr_minutes > 0:
            results["ettr"] = {m: ettr_run(Path(tmp), args.ettr_minutes, args.crash_every, warm=m == "warm",
                                           checkpoint_every=args.checkpoint_every)
                               for m in modes}
            print("ettr", json.dumps(results["ettr"]), flush=True)
    finally:
        if args.keep:
            print("run directories kept in", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
