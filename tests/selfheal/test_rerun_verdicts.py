"""The `sdc` and `rerun` detectors over the trainer's re-run verdicts (healer/detect/sdc.py), fed through the real
heartbeat ingest (a `rerun` event in rank 0's heartbeat), and the sentences an incident page says of them."""

from __future__ import annotations

from typing import Any

import pytest

from healer.detect.sdc import RerunNotice, Sdc
from healer.observe.heartbeats import HeartbeatTable
from healer.pages.reruns import rerun_sentences
from tests.healer.helpers import ManualClock
from tests.selfheal.streams import JobStream
from wire.rerun import RerunVerdict, event_fields

pytestmark = pytest.mark.unit


def stream() -> JobStream:
    clock = ManualClock()
    return JobStream(table=HeartbeatTable(clock=clock), clock=clock, nodes={"n1": [0, 1], "n2": [2, 3]})


def tell(s: JobStream, **verdict: Any) -> None:
    """Rank 0's next heartbeat carries this verdict (the trainer's `rerun` event)."""
    fields = event_fields(RerunVerdict(**{"what": "nan", "skipped": True, **verdict}))
    s.events[0] = {"name": "rerun", "time": s.clock.now, "fields": fields}
    s.advance()


def test_a_persistent_verdict_convicts_the_host_of_the_ranks_it_blames_at_once() -> None:
    s, sdc, notice = stream(), Sdc(Sdc.Config()), RerunNotice(RerunNotice.Config())
    s.advance()
    assert not sdc.evaluate(s.table, s.clock.now).firing
    tell(s, step=5, verdict="persistent", ranks=[2, 3], flagged=[0, 1, 2, 3], reproduced=True)
    (f,) = sdc.evaluate(s.table, s.clock.now).firing
    assert f.node == "n2" and f.key == "job/n2" and f.evidence["suspect_nodes"] == ["n2"], f
    assert f.evidence["suspect_ranks"] == [2, 3] and f.evidence["verdicts"][0]["nodes"] == ["n2"]
    assert "silent data corruption on n2" in f.summary and "other results for the same work" in f.summary
    assert not notice.evaluate(s.table, s.clock.now).firing  # a conviction is not also a notice
    s.advance()
    assert sdc.evaluate(s.table, s.clock.now).firing  # it stands until the host is left out


def test_a_conviction_stands_through_a_restart_that_keeps_the_host_and_ends_once_one_leaves_it_out() -> None:
    s, sdc = stream(), Sdc(Sdc.Config())
    s.table.processes.started("job", 0, ("n1", "n2"))
    tell(s, step=5, verdict="persistent", ranks=[2, 3], flagged=[0, 1, 2, 3], reproduced=True, attempt=0)
    assert [f.key for f in sdc.evaluate(s.table, s.clock.now).firing] == ["job/n2"]
    # Another incident's restart (the rollback of the NaN the corruption made) keeps n2 in the job.
    s.table.processes.started("job", 1, ("n1", "n2"))
    s.advance()
    assert [f.key for f in sdc.evaluate(s.table, s.clock.now).firing] == ["job/n2"]
    s.table.processes.started("job", 2, ("n1", "n3"))
    s.advance()
    out = sdc.evaluate(s.table, s.clock.now)
    assert not out.firing and "job/n2" in out.healthy


def test_two_transient_faults_on_one_host_convict_it_and_the_first_is_a_notice() -> None:
    s, sdc, notice = stream(), Sdc(Sdc.Config(convict_after=2)), RerunNotice(RerunNotice.Config())
    tell(s, step=3, verdict="transient", ranks=[1], flagged=[0, 1, 2, 3], skipped=False)
    assert not sdc.evaluate(s.table, s.clock.now).firing
    (n,) = notice.evaluate(s.table, s.clock.now).firing
    assert n.node == "n1" and "came out clean when re-run" in n.summary and n.labels == {"verdict": "transient"}
    s.advance()
    assert n.key in notice.evaluate(s.table, s.clock.now).healthy  # shown once: nothing is left to mend
    tell(s, step=9, verdict="transient", ranks=[3], flagged=[0, 1, 2, 3], skipped=False)  # another host: not yet
    assert not sdc.evaluate(s.table, s.clock.now).firing
    tell(s, step=14, verdict="transient", ranks=[0, 1], flagged=[0, 1], skipped=False)
    (f,) = sdc.evaluate(s.table, s.clock.now).firing
    assert f.node == "n1" and f.evidence["strikes"] == 2 and [v["step"] for v in f.evidence["verdicts"]] == [3, 14]
    assert "2 faults of its ranks were caught and mended" in f.summary


