"""The healer's memory stays bounded over months of jobs: the detectors' per-rank history and their per-job state
forget ranks and jobs not heard of for a while (and keep at most so many ranks), what fired is forgotten with its
incident; and a detection cycle never runs on the service's event loop, which must keep taking heartbeats."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from healer.decide.states import IncidentState
from healer.detect.base import Evaluation
from healer.detect.heartbeat_stale import HeartbeatStale
from healer.observe.heartbeats import HeartbeatTable
from healer.observe.history import RankHistory
from tests.healer.helpers import ManualClock, batch, make_healer
from tests.healer.services import TOKEN

pytestmark = pytest.mark.unit

RULES = "\n".join(f"- {{name: {d}, when: {{detector: {d}}}, remediate: notify}}" for d in (
    "hang", "straggler", "loss_spike", "nonfinite", "collective_slowdown", "job_slowdown", "crash",
    "heartbeat_stale"))
PER_JOB = {"hang": ("_jobs", "_times"), "straggler": ("_jobs",), "loss_spike": ("_spikes",), "nonfinite": ("_bad",),
           "collective_slowdown": ("_jobs",), "job_slowdown": ("_jobs",)}


def beat(table: HeartbeatTable, job: str, node: str, step: int, loss: float = 2.5) -> None:
    body = batch(node, [0, 1, 2, 3], job=job)
    for r in body["ranks"]:
        r.update(step=step, loss=loss, phases={"forward_backward": 0.4, "dp_reduce": 0.05})
    table.ingest(json.dumps(body).encode())


def remembered(healer: Any) -> dict[str, set[str]]:
    """Per detector, the jobs it still keeps anything of (its history and its per-job state)."""
    out = {}
    for rule, det in healer.detectors:
        jobs = {job for job, _ in det.history.keys()} if hasattr(det, "history") else set()
        for attr in PER_JOB.get(rule.name, ()):
            jobs |= set(getattr(det, attr))
        out[rule.name] = jobs
    return out


def test_it_forgets_jobs_no_longer_heard_of_with_every_detectors_state(tmp_path: Path) -> None:
    clock = ManualClock()
    healer = make_healer(tmp_path, RULES, clock=clock)
    for step in range(12):  # 30 jobs of 4 ranks each train a few steps, then all but one end
        for j in range(30):
            beat(healer.table, f"job-{j}", f"n{j}", step, loss=100.0 if step == 11 and j == 3 else 2.5)
        healer.tick_detect()
        clock.now += 1.0
    kept = remembered(healer)
    assert all(len(jobs) == 30 for name, jobs in kept.items() if name in PER_JOB), kept
    assert "job-3" in healer.detectors[2][1]._spikes  # the loss spike of job-3 is state of its own
    for step in range(12, 80):  # an hour and more: only job-29 goes on
        beat(healer.table, "job-29", "n29", step)
        healer.tick_detect()
        healer.tick_respond()
        clock.now += 60.0
    healer.tick_housekeeping(timedelta(days=90))  # the heartbeat table forgets after an hour
    healer.tick_detect()
    assert all(jobs <= {"job-29"} for jobs in remembered(healer).values()), remembered(healer)
    # The silent jobs' hangs stay open (silence is no recovery) until someone closes them; then what fired goes too.
    gone = [i for i in healer.store.active() if i.job != "job-29"]
    assert len(gone) >= 29 and len(healer._fired) >= 29
    for incident in gone:
        healer.person_action(incident.id, IncidentState.RESOLVED, "oncall", "the job ended")
    healer.tick_respond()
    healer.tick_detect()
    assert all(job == "job-29" for _, key in healer._fired for job in [key.split("/")[0]]), healer._fired


def test_it_keeps_at_most_max_series_ranks() -> None:
    clock = ManualClock()
    table = HeartbeatTable(clock=clock)
    for n in range(40):
        table.ingest(json.dumps(batch(f"n{n}", list(range(8)), job=f"job-{n}")).encode())
    history = RankHistory(keep=4, max_series=100)
    history.update(table, clock.now)
    # Bounded, and evicted a sixteenth at a time (one sort each, not a scan of every series per new rank).
    assert 100 - 100 // 16 <= len(history.keys()) <= 100 and history.evicted == 320 - len(history.keys())


@pytest.mark.timeout(60)
def test_a_long_detection_cycle_does_not_hold_up_the_services_requests(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    from healer.service.app import Service
    from healer.service.config import HealerConfig

    entered, release = threading.Event(), threading.Event()

    def slow_cycle(self: HeartbeatStale, table: Any, now: float) -> Evaluation:
        entered.set()
        release.wait(10)  # a cycle over very many ranks, as long as it takes
        return Evaluation()

    monkeypatch.setattr(HeartbeatStale, "evaluate", slow_cycle)
    monkeypatch.setenv("MEGAHEAL_TOKEN", TOKEN)
    rules = tmp_path / "rules.yaml"
    rules.write_text("- {name: node-silent, when: {detector: heartbeat_stale}, remediate: notify}\n")
    service = Service(HealerConfig(db=f"sqlite:///{tmp_path / 'h.db'}", rules=[str(rules)],
                                   detect_interval=timedelta(milliseconds=100)))
    service.check_database()
    try:
        with TestClient(service.app) as client:
            assert entered.wait(20), "no detection cycle started"
            started = time.monotonic()
            health = client.get("/healthz")
            beats = client.post("/v1/heartbeats", content=json.dumps(batch("n1", [0])),
                                headers={"Authorization": f"Bearer {TOKEN}"})
            waited = time.monotonic() - started
            release.set()
    finally:
        release.set()
    assert (health.status_code, beats.status_code) == (200, 202)
    assert waited < 2.0, f"requests waited {waited:.1f} s behind a detection cycle"
