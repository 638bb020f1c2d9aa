"""`megaheal run SCRIPT.py`: a user's own training program under megaheal, end to end on real processes (2 hosts x 2
ranks of local agents, a spare, the embedded healer). With no line of megaheal in the script, a killed rank is a
crash and a stopped one a hang (seen by its collectives no longer completing), each named and healed by a restart the
script resumes from under torchrun's contract; with megaheal.rank's few lines, a NaN is named by rank and step and a
slowed rank as a straggler."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from healer.incidents.models import IncidentEvent
from healer.runner.chaos import duty_cycle
from healer.runner.loop import SelfHealingJob
from tests.usertrainer.jobs import faults_in_attempts, make_loop, rank_logs
from tests.usertrainer.scripts import PLAIN_DDP, PLAIN_FSDP2, WITH_API

pytestmark = pytest.mark.e2e
_built: list[SelfHealingJob] = []


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    yield
    while _built:
        _built.pop().close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["ddp", "fsdp2"])
def test_a_killed_rank_of_an_unchanged_script_is_a_crash_and_the_script_resumes_under_torchruns_contract(
        tmp_path: Path, script: str) -> None:
    text, ckpt, ready = {"ddp": (PLAIN_DDP, tmp_path / "ckpt.pt", tmp_path / "ckpt.pt"),
                         "fsdp2": (PLAIN_FSDP2, tmp_path / "ckpt", tmp_path / "ckpt" / "latest")}[script]
    loop = make_loop(tmp_path, text, ["--steps", "30", "--ckpt", str(ckpt)], _built)
    fired, hook = faults_in_attempts({0: (signal.SIGKILL, 3)}, ready, steps_in=0)
    assert loop.run(timedelta(seconds=200), on_tick=hook) == "finished"  # type: ignore[arg-type]
    [inc] = loop.incidents()
    assert inc.kind == "crash" and inc.state == "resolved" and inc.action == "restart"
    assert inc.detected_at >= fired[0] and "SIGKILL" in inc.summary, inc.summary
    assert inc.suspect_ranks == [3]
    first, second = rank_logs(loop.sup.cfg.run_dir, 0), rank_logs(loop.sup.cfg.run_dir, 1)
    assert "starts at step 0 restart 0" in first
    # The healer's restart is torchrun's restart 1 to the script, which resumed from its own checkpoint.
    resumed = [int(line.split()[5]) for line in second.splitlines() if "starts at step" in line]
    assert len(resumed) == 4 and min(resumed) >= 5 and "restart 1" in second and second.count("done") == 4


@pytest.mark.timeout(300)
def test_killed_ranks_on_two_hosts_restart_and_an_exception_that_recurs_on_two_hosts_stops_the_job_once(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    loop = make_loop(tmp_path, PLAIN_DDP, ["--steps", "40", "--ckpt", str(ckpt), "--raise-at", "20"], _built)
    _, hook = faults_in_attempts({0: (signal.SIGKILL, 0), 1: (signal.SIGKILL, 3)}, ckpt, steps_in=0)
    assert loop.run(timedelta(seconds=260), on_tick=hook) == "escalated"  # type: ignore[arg-type]
    incidents = sorted(loop.incidents(), key=lambda i: i.attempt)
    assert [(i.kind, i.attempt) for i in incidents] == [("crash", a) for a in range(4)], \
        [(i.kind, i.attempt, i.summary) for i in incidents]
    # The kills (on n1, then on n2) and the exception's first time: restarted as crashes are. The kills' restarts
    # trained again; the exception's either trained a step before it raised again (where the script resumed before
    # the bad step) or ran straight into the loop, which then closed it as it stopped the job: resolved either way.
    assert [(i.state, i.action) for i in incidents[:3]] == [("resolved", "restart")] * 3, \
        [(i.state, i.action, i.summary) for i in incidents]
    closed = str(loop.healer.store.get(incidents[2].id)["events"][-1]["evidence"])
    assert f"crash loop of incident {incidents[3].id}" in closed or "recovered" in closed, closed
    assert [i.evidence["signature"] for i in incidents[:2]] == [None, None]
    sig = incidents[2].evidence["signature"]
    assert sig is not None and sig.startswith("ValueError at train.py:") and sig.endswith(" in <module>"), sig
    # Its second time, on both hosts again: the program's own failure. Stopped before any diagnosis; the one page.
    looped = incidents[3]
    assert looped.state == "escalated" and looped.evidence["signature"] == sig, looped.summary
    stopped = loop.healer.responder.crash_loop
    assert stopped is not None and stopped["signature"] == sig and stopped["attempts"] == [2, 3], stopped
    assert stopped["hosts"] == ["n1", "n2"]
    assert not rank_logs(loop.sup.cfg.run_dir, 4), "no attempt after the loop"


@pytest.mark.timeout(240)
def test_a_stopped_rank_of_an_unchanged_script_is_a_hang_its_collectives_stalled_and_the_job_is_restarted(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    loop = make_loop(tmp_path, PLAIN_DDP, ["--steps", "30", "--ckpt", str(ckpt)], _built, hang={"floor": "6s", "k": 3})
    _, hook = faults_in_attempts({0: (signal.SIGSTOP, 2)}, ckpt, steps_in=0)
    assert loop.run(timedelta(seconds=200), on_tick=hook) == "finished"  # type: ignore[arg-type]
    [inc] = loop.incidents()
    assert inc.kind == "hang" and inc.state == "resolved", (inc.kind, inc.summary)
    assert inc.suspect_ranks == [2], inc.summary
    assert "restart 1" in rank_logs(loop.sup.cfg.run_dir, 1)


@pytest.mark.timeout(240)
def test_a_nan_reported_through_megaheal_rank_is_named_by_rank_and_step(tmp_path: Path) -> None:
    loop = make_loop(tmp_path, WITH_API, ["--steps", "40", "--poison-step", "8", "--poison-rank", "1"], _built)
    # A script's batches cannot be rolled back by megaheal without the checkpoints it keeps: the healer says so.
    assert loop.run(timedelta(seconds=150)) == "escalated"
    inc = next(i for i in loop.incidents() if i.kind == "nonfinite")
    # The sidecar holds each rank's first NaN step for the next heartbeat, and the detector waits for every host's:
    # rank 1's step 8 is named, not the reduce's NaN on every rank at step 9.
    assert inc.evidence["first_step"] == 8 and inc.suspect_ranks == [1], (inc.summary, inc.evidence)
    assert "no good checkpoint before step" in str(inc.to_payload()), inc.to_payload()


@pytest.mark.timeout(240)
def test_a_slowed_rank_of_a_script_with_megaheal_rank_is_named_a_straggler_and_on_call_notified(
        tmp_path: Path) -> None:
    # A compute-bound DDP step (~50 ms of matrix products a rank); rank 2 is then stopped 85% of every 200 ms for 12 s.
    # Its peers wait for it inside DDP's reduce, which megaheal.rank.watch times apart from their own compute.
    loop = make_loop(tmp_path, WITH_API, ["--steps", "90", "--width", "1024", "--batch", "512", "--sleep", "0.05"],
                     _built, straggler={"window": 3, "consecutive": 2})
    fired: dict[str, float] = {}

    def slow(lp: SelfHealingJob) -> None:
        a = lp.sup.attempt
        steps = [b.step for b in lp.table.ranks() if a is not None and b.entry.pid in a.ranks and b.step is not None]
        if "slowed" in fired or a is None or len(steps) != 4 or min(steps) < 3:
            return
        pid = next(p for p, r in a.ranks.items() if r.rank == 2)
        threading.Thread(target=duty_cycle, args=(pid, 0.85, 12.0), daemon=True).start()
        fired["slowed"] = lp.healer.clock()

    assert loop.run(timedelta(seconds=200), on_tick=slow) == "finished"  # type: ignore[arg-type]
    # NOTE: one incident per host named: on a loaded 2-core CI machine another rank was named too, for 2 windows of
    # 3 steps (a notice, like this one): what is asserted is that the slowed rank is named, and nothing restarted.
    stragglers = [i for i in loop.incidents() if i.kind == "straggler"]
    inc = next((i for i in stragglers if i.suspect_ranks == [2]), None)
    assert inc is not None, [(i.summary, i.suspect_ranks) for i in stragglers]
    assert inc.detected_at >= fired["slowed"] and "rank 2 on n2" in inc.summary, (inc.summary, inc.evidence)
    assert {i.action for i in stragglers} == {"notify"} and loop.sup.attempt is not None \
        and loop.sup.attempt.number == 0  # nothing restarted
    # The phase table of the finding that opened the incident, while rank 2 was slowed. NOTE: not the incident's own
    # evidence, which a reopening replaces: on a loaded 2-core machine a window long after the slowdown named rank 2
    # again for 1.3-1.4x the compute of its peers (steps 66 and 67 of 90 in 2 runs of 6 under 2 busy loops), and
    # that table's reduces were the noise's (a fresh make test's peer waited less than rank 2 there).
    with Session(loop.healer.store.engine) as session:
        opened = session.execute(select(IncidentEvent.evidence).where(
            IncidentEvent.incident_id == inc.id, IncidentEvent.from_state.is_(None),
            IncidentEvent.to_state == "open")).scalar_one()
    rows = {r["rank"]: r for r in opened["phase_table"]}
    # The waiting is in the peers' reduce, not in their compute: the slowed rank's own work is what stands out.
    assert all(rows[r]["dp_reduce_s"] > rows[2]["dp_reduce_s"] for r in (0, 1, 3)), rows
