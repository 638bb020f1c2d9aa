"""megaheal.rank.restartable end to end: a plain DDP training function, wrapped, on 4 CPU ranks (2 hosts x 2) as warm
workers under the embedded healer (`megaheal run --warm`). A killed rank is a crash restarted in process: the
survivors' collectives are aborted, the function is called again in the same processes with a new process group and
the state they kept, a standby takes the lost rank from a survivor, and nothing is read from the disk."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from healer.launchers.warm_control import WarmSettings
from healer.runner.loop import SelfHealingJob
from tests.usertrainer.jobs import make_loop
from tests.usertrainer.scripts import RESTARTABLE

pytestmark = pytest.mark.e2e
_built: list[SelfHealingJob] = []
LINE = re.compile(r"rank (\d+) pid (\d+) generation (\d+) source (\S+) step (\d+)")


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    yield
    while _built:
        _built.pop().close()


def generations(run_dir: Path) -> dict[int, dict[int, tuple[int, str, int]]]:
    """generation -> rank -> (pid, source, step), from every warm worker's log."""
    out: dict[int, dict[int, tuple[int, str, int]]] = {}
    for log in run_dir.glob("nodes/*/agent/*/warm/*.log"):
        for m in LINE.finditer(log.read_text()):
            rank, pid, gen, source, step = m.groups()
            out.setdefault(int(gen), {})[int(rank)] = (int(pid), source, int(step))
    return out


@pytest.mark.timeout(240)
def test_a_killed_rank_of_a_wrapped_function_restarts_in_process_and_the_survivors_keep_their_pids(
        tmp_path: Path) -> None:
    loop = make_loop(tmp_path, RESTARTABLE, ["--steps", "40"], _built, warm=WarmSettings(standbys=1))
    fired: dict[str, float] = {}

    def hook(j: SelfHealingJob) -> None:
        a = j.sup.attempt
        steps = [b.step for b in j.table.ranks() if a is not None and b.entry.pid in a.ranks and b.step is not None]
        if not fired and a is not None and len(steps) == len(a.ranks) == 4 and min(steps) >= 8:
            j.remediator.signal_rank(3, signal.SIGKILL)
            fired["at"] = j.healer.clock()

    assert loop.run(timedelta(seconds=200), on_tick=hook) == "finished"  # type: ignore[arg-type]
    [inc] = loop.incidents()
    assert inc.kind == "crash" and inc.state == "resolved" and inc.suspect_ranks == [3], inc.summary
    restarts = loop.healer.jobs.restarts("mine")
    assert [r.mode for r in restarts] == ["warm"], restarts
    gens = generations(loop.sup.cfg.run_dir)
    first, second = gens[min(gens)], gens[max(gens)]
    assert len(gens) == 2 and sorted(first) == sorted(second) == [0, 1, 2, 3], gens
    # The survivors are the same processes; rank 3 is a standby's; all took the step a survivor kept.
    assert all(first[r][0] == second[r][0] for r in (0, 1, 2)) and first[3][0] != second[3][0]
    # NOTE: the script saves nothing: a step of 8 or more after the restart came from the survivors' memory.
    assert second[0][1] == "0" and len({s for _, _, s in second.values()}) == 1 and second[0][2] >= 8
