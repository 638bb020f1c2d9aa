"""The user-script row of bench/recovery.py: the MTTR of a crash (SIGKILL of rank 3 once the job has done 10 steps)
of one plain-PyTorch DDP job (4 CPU ranks, gloo, 0.2 s of work a step, its own checkpoint every 5 steps) run four
ways, side by side in one run:

- unchanged: the script as it is, under `megaheal run` (cold restart; the script resumes from its checkpoint);
- integrated: the same script with megaheal.rank's calls (mh.step per step), under `megaheal run` (cold);
- in-process: its training function wrapped by megaheal.rank.restartable, under `megaheal run --warm` (the survivors
  keep their processes and state, a standby takes rank 3);
- torchrun: the unchanged script under `torchrun --max-restarts 3` alone.

Every variant's rank 0 appends "<step> <unix time>" to a trace file after each step, so the MTTR is measured the same
way for all: from the fault to the first step finished after it. detection_s is the healer's incident (torchrun:
its agent's new workers).

Run:  .venv/bin/python bench/recovery.py --faults user-script     (or this module alone: python bench/recovery_user_script.py)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ground import procfs
from healer.launchers.local_agents import LocalAgents
from healer.launchers.warm_control import WarmSettings
from healer.runner.build import JobSpec, build_job
from healer.runner.build import shipped_rules as rule_set
from healer.runner.loop import SelfHealingJob
from wire.orders import UserProgram

FAULT_STEP = 10
STEPS = 30
VARIANTS = ("unchanged", "integrated", "in-process", "torchrun")

# One training loop, three ways to call it; `trace` is rank 0's record of each finished step.
SCRIPT = r'''
import argparse, os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--variant", required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--ckpt", required=True)
p.add_argument("--trace", required=True)
a = p.parse_args()
if a.variant != "unchanged" and a.variant != "torchrun":
    import megaheal.rank as mh


def loop(model, opt, start, rank, kept=None, marker="0"):
    ddp = DDP(model, init_sync=kept is None)
    g = torch.Generator().manual_seed(rank * 1000 + start)
    for s in range(start, a.steps):
        loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        time.sleep(0.2)
        if a.variant == "integrated":
            mh.step(s, loss=loss.item())
        if kept is not None:
            kept.update(model=model, opt=opt, step=s + 1)
        if rank == 0:
            with open(a.trace, "a") as f:
                f.write(f"{s} {time.time()} {marker}\n")
            if s % 5 == 4 and kept is None:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s + 1}, a.ckpt + ".tmp")
                os.replace(a.ckpt + ".tmp", a.ckpt)


def fresh():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


if a.variant == "in-process":
    @mh.restartable
    def train(r):
        model, opt = (r.kept["model"], r.kept["opt"]) if r.kept else fresh()
        step = torch.tensor([r.kept.get("step", 0)])
        if r.source is not None:
            for t in [*model.state_dict().values(), step]:
                dist.broadcast(t, r.source)
        loop(model, opt, int(step), r.rank, r.kept, marker=str(r.generation))
    train()
else:
    dist.init_process_group("gloo")
    model, opt = fresh()
    start = 0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(a.ckpt):
        state = torch.load(a.ckpt)
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    loop(model, opt, start, dist.get_rank(), marker=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.destroy_process_group()
'''


def trace(path: Path) -> list[tuple[int, float, str]]:
    """(step, unix time, attempt marker) of each step rank 0 finished: the marker is torchrun's restart count, or
    the generation of an in-process restart."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), parts[2]))
    return out


def first_step_after(path: Path, t: float) -> float | None:
    """When the restarted job finished its first step: the first record after `t` of another attempt than the one
    running at `t` (the survivors finish a step or two of the failed one first)."""
    done = trace(path)
    before = [m for _, at, m in done if at <= t]
    return next((at for _, at, m in done if at > t and (not before or m != before[-1])), None)


