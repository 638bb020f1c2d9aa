"""A healer that dies in the middle of an incident, and the one started after it: the real `megaheal run`
process is SIGKILLed right after it detected a crash (its job's processes live on: they are in sessions of
their own), and `megaheal run --resume` on the same run directory stops what was left, finishes the incident
and the job."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from healer.core.db import make_engine
from healer.core.goodput import compute
from healer.core.store import IncidentStore
from megaheal import procfs
from tests.conftest import REPO, job_env, kill_job
from tests.support import wait_for

pytestmark = pytest.mark.distributed
STEPS = 16


def megaheal_run(run_dir: Path, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "megaheal", "run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
            "--set", f"steps={STEPS}", "--set", "checkpoint.every_steps=4", "--metrics-port", "-1", *extra]
    return subprocess.Popen(argv, cwd=REPO, env=job_env() | {"COLUMNS": "160"}, stdin=subprocess.DEVNULL,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "incidents.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kill_after", ["detected", "restarted"])
def test_a_healer_killed_mid_incident_is_replaced_by_one_that_finishes_the_incident_and_the_job(
        tmp_path: Path, kill_after: str) -> None:
    """detected: killed before it acted (the next healer decides and restarts); restarted: killed while the
    new attempt starts up (the next healer stops that attempt, starts its own, and sees it recover)."""
    run_dir = tmp_path / "run"
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {at_step: 6, kind: kill, rank: 3}\n")
    first = megaheal_run(run_dir, "--chaos", str(chaos), log=tmp_path / "first.log")
    try:
        wait_for(f"the first healer's {kill_after} event", lambda: any(e["event"] == kill_after for e in events(run_dir)),
                 timeout_s=240, every_s=0.05)
        left = procfs.descendants(first.pid)
        first.send_signal(signal.SIGKILL)  # the healer dies; its job's agents and ranks do not
        first.wait(timeout=30)
    except BaseException:
        kill_job(first)
        raise
    (inc,) = {e["incident"]["id"]: e["incident"] for e in events(run_dir)}.values()
    assert inc["kind"] == "crash" and inc["state"] == ("open" if kill_after == "detected" else "remediating")
    if kill_after == "restarted":
        # The attempt it had just started is still starting up (imports, rendezvous): it outlived its healer.
        assert [p for p in left if procfs.alive(p) and "torch.distributed.run" in procfs.cmdline(p)]

    second = megaheal_run(run_dir, "--resume", log=tmp_path / "second.log")
    try:
        code = second.wait(timeout=300)
    except BaseException:
        kill_job(second)
        raise
    out = (tmp_path / "second.log").read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert "outcome: finished" in out
    assert not [p for p in left if procfs.alive(p)], "the old healer's processes were all stopped"

    journal = events(run_dir)
    assert {e["incident"]["id"] for e in journal} == {1}, "the same incident, finished; not a new one"
    kinds = [e["event"] for e in journal]
    assert kinds[0] == "detected" and kinds.count("taken-over") == 1 and kinds[-2:] == ["restarted", "recovered"]
    final = journal[-1]["incident"]
    assert final["state"] == "resolved" and final["taken_over_at"] is not None
    assert final["suspect_ranks"] == [3] and final["resume_step"] in (4, 8)
    attempts = [json.loads(x) for x in (run_dir / "supervisor" / "attempts.jsonl").read_text().splitlines()]
    starts = [a["attempt"] for a in attempts if a["event"] == "start"]
    if kill_after == "restarted":
        assert starts == [0, 1, 2] and [a["attempt"] for a in attempts if a.get("taken_over")] == [1]
    else:
        assert starts == [0, 1]
    # The job finished every step, from the checkpoint, with the loss still going down.
    losses: dict[int, float] = {}
    for line in (run_dir / "ranks" / "0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        losses[rec["step"]] = rec["loss"]
    assert sorted(losses) == list(range(STEPS)) and all(math.isfinite(v) for v in losses.values())
    assert losses[STEPS - 1] < losses[0]
    assert compute(run_dir).attempts == len(starts)
    # The healer's database (SQLite in the run dir by default) holds the same one incident, resolved.
    store = IncidentStore(make_engine(f"sqlite:///{run_dir / 'healer.db'}"), "test")
    (row,) = store.list_incidents()
    assert row["kind"] == "crash" and row["rule"] == "selfheal-crash" and row["state"] == "resolved"
    store.engine.dispose()
