"""The attempts' journal (wire/journal.py) and the run directory's paths (wire/run_paths.py): every event written is
read back as it was, whatever a line's keys became in JSON; a torn line, a newer writer's kind and an event that
does not fit its kind are skipped (the last with a warning naming file and line); a run of the release before is
read from its `supervisor/` folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from wire import journal
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit

EVENTS: list[journal.Event] = [
    journal.Start(at=10.0, attempt=0, job="demo", nodes=["n1", "n2"], dp=2, resume="auto",
                  agent_urls={"n1": "http://127.0.0.1:1"}, warm=journal.WarmNote(formation=True, formed_in=0)),
    journal.Launched(at=10.5, attempt=0, agents={"n1": 4242, "n2": None}, agents_started={"n1": 9.9, "n2": None}),
    journal.Ranks(at=11.0, attempt=0, ranks={"4250": 0, "4251": 1}, started={"4250": 10.9}, nodes={"0": "n1"}),
    journal.WarmReady(at=12.0, attempt=0, resumed={"n1.r0.a0": "memory step 4 in 0.310 s"}),
    journal.End(at=20.0, attempt=0, stopped=False, superseded=True),
    journal.Start(at=20.0, attempt=1, job="demo", nodes=["n1", "n2"], dp=2, resume="memory",
                  warm=journal.WarmNote(replaced={3: "n2.s1.a0"}, why="crash", formed_in=0)),
    journal.Adopted(at=21.0, attempt=1, node="n2"),
    journal.LeftoverStopped(at=22.0, attempt=0, node="n1"),
    journal.AgentRestarted(at=23.0, node="n2", url="http://127.0.0.1:2", adopted=1),
    journal.End(at=30.0, attempt=1, exit_codes={"n1": 0, "n2": 0}, stopped=True, lost=["n2"], killed=[7]),
]


def test_every_event_comes_back_as_it_was_written(tmp_path: Path) -> None:
    path = RunPaths(tmp_path).journal
    for event in EVENTS:
        journal.append(path, event)
    assert journal.read(path) == EVENTS
    past = journal.Journal.of(path)
    assert past.job() == "demo" and past.last_attempt() == 1 and past.unfinished() is None
    assert [s.attempt for s in past.starts] == [0, 1] and past.window(0) == (10.0, 20.0) and past.window(1) == (20.0, None)
    last = past.last_start()
    assert last is not None and last.warm is not None and last.warm.replaced == {3: "n2.s1.a0"}


def test_a_torn_line_a_newer_kind_and_a_misfit_are_skipped_and_the_misfit_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "attempts.jsonl"
    path.write_text("\n".join([
        json.dumps({"event": "start", "attempt": 3, "at": 1.0, "nodes": ["n1"]}),
        json.dumps({"event": "checkpointed", "attempt": 3, "at": 2.0}),  # a kind of a newer release
        json.dumps({"event": "end", "attempt": "three", "at": 3.0}),  # does not fit
        '{"event": "end", "attempt": 3, "a',  # torn: its writer was killed mid-line
    ]))
    with caplog.at_level(logging.WARNING, logger="wire.journal"):
        events = journal.read(path)
    assert events == [journal.Start(at=1.0, attempt=3, nodes=["n1"])]
    assert journal.Journal(events).unfinished() == 3
    assert any(f"{path}:3: a end event that does not fit its kind" in r.getMessage() for r in caplog.records)
    assert journal.read(tmp_path / "none.jsonl") == []


def test_a_run_of_the_release_before_is_read_from_supervisor_and_a_new_one_written_to_launcher(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "supervisor").mkdir(parents=True)
    journal.append(old / "supervisor" / "attempts.jsonl", EVENTS[0])
    assert RunPaths(old).journal == old / "supervisor" / "attempts.jsonl"
    assert journal.Journal.of(RunPaths(old).journal).job() == "demo"
    journal.append(RunPaths(new).journal, EVENTS[0])
    assert (new / "launcher" / "attempts.jsonl").is_file() and not (new / "supervisor").exists()
    assert RunPaths(new).token == new / "launcher" / "token" and RunPaths(new).rank_records(3) == new / "ranks" / "3.jsonl"
