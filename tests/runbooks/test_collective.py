"""The collective bandwidth check as real 4-rank torch.distributed jobs on gloo."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runbooks.busbw import COLLECTIVES
from runbooks.registry import CheckContext
from runbooks.runner import run_runbook
from runbooks.spec import load_runbook
from tests.conftest import REPO, job_env
from wire.verdict import Status

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

MEGAHEAL = [sys.executable, "-c", "from megaheal.cli import app; app()"]


def _diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MEGAHEAL, "diagnose", *args], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=140
    )


def test_collectives_quick_prints_busbw_per_collective_and_size_and_exits_0(tmp_path) -> None:
    proc = _diagnose("collectives-quick", "--json", "--baselines", str(tmp_path / "none.json"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["verdict"] == "pass"
    busbw = {
        (m["labels"]["collective"], int(m["labels"]["size"])): m["value"]
        for m in out["steps"][0]["measurements"]
        if m["name"] == "busbw"
    }
    assert set(busbw) == {(c, s) for c in COLLECTIVES for s in (65536, 1048576, 4194304)}
    assert all(v > 0 for v in busbw.values())
    assert "no baselines stored" in out["summary"] or "no baselines stored" in out["steps"][0]["summary"]


def test_calibrated_baselines_are_compared_and_a_drop_below_0_9_fails(tmp_path) -> None:
    baselines = tmp_path / "baselines.json"
    small = ["--set", "collectives.collectives=[all_reduce, sendrecv]", "--set", "collectives.sizes=[1048576]"]
    proc = _diagnose("--calibrate", "collectives-quick", "--repeats", "1", "--baselines", str(baselines), *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored = json.loads(baselines.read_text())["baselines"]
    key = "collective/gloo/4/all_reduce/1048576/busbw"
    assert set(stored) == {key, "collective/gloo/4/sendrecv/1048576/busbw"}
    # Pretend the healthy machine was 1000x faster: today's all_reduce is far below 0.9 x baseline.
    stored[key]["value"] *= 1000
    # And take a tenth of sendrecv's baseline, so run-to-run noise cannot push it under 0.9 x: one repeat of a 1 MiB
    # sendrecv on loopback once measured 0.304 GB/s against a calibration of 1.146 minutes before (half was not enough).
    stored["collective/gloo/4/sendrecv/1048576/busbw"]["value"] *= 0.1
    baselines.write_text(json.dumps({"version": 1, "baselines": stored}))
    proc = _diagnose("collectives-quick", "--json", "--baselines", str(baselines), *small)
    out = json.loads(proc.stdout)
    assert proc.returncode == 1 and out["verdict"] == "fail", out["summary"]
    assert "all_reduce 1MiB busbw" in out["summary"] and "0.9 x baseline" in out["summary"]
    assert "sendrecv" not in out["summary"], "the collective at its baseline is not blamed"


def test_pairwise_names_the_node_whose_rank_sleeps_in_its_send_path(tmp_path) -> None:
    # Rank 2 (node n2) really sleeps 20 ms before each send: every pair it is part of is slow.
    runbook = load_runbook(
        "network-triage",
        [
            "pairwise.inject_send_delay=20ms",
            "pairwise.inject_rank=2",
            "pairwise.collectives=[sendrecv]",
            "pairwise.sizes=[65536]",
        ],
    )
    runbook.steps = [s for s in runbook.steps if s.name == "pairwise"]
    result = run_runbook(runbook, CheckContext(nodes=("n0", "n1", "n2", "n3"), baselines_path=str(tmp_path / "b.json")))
    assert result.verdict is Status.FAIL, result.summary
    nodes = [s.name for s in result.suspects if s.kind == "node"]
    assert nodes == ["n2"], result.suspects
    pairs = {m.labels["pair"]: m.value for m in result.measurements if m.name == "pair_busbw"}
    assert len(pairs) == 6
    slow = {p for p, v in pairs.items() if "n2" in p}
    assert max(pairs[p] for p in slow) < min(v for p, v in pairs.items() if p not in slow)
    assert "node n2" in result.summary


def test_a_slow_operation_is_timed_fewer_times_to_fit_the_budget_and_a_fast_one_as_often_as_asked(tmp_path) -> None:
    # Rank 2 really sleeps 300 ms before each send: a send/recv takes that long at least, and 10 of them (and 2
    # warm-ups) would take 3.6 s, past the 1 s budget: as many as fit, and the warm-ups no more.
    runbook = load_runbook("network-triage", ["pairwise.inject_send_delay=300ms", "pairwise.inject_rank=2",
                                              "pairwise.collectives=[sendrecv]", "pairwise.sizes=[1024]",
                                              "pairwise.iters=10", "pairwise.budget=1s", "pairwise.pairwise=false"])
    runbook.steps = [s for s in runbook.steps if s.name == "pairwise"]
    result = run_runbook(runbook, CheckContext(nodes=("n0", "n1", "n2", "n3"), baselines_path=str(tmp_path / "b.json")))
    [iters] = [m.value for m in result.measurements if m.name == "iterations"]
    assert 1 <= iters <= 3, result.measurements
    [seconds] = [m.value for m in result.measurements if m.name == "time"]
    assert seconds >= 0.3, "each timed operation waited for the slowed send"
    fast = load_runbook("collectives-quick", ["collectives.collectives=[all_reduce]", "collectives.sizes=[1024]",
                                              "collectives.iters=4"])
    result = run_runbook(fast, CheckContext(nodes=("n0", "n1", "n2", "n3"), baselines_path=str(tmp_path / "b.json")))
    assert [m.value for m in result.measurements if m.name == "iterations"] == [4], result.summary

