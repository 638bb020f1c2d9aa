"""The trainer's step record (wire/step_record.py): what the trainer writes as a line comes back as it was, a NaN loss
included (Python's json writes it as NaN, which strict JSON refuses); a torn line and a record that does not fit are
skipped, the latter named by file and line."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from train.records import StepRecordWriter
from wire import step_record
from wire.run_paths import RunPaths
from wire.step_record import StepRecord, to_line

pytestmark = pytest.mark.unit


def test_a_record_written_as_the_trainer_writes_it_reads_back_nan_and_all(tmp_path: Path) -> None:
    records = [StepRecord(step=0, time=10.0, loss=5.5, step_seconds=0.2, grad_norm=0.7, phases={"optimizer": 0.01},
                          mesh={"pp": 0, "dp": 1, "tp": 0}, node="n1", pid=42, checkpoint_events=[{"event": "x"}]),
               StepRecord(step=1, time=10.3, loss=math.nan, step_seconds=0.3, grad_norm=math.inf)]
    writer = StepRecordWriter(tmp_path, 3)
    for r in records:
        writer.write(to_line(r))
    writer.close()
    path = RunPaths(tmp_path).rank_records(3)
    assert "NaN" in path.read_text() and "Infinity" in path.read_text()
    back = step_record.read(path)
    assert back[0] == records[0] and back[1].step == 1 and math.isnan(back[1].loss) and back[1].grad_norm == math.inf


def test_a_torn_line_and_a_misfit_are_skipped_and_the_misfit_named(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "0.jsonl"
    path.write_text("\n".join([json.dumps({"step": 0, "time": 1.0, "loss": 2.0, "step_seconds": 0.1}),
                               json.dumps({"step": "one", "time": 2.0, "loss": 2.0, "step_seconds": 0.1}),
                               '{"step": 2, "time": 3.0, "lo']))
    with caplog.at_level(logging.WARNING, logger="wire.step_record"):
        assert [r.step for r in step_record.read(path)] == [0]
    assert any(f"{path}:2: a step record that does not fit" in r.getMessage() for r in caplog.records)
    assert step_record.read(tmp_path / "none.jsonl") == []
