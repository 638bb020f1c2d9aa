"""A user's script as a self-healing job under the embedded healer (2 hosts x 2 ranks of local agents and a spare),
and faults sent to its ranks from the healer's loop, as the tests of tests/usertrainer use them."""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

from healer.launchers.local_agents import LocalAgents
from healer.launchers.warm_control import WarmSettings
from healer.runner.build import JobSpec, build_job
from healer.runner.build import shipped_rules as rule_set
from healer.runner.loop import SelfHealingJob
from wire.orders import UserProgram


def make_loop(tmp_path: Path, text: str, args: list[str], built: list[SelfHealingJob], warm: WarmSettings | None = None,
              **rules: Any) -> SelfHealingJob:
    """The script `text` (written to tmp_path/train.py) started with `args` under a healer with the shipped rules
    (`rules`: a detector's parameters or the policy's limits, as shipped_rules takes them); `warm`: as warm
    workers (megaheal run --warm)."""
    script = tmp_path / "train.py"
    script.write_text(text)
    spec = JobSpec(job="mine", config=None, run_dir=tmp_path / "run", nodes=("n1", "n2"), spares=("n3",),
                   program=UserProgram(target=str(script), args=args, cwd=str(tmp_path)), nproc_per_node=2,
                   rules=rule_set(**rules), grace=timedelta(seconds=10), launcher=LocalAgents.Config(), warm=warm)
    job = build_job(spec)
    built.append(job)
    job.start()
    return job


def faults_in_attempts(plan: dict[int, tuple[signal.Signals, int]], ready: Path,
                       steps_in: int = 2) -> tuple[dict[int, float], Any]:
    """An on_tick hook that sends, in attempt N of `plan`, its signal to its rank: once the script has saved a
    checkpoint (`ready` exists), every rank reports steps, and the slowest is `steps_in` past where it started."""
    fired: dict[int, float] = {}
    first: dict[int, int] = {}

    def hook(loop: SelfHealingJob) -> None:
        a = loop.sup.attempt
        if a is None or a.number in fired or a.number not in plan or not ready.exists():
            return
        steps = [b.step for b in loop.table.ranks() if b.entry.pid in a.ranks and b.step is not None]
        if len(steps) != len(a.ranks) or len(steps) != 4:
            return
        low = first.setdefault(a.number, min(steps))
        if min(steps) >= low + steps_in:
            sig, rank = plan[a.number]
            loop.remediator.signal_rank(rank, sig)
            fired[a.number] = loop.healer.clock()
    return fired, hook


def rank_logs(run_dir: Path, attempt: int) -> str:
    """Every rank's stdout of `attempt`, on every host."""
    return "".join(p.read_text() for p in sorted(run_dir.glob(f"nodes/*/agent/*-attempt-{attempt:03d}/ranks/*/*/*/"
                                                              "stdout.log")))