def test_a_bad_batch_is_a_notice_naming_its_samples_and_convicts_no_one() -> None:
    s, sdc, notice = stream(), Sdc(Sdc.Config()), RerunNotice(RerunNotice.Config())
    tell(s, step=4, verdict="data", flagged=[3], replicas=[1], samples=[72, 80], reproduced=True, moved=True)
    assert not sdc.evaluate(s.table, s.clock.now).firing
    (n,) = notice.evaluate(s.table, s.clock.now).firing
    assert n.evidence["samples"] == [[72, 80]] and "samples 72-79" in n.summary and "judged data" in n.summary
    assert rerun_sentences(n.evidence) == [(
        "Step 4: a NaN in its first run (rank 3). Run again, it was the same; moved to other ranks, the same batches "
        "gave the same results: the batch is bad, not a host. Samples 72-79 were passed over. The re-runs took "
        "0.00 s.")]


def test_a_verdict_that_does_not_fit_is_dropped_and_a_state_verdict_is_the_rollbacks() -> None:
    s, sdc, notice = stream(), Sdc(Sdc.Config()), RerunNotice(RerunNotice.Config())
    s.events[0] = {"name": "rerun", "time": 1.0, "fields": {"step": -1, "verdict": "persistent", "what": "nan"}}
    s.advance()
    s.events[0] = {"name": "rerun", "time": 1.0, "fields": {"step": 2, "verdict": "guilty", "what": "nan"}}
    s.advance()
    tell(s, step=6, verdict="state", flagged=[0, 1, 2, 3], reproduced=True, moved=True)
    assert not sdc.evaluate(s.table, s.clock.now).firing and not notice.evaluate(s.table, s.clock.now).firing
    assert [v.step for v in s.table.columns()["job"].verdicts] == [6]


def test_the_page_says_what_each_re_run_showed() -> None:
    persistent = {"step": 12, "attempt": 0, "verdict": "persistent", "what": "gradient", "ranks": [2], "nodes": ["n2"],
                  "flagged_ranks": [0, 1, 2, 3], "reproduced": True, "moved_same": None, "skipped": True,
                  "rerun_s": 0.25}
    transient = {**persistent, "verdict": "transient", "reproduced": False, "skipped": False, "step": 7}
    assert rerun_sentences({"verdicts": [transient, persistent]}) == [
        ("Step 7 (attempt 0): non-finite gradients in its first run (ranks 0, 1, 2, 3). Run again on the same ranks "
         "and batches, it came out clean; the first run differed first at rank 2 on n2: a one-off fault: the clean "
         "run's result was used, and nothing was lost. The re-runs took 0.25 s."),
        ("Step 12 (attempt 0): non-finite gradients in its first run (ranks 0, 1, 2, 3). Run again on the same ranks "
         "and batches, it was anomalous again, and rank 2 on n2 gave other results for the same work: the host is "
         "faulty. Its update was skipped. The re-runs took 0.25 s.")]
    assert rerun_sentences({"verdict": "x"}) == [] and rerun_sentences({"verdicts": "x"}) == []


def test_a_diverged_copy_of_the_weights_is_named_as_a_notice_and_counts_as_a_strike_against_its_host() -> None:
    s, sdc, notice = stream(), Sdc(Sdc.Config(convict_after=2)), RerunNotice(RerunNotice.Config())
    tell(s, step=6, verdict="diverged", what="weights", ranks=[3], flagged=[3], replicas=[3])
    assert not sdc.evaluate(s.table, s.clock.now).firing
    (n,) = notice.evaluate(s.table, s.clock.now).firing
    assert n.node == "n2" and "on a copy of the weights that was not its peers'" in n.summary
    assert rerun_sentences(n.evidence)[0].startswith(
        "Step 6: nothing the loss showed in its first run (rank 3). The gathered copy of the weights of rank 3 on n2 "
        "was not what its data-parallel group's shards sum to: its memory or its link corrupted that copy")
    tell(s, step=11, verdict="transient", ranks=[2], flagged=[0, 1, 2, 3], skipped=False)
    (f,) = sdc.evaluate(s.table, s.clock.now).firing
    assert f.node == "n2" and f.evidence["strikes"] == 2
