"""A job of replica groups under Slurm (train/ft/): deploy/slurm/megaheal.sbatch on the bed's 4 hosts, 3 groups of one
host each (2 ranks, FSDP2 inside the group) and a spare, joined each step through the Lighthouse the healer keeps.
Three faults, and not one of them restarts the job:
- the Lighthouse is SIGKILLed: its keeper starts it again on the same address, and the groups ride out the gap;
- a host dies: the other two groups step on without it, the spare's group joins in its place by a live peer's state
  (not the disk);
- a second host dies while the spare's group is on its way in: with no spare left, the job goes on as two groups.
It ends with every step trained once, on each step's whole batch, whoever took part."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import faults
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob
from tests.support import wait_for

pytestmark = pytest.mark.multihost
STEPS, BATCH = 300, 12
GROUP = ("configs/tiny-dp4.yaml", f"global_batch={BATCH} parallel.dp=2 ft.enabled=true ft.groups=3 ft.min_groups=2 "
         "ft.timeout_s=5 checkpoint.every_steps=100")


@pytest.fixture
def job(healthy_bed, tmp_path, monkeypatch) -> Iterator[SlurmJob]:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])
    config, extra = GROUP
    the_job = SlurmJob.submit(healthy_bed, tmp_path, STEPS, extra_set=extra, config=config)
    yield the_job
    the_job.stop()


def lighthouse_pid(pids: list[int]) -> int | None:
    for pid in pids:
        try:
            if b"healer.runner.lighthouse" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def by_rank(job: SlurmJob) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in job.records():
        out.setdefault(int(r["rank"]), []).append(r)
    return out


@pytest.mark.timeout(600)
def test_a_lighthouse_and_two_hosts_killed_cost_the_groups_left_a_step_each_and_never_restart_the_job(
        healthy_bed, job) -> None:
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    job.wait_step(15, 300)
    pid = lighthouse_pid(bed.pids(bed.host(hosts[0])))
    assert pid is not None, "the healer's host keeps the Lighthouse"
    faults.procs.kill([pid])
    at_lighthouse = max(job.steps().values())
    job.wait_step(at_lighthouse + 10, 120)
    assert lighthouse_pid(bed.pids(bed.host(hosts[0]))) not in (None, pid), "started again"

    dead = hosts[1]
    at_death = max(job.steps().values())
    killed_at = time.time()
    faults.kill_host(bed, dead)
    joined = wait_for("the spare's group started", lambda: [e for e in job.journal() if e["event"] == "regrouped"],
                      240, every_s=0.5)
    second, second_at = hosts[2], time.time()
    faults.kill_host(bed, second)  # while the spare's group is on its way in
    job.finish(420)

    # One attempt all along: nothing restarted the job; the groups were regrouped twice within it.
    assert job.attempts() == [0], job.journal()
    regroups = [e for e in job.journal() if e["event"] == "regrouped"]
    assert [(e["left"], e["started"]) for e in regroups] == [([dead], [hosts[3]]), ([second], [])], regroups
    assert joined[0]["groups"] == {hosts[0]: 0, hosts[3]: 1, second: 2}, "the spare takes the lost group's index"
    lost = sorted((i for i in job.incidents() if i["kind"] == "host_lost"), key=lambda i: i["id"])
    assert [i["suspect_nodes"] for i in lost] == [[dead], [second]], [(i["kind"], i["summary"]) for i in job.incidents()]
    assert all(i["state"] == "resolved" and i["restart_mode"] == "replica" for i in lost), lost
    assert not [i for i in job.incidents() if i["kind"] in ("crash", "hang")], "the Lighthouse's death was no fault"

    ranks = by_rank(job)
    # The group that never died (hosts[0]'s: ranks 0 and 1) trained every step from its first to the last, each
    # on the next 12 samples: the steps a lost group broke were tried again, none skipped or seen twice.
    for rank in (0, 1):
        steps = [r["step"] for r in ranks[rank]]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS - 1, steps
        assert [s for s in steps if s >= at_lighthouse] == list(range(at_lighthouse, STEPS)), steps
        assert all(r["sample_index"] == (r["step"] + 1) * BATCH for r in ranks[rank])
    # Two groups from the step after the first host died to the end: the two left, then the one left and the
    # spare's (the second host died while the spare's group was on its way in).
    # NOTE: the first record after the kill may be the step the three had already averaged when the host died (its
    # record is written after the commit): a fresh make test saw step 26 so, the next ones of two.
    after = [r for r in ranks[0] if r["time"] > killed_at]
    assert after and after[0]["replicas"] in (2, 3), after[:1]
    assert {r["replicas"] for r in after[1:]} == {2}, [(r["step"], r["replicas"]) for r in after]
    # The spare's group (ranks 2 and 3 again: the lost group's index) took a live peer's state and trained on.
    spare = [r for r in ranks[2] if r["node"] == hosts[3]]
    assert spare and spare[0]["step"] > at_death and spare[-1]["step"] == STEPS - 1, spare[:2]
    log = "\n".join(p.read_text(errors="replace") for p in job.run_dir.glob(f"nodes/{hosts[3]}/agent/*/torchrun.log"))
    assert "took a live peer's state" in log
    # Every group that recorded a step recorded the same loss for it: one update, whoever took part.
    losses: dict[int, set[float]] = {}
    for rows in ranks.values():
        for r in rows:
            losses.setdefault(r["step"], set()).add(r["loss"])
    assert all(len(v) == 1 for v in losses.values()), {s: v for s, v in losses.items() if len(v) > 1}
    gaps = [b["time"] - a["time"] for a, b in zip(ranks[0], ranks[0][1:])]
    ledger = json.loads((job.run_dir / "report.json").read_text())
    print(f"\nlighthouse killed at step {at_lighthouse}; {dead} at step {at_death}, {second} "
          f"{second_at - killed_at:.1f} s later; longest gap of group 0 {max(gaps):.2f} s; "
          f"spare's group from step {spare[0]['step']}; degraded {ledger.get('degraded_s')} s of "
          f"{ledger.get('wall_s')} s")
    job.assert_nothing_left()