def megaheal_variant(variant: str, workdir: Path) -> dict[str, object]:
    run = workdir / variant
    run.mkdir(parents=True)
    script, ckpt, steps_file = run / "train.py", run / "ckpt.pt", run / "trace.txt"
    script.write_text(SCRIPT)
    args = ["--variant", variant, "--steps", str(STEPS), "--ckpt", str(ckpt), "--trace", str(steps_file)]
    spec = JobSpec(job=f"user-{variant}", config=None, run_dir=run / "run", nodes=("n1", "n2"), spares=("n3",),
                   program=UserProgram(target=str(script), args=args, cwd=str(run)), nproc_per_node=2,
                   rules=rule_set(), grace=timedelta(seconds=10), launcher=LocalAgents.Config(),
                   warm=WarmSettings(standbys=1) if variant == "in-process" else None)
    job: SelfHealingJob = build_job(spec)
    fired: dict[str, float] = {}

    def hook(j: SelfHealingJob) -> None:
        done = trace(steps_file)
        if not fired and done and done[-1][0] >= FAULT_STEP:
            j.remediator.signal_rank(3, signal.SIGKILL)
            fired["at"] = time.time()

    job.start()
    outcome = job.run(timedelta(minutes=5), on_tick=hook)
    incidents = job.incidents()
    restarts = job.healer.jobs.restarts(spec.job)
    job.close()
    inc = incidents[0] if incidents else None
    at = fired.get("at")
    after = first_step_after(steps_file, at) if at is not None else None
    return {"outcome": outcome, "kind": inc.kind if inc else None, "summary": inc.summary if inc else None,
            "restart_mode": restarts[0].mode if restarts else None,
            "detection_s": round(inc.detected_at - at, 3) if inc and at is not None else None,
            "mttr_s": round(after - at, 3) if after is not None and at is not None else None,
            "steps_done": len({s for s, _, _ in trace(steps_file)})}


def torchrun_variant(workdir: Path) -> dict[str, object]:
    run = workdir / "torchrun"
    run.mkdir(parents=True)
    script, ckpt, steps_file = run / "train.py", run / "ckpt.pt", run / "trace.txt"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--max-restarts",
            "3", "--monitor-interval", "0.2", str(script), "--variant", "torchrun", "--steps", str(STEPS), "--ckpt",
            str(ckpt), "--trace", str(steps_file)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with open(run / "torchrun.log", "wb") as log:
        agent = subprocess.Popen(argv, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        at, detection, workers = None, None, set()
        try:
            deadline = time.time() + 300
            while time.time() < deadline and agent.poll() is None:
                kids = set(procfs.children(agent.pid))
                done = trace(steps_file)
                if at is None:
                    workers = kids
                    if done and done[-1][0] >= FAULT_STEP:
                        os.kill(next(p for p in kids if procfs.worker_rank(p) == 3), signal.SIGKILL)
                        at = time.time()
                elif detection is None and kids and not kids & workers:
                    detection = round(time.time() - at, 3)  # new workers: the agent restarted them
                time.sleep(0.05)
            agent.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            for pid in [agent.pid, *procfs.descendants(agent.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait(30)
    after = first_step_after(steps_file, at) if at is not None else None
    errors = [line.strip() for line in (run / "torchrun.log").read_text(errors="replace").splitlines()
              if "Error" in line or "error" in line][-3:]
    return {"outcome": f"exit {agent.returncode}", "errors": errors, "restart_mode": "cold (all 4 workers)",
            "detection_s": detection,
            "mttr_s": round(after - at, 3) if after is not None and at is not None else None,
            "steps_done": len({s for s, _, _ in trace(steps_file)})}


def user_script_row(variants: tuple[str, ...] = VARIANTS) -> dict[str, object]:
    """Each variant's crash, one after the other on this machine."""
    with tempfile.TemporaryDirectory(prefix="megaheal-bench-user-") as tmp:
        out: dict[str, object] = {}
        for variant in variants:
            out[variant] = torchrun_variant(Path(tmp)) if variant == "torchrun" else \
                megaheal_variant(variant, Path(tmp))
            print("user-script", variant, json.dumps(out[variant]), flush=True)
        return out


if __name__ == "__main__":
    print(json.dumps(user_script_row(), indent=2))
