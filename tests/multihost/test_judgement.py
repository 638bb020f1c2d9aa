"""Judgement under Slurm, end to end: deploy/slurm/megaheal.sbatch on the bed's 4 hosts (3 training, 2 ranks each,
and a spare), one job through what the healer must tell apart before it acts:
- the spare's local disk is broken before the job starts: preflight fails it and drains it in Slurm, and it takes no
  work;
- rank 4's gathered weights flip a bit at step 3: the replica checksum names its copy `diverged` that step, and the
  update is skipped (one strike on its host, nothing restarted);
- a batch that trains to NaN at step 6: the re-runs judge it `data` and skip it, excluding nothing;
- from step 12 every forward pass of mh2's ranks flips a bit of a matmul output: the re-runs convict mh2 of silent
  data corruption, it is drained with that reason, and, with no spare left, the job comes back smaller (dp 3 -> 2)
  from a checkpoint saved before its first suspect step;
- the spare's disk mended, its screening passes again: megaheal resumes it in Slurm (scontrol ... State=RESUME) and
  the job grows back onto it (dp 2 -> 3) as a planned change, from the checkpoint its stop saved, with no sample
  skipped or trained twice.
Nothing pages: each was the healer's to mend."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from healer.ledger.goodput import compute
from testbed.bed import Bed
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob
from tests.support import wait_for

pytestmark = pytest.mark.multihost
STEPS = 36  # the grown attempt trains from about step 18 (the shrunk one from 10, for ~8 steps)
GLOBAL_BATCH = 24  # the batch script's default for the demo on 3 training hosts (dp 3, 2 and 1 all split it)
BAD_SAMPLE = 6 * GLOBAL_BATCH + 2  # in data-parallel replica 0's share of step 6
SDC_FROM = 12


def scratch(bed: Bed, job: SlurmJob, host: str) -> Path:
    """`host`'s local scratch directory for `job` (healer/launchers/slurm_agents.py), as this machine sees it."""
    return bed.host(host).tmp / f"megaheal-{job.job_id}" / host


@pytest.fixture
def job(healthy_bed, tmp_path, monkeypatch) -> Iterator[SlurmJob]:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])  # scontrol, for the hosts' states
    spare = healthy_bed.hosts[3].name
    the_job = SlurmJob.submit(healthy_bed, tmp_path, STEPS, args="--rescreen-min 0.05", extra_set=(
        # (JSON: the batch script splits MEGAHEAL_SET at spaces)
        f'inject_param_flips=[{{"rank":4,"at_step":3}}] inject_bad_sample={BAD_SAMPLE} '
        f'inject_matmul_flips=[{{"node":"{healthy_bed.hosts[1].name}","from_step":{SDC_FROM},"rate":1.0}}]'))
    # NOTE: the spare's disk broken before its agent starts (sbatch has only just queued the job): a file where its
    # scratch directory goes. The agent still starts (it is how the healer sees the host is sick).
    broken = scratch(healthy_bed, the_job, spare)
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("not a directory\n")
    yield the_job
    the_job.stop()


