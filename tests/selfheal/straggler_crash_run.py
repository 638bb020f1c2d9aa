"""One self-healing run shared by the end-to-end tests of a straggler and of a crash (tests/selfheal/test_e2e.py) and
by the pages read in a browser after it (tests/pages/test_browser.py): 2 nodes x 2 ranks of the demo job healed by the
embedded healer, rank 2 slowed by a SIGSTOP/SIGCONT duty cycle from step 3 for 15 s (a straggler: notified, nothing
restarted), then, once that incident is open, rank 3 SIGKILLed (a crash: diagnosed, restarted from the checkpoint, with the save
interval the healer tuned at the restart).
One job for the three modules' checks: about a minute on 2 cores (`straggler_then_crash` in tests/conftest.py runs it
once per session)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from healer.runner.build import JobSpec, build_job, shipped_rules
from healer.runner.chaos import duty_cycle
from healer.runner.loop import SelfHealingJob
from tests.conftest import REPO

JOB, STEPS = "healed-e2e", 24
SLOW_RANK, KILLED_RANK = 2, 3


@dataclass(frozen=True, slots=True)
class HealedRun:
    run_dir: Path
    incidents: list[Any]
    """The run's incidents as the healer's store had them at the end, oldest first."""
    fired: dict[str, float]
    """Healer time at which rank 2 was slowed ("slowed") and rank 3 killed ("killed")."""
    attempts: int
    last_attempt_succeeded: bool

    def first(self, kind: str) -> Any:
        """The first incident of `kind`: the one the fault made (a loaded machine may add another straggler)."""
        return next(i for i in self.incidents if i.kind == kind)


def heal(root: Path) -> HealedRun:
    spec = JobSpec(job=JOB, config=str(REPO / "configs" / "demo.yaml"), run_dir=root / JOB, nodes=("n1", "n2"),
                   overrides=(f"steps={STEPS}", "checkpoint.every_steps=4"), grace=timedelta(seconds=20),
                   rules=shipped_rules(straggler={"window": 3, "consecutive": 2}), tune_saves=True)
    loop = build_job(spec)
    fired: dict[str, float] = {}

    def hook(lp: SelfHealingJob) -> None:
        a = lp.sup.attempt
        if a is None or a.number != 0:
            return
        steps = [b.step for b in lp.table.ranks() if b.entry.pid in a.ranks and b.step is not None]
        if len(steps) != 4:
            return
        if "slowed" not in fired and min(steps) >= 3:
            # Rank 2 spends 85% of each 200 ms stopped: its peers wait for it in the parameter all-gather and the
            # gradient reduce, so only its own compute grows.
            pid = next(p for p, r in a.ranks.items() if r.rank == SLOW_RANK)
            threading.Thread(target=duty_cycle, args=(pid, 0.85, 15.0), daemon=True).start()
            fired["slowed"] = lp.healer.clock()
        elif "killed" not in fired and "slowed" in fired and min(steps) >= 12 and any(
                i.kind == "straggler" for i in lp.incidents()):
            lp.remediator.signal_rank(KILLED_RANK, signal.SIGKILL)
            fired["killed"] = lp.healer.clock()

    loop.start()
    try:
        outcome = loop.run(timedelta(seconds=240), on_tick=hook)
        incidents = sorted(loop.incidents(), key=lambda i: i.detected_at)
        history = list(loop.sup.history)
    finally:
        loop.close()
    assert outcome == "finished" and "killed" in fired, (outcome, fired, [i.summary for i in incidents])
    return HealedRun(run_dir=root / JOB, incidents=incidents, fired=fired, attempts=len(history),
                     last_attempt_succeeded=history[-1].succeeded)
