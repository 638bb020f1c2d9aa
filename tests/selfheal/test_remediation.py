"""The remediation policy (pure) and the node history it reads across jobs."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from healer.core.remediation import (
    Budgets,
    IncidentInput,
    JobFacts,
    Remedy,
    VerdictInput,
    plan,
)
from healer.core.remediation_history import NodeEvent, NodeHistory

NOW = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)


def facts(**kw: object) -> JobFacts:
    base: dict[str, object] = {"now": NOW, "nodes": ("n1", "n2"), "spares": ("n3",), "dp": 4,
                               "checkpoint_steps": (4, 8, 12)}
    base.update(kw)
    return JobFacts(**base)  # type: ignore[arg-type]


def test_a_crash_with_a_clean_verdict_restarts_in_place_and_records_its_basis() -> None:
    p = plan(IncidentInput(id=1, kind="crash", suspect_nodes=("n2",)), VerdictInput("pass"), facts(), Budgets())
    assert p.remedy is Remedy.RESTART and p.nodes == ("n1", "n2") and p.dp == 4 and p.exclude == ()
    payload = p.to_payload()
    assert payload["decision_basis"]["verdict"] == "pass" and payload["decision_basis"]["restarts_in_window"] == 0
    assert "restart in place" in payload["decision_basis"]["reason"]


def test_a_failed_verdict_excludes_the_node_and_takes_a_spare() -> None:
    p = plan(IncidentInput(id=2, kind="hang"), VerdictInput("fail", bad_nodes=("n2",)), facts(), Budgets())
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",)
    assert p.nodes == ("n1", "n3") and p.dp == 4 and "spare" in p.basis["reason"]


def test_without_a_spare_the_job_comes_back_smaller_or_escalates_below_min_nodes() -> None:
    p = plan(IncidentInput(id=3, kind="gpu_fault", suspect_nodes=("n2",)), None, facts(spares=()), Budgets())
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.nodes == ("n1",) and p.dp == 2
    assert "dp 2 (was 4)" in p.basis["reason"]
    p = plan(IncidentInput(id=3, kind="gpu_fault", suspect_nodes=("n2",)), None, facts(spares=()),
             Budgets(min_nodes=2))
    assert p.remedy is Remedy.ESCALATE and p.exclude == ("n2",)
    odd = plan(IncidentInput(id=3, kind="gpu_fault", suspect_nodes=("n2",)), None,
               facts(nodes=("n1", "n2", "n4"), spares=(), dp=4), Budgets())
    assert odd.remedy is Remedy.ESCALATE  # dp 4 over 3 nodes cannot shrink evenly to 2 nodes


def test_a_lemon_node_is_excluded_on_sight_even_when_the_runbook_passes() -> None:
    p = plan(IncidentInput(id=4, kind="crash", suspect_nodes=("n2",)), VerdictInput("pass"),
             facts(node_incidents={"n2": 3, "n1": 1}), Budgets(lemon_incidents=3))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.basis["lemons"] == {"n2": 3}


def test_a_straggler_without_a_culprit_node_only_notifies() -> None:
    p = plan(IncidentInput(id=5, kind="straggler", suspect_nodes=("n1",)), VerdictInput("pass"), facts(), Budgets())
    assert p.remedy is Remedy.NOTIFY
    p = plan(IncidentInput(id=5, kind="straggler", suspect_nodes=("n1",)), VerdictInput("degraded", ("n1",)),
             facts(), Budgets())
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.nodes == ("n2", "n3")
    assert plan(IncidentInput(id=6, kind="rank-heartbeat-stale"), None, facts(), Budgets()).remedy is Remedy.NOTIFY


def test_a_loss_spike_rolls_back_before_the_first_bad_step_and_skips_its_batches() -> None:
    p = plan(IncidentInput(id=7, kind="loss_spike", first_bad_step=12), None, facts(), Budgets(skip_steps=2))
    assert p.remedy is Remedy.ROLLBACK and p.resume_step == 8 and p.skip_steps == (11, 12)
    p = plan(IncidentInput(id=8, kind="nonfinite", first_bad_step=9), None, facts(), Budgets(skip_steps=5))
    assert p.resume_step == 8 and p.skip_steps == (8, 9)  # never skips steps the checkpoint already holds (0..7)
    p = plan(IncidentInput(id=9, kind="nonfinite", first_bad_step=3), None, facts(), Budgets())
    assert p.remedy is Remedy.ESCALATE and "no good checkpoint before step 3" in p.basis["reason"]


def test_restarts_back_off_exponentially_and_a_spent_budget_escalates() -> None:
    budgets = Budgets(max_restarts=3, window=timedelta(minutes=10), backoff=timedelta(seconds=10))
    crash = IncidentInput(id=10, kind="crash")
    one = (NOW - timedelta(seconds=5),)
    p = plan(crash, None, facts(restarts=one), budgets)
    assert p.remedy is Remedy.WAIT and p.not_before == one[0] + timedelta(seconds=10)
    assert plan(crash, None, facts(restarts=one, now=NOW + timedelta(seconds=6)), budgets).remedy is Remedy.RESTART
    two = (NOW - timedelta(seconds=15), NOW - timedelta(seconds=100))
    p = plan(crash, None, facts(restarts=two), budgets)
    assert p.remedy is Remedy.WAIT and p.basis["backoff_s"] == 20
    three = (NOW - timedelta(seconds=30), NOW - timedelta(seconds=60), NOW - timedelta(seconds=90))
    p = plan(crash, None, facts(restarts=three), budgets)
    assert p.remedy is Remedy.ESCALATE and "restart budget spent" in p.basis["reason"]
    old = tuple(NOW - timedelta(minutes=m) for m in (11, 12, 13))
    assert plan(crash, None, facts(restarts=old), budgets).remedy is Remedy.RESTART  # outside the window


def test_budgets_are_validated() -> None:
    with pytest.raises(ValueError, match="backoff"):
        Budgets(backoff=timedelta(minutes=10), max_backoff=timedelta(minutes=1))
    with pytest.raises(ValueError, match="max_restarts"):
        Budgets(max_restarts=-1)


def test_node_history_counts_incidents_across_jobs_and_survives_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "state" / "node-history.json"
    old = NOW - timedelta(days=40)
    NodeHistory(path).record([NodeEvent("n2", "job-a", "crash", 1, old)], now=old)
    writers = [threading.Thread(target=NodeHistory(path).record,
                                args=([NodeEvent("n2", f"job-{i}", "hang", i, NOW)],), kwargs={"now": NOW})
               for i in range(8)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    NodeHistory(path).record([NodeEvent("n2", "job-0", "hang", 0, NOW)], now=NOW)  # the same incident again
    counts = NodeHistory(path).counts(since=NOW - timedelta(days=7))
    assert counts == {"n2": 8}
    path.write_text("{torn")
    with pytest.raises(ValueError, match="not valid JSON"):
        NodeHistory(path).counts(since=NOW)
