"""The phase-now beacon: what a rank writes as each phase begins, and what its node agent reads back (nested
phases, the gap between two, a write caught half-way, files that are not beacons)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wire import phase_now
from wire.phase_now import PhaseBeacon

pytestmark = pytest.mark.unit


def test_the_agent_reads_the_phase_a_rank_is_in_and_since_when_through_nesting_and_between_steps(tmp_path) -> None:
    beacon = PhaseBeacon(tmp_path, rank=3)
    path = phase_now.path_for(tmp_path, os.getpid())
    assert beacon.path == path and phase_now.read(path) is None, "nothing entered yet"
    beacon.enter("forward_backward", 7)
    outer = phase_now.read(path)
    assert outer is not None and (outer.rank, outer.step, outer.phase) == (3, 7, "forward_backward")
    with beacon.inside("dp_gather"):
        inner = phase_now.read(path)
        assert inner is not None and (inner.step, inner.phase) == (7, "dp_gather") and inner.since_ns >= outer.since_ns
    back = phase_now.read(path)
    assert back is not None and back.phase == "forward_backward" and back.since_ns == outer.since_ns
    beacon.leave()
    idle = phase_now.read(path)
    assert idle is not None and idle.phase == "" and idle.to_payload()["phase"] is None
    beacon.between(8)
    nxt = phase_now.read(path)
    assert nxt is not None and nxt.step == 8
    beacon.close()
    assert not path.exists()


def test_a_write_caught_half_way_or_a_file_that_is_no_beacon_reads_as_nothing(tmp_path: Path) -> None:
    beacon = PhaseBeacon(tmp_path, rank=0)
    beacon.enter("optimizer", 2)
    raw = bytearray(beacon.path.read_bytes())
    raw[4:8] = (7).to_bytes(4, "little")  # an odd sequence: the writer was in the middle of it (and stays there)
    torn = tmp_path / "torn.phase"
    torn.write_bytes(bytes(raw))
    assert phase_now.read(torn) is None
    (tmp_path / "short.phase").write_bytes(b"MHP1")
    (tmp_path / "other.phase").write_bytes(b"x" * 64)
    assert phase_now.read(tmp_path / "short.phase") is None and phase_now.read(tmp_path / "other.phase") is None
    assert phase_now.read(tmp_path / "missing.phase") is None
    beacon.close()


def test_no_directory_in_the_environment_means_no_beacon_and_an_unwritable_one_costs_only_the_beacon(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(phase_now.ENV, raising=False)
    assert PhaseBeacon.from_env(0) is None
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(phase_now.ENV, str(blocker / "phase"))
    assert PhaseBeacon.from_env(0) is None


def test_a_file_removed_between_the_two_reads_reads_as_nothing_and_raises_nothing(tmp_path: Path) -> None:
    # The rank ends its trainer (PhaseBeacon.close unlinks the file) right after the reader's first read: as a
    # warm worker does between two generations, and a rank as it exits. That read once killed an agent's poll thread.
    class VanishingAfterRead(type(Path())):  # type: ignore[misc]
        def read_bytes(self) -> bytes:
            data = super().read_bytes()
            self.unlink(missing_ok=True)
            return data

    beacon = PhaseBeacon(tmp_path, rank=1)
    beacon.enter("forward_backward", 3)
    path = VanishingAfterRead(beacon.path)
    assert phase_now.read(path) is None and not beacon.path.exists()
    beacon.close()
