"""The flight recorder's answer (exporters/flight_recorder.py) from PyTorch's dump as gloo writes it: the status of each
group is keyed by this process's own id of it, the entries name it; the answer is by name, which a group's members
share."""

from __future__ import annotations

import pytest

from exporters.flight_recorder import enabled, summary

pytestmark = pytest.mark.unit


def entry(pg_id: int, name: str, seq: int, op: str, retired: bool) -> dict[str, object]:
    return {"pg_id": pg_id, "process_group": [name, "undefined"], "collective_seq_id": seq, "p2p_seq_id": 0,
            "is_p2p": False, "profiling_name": f"gloo:{op}", "retired": retired, "time_created_ns": 1_000_000_000}


def test_the_answer_names_each_group_by_its_shared_name_with_its_last_collectives_and_what_is_in_flight() -> None:
    dump = {"pg_status": {"0": {"last_enqueued_collective": "12", "last_completed_collective": "12"},
                          "2": {"last_enqueued_collective": "66", "last_completed_collective": "66"},
                          "4": {"last_enqueued_collective": "1", "last_completed_collective": "-1"},
                          "7": {"last_enqueued_collective": "3", "last_completed_collective": "3"}},
            "entries": [entry(0, "0", 12, "all_reduce", True), entry(2, "4", 66, "all_gather", True),
                        entry(4, "9", 1, "barrier", False)]}
    groups = {"4": {"desc": "mesh_dp", "ranks": [2, 3]}, "9": {"desc": "", "ranks": [0, 1, 2, 3]}}
    out = summary([dump], groups, now_ns=3_500_000_000)["groups"]
    assert sorted(out) == ["0", "4", "9"], "the group of id 7 has no entry left to name it"
    assert (out["4"]["last_enqueued"], out["4"]["last_completed"], out["4"]["ranks"]) == (66, 66, [2, 3])
    assert out["9"]["in_flight"] == [{"op": "barrier", "seq": 1, "p2p_seq": 0, "p2p": False, "for_s": 2.5}]
    assert (out["9"]["last_enqueued"], out["9"]["last_completed"]) == (1, -1)


def test_the_recorder_is_on_when_either_buffer_setting_is_above_zero() -> None:
    assert enabled({"TORCH_FR_BUFFER_SIZE": "2000"}) and enabled({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"})
    assert not enabled({}) and not enabled({"TORCH_FR_BUFFER_SIZE": "0"}) and not enabled({"TORCH_FR_BUFFER_SIZE": "x"})
