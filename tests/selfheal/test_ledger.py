"""The goodput ledger and the restarts in the healer's database (real SQLite and PostgreSQL), for the dashboards:
a crash healed by a restart, driven through the one lifecycle (real engine and store, scripted hands), with the
run's journals written the way the supervisor and the trainer write them.

A crash healed by a restart, in seconds from the detection (T0): attempt 0 starts at -50, its steps 0..44 take 1 s
each from -48 (step 39 saves: a 0.5 s stall); it dies after step 44 (-3) and is detected at 0, diagnosed at 5
(node n2 fails node-health), decided at 6 (n2 excluded, spare n3 in); attempt 1 starts at 8 from the checkpoint
of step 40 (steps 40..44 are lost), its first step begins at 12, steps 40..59 end at 32, and it ends at 34.
Wall 84 s: 59.5 productive, 0.5 checkpointing, 5 lost, 3 detection, 6 diagnosis, 2 restart, 4 startup, 4 other.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from dashboards.incidents import RESTARTS_SQL, TIMINGS_SQL
from dashboards.training import GOODPUT_SQL
from ground.jsonl import append_jsonl
from healer.engine.engine import Healer
from healer.incidents.jobstore import JobStore
from healer.incidents.timeline import job_timelines
from healer.ledger.store import LedgerWriter
from healer.ports import HostVerdict
from tests.deploy.test_dashboard_sql import grafana_sql
from tests.selfheal.scripted import ScriptedRemediator
from tests.selfheal.test_lifecycle import JOB, crash, setup, tick

pytestmark = pytest.mark.services

T0 = 1_700_000_000.0
LEDGER = [("startup", -50, -48, False, None), ("productive", -48, -8.5, False, 40),
          ("checkpointing", -8.5, -8, False, None), ("lost", -8, -3, True, 5), ("detection", -3, 0, True, None),
          ("diagnosis", 0, 6, True, None), ("restart", 6, 8, True, None), ("startup", 8, 12, False, None),
          ("productive", 12, 32, False, 20), ("other", 32, 34, False, None)]


def _attempt(run_dir: Path, event: str, attempt: int, at: float) -> None:
    append_jsonl(run_dir / "supervisor" / "attempts.jsonl", {"event": event, "job": JOB, "attempt": attempt, "at": at})


def _steps(run_dir: Path, steps: range, first_ends_at: float) -> None:
    for n, step in enumerate(steps):
        append_jsonl(run_dir / "ranks" / "0.jsonl", {"step": step, "time": first_ends_at + n, "step_seconds": 1.0,
                                                     "loss": 2.0, "phases": {"checkpoint": 0.5 if step == 39 else 1e-5}})


def heal_a_crash(tmp_path: Path, db_url: str | None = None) -> tuple[Healer, Path]:
    """The crash above, through the real lifecycle; returns the healer and the run directory."""
    run = tmp_path / "run"
    healer, hands, clock = setup(tmp_path, db_url=db_url)
    clock.now = T0 - 50
    _attempt(run, "start", 0, T0 - 50)
    _steps(run, range(45), T0 - 47)
    clock.now = T0
    hands.highest[0], hands.checkpoints = 44, (20, 40)
    crash(healer, clock)
    tick(healer)  # detected, diagnosing (the attempt is stopped)
    _attempt(run, "end", 0, T0 + 1)
    clock.now = T0 + 5
    hands.diagnoses.pop()([HostVerdict("n2", "fail", "scratch disk gone", 4.2)])
    clock.now = T0 + 6
    held: list[Any] = []
    hands.restart = lambda order, done: held.append((order, done))  # type: ignore[method-assign]
    tick(healer)  # decided: exclude n2, restart on n1 + n3
    clock.now = T0 + 8
    (order, done) = held.pop()
    _attempt(run, "start", 1, T0 + 8)
    ScriptedRemediator.restart(hands, order, done)  # the new attempt starts, from the checkpoint of step 40
    _steps(run, range(40, 60), T0 + 13)
    hands.first_steps[1] = 40
    hands.view.found(JOB, frozenset({2000, 2001}))
    healer.table.ingest(_beat(2000, 40))
    clock.now = T0 + 13
    tick(healer)  # recovered
    _attempt(run, "end", 1, T0 + 34)
    return healer, run


def _beat(pid: int, step: int) -> dict[str, Any]:
    from tests.healer.helpers import batch

    b = batch("n1", [0], job=JOB)
    b["ranks"][0].update(pid=pid, step=step)
    return b


def _rows(healer: Healer, t0: float = T0) -> list[tuple[Any, ...]]:
    at = datetime.fromtimestamp(t0, UTC)
    return [(r.kind, round((r.started_at - at).total_seconds(), 3), round((r.ended_at - at).total_seconds(), 3),
             r.incident_id, r.steps) for r in JobStore(healer.store.engine).intervals(JOB)]


def _expected(incident_id: int | None) -> list[tuple[Any, ...]]:
    return [(kind, a, b, incident_id if linked else None, steps) for kind, a, b, linked, steps in LEDGER]


def test_the_ledger_is_written_as_intervals_linked_to_the_incident_and_the_restart_is_on_record(
        db_url: str, tmp_path: Path) -> None:
    healer, run = heal_a_crash(tmp_path, db_url)
    (inc,) = job_timelines(healer.store.engine, JOB)
    assert inc.stages == ["detected", "diagnosed", "decided", "restarted", "recovered"]
    assert LedgerWriter(run, healer.store.engine, JOB).write() == len(LEDGER)
    assert _rows(healer) == _expected(inc.id)
    (restart,) = JobStore(healer.store.engine).restarts(JOB)
    at = datetime.fromtimestamp(T0, UTC)
    assert (restart.incident_id, restart.from_step, restart.resumed_step, restart.nodes, restart.excluded,
            restart.outcome, restart.attempt) == (inc.id, 40, 40, ["n1", "n3"], ["n2"], "recovered", 1)
    assert restart.requested_at - at == timedelta(seconds=6) and restart.resumed_at - at == timedelta(seconds=13)


def test_writing_the_ledger_again_replaces_the_run_s_rows(tmp_path: Path) -> None:
    healer, run = heal_a_crash(tmp_path)
    writer = LedgerWriter(run, healer.store.engine, JOB)
    writer.write()
    first = _rows(healer)
    writer.write()
    assert _rows(healer) == first and len(first) == len(LEDGER)


def test_another_run_of_the_same_job_keeps_its_ledger(tmp_path: Path) -> None:
    healer, run = heal_a_crash(tmp_path)
    LedgerWriter(run, healer.store.engine, JOB).write()
    later = tmp_path / "later"
    _attempt(later, "start", 0, T0 + 3600)
    _steps(later, range(5), T0 + 3602)
    _attempt(later, "end", 0, T0 + 3610)
    LedgerWriter(later, healer.store.engine, JOB).write()
    LedgerWriter(run, healer.store.engine, JOB).write()
    (inc,) = job_timelines(healer.store.engine, JOB)
    rows = _rows(healer)
    assert rows[:len(LEDGER)] == _expected(inc.id)
    assert [r[0] for r in rows[len(LEDGER):]] == ["startup", "productive", "other"]


def test_the_dashboards_read_ettr_detection_lost_work_and_the_restart_from_the_written_ledger(
        pg_url: str, tmp_path: Path) -> None:
    healer, run = heal_a_crash(tmp_path, pg_url)
    LedgerWriter(run, healer.store.engine, JOB).write()
    (inc,) = job_timelines(healer.store.engine, JOB)
    since, until = datetime.fromtimestamp(T0 - 3600, UTC), datetime.now(UTC) + timedelta(days=3650)

    def query(sql: str) -> list[dict[str, Any]]:
        with healer.store.engine.connect() as conn:
            return [dict(r) for r in conn.execute(text(grafana_sql(sql, since, until, JOB))).mappings()]

    (ledger,) = query(GOODPUT_SQL)
    # ETTR as everywhere (healer/ledger/goodput.py): productive / wall; checkpointing beside it, not added in.
    assert float(ledger["ETTR"]) == pytest.approx(59.5 / 84) and float(ledger["Checkpointing"]) == pytest.approx(0.5 / 84)
    (timings,) = query(TIMINGS_SQL)
    assert timings["incident"] == inc.id
    assert float(timings["detection"]) == pytest.approx(3) and float(timings["lost work"]) == pytest.approx(5)
    assert float(timings["diagnosis"]) == pytest.approx(6)
    (restart,) = query(RESTARTS_SQL)
    assert (restart["incident"], restart["from step"], restart["resumed at step"], restart["excluded nodes"],
            restart["outcome"]) == (inc.id, 40, 40, '["n2"]', "recovered")