@pytest.mark.timeout(600)
def test_a_broken_spare_a_diverged_replica_a_bad_batch_and_a_corrupting_host_are_each_judged_and_the_job_grows_back(
        healthy_bed, job) -> None:
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    sick, spare = hosts[1], hosts[3]
    # The job comes back smaller once mh2 is convicted; then the spare's disk is mended.
    wait_for("attempt 1 training", lambda: any(r["attempt"] == 1 for r in job.records()), 300, every_s=0.5)
    assert job.attempt(1)["nodes"] == [hosts[0], hosts[2]] and job.attempt(1)["dp"] == 2
    assert "DRAIN" in job.slurm_state(spare).state, "preflight drained the broken spare"
    path = scratch(bed, job, spare)
    path.unlink()
    path.mkdir()
    text = job.finish(420)

    events = job.journal()
    screened = [e for e in events if e["event"] == "screened"]
    first: dict[str, dict] = {}
    for e in screened:  # each host's first screening: before attempt 0 (the spare's later ones while it waited)
        first.setdefault(e["node"], e)
    assert {n: e["status"] for n, e in first.items()} == {n: "fail" if n == spare else "pass" for n in hosts}, first
    assert "is not a directory" in first[spare]["summary"] and first[spare]["drain"]["drained"] is True, first[spare]
    incidents = sorted(job.incidents(), key=lambda i: i["id"])
    by_verdict = {i["evidence"].get("verdict"): i for i in incidents if i["kind"] == "rerun"}
    # The diverged replica: named in the step it happened, its update skipped, nothing restarted for it.
    diverged = by_verdict["diverged"]
    assert diverged["evidence"]["step"] == 3 and diverged["evidence"]["ranks"] == [4], diverged["evidence"]
    assert diverged["suspect_nodes"] == [hosts[2]] and diverged["action"] == "notify", diverged
    # The bad batch: judged data, its samples passed over, no host left out for it.
    data = by_verdict["data"]
    assert data["evidence"]["step"] == 6 and data["action"] == "notify", data
    assert data["evidence"]["samples"] == [[6 * GLOBAL_BATCH, 6 * GLOBAL_BATCH + 8]], data["evidence"]
    # The corrupting host: convicted by the re-runs, drained with that reason, the job smaller without it.
    [sdc] = [i for i in incidents if i["kind"] == "sdc"]
    [verdict] = sdc["evidence"]["verdicts"]
    assert sdc["suspect_nodes"] == [sick] and verdict["verdict"] == "persistent", sdc["evidence"]
    assert verdict["step"] >= SDC_FROM and verdict["nodes"] == [sick], verdict
    assert sdc["action"] == "exclude-node-and-restart" and sdc["state"] == "resolved", sdc
    assert sdc["plan"]["exclude"] == [sick] and sdc["plan"]["dp"] == 2, sdc["plan"]
    assert "no spare left" in sdc["plan"]["decision_basis"]["reason"], sdc["plan"]["decision_basis"]
    # The checkpoints saved since its first suspect step are tainted: the restart resumed from one before it.
    assert sdc["resume_step"] is not None and sdc["resume_step"] <= verdict["step"], sdc
    assert all(s > verdict["step"] for s in sdc["plan"]["decision_basis"].get("tainted_checkpoints", [])), sdc["plan"]
    state = job.slurm_state(sick)
    assert "DRAIN" in state.state and f"megaheal: incident {sdc['id']}: sdc" in state.reason, state
    # Nothing paged, and nothing else opened but notices.
    assert [i["kind"] for i in incidents if i["action"] not in ("notify", None)] == ["sdc"], incidents
    assert all(i["state"] != "escalated" for i in incidents), incidents
    # The spare passed again: resumed in Slurm (megaheal had drained it) and the job grew back onto it.
    [returned] = [e for e in events if e["event"] == "returned"]
    assert returned["node"] == spare and returned["scheduler"]["resumed"] is True, returned
    assert "DRAIN" not in job.slurm_state(spare).state
    [grown] = [e for e in events if e["event"] == "grown"]
    assert (sorted(grown["nodes"]), grown["dp"], grown["from_dp"]) == (sorted([hosts[0], hosts[2], spare]), 3, 2)
    assert job.attempts() == [0, 1, 2] and sorted(job.attempt(2)["nodes"]) == sorted(grown["nodes"])
    assert spare not in job.attempt(0)["nodes"] and sick not in job.attempt(2)["nodes"]
    # Rank 0's steps: the grown attempt goes on from the step after the shrunk one's last, no sample repeated or
    # skipped; every loss finite.
    mine = [r for r in job.records() if r["rank"] == 0 and "loss" in r]
    shrunk = [r["step"] for r in mine if r["attempt"] == 1]
    again = [r["step"] for r in mine if r["attempt"] == 2]
    assert max(shrunk) + 1 == grown["resume_step"] == min(again), (shrunk, again, grown)
    last = {r["step"]: r for r in mine}
    assert sorted(last) == list(range(STEPS)), sorted(last)
    assert [last[s]["sample_index"] for s in range(STEPS)] == [GLOBAL_BATCH * (s + 1) for s in range(STEPS)]
    assert all(math.isfinite(r["loss"]) for r in last.values())
    # Each verdict's evidence is said on its incident's page (here in the run's one-file report), and the time the
    # job trained smaller is counted as degraded in the goodput ledger.
    page = (job.run_dir / "report.html").read_text()
    assert "What the re-runs showed" in page and "the host is faulty." in page, page[-3000:]
    assert "the batch is bad, not a host." in page and "Samples 144-151 were passed over." in page
    ledger = compute(job.run_dir, incidents)
    assert 0 < ledger.degraded_s < ledger.seconds["productive"], ledger
    assert "outcome: finished" in text
    job.assert_nothing_left()
