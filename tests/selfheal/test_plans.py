"""Choosing the remedy (healer.decide.plans.choose, pure): restart, exclude with a spare or a smaller job, roll back,
notify, escalate; the restart budget and its backoff; a smaller job only at a degree the training layout accepts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from healer.decide.catalogue import CATALOGUE, FaultKind, Remedy, fault
from healer.decide.plans import JobFacts, Limits, Plan, RestartBudget, Verdict, choose, gate, restart_mode

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)


def facts(**kw: object) -> JobFacts:
    base: dict[str, object] = {"nodes": ("n1", "n2"), "spares": ("n3",), "dp": 4, "checkpoint_steps": (4, 8, 12)}
    base.update(kw)
    return JobFacts(**base)  # type: ignore[arg-type]


def plan(kind: str, remedy: Remedy | None = None, suspects: tuple[str, ...] = (), first_bad_step: int | None = None,
         verdict: Verdict | None = None, job: JobFacts | None = None, limits: Limits | None = None,
         budget: RestartBudget | None = None, now: datetime = NOW) -> Plan:
    return choose(fault(kind), remedy, suspects, first_bad_step, verdict, job or facts(), limits or Limits(),
                  budget or RestartBudget(), now, {"rule": "test"})


def test_a_crash_with_a_clean_verdict_restarts_in_place_and_records_its_basis() -> None:
    p = plan("crash", suspects=("n2",), verdict=Verdict("pass"))
    assert p.remedy is Remedy.RESTART and p.nodes == ("n1", "n2") and p.dp == 4 and p.exclude == ()
    payload = p.to_payload()
    assert payload["decision_basis"]["verdict"] == "pass" and payload["decision_basis"]["restarts_in_window"] == 0
    assert "restart in place" in payload["decision_basis"]["reason"]
    assert payload["decision_basis"]["remedy_from"] == "catalogue"


def test_a_failed_verdict_excludes_the_node_and_takes_a_spare() -> None:
    p = plan("hang", verdict=Verdict("fail", bad_nodes=("n2",)))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",)
    assert p.nodes == ("n1", "n3") and p.dp == 4 and "spare" in p.basis["reason"]


def test_an_error_verdict_blames_no_host() -> None:
    p = plan("crash", suspects=("n2",), verdict=Verdict("error"))
    assert p.remedy is Remedy.RESTART and p.exclude == ()


def test_without_a_spare_the_job_comes_back_smaller_or_escalates() -> None:
    p = plan("gpu_fault", suspects=("n2",), job=facts(spares=()))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.nodes == ("n1",) and p.dp == 2
    assert "dp 2 (was 4)" in p.basis["reason"]
    p = plan("gpu_fault", suspects=("n2",), job=facts(spares=()), limits=Limits(min_nodes=2))
    assert p.remedy is Remedy.ESCALATE and p.exclude == ("n2",) and "min_nodes 2" in p.basis["reason"]
    odd = plan("gpu_fault", suspects=("n2",), job=facts(nodes=("n1", "n2", "n4"), spares=()))
    assert odd.remedy is Remedy.ESCALATE and "does not shrink evenly" in odd.basis["reason"]


def test_a_job_whose_replicas_span_hosts_shrinks_by_a_whole_replica_and_releases_the_rest_as_spares() -> None:
    # Four hosts, two replicas of two hosts (pp 2 across hosts): losing n2 with no spare leaves three hosts, one
    # of them half a replica. The job comes back on one replica; the healthy leftover is a spare, not excluded.
    four = facts(nodes=("n1", "n2", "n3", "n4"), spares=(), dp=2)
    p = plan("gpu_fault", suspects=("n2",), job=four)
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",)
    assert p.nodes == ("n1", "n3") and p.dp == 1 and p.released == ("n4",)
    assert "n4 left idle as spare(s) (2 hosts a replica)" in p.basis["reason"]
    assert p.to_payload()["released"] == ["n4"]
    # With a spare, nothing is released: the spare takes the host's place.
    assert plan("gpu_fault", suspects=("n2",), job=facts(nodes=("n1", "n2", "n3", "n4"), spares=("n5",), dp=2)
                ).released == ()


def test_a_smaller_job_is_only_tried_at_a_degree_the_training_layout_accepts() -> None:
    p = plan("gpu_fault", suspects=("n2",), job=facts(spares=(), valid_dp=(1, 4)))
    assert p.remedy is Remedy.ESCALATE and "does not accept dp 2" in p.basis["reason"]
    assert plan("gpu_fault", suspects=("n2",), job=facts(spares=(), valid_dp=(1, 2, 4))).dp == 2


def test_a_lemon_node_is_excluded_on_sight_even_when_the_runbook_passes() -> None:
    p = plan("crash", suspects=("n2",), verdict=Verdict("pass"), job=facts(node_incidents={"n2": 3, "n1": 1}),
             limits=Limits(lemon_incidents=3))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.basis["lemons"] == {"n2": 3}


def test_a_nan_whose_suspects_hold_a_lemon_leaves_out_the_lemon_alone() -> None:
    # Every rank reports a NaN once it passed the reduce: the hosts it names are where it was seen, not its cause.
    p = plan("nonfinite", suspects=("n1", "n2"), first_bad_step=10, job=facts(spares=(), node_incidents={"n2": 3}),
             limits=Limits(lemon_incidents=3))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.nodes == ("n1",), p.basis["reason"]
    assert plan("nonfinite", suspects=("n1", "n2"), first_bad_step=10).remedy is Remedy.ROLLBACK


def test_a_straggler_notifies_unless_a_diagnosis_proves_its_host_bad() -> None:
    assert plan("straggler", suspects=("n1",), verdict=Verdict("pass")).remedy is Remedy.NOTIFY
    p = plan("straggler", suspects=("n1",), verdict=Verdict("degraded", ("n1",)))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.nodes == ("n3", "n2"), "the spare takes n1's place"
    assert p.basis["remedy_from"] == "a host proven bad"
    assert plan("rank-heartbeat-stale").remedy is Remedy.NOTIFY  # a kind the catalogue does not know


def test_a_rules_remedy_wins_over_the_catalogue() -> None:
    assert plan("crash", Remedy.NOTIFY, suspects=("n2",), verdict=Verdict("fail", ("n2",))).remedy is Remedy.NOTIFY
    p = plan("crash", Remedy.EXCLUDE_AND_RESTART, suspects=("n2",))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.basis["remedy_from"] == "rule"
    assert plan("straggler", Remedy.ESCALATE).remedy is Remedy.ESCALATE
    # exclude-node-and-restart with no host named in the job restarts in place, and says why
    p = plan("hang", Remedy.EXCLUDE_AND_RESTART, suspects=("n9",))
    assert p.remedy is Remedy.RESTART and "not in the job" in p.basis["reason"]


def test_a_loss_spike_rolls_back_before_the_first_bad_step_and_skips_its_batches() -> None:
    p = plan("loss_spike", first_bad_step=12, limits=Limits(skip_steps=2))
    assert p.remedy is Remedy.ROLLBACK and p.resume_step == 8 and p.skip_steps == (11, 12)
    p = plan("nonfinite", first_bad_step=9, limits=Limits(skip_steps=5))
    assert p.resume_step == 8 and p.skip_steps == (8, 9)  # never skips steps the checkpoint already holds (0..7)
    p = plan("nonfinite", first_bad_step=3)
    assert p.remedy is Remedy.ESCALATE and "no good checkpoint before step 3" in p.basis["reason"]
    assert plan("nonfinite").remedy is Remedy.ESCALATE  # without the step it began at


def test_a_host_convicted_of_sdc_leaves_and_the_checkpoints_saved_since_its_first_suspect_step_are_tainted() -> None:
    p = plan("sdc", suspects=("n2",), first_bad_step=9)
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.nodes == ("n1", "n3")
    assert p.resume_step == 8 and p.basis["tainted_checkpoints"] == [12]
    assert "the checkpoints of steps 12, saved since n2's first suspect step 9, are tainted: resume from the " \
           "checkpoint of step 8" in p.basis["reason"]
    # Nothing saved since yet: still named, for the stop that ends the attempt saves one (an e2e run resumed from the
    # stop's save at step 13, after the first suspect step 11, when this was left to `auto`).
    assert plan("sdc", suspects=("n2",), first_bad_step=12).resume_step == 12
    exposed = plan("sdc", suspects=("n2",), first_bad_step=2)
    assert exposed.resume_step is None and "none is known clean" in exposed.basis["exposure"]
    assert plan("gpu_fault", suspects=("n2",), first_bad_step=9).resume_step is None  # only kinds that taint


def test_a_budget_per_hosts_grows_with_the_job_and_never_falls_below_its_restarts() -> None:
    budget = RestartBudget(max_restarts=5, per_hosts=2048)
    assert [budget.allowed(h) for h in (1, 2048, 2049, 12288)] == [5, 5, 10, 30]
    assert RestartBudget(max_restarts=5).allowed(12288) == 5  # unscaled: the whole job's, whatever its size
    five = tuple(NOW - timedelta(minutes=m) for m in (50, 40, 30, 20, 10))
    small = facts(restarts=five)
    assert plan("crash", job=small, budget=budget).remedy is Remedy.ESCALATE
    big = facts(nodes=tuple(f"n{i}" for i in range(4096)), restarts=five)
    p = plan("crash", job=big, budget=budget)
    assert p.remedy is Remedy.RESTART and p.basis["max_restarts"] == 10
    assert p.basis["budget_scale"] == {"restarts": 5, "per_hosts": 2048, "hosts": 4096}
    ten = tuple(NOW - timedelta(minutes=m) for m in range(5, 55, 5))
    assert plan("crash", job=facts(nodes=big.nodes, restarts=ten), budget=budget).remedy is Remedy.ESCALATE
    with pytest.raises(ValueError, match="per_hosts must be >= 0"):
        RestartBudget(per_hosts=-1)


def test_a_scaled_budget_holds_faults_that_name_no_host_to_its_unscaled_count() -> None:
    # A NaN loop is the job's, not its hosts': five rollbacks in the hour page a big job as they page a small one,
    # while a host's crash after them still restarts within the scaled budget.
    budget = RestartBudget(max_restarts=5, per_hosts=2048)
    five = tuple(NOW - timedelta(minutes=m) for m in (50, 40, 30, 20, 10))
    big = facts(nodes=tuple(f"n{i}" for i in range(4096)), restarts=five, unnamed_restarts=five)
    p = plan("nonfinite", first_bad_step=9, job=big, budget=budget)
    assert p.remedy is Remedy.ESCALATE and p.basis["unnamed_restarts_in_window"] == 5
    assert "named no host, of at most 5 whatever the job's size" in p.basis["reason"]
    assert plan("crash", job=big, budget=budget).remedy is Remedy.RESTART
    old = facts(nodes=big.nodes, restarts=five, unnamed_restarts=(NOW - timedelta(hours=2),) * 5)
    assert plan("nonfinite", first_bad_step=9, job=old, budget=budget).remedy is Remedy.ROLLBACK


def test_restarts_back_off_exponentially_and_a_spent_budget_escalates() -> None:
    budget = RestartBudget(max_restarts=3, window=timedelta(minutes=10), backoff=timedelta(seconds=10))
    one = (NOW - timedelta(seconds=5),)
    p = plan("crash", job=facts(restarts=one), budget=budget)
    assert p.remedy is Remedy.RESTART and p.not_before == one[0] + timedelta(seconds=10)
    assert plan("crash", job=facts(restarts=one), budget=budget, now=NOW + timedelta(seconds=6)).not_before is None
    two = (NOW - timedelta(seconds=100), NOW - timedelta(seconds=15))
    p = plan("crash", job=facts(restarts=two), budget=budget)
    assert p.not_before is not None and p.basis["backoff_s"] == 20
    three = (NOW - timedelta(seconds=90), NOW - timedelta(seconds=60), NOW - timedelta(seconds=30))
    p = plan("crash", job=facts(restarts=three), budget=budget)
    assert p.remedy is Remedy.ESCALATE and "restart budget spent" in p.basis["reason"]
    old = tuple(NOW - timedelta(minutes=m) for m in (13, 12, 11))
    assert plan("crash", job=facts(restarts=old), budget=budget).remedy is Remedy.RESTART  # outside the window


def test_limits_and_budgets_are_validated() -> None:
    with pytest.raises(ValueError, match="backoff"):
        RestartBudget(backoff=timedelta(minutes=10), max_backoff=timedelta(minutes=1))
    with pytest.raises(ValueError, match="max_restarts"):
        RestartBudget(max_restarts=-1)
    with pytest.raises(ValueError, match="min_nodes"):
        Limits(min_nodes=0)


@pytest.mark.parametrize("kind", sorted(CATALOGUE))
def test_only_faults_that_stop_the_job_or_poison_its_weights_are_critical(kind: str) -> None:
    entry: FaultKind = CATALOGUE[kind]
    # (and what leaves the job unwatched: a healer that hears none of its hosts, no telemetry; and a host whose
    # arithmetic is wrong, sdc)
    critical = entry.stops_job or entry.name in ("gpu_fault", "sdc", "nonfinite", "heartbeat_stale", "node_down",
                                                 "telemetry_absent", "healer_blind")
    assert (entry.severity == "critical") == critical


def test_a_crash_a_bad_batch_or_a_named_hung_rank_restarts_warm_in_a_job_that_runs_warm() -> None:
    warm_job = facts(warm_unavailable=None)
    crash = restart_mode(plan("crash", suspects=("n2",), verdict=Verdict("pass"), job=warm_job), fault("crash"),
                         warm_job)
    assert crash.warm and crash.basis["restart"]["mode"] == "warm"
    assert "a standby takes its rank" in crash.basis["restart"]["why"] and crash.to_payload()["warm"] is True
    rollback = restart_mode(plan("nonfinite", first_bad_step=9, job=warm_job), fault("nonfinite"), warm_job)
    assert rollback.warm and rollback.resume_step == 8 and "a bad batch" in rollback.basis["restart"]["why"]
    hang = restart_mode(plan("hang", job=warm_job), fault("hang"), warm_job, replace_ranks=(3,))
    assert hang.warm and hang.replace_ranks == (3,) and hang.to_payload()["replace_ranks"] == [3]
    assert "standbys take the named ranks' places" in hang.basis["restart"]["why"]
    # A hang that names no rank: which process to replace is not known.
    unnamed = restart_mode(plan("hang", job=warm_job), fault("hang"), warm_job)
    assert not unnamed.warm and unnamed.basis["restart"] == {
        "mode": "cold", "why": "hang: no rank is named as the one at fault, so none can be replaced alone"}
    # A straggler's kind is not trusted warm: its host proven bad restarts cold.
    cold_kind = restart_mode(plan("straggler", suspects=("n1",), verdict=Verdict("fail", ("n1",)), job=warm_job),
                             fault("straggler"), warm_job)
    assert not cold_kind.warm and cold_kind.basis["restart"]["why"] == \
        "straggler: the ranks' processes cannot be trusted after it"


def test_a_lost_host_restarts_warm_on_the_spare_in_its_place_while_its_replicas_survive() -> None:
    ring = {"n1": "n2", "n2": "n3", "n3": "n1"}
    job = facts(nodes=("n1", "n2", "n3"), spares=("n4",), dp=3, warm_unavailable=None, replica_hosts=ring)
    lost = restart_mode(plan("host_lost", suspects=("n2",), job=job), fault("host_lost"), job)
    assert lost.nodes == ("n1", "n4", "n3") and lost.exclude == ("n2",) and lost.warm
    assert lost.basis["restart"]["why"].endswith("n4 takes the place of n2, its ranks' state from their replicas on n3")
    gpu = restart_mode(plan("gpu_fault", suspects=("n3",), job=job), fault("gpu_fault"), job)
    assert gpu.nodes == ("n1", "n2", "n4") and gpu.warm
    # Two hosts next to each other in the ring: n2's replicas were on n3, lost too.
    two = facts(nodes=("n1", "n2", "n3"), spares=("n4", "n5"), dp=3, warm_unavailable=None, replica_hosts=ring)
    both = restart_mode(plan("host_lost", suspects=("n2", "n3"), job=two), fault("host_lost"), two)
    assert both.nodes == ("n1", "n4", "n5") and not both.warm
    assert both.basis["restart"]["why"] == "the state of the ranks of n2 is lost with the replicas (n2's on n3)"
    # No spare: the job shrinks, a new layout that the snapshots do not fit.
    alone = facts(nodes=("n1", "n2", "n3"), spares=(), dp=3, warm_unavailable=None, replica_hosts=ring)
    smaller = restart_mode(plan("host_lost", suspects=("n2",), job=alone), fault("host_lost"), alone)
    assert smaller.dp == 2 and not smaller.warm and smaller.basis["restart"]["why"].startswith("the layout changes")


def test_a_hung_rank_the_kernel_holds_leaves_its_host_out_and_the_spare_takes_its_place_warm() -> None:
    ring = {"n1": "n2", "n2": "n1"}
    job = facts(warm_unavailable=None, replica_hosts=ring)
    p = restart_mode(choose(fault("hang"), None, ("n2",), None, None, job, Limits(), RestartBudget(), NOW,
                            {"rule": "test"}, stuck=("n2",)), fault("hang"), job, replace_ranks=(3,))
    assert p.remedy is Remedy.EXCLUDE_AND_RESTART and p.exclude == ("n2",) and p.nodes == ("n1", "n3")
    assert p.warm and p.basis["stuck_in_kernel"] == ["n2"] and "n3 takes the place of n2" in p.basis["restart"]["why"]


def test_a_warm_kind_restarts_cold_when_the_job_cannot_or_no_replica_is_elsewhere() -> None:
    cold_job = facts(warm_unavailable="the warm restart of attempt 3 has not trained yet")
    p = restart_mode(plan("crash", job=cold_job), fault("crash"), cold_job)
    assert not p.warm and p.basis["restart"]["why"] == "the warm restart of attempt 3 has not trained yet"
    warm_job = facts(warm_unavailable=None)
    excluded = restart_mode(plan("crash", verdict=Verdict("fail", bad_nodes=("n2",)), job=warm_job), fault("crash"),
                            warm_job)
    assert excluded.exclude == ("n2",) and not excluded.warm
    assert excluded.basis["restart"]["why"] == "the state of the ranks of n2 is lost with the replicas (n2's nowhere else)"
    ring = facts(warm_unavailable=None, replica_hosts={"n1": "n2", "n2": "n1"})
    kept = restart_mode(plan("crash", verdict=Verdict("fail", bad_nodes=("n2",)), job=ring), fault("crash"), ring)
    assert kept.nodes == ("n1", "n3") and kept.warm
    # What does not restart has no restart mode; the backoff keeps the mode it was decided with.
    notify = restart_mode(plan("straggler", job=warm_job), fault("straggler"), warm_job)
    assert "restart" not in notify.basis and not notify.warm
    budget = RestartBudget(max_restarts=3, window=timedelta(minutes=10), backoff=timedelta(seconds=10))
    backed_off = gate(crash_plan := restart_mode(plan("crash", job=warm_job), fault("crash"), warm_job),
                      facts(warm_unavailable=None, restarts=(NOW - timedelta(seconds=1),)), budget, NOW)
    assert backed_off.not_before is not None and backed_off.warm and crash_plan.warm


def test_a_job_of_replica_groups_replaces_the_group_of_the_host_at_fault_and_rolls_back_all_together() -> None:
    job = facts(nodes=("n1", "n2", "n3"), spares=("n4",), dp=3, valid_dp=(2, 3), replica_groups=3)
    # A lost host: the spare's group joins in its place, nothing else of the job stops.
    lost = restart_mode(plan("host_lost", suspects=("n2",), job=job), fault("host_lost"), job)
    assert lost.replica and not lost.warm and lost.nodes == ("n1", "n4", "n3")
    assert lost.basis["restart"] | {"why": ""} == {"mode": "replica", "why": "", "leaving": ["n2"],
                                                   "joining": ["n4"], "groups": "3 -> 3"}
    # A crash on a host that passed its checks: its group starts again where it was.
    crash = restart_mode(plan("crash", verdict=Verdict("pass"), job=job), fault("crash"), job)
    assert crash.replica and crash.nodes == job.nodes and crash.basis["restart"]["leaving"] == []
    # No spare: the others go on as two groups.
    alone = facts(nodes=("n1", "n2", "n3"), spares=(), dp=3, valid_dp=(2, 3), replica_groups=3)
    fewer = restart_mode(plan("gpu_fault", suspects=("n3",), job=alone), fault("gpu_fault"), alone)
    assert fewer.replica and fewer.nodes == ("n1", "n2") and fewer.basis["restart"]["groups"] == "3 -> 2"
    # A bad batch spoils every group's state alike: they all roll back together, from the disk.
    nan = restart_mode(plan("nonfinite", first_bad_step=9, job=job), fault("nonfinite"), job)
    assert nan.remedy is Remedy.ROLLBACK and not nan.replica and nan.basis["restart"]["mode"] == "cold"
    # One world: no replica mode.
    world = facts(nodes=("n1", "n2", "n3"), spares=("n4",), dp=3)
    assert not restart_mode(plan("host_lost", suspects=("n2",), job=world), fault("host_lost"), world).replica
