"""The incident store on SQLite and on a real PostgreSQL: dedupe by fingerprint, cool-down reopening, transitions
stored with time and evidence, conditional claims, and two processes racing for the same incidents."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import func, select

from healer.decide.signals import Signal
from healer.decide.states import IncidentState
from healer.errors import IllegalTransition, NotFound
from healer.incidents import db
from healer.incidents.models import IncidentEvent
from healer.incidents.store import IncidentStore

pytestmark = pytest.mark.services

S = IncidentState


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


def _signal(node: str = "n1", cooldown: timedelta = timedelta(minutes=10)) -> Signal:
    return Signal(rule="stale", kind="heartbeat_stale", severity="critical", page="on-escalation", cooldown=cooldown,
                  identity=(("key", f"job/{node}"),), job="job", node=node, summary=f"{node} silent",
                  evidence={"stale_ranks": 8}, labels={"job": "job", "node": node})


@pytest.fixture
def store(db_url: str) -> Any:
    engine = db.make_engine(db_url)
    db.ensure_schema(engine)
    yield IncidentStore(engine, "healer-a", clock=Clock())
    engine.dispose()


def test_it_opens_one_incident_per_fingerprint_and_joins_recurrences(store: IncidentStore) -> None:
    first = store.record(_signal())
    assert first[1] == "opened"
    assert store.record(_signal()) == (first[0], "joined")
    other = store.record(_signal("n2"))
    assert other[1] == "opened" and other[0] != first[0]
    got = store.get(first[0])
    assert got["occurrences"] == 2 and [e["kind"] for e in got["events"]] == ["transition", "recurred"]
    assert got["events"][0]["to"] == "open" and got["events"][0]["evidence"]["stale_ranks"] == 8
    assert store.open_counts() == {("heartbeat_stale", "critical"): 2}


def test_a_recurrence_within_the_cooldown_reopens_and_after_it_opens_anew(store: IncidentStore) -> None:
    clock = store.clock
    assert isinstance(clock, Clock)
    incident_id, _ = store.record(_signal())
    assert store.resolve_fingerprint(_signal().fingerprint, {"reason": "cleared"}) == incident_id
    clock.now += timedelta(minutes=9)
    assert store.record(_signal()) == (incident_id, "reopened")
    got = store.get(incident_id)
    assert got["state"] == "open" and got["resolved_at"] is None
    assert [(e["from"], e["to"]) for e in got["events"]][-2:] == [("open", "resolved"), ("resolved", "open")]
    # Reopened by a signal that says something else of the same thing: the incident says what the new one does.
    store.resolve_fingerprint(_signal().fingerprint, {"reason": "cleared"})
    again = replace(_signal(), summary="n1 silent again", evidence={"stale_ranks": 3})
    assert store.record(again) == (incident_id, "reopened")
    got = store.get(incident_id)
    assert (got["summary"], got["evidence"]["stale_ranks"]) == ("n1 silent again", 3), got
    assert got["events"][0]["evidence"]["summary"] == "n1 silent", "the first opening's words stay in its event"
    store.resolve_fingerprint(_signal().fingerprint, {})
    clock.now += timedelta(minutes=11)
    new_id, outcome = store.record(_signal())
    assert outcome == "opened" and new_id != incident_id


def test_transitions_are_conditional_and_stored_with_time_actor_and_evidence(store: IncidentStore) -> None:
    incident_id, _ = store.record(_signal())
    assert store.transition(incident_id, S.OPEN, S.DIAGNOSING, {"runbook": "node-health"})
    assert not store.transition(incident_id, S.OPEN, S.DIAGNOSING, {"runbook": "again"})  # lost: no longer open
    with pytest.raises(IllegalTransition):
        store.transition(incident_id, S.DIAGNOSING, S.OPEN, {})
    event = store.get(incident_id)["events"][-1]
    assert (event["from"], event["to"], event["actor"], event["evidence"]) == (
        "open", "diagnosing", "healer-a", {"runbook": "node-health"})
    assert event["at"] == "2024-05-01T12:00:00+00:00"
    assert store.get(incident_id)["owner"] == "healer-a"


def test_a_persons_ack_and_resolve_follow_the_table(store: IncidentStore) -> None:
    incident_id, _ = store.record(_signal())
    acked = store.act(incident_id, S.ACKNOWLEDGED, "person:ann", {"note": "mine"})
    assert (acked["state"], acked["acknowledged_by"]) == ("acknowledged", "person:ann")
    with pytest.raises(IllegalTransition, match="from acknowledged to acknowledged"):
        store.act(incident_id, S.ACKNOWLEDGED, "person:bob", {})
    assert store.act(incident_id, S.RESOLVED, "person:ann", {})["state"] == "resolved"
    with pytest.raises(NotFound):
        store.act(999, S.RESOLVED, "person:ann", {})


def test_due_incidents_and_retention(store: IncidentStore) -> None:
    clock = store.clock
    assert isinstance(clock, Clock)
    a, _ = store.record(_signal("n1"))
    b, _ = store.record(_signal("n2"))
    assert {i.id for i in store.due()} == {a, b}
    store.set_next_action(b, clock.now + timedelta(minutes=1))
    assert [i.id for i in store.due()] == [a]
    store.resolve_fingerprint(_signal("n1").fingerprint, {})
    clock.now += timedelta(days=31)
    assert store.purge(timedelta(days=30)) == 1
    with pytest.raises(NotFound):
        store.get(a)
    with store.engine.connect() as conn:  # its events went with it
        assert conn.execute(select(func.count()).select_from(IncidentEvent)
                            .where(IncidentEvent.incident_id == a)).scalar() == 0


# ---- two processes racing ------------------------------------------------------------------------------------

def _race(url: str, name: str, ids: list[int], start: Any, out: Any) -> None:
    engine = db.make_engine(url)
    store = IncidentStore(engine, name)
    start.wait()
    won = [i for i in ids if store.transition(i, S.OPEN, S.DIAGNOSING, {"by": name})]
    out.put((name, won))
    engine.dispose()


def test_two_processes_racing_for_the_same_incidents_each_claim_exactly_once(store: IncidentStore) -> None:
    ids = [store.record(_signal(f"n{i}"))[0] for i in range(60)]
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    url = store.engine.url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_race, args=(url, name, ids if name == "a" else ids[::-1], start, out))
             for name in ("a", "b")]
    for p in procs:
        p.start()
    start.set()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sorted(results["a"] + results["b"]) == sorted(ids)  # every incident claimed once, none twice
    with store.engine.connect() as conn:
        claims = conn.execute(select(IncidentEvent.incident_id, func.count()).where(IncidentEvent.to_state == "diagnosing")
                              .group_by(IncidentEvent.incident_id)).all()
    assert len(claims) == len(ids) and all(n == 1 for _, n in claims)


def test_non_finite_evidence_is_stored_as_text(store: IncidentStore) -> None:
    # PostgreSQL's json type refuses NaN and infinities; a NaN incident's evidence is exactly where they turn up.
    signal = Signal(rule="nan", kind="nonfinite", severity="critical", page="never", cooldown=timedelta(minutes=1),
                    identity=(("key", "job"),), job="job", node=None, summary="loss is NaN",
                    evidence={"loss": float("nan"), "grad_norm": float("inf"), "first_step": 10})
    incident_id, _ = store.record(signal)
    store.update_evidence(incident_id, {"median": float("-inf")})
    store.note(incident_id, {"last": float("nan")})
    got = store.get(incident_id)
    assert got["evidence"] == {"loss": "NaN", "grad_norm": "Infinity", "first_step": 10, "median": "-Infinity"}
    assert [e["evidence"].get("last") for e in got["events"] if e["kind"] == "note"] == ["NaN"]


def test_a_service_and_a_megaheal_run_on_one_database_each_act_only_on_their_own_incidents(
        store: IncidentStore) -> None:
    run = IncidentStore(store.engine, "megaheal-run:h:1", clock=store.clock, handler="run:job")
    service_incident, _ = store.record(_signal("n1"))
    run_incident, _ = run.record(_signal("n2"))
    assert [i.id for i in store.due()] == [service_incident]
    assert [i.id for i in run.due()] == [run_incident]
    assert {i["id"] for i in store.list_incidents()} == {service_incident, run_incident}  # both are on record


def test_the_restarts_a_budget_counts_can_be_those_of_faults_that_named_no_host(store: IncidentStore) -> None:
    # What a restart budget scaled by hosts holds to its unscaled count (healer/decide/plans.py, gate).
    from healer.decide.catalogue import UNNAMED_KINDS
    from healer.incidents.jobstore import JobStore

    jobs = JobStore(store.engine, clock=store.clock)
    nan = replace(_signal(), kind="nonfinite", identity=(("key", "job/nan"),))
    crash_id, _ = store.record(replace(_signal(), kind="crash"))
    nan_id, _ = store.record(nan)
    for incident_id in (crash_id, nan_id, nan_id, None):  # None: a restart no incident asked for (a person's)
        jobs.add_restart(job="job", incident_id=incident_id, nodes=["n1"], excluded=[], dp=1, skip_steps=[])
        store.clock.now += timedelta(minutes=1)  # type: ignore[attr-defined]
    since = datetime(2024, 5, 1, tzinfo=timezone.utc)
    assert len(jobs.restart_times("job", since)) == 4
    assert len(jobs.restart_times("job", since, UNNAMED_KINDS)) == 2
    assert jobs.restart_times("job", since, ()) == ()
