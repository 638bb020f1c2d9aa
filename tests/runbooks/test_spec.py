"""Pure validation: nccl-tests arithmetic, runbook files, the registry, durations, pairwise attribution."""

from __future__ import annotations

from datetime import timedelta

import pytest

from ground.durations import format_duration
from ground.typedconfig import ConfigError, parse_duration
from runbooks.busbw import bus_factor, busbw, check_size
from runbooks.checks.collective_job import iterations_in_budget
from runbooks.checks.pairwise import attribute, round_robin
from runbooks.registry import CheckContext, CheckRegistry, default_registry
from runbooks.runner import run_runbook
from runbooks.spec import load_runbook, shipped_runbooks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_busbw_follows_nccl_tests_formulas(n: int) -> None:
    size, seconds = 1 << 30, 0.01
    algbw = size / seconds
    assert busbw("all_reduce", n, size, seconds) == pytest.approx(algbw * 2 * (n - 1) / n)
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):
        assert busbw(collective, n, size, seconds) == pytest.approx(algbw * (n - 1) / n)
    assert busbw("sendrecv", n, size, seconds) == pytest.approx(algbw)
    # nccl-tests' worked example: 8 ranks, all_reduce algbw 100 GB/s is busbw 175 GB/s.
    assert bus_factor("all_reduce", 8) * 100 == pytest.approx(175)


def test_busbw_refuses_what_cannot_be_measured() -> None:
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bus_factor("all_reduce", 1)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcastish", 4)
    with pytest.raises(ValueError, match="multiple of 4 x ranks"):
        check_size(1000, 3)


def test_a_malformed_runbook_is_refused_naming_the_file_and_key(tmp_path) -> None:
    good_step = "  - name: probe\n    check: host\n    timeout: 10s\n"
    cases = {
        "typo.yaml": ("name: x\nsteps:\n  - name: probe\n    check: host\n    timout: 10s\n", "'timout'"),
        "param.yaml": (f"name: x\nsteps:\n{good_step}    params: {{checkpoint_dri: /ckpt}}\n", "'checkpoint_dri'"),
        "check.yaml": (
            "name: x\nsteps:\n  - name: probe\n    check: nccl_magic\n    timeout: 10s\n",
            "unknown check 'nccl_magic'",
        ),
        "top.yaml": (f"name: x\nstages: []\nsteps:\n{good_step}", "'stages'"),
        "duration.yaml": (
            "name: x\nsteps:\n  - name: probe\n    check: host\n    timeout: soon\n",
            "timeout: expected a duration",
        ),
        "value.yaml": (f"name: x\nsteps:\n{good_step}    params: {{min_free_gib: -1}}\n", "min_free_gib must be >= 0"),
    }
    for filename, (text, expected) in cases.items():
        path = tmp_path / filename
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_runbook(str(path))
        assert str(path) in str(info.value), info.value
        assert expected in str(info.value), info.value


def test_overrides_are_typed_and_checked_like_the_file() -> None:
    rb = load_runbook("node-health", ["host.checkpoint_dir=/ckpt", "host.ntp_timeout=500ms"])
    host = rb.steps[0].config
    assert host.checkpoint_dir == "/ckpt" and host.ntp_timeout == timedelta(milliseconds=500)
    with pytest.raises(ConfigError, match="no step 'hots'"):
        load_runbook("node-health", ["hots.checkpoint_dir=/ckpt"])
    with pytest.raises(ConfigError, match="ntp_server must be HOST or HOST:PORT"):
        load_runbook("node-health", ["host.ntp_server=$(reboot)"])


def test_registering_a_check_twice_is_an_error() -> None:
    registry = default_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.register("host", "runbooks.checks.host:HostCheck")
    with pytest.raises(KeyError, match="unknown check"):
        CheckRegistry().target("host")


def test_every_shipped_runbook_loads_with_typed_params() -> None:
    names = shipped_runbooks()
    assert names == sorted(
        [
            "collectives-quick",
            "network-triage",
            "gpu-triage",
            "hang-triage",
            "straggler-triage",
            "node-health",
            "node-health-live",
            "preflight",
        ]
    )
    for name in names:
        rb = load_runbook(name)
        assert all(step.config is not None for step in rb.steps)


def test_node_names_and_node_counts_are_validated_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="not a valid host name"):
        CheckContext(nodes=("node1", "node2;rm -rf /"))
    started = []
    rb = load_runbook("network-triage")
    with pytest.raises(ConfigError, match="pairwise needs at least 2 nodes|needs 2..64 ranks"):
        run_runbook(rb, CheckContext(nodes=("only-one",)), on_event=lambda *a: started.append(a))
    assert started == [], "no step started"


def test_durations_read_back_what_they_write() -> None:
    for text, seconds in (("30s", 30), ("500ms", 0.5), ("2m", 120), ("1h", 3600), (7, 7), ("1.25s", 1.25)):
        value = parse_duration(text, "x")
        assert value == timedelta(seconds=seconds)
        assert parse_duration(format_duration(value), "x") == value


def test_round_robin_tests_every_pair_once_with_each_node_busy_once_per_round() -> None:
    for n in (2, 3, 4, 5, 8):
        rounds = round_robin(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(n) for b in range(a + 1, n)]
        for r in rounds:
            members = [i for p in r for i in p]
            assert len(members) == len(set(members))


def test_attribution_tells_a_slow_node_from_a_slow_link() -> None:
    names = ["a", "b", "c", "d"]
    fast, slow = 10e9, 1e9
    node_c = {(x, y): slow if 2 in (x, y) else fast for x in range(4) for y in range(x + 1, 4)}
    verdict = attribute(node_c, names, fraction=0.5)
    assert [(s.kind, s.name) for s in verdict.suspects] == [("node", "c")]
    link_ab = {(x, y): slow if (x, y) == (0, 1) else fast for x in range(4) for y in range(x + 1, 4)}
    assert [(s.kind, s.name) for s in attribute(link_ab, names, fraction=0.5).suspects] == [("link", "a<->b")]
    two = attribute({(0, 1): slow}, ["a", "b"], fraction=0.9, baseline=fast)
    assert [(s.kind, s.name) for s in two.suspects] == [("link", "a<->b")] and two.reference_source == "baseline"
    three = {(0, 1): fast, (0, 2): slow, (1, 2): slow}
    assert [(s.kind, s.name) for s in attribute(three, names[:3], fraction=0.5).suspects] == [("node", "c")]
    # A run on a busy machine: healthy pairs spread 2x around each other, nobody is blamed.
    noisy = {(0, 1): 0.65e9, (0, 2): 1.08e9, (0, 3): 0.50e9, (1, 2): 0.88e9, (1, 3): 0.56e9, (2, 3): 0.59e9}
    assert attribute(noisy, names, fraction=0.5).suspects == []


def test_iterations_in_budget_keeps_what_fits_and_cuts_the_rest() -> None:
    assert iterations_in_budget(0.01, 1, 10, 3.0) == (1, 10)
    assert iterations_in_budget(2.4, 1, 10, 3.0) == (0, 1)
    assert iterations_in_budget(0.5, 1, 10, 3.0) == (0, 6)
    assert iterations_in_budget(10.0, 1, 10, 3.0) == (0, 1), "one at least"
