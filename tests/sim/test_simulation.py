"""The reliability simulator (sim/): seeded and reproducible, its ledger conserved, each kind of failure healed the
way the real policy decides, its analytic baseline equal to the closed forms, its config checked, its command's
files written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ground.typedconfig import ConfigError
from healer.decide.rules import DEFAULT_RULES, load_rule_set
from sim.analytic import exact_ettr, kokolis_ettr
from sim.config import load_config
from sim.engine import Simulation
from sim.fleet import Failure, Where
from tests.conftest import REPO

pytestmark = pytest.mark.unit

LLAMA = REPO / "configs" / "sim" / "llama3-16k.yaml"
RULES = load_rule_set([DEFAULT_RULES])
QUIET = "failures.scale=1e-9"
"""The drawn failures made negligible: only the failure a test schedules happens."""
FIXED = "tuning.enabled=false"
"""The intervals as configured (snapshots every 2 min, saves every 10), not tuned."""


def one_failure(category: str, *overrides: str, host: int = 5, at_s: float = 3600.0) -> Simulation:
    cfg = load_config(LLAMA, ["days=1", QUIET, FIXED, "failures.planned=0", *overrides])
    sim = Simulation(cfg, RULES)
    cat = next(c for c in cfg.failures.categories if c.name == category)
    sim.schedule(Failure(at_s, host, cat))
    return sim


def test_a_run_is_the_same_for_its_seed_and_another_for_another_seed() -> None:
    cfg = load_config(LLAMA, ["days=10"])
    first, again, other = (Simulation(cfg, RULES, seed=s).run().to_payload() for s in (1, 1, 2))
    for p in (first, again, other):
        p.pop("sim_seconds")
    assert first == again
    assert first != other


def test_the_ledger_adds_up_to_the_jobs_gpu_time_and_every_loss_has_a_cause() -> None:
    cfg = load_config(LLAMA, ["days=20", "failures.scale=2"])
    r = Simulation(cfg, RULES).run()
    hours = r.ledger.gpu_hours()
    assert sum(hours.values()) == pytest.approx(20 * 24 * cfg.job.gpus, rel=1e-6)
    assert hours["lost_work"] > 0 and hours["detection"] > 0 and hours["restart"] > 0
    by_cause = r.ledger.causes_gpu_hours()
    assert set(by_cause) <= {c.name for c in cfg.failures.categories} | {"planned"}
    lost = sum(c.get("lost_work", 0.0) for c in by_cause.values())
    assert lost == pytest.approx(hours["lost_work"], abs=1.0)


def test_a_gpu_off_the_bus_leaves_its_host_for_repair_and_a_spare_takes_its_place_warm_from_the_replicas() -> None:
    sim = one_failure("faulty-gpu")
    r = sim.run()
    assert dict(r.incidents) == {"gpu_fault": 1} and dict(r.remedies) == {"exclude-node-and-restart": 1}
    # The host's ranks' snapshots live on in their replicas on the next host: the spare takes them, warm.
    assert dict(r.restarts) == {"warm": 1} and r.spares_taken == 1
    assert sim.fleet.where[5] == Where.REPAIR and 5 not in sim.hosts and len(sim.hosts) == 2048
    assert r.ledger.gpu_hours()["diagnosis"] == 0, "a GPU fault's host is at fault by definition: no runbook"
    # Back to the newest snapshot (every 2 min at most), not the newest save (every 10 min).
    assert r.ledger.gpu_hours()["lost_work"] <= 120 * 16384 / 3600
    cold = one_failure("faulty-gpu", "restart=cold").run()
    assert dict(cold.restarts) == {"cold": 1}


def test_a_software_crash_restarts_warm_after_node_health_live_and_cold_when_the_job_runs_cold() -> None:
    warm = one_failure("software-bug")
    r = warm.run()
    assert dict(r.remedies) == {"restart": 1} and dict(r.restarts) == {"warm": 1} and r.spares_taken == 0
    assert 5 in warm.hosts
    cold = one_failure("software-bug", "restart=cold").run()
    assert dict(cold.restarts) == {"cold": 1}
    # The cold restart stopped the job for node-health and started new processes from a durable checkpoint.
    assert cold.ledger.gpu_hours()["diagnosis"] > r.ledger.gpu_hours()["diagnosis"]
    assert cold.ledger.gpu_hours()["restart"] > r.ledger.gpu_hours()["restart"]


def test_a_crash_whose_host_fails_node_health_takes_a_spare() -> None:
    sim = one_failure("ssd", "restart=cold",
                      "failures.categories=[{name: ssd, count: 3, sees: crash, found: 1.0, repair: 1d}]")
    r = sim.run()
    assert dict(r.incidents) == {"crash": 1} and dict(r.remedies) == {"exclude-node-and-restart": 1}
    assert sim.fleet.where[5] == Where.REPAIR and r.spares_taken == 1


def test_a_hang_restarts_warm_replacing_the_ranks_it_names_and_a_lost_host_is_replaced() -> None:
    hang = one_failure("nccl-watchdog-timeout").run()
    assert dict(hang.incidents) == {"hang": 1} and dict(hang.restarts) == {"warm": 1}
    lost = one_failure("host-maintenance")
    r = lost.run()
    assert dict(r.incidents) == {"host_lost": 1} and dict(r.remedies) == {"exclude-node-and-restart": 1}
    assert 5 not in lost.hosts and r.repairs == 1 and r.spares_taken == 1
    assert lost.fleet.where[5] == Where.SPARE, "repaired within the day (4 h), it is a spare again"


def test_a_nan_rolls_back_warm_to_a_save_before_it() -> None:
    r = one_failure("silent-data-corruption",
                    "failures.categories=[{name: silent-data-corruption, count: 6, sees: nonfinite, repair: 2d}]").run()
    assert dict(r.incidents)["nonfinite"] >= 1 and dict(r.remedies)["rollback-and-skip"] >= 1
    assert r.restarts["warm"] >= 1


def sdc(found: float, *overrides: str) -> Simulation:
    return one_failure("silent-data-corruption", *overrides,
                       f"failures.categories=[{{name: silent-data-corruption, count: 6, sees: sdc, found: {found}, "
                       "repair: 2d}]")


def test_a_corrupting_host_is_convicted_by_the_reruns_verdict_and_left_out_without_a_rollback() -> None:
    # A persistent verdict convicts at once: the host leaves, a spare takes its ranks' replicas, nothing rolls back.
    sim = sdc(1.0)
    r = sim.run()
    assert dict(r.incidents) == {"sdc": 1} and dict(r.remedies) == {"exclude-node-and-restart": 1}
    assert dict(r.restarts) == {"warm": 1} and sim.fleet.where[5] == Where.REPAIR and not r.pages
    # Transient verdicts mend the step in place (the re-run's result is used) until the rule's second strike
    # convicts the host: it fails again within the day (recur_after 1 h), then leaves.
    sim = sdc(0.0)
    r = sim.run()
    assert r.incidents["sdc_mended"] == 1 and r.incidents["sdc"] == 1, r.incidents
    assert dict(r.remedies) == {"exclude-node-and-restart": 1} and sim.fleet.where[5] == Where.REPAIR
    mended = sdc(0.0, "days=0.05").run()  # 72 min: only the first strike, mended (the re-run's 12 s) in the run
    assert dict(mended.incidents) == {"sdc_mended": 1} and not mended.restarts and not mended.remedies
    # Where the trainer runs no re-run (replica groups), the same fault is a NaN: every group rolls back.
    assert "nonfinite" in sdc(1.0, "restart=replica").run().incidents


def test_with_no_spare_left_a_lost_host_takes_its_replica_out_and_the_rest_of_it_waits_as_spares() -> None:
    # 16 hosts a replica: the job comes back one replica smaller, without a page; 15 healthy hosts are spares.
    sim = one_failure("host-maintenance", "job.spares=0")
    r = sim.run()
    assert dict(r.remedies) == {"exclude-node-and-restart": 1} and not r.pages
    assert len(sim.hosts) == 2048 - 16 and sim.dp == 127
    assert r.ledger.gpu_hours()["degraded"] > 0 and r.ledger.gpu_hours()["person"] == 0


def test_a_job_that_cannot_run_smaller_pages_a_person_who_restarts_it() -> None:
    r = one_failure("host-maintenance", "job.spares=0", "job.nodes=16", "job.hosts_per_replica=16").run()
    assert len(r.pages) == 1 and r.pages[0]["paged"] and "cannot run smaller" in r.pages[0]["reason"]
    assert r.ledger.gpu_hours()["person"] > 0


def test_the_analytic_baseline_matches_the_exact_model_and_kokolis_first_order_where_it_holds() -> None:
    for extra in ([], ["checkpoint.interval=30m"], ["failures.scale=2"]):
        cfg = load_config(LLAMA, ["policy=false", "days=270", "checkpoint.persist=0s", *extra])
        sims = [Simulation(cfg, RULES, seed=s) for s in range(3)]
        ettr = sum(s.run().ettr for s in sims) / len(sims)
        lam = cfg.failures.rate_per_node * cfg.job.nodes
        dt, w, u0 = cfg.checkpoint.interval.total_seconds(), cfg.checkpoint.stall.total_seconds(), sims[0].u0
        assert ettr == pytest.approx(exact_ettr(lam, u0, dt, w), rel=0.005), extra
        if lam * (u0 + dt / 2) < 0.1:  # first order: its error grows as the square of this
            assert ettr == pytest.approx(kokolis_ettr(lam, u0, dt, w), rel=0.01), extra


def test_a_stage_time_without_a_source_or_an_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    text = LLAMA.read_text()
    unsourced = tmp_path / "unsourced.yaml"
    unsourced.write_text(text.replace('  stages.cold_start: "', '  # stages.cold_start: "'))
    with pytest.raises(ConfigError, match="missing: stages.cold_start"):
        load_config(unsourced)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'spare'"):
        load_config(LLAMA, ["job.spare=3"])
    with pytest.raises(ConfigError, match="sees must be one of"):
        load_config(LLAMA, ["failures.categories=[{name: x, count: 1, sees: meltdown}]"])


@pytest.mark.timeout(300)
def test_the_command_writes_its_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    argv = [sys.executable, "-m", "megaheal", "simulate", "--config", str(LLAMA), "--sweeps", "--out", str(out),
            "--set", "days=5", "--set", "sweeps.seeds=1", "--set", "sweeps.checkpoint_interval=[5m, 20m]",
            "--set", "sweeps.failure_scale=[1, 2]", "--set", "sweeps.gpus=[1024, 4096]",
            "--set", "sweeps.cold_start=[1m, 5m]"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm" in done.stdout and "analytic check" in done.stdout
    result = json.loads((out / "simulation.json").read_text())
    assert set(result["headline"]) == {"warm", "cold", "replica"} and len(result["sweeps"]["gpus"]) == 2
    assert result["sources"]["stages.cold_start"]
    assert len(result["plots"]) == 5
    for name in result["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_replica_mode_a_lost_host_costs_the_job_a_step_and_its_group_while_a_spare_joins() -> None:
    sim = one_failure("host-maintenance", "restart=replica")
    r = sim.run()
    assert dict(r.incidents) == {"host_lost": 1} and dict(r.restarts) == {"replica": 1} and r.spares_taken == 1
    assert 5 not in sim.hosts and not sim.out, "the spare's group joined"
    hours = r.ledger.gpu_hours()
    cold = one_failure("host-maintenance", "restart=cold").run().ledger.gpu_hours()
    # Every GPU waits out the collective with the lost group (6 s) and loses the step in flight; the group's own
    # 128 GPUs wait for detection, the decision and the spare's group to join (degraded); nothing is restarted.
    gpus, group = 16384, 16 * 8
    assert hours["detection"] == pytest.approx(6 * gpus / 3600, abs=0.01)
    assert hours["lost_work"] == pytest.approx(6 * gpus / 3600, abs=0.01)
    assert hours["diagnosis"] == 0 and hours["restart"] == pytest.approx(70 * gpus / 3600, abs=0.01), "the first start"
    # (from the end of the 6 s stall to the join: detection 15.75 s, the regroup, the join 61 s)
    assert hours["degraded"] == pytest.approx((15.75 - 6 + 61) * group / 3600, rel=0.01), hours["degraded"]
    def cost(h: dict[str, float]) -> float:  # what the failure cost, the first start set aside
        return sum(h[k] for k in ("lost_work", "detection", "diagnosis", "degraded", "restart")) - 70 * gpus / 3600

    assert cost(hours) < cost(cold) / 10, (hours, cold)
    # With no spare, the others go on a group smaller (its healthy hosts wait as spares), as a cold job would.
    alone = one_failure("host-maintenance", "restart=replica", "job.spares=0")
    alone.run()
    assert len(alone.hosts) == 2048 - 16 and alone.dp == 127 and not alone.out


def test_in_replica_mode_a_nan_still_rolls_every_group_back_together() -> None:
    r = one_failure("silent-data-corruption", "restart=replica").run()
    assert dict(r.remedies)["rollback-and-skip"] >= 1 and r.restarts["cold"] >= 1 and not r.restarts["replica"]


def test_a_planned_interruption_is_one_warm_restart_where_the_job_runs_warm_and_a_maintenance_where_it_runs_cold(
) -> None:
    runs = {mode: Simulation(load_config(LLAMA, ["days=20", QUIET, "failures.planned=47", f"restart={mode}"]),
                             RULES).run() for mode in ("warm", "cold")}
    warm, cold = runs["warm"], runs["cold"]
    gpus = 16384
    assert warm.restarts["planned"] > 5 and cold.restarts["planned"] > 5
    # 20 s each against the 30 min maintenance, the stop (30 s), the cold start (60 s) and the load (10 s)
    assert warm.ledger.gpu_hours()["planned"] == pytest.approx(warm.restarts["planned"] * 20 * gpus / 3600, rel=1e-6)
    assert cold.ledger.gpu_hours()["planned"] == pytest.approx(
        cold.restarts["planned"] * (30 * 60 + 30 + 60 + 10) * gpus / 3600, rel=1e-6)
    assert warm.ledger.gpu_hours()["lost_work"] == cold.ledger.gpu_hours()["lost_work"] == 0


def test_snapshots_stall_the_job_each_time_and_bound_what_a_warm_restart_loses() -> None:
    quiet = Simulation(load_config(LLAMA, ["days=1", QUIET, FIXED, "failures.planned=0"]), RULES).run()
    # A day less the first start (70 s) is 141 cycles of 5 snapshots every 2 min (4 x 0.7 s, then a save's 6.3 s:
    # 609.1 s), then 3 snapshots more in the last 447 s.
    stall_s = 141 * (4 * 0.7 + 6.3) + 3 * 0.7
    assert quiet.ledger.gpu_hours()["checkpoint_stall"] == pytest.approx(stall_s * 16384 / 3600, rel=1e-6)
    for at_s in (3600 + 30, 3600 + 110):  # just after a snapshot, just before the next one
        r = one_failure("faulty-gpu", at_s=at_s).run()
        assert 0 < r.ledger.gpu_hours()["lost_work"] <= 121 * 16384 / 3600


def test_the_tuned_intervals_move_toward_the_optimum_for_the_failures_seen_and_say_why() -> None:
    cfg = load_config(LLAMA, ["days=20", "tuning.enabled=true"])
    r = Simulation(cfg, RULES).run()
    changes = r.interval_changes
    assert {c["what"] for c in changes} == {"snapshot", "save"}
    assert all(0.5 <= c["to_s"] / c["from_s"] <= 2 for c in changes), "at most twice or half per move"
    assert all("failure(s) in the window" in c["why"] for c in changes)
    # Few restarts resume from a save (only cold ones do): its interval grows past the configured 10 min; the
    # snapshots' stays near Young's sqrt(2 x 0.7 s x 3.1 h) = 2.1 min.
    last = {c["what"]: c["to_s"] for c in changes}
    assert last["save"] > 1200 and 60 < last["snapshot"] < 240, last
    fixed = Simulation(load_config(LLAMA, ["days=20", FIXED]), RULES).run()
    assert r.ettr > fixed.ettr
    assert not fixed.interval_changes


def test_the_failure_rate_changes_when_the_config_says() -> None:
    flat = Simulation(load_config(LLAMA, ["days=54"]), RULES).run()
    doubled = Simulation(load_config(LLAMA, ["days=54", "failures.change_at=27d", "failures.change_scale=3"]),
                         RULES).run()
    # Half the run at the record's rate, half at three times it: twice the failures in all.
    assert doubled.failures == pytest.approx(2 * flat.failures, rel=0.15), (doubled.failures, flat.failures)
