"""The job's ETTR objective as the run records it (launcher/objective.json), the run judged against it from its
ledger's intervals (the burn rate as deploy/prometheus/rules/recording.yml makes it), and what `megaheal report`
writes of it. Over the hand-built crash run of test_goodput.py:

    0 ........ 10   startup (attempt 0)               21 ....... 26   startup (attempt 1)
    10 ..... 13.5   productive, steps 0..3            26 ....... 32   productive, steps 4..9
    13.5 ..... 14   checkpointing (step 3 saves)      32 ....... 33   other (the end)
    14 ....... 16   lost: steps 4, 5 (incident 1)
    16 ....... 19   detection, 19 .. 19.5 diagnosis, 19.5 .. 21 restart (incident 1)

productive 9.5 s of 33; 23.5 s not productive, 13.5 s of them since the first step (at 10)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from ground.typedconfig import ConfigError
from healer.ledger.goodput import intervals
from healer.ledger.metrics import GoodputCollector
from healer.ledger.objective import (
    DEFAULT,
    RECORDED,
    Objective,
    label,
    lines,
    read_objective,
    standing,
    write_objective,
)
from healer.runner.report import report
from tests.selfheal.test_goodput import CRASH, write, write_crash_run
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit

Config = GoodputCollector.Config


# ---- the file ---------------------------------------------------------------------------------------------------

def test_it_reads_back_the_objective_it_wrote_whole(tmp_path: Path) -> None:
    cfg = Config(ettr_target=0.9, ettr_window=timedelta(days=14))
    path = write_objective(tmp_path, cfg)
    assert path == tmp_path / "launcher" / "objective.json"
    assert json.loads(path.read_text()) == {"ettr_target": 0.9, "ettr_window": "1209600s"}
    assert read_objective(tmp_path) == Objective(cfg, RECORDED)
    write_objective(tmp_path, Config())  # a take-over given another replaces it, leaving no temporary file
    assert read_objective(tmp_path) == Objective(Config(), RECORDED)
    assert [p.name for p in path.parent.iterdir()] == ["objective.json"]


def test_a_run_that_recorded_none_is_judged_against_the_defaults_and_says_so(tmp_path: Path) -> None:
    found = read_objective(tmp_path)
    assert found == Objective(Config(), DEFAULT) and found.source == "default"
    assert (found.cfg.ettr_target, found.cfg.ettr_window) == (0.95, timedelta(days=7))  # GoodputCollector.Config's


def test_a_run_of_the_release_before_keeps_it_beside_its_journal(tmp_path: Path) -> None:
    (tmp_path / "supervisor").mkdir()
    write_objective(tmp_path, Config(ettr_target=0.8))
    assert (tmp_path / "supervisor" / "objective.json").is_file()
    assert not (tmp_path / "launcher").exists(), "a new launcher/ would hide the run's journal in supervisor/"
    assert read_objective(tmp_path).cfg.ettr_target == 0.8


@pytest.mark.parametrize(("text", "said"), [
    ("{", "objective.json: not JSON"),
    ("[0.95]", "objective.json: expected a mapping, got list"),
    ('{"ettr_target": 0.95}', "objective.json: missing key(s) 'ettr_window'"),
    ('{"ettr_target": 0.95, "ettr_window": "7d", "ettr_taget": 1}', "objective.json: unknown key(s) 'ettr_taget'"),
    ('{"ettr_target": 95, "ettr_window": "7d"}', "objective.json: ettr_target must be a fraction > 0 and < 1"),
    ('{"ettr_target": "high", "ettr_window": "7d"}', "objective.json.ettr_target: expected float, got 'high'"),
    ('{"ettr_target": 0.95, "ettr_window": "a week"}', "objective.json.ettr_window: expected a duration"),
    ('{"ettr_target": 0.95, "ettr_window": "0s"}', "objective.json: ettr_window must be > 0"),
])
def test_a_file_that_is_not_an_objective_is_an_error_naming_the_file_and_the_key(tmp_path: Path, text: str,
                                                                                 said: str) -> None:
    RunPaths(tmp_path).launcher.mkdir()
    RunPaths(tmp_path).objective.write_text(text)
    with pytest.raises(ConfigError) as caught:
        read_objective(tmp_path)
    assert str(caught.value).startswith(str(RunPaths(tmp_path).objective)) and said in str(caught.value)


# ---- judged against the ledger ----------------------------------------------------------------------------------

def test_it_judges_a_run_shorter_than_its_window_over_all_of_it(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    judged = standing(intervals(tmp_path, [CRASH]), Objective())
    assert judged is not None
    assert (judged.at, judged.judged_s, judged.unproductive_s) == (33.0, 33.0, 23.5)
    assert judged.ettr == pytest.approx(9.5 / 33) and not judged.met
    assert judged.points == pytest.approx(100 * (9.5 / 33 - 0.95))
    assert judged.spent == pytest.approx(23.5 / (0.05 * 33))  # 14 budgets: the run's whole budget 14 times over
    one_hour, six_hours = judged.burns
    # The recording rule: increase(unproductive)[1h] / clamp_min(increase(elapsed)[1h], 3600) / (1 - target), with
    # the counters from the first step (10): 13.5 s of 23 s passed, over at least the window's 3600 s.
    assert (one_hour.window_s, one_hour.unproductive_s, one_hour.seen_s) == (3600.0, 13.5, 23.0) and one_hour.short
    assert one_hour.rate == pytest.approx(13.5 / max(23.0, 3600) / 0.05)
    assert six_hours.rate == pytest.approx(13.5 / 21600 / 0.05)


def test_it_judges_a_run_longer_than_its_windows_over_their_last_seconds(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    objective = Objective(Config(ettr_target=0.5, ettr_window=timedelta(seconds=20)), RECORDED)
    judged = standing(intervals(tmp_path, [CRASH]), objective, windows=(timedelta(seconds=10),))
    assert judged is not None and judged.judged_s == 20.0
    # 13 .. 33: productive 13 .. 13.5 and 26 .. 32, the rest not.
    assert judged.unproductive_s == pytest.approx(13.5) and judged.ettr == pytest.approx(0.325)
    assert not judged.met and judged.spent == pytest.approx(13.5 / (0.5 * 20))
    (burn,) = judged.burns  # 23 .. 33: the second startup's last 3 s and the end's 1 s
    assert (burn.unproductive_s, burn.seen_s, burn.short) == (4.0, 10.0, False)
    assert burn.rate == pytest.approx(4 / 10 / 0.5)


def test_it_judges_the_run_as_it_stood_at_a_time(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    spans = intervals(tmp_path, [CRASH])
    at_restart = standing(spans, Objective(), at=21.0)  # incident 1's restart done: 0 .. 21, 3.5 s productive
    assert at_restart is not None and (at_restart.judged_s, at_restart.unproductive_s) == (21.0, 17.5)
    assert at_restart.burns[0].unproductive_s == 7.5 and at_restart.burns[0].seen_s == 11.0
    assert standing(spans, Objective(), at=5.0) is None, "before the first step: nothing to judge"
    assert standing(spans, Objective(), at=99.0) == standing(spans, Objective()), "past the end: at the end"


def test_a_run_that_trained_no_step_is_not_judged(tmp_path: Path) -> None:
    # A user's program: the launcher's journal, no step records (docs/your-trainer.md).
    write(tmp_path / "launcher" / "attempts.jsonl", [{"event": "start", "attempt": 0, "at": 0.0},
                                                     {"event": "end", "attempt": 0, "at": 600.0}])
    assert [s.kind for s in intervals(tmp_path, [])] == ["other"]
    assert standing(intervals(tmp_path, []), Objective()) is None
    assert standing([], Objective()) is None


def test_the_ledgers_lines_put_the_largest_loss_first() -> None:
    seconds = {"productive": 9.5, "checkpointing": 0.5, "lost_work": 2.0, "detection": 3.0, "diagnosis": 0.5,
               "restart": 1.5, "startup": 15.0, "other": 1.0}
    got = lines(seconds, 33.0)
    assert [c for c, _, _ in got] == ["productive", "startup", "detection", "lost_work", "restart", "other",
                                      "checkpointing", "diagnosis"]  # a tie keeps the ledger's order
    assert got[1] == ("startup", 15.0, pytest.approx(15 / 33))
    assert [label(s) for s in (3600, 21600, 604800, 5400, 90, 1.5)] == ["1h", "6h", "7d", "90m", "90s", "1.5s"]


# ---- the report ---------------------------------------------------------------------------------------------------

def test_the_report_says_the_run_against_its_objective_and_writes_it_to_report_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_crash_run(tmp_path)
    report(tmp_path, [CRASH])
    said = capsys.readouterr().out
    assert "objective: ETTR >= 95.0% over 7d (the default: the run recorded none)" in said
    assert "ETTR 28.8% over the run's 33.0 s (shorter than the window): missed by 66.2 points" in said
    assert "error budget 5.0% (1.7 s of 33.0 s): 23.5 s not productive, 1424% of it spent" in said
    assert "burn rate (1 spends the budget exactly over the window): 1h 0.075, 6h 0.0125" in said
    assert "the run had 23.0 s since its first step, less than 1h and 6h" in said
    written = json.loads((tmp_path / "report.json").read_text())
    objective = written["objective"]
    assert (objective["ettr_target"], objective["ettr_window_s"], objective["source"]) == (0.95, 604800.0, "default")
    got = objective["standing"]
    assert (got["ettr"], got["met"], got["points"], got["unproductive_s"]) == (0.2879, False, -66.21, 23.5)
    assert (got["budget"], got["budget_s"], got["spent"], got["shorter_than_window"]) == (0.05, 1.65, 14.2424, True)
    assert got["burn_rate"]["1h"] == {"rate": 0.075, "unproductive_s": 13.5, "seen_s": 23.0,
                                      "shorter_than_window": True}
    assert [line["category"] for line in written["lines"]][:3] == ["productive", "startup", "detection"]
    assert written["lines"][1] == {"category": "startup", "seconds": 15.0, "share": 0.4545}


def test_the_report_judges_the_run_against_the_objective_it_recorded(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    write_crash_run(tmp_path)
    write_objective(tmp_path, Config(ettr_target=0.25, ettr_window=timedelta(hours=36)))
    report(tmp_path, [CRASH])
    assert "objective: ETTR >= 25.0% over 36h (the run's own)" in capsys.readouterr().out
    got = json.loads((tmp_path / "report.json").read_text())["objective"]
    assert got["source"] == "run directory" and got["standing"]["met"] and got["standing"]["points"] == 3.79


def test_a_report_of_a_run_whose_objective_file_is_broken_says_which_and_writes_nothing(tmp_path: Path) -> None:
    write_crash_run(tmp_path)
    RunPaths(tmp_path).objective.write_text('{"ettr_target": 2, "ettr_window": "7d"}')
    with pytest.raises(ConfigError, match=r"supervisor/objective.json: ettr_target must be a fraction"):
        report(tmp_path, [CRASH], quiet=True)
    assert not (tmp_path / "report.json").exists()


def test_a_report_of_a_program_that_writes_no_step_records_does_not_judge_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "launcher" / "attempts.jsonl", [{"event": "start", "attempt": 0, "at": 0.0},
                                                     {"event": "end", "attempt": 0, "at": 600.0}])
    report(tmp_path, [])
    assert "(the default: the run recorded none): not judged: the run trained no step" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["objective"]["standing"] is None


# ---- megaheal run -------------------------------------------------------------------------------------------------

class _Stop(Exception):
    """Raised in place of building the job: what `megaheal run` did before it is what is checked."""


def _stopped_run(monkeypatch: pytest.MonkeyPatch, run_dir: Path, resume: bool,
                 ettr: GoodputCollector.Config | None) -> None:
    import healer.runner.run as run_module
    from ground.shipped import shipped_config

    def build_job(spec: object) -> None:
        raise _Stop

    monkeypatch.setattr(run_module, "build_job", build_job)
    with pytest.raises(_Stop):
        run_module.run_job(str(shipped_config("demo.yaml")), run_dir, None, resume=resume, ettr=ettr, preflight=False)


def test_megaheal_run_records_its_objective_and_a_take_over_goes_on_under_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from wire.journal import End, Start, append

    run_dir = tmp_path / "run"
    given = Config(ettr_target=0.9, ettr_window=timedelta(days=14))
    _stopped_run(monkeypatch, run_dir, False, given)
    assert read_objective(run_dir) == Objective(given, RECORDED)  # written before the job is built
    append(RunPaths(run_dir).journal, Start(job="demo", attempt=0, at=1.0, nodes=["n1"], resume="auto"))
    append(RunPaths(run_dir).journal, End(attempt=0, at=2.0))
    _stopped_run(monkeypatch, run_dir, True, None)  # a take-over given none keeps the run's
    assert read_objective(run_dir) == Objective(given, RECORDED)
    _stopped_run(monkeypatch, tmp_path / "new", False, None)  # a new run given none: the defaults, recorded
    assert read_objective(tmp_path / "new") == Objective(Config(), RECORDED)


def test_the_command_line_sets_on_a_taken_over_runs_objective_only_what_it_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import healer.runner.run as run_module
    from megaheal.cli import app

    got: dict[str, object] = {}
    monkeypatch.setattr(run_module, "run_job", lambda *args, **kwargs: got.update(kwargs) or 0)

    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, ["run", "--metrics-port", "-1", *args])
        return result.exit_code, result.output

    run_dir = tmp_path / "run"
    write_objective(run_dir, Config(ettr_target=0.9, ettr_window=timedelta(days=14)))
    assert run("--take-over", "--run-dir", str(run_dir), "--ettr-window", "36h") == (0, "")
    assert got["ettr"] == Config(ettr_target=0.9, ettr_window=timedelta(hours=36))
    assert run("--take-over", "--run-dir", str(run_dir))[0] == 0 and got["ettr"] is None  # run_job reads the run's
    assert run("--run-dir", str(tmp_path / "new"), "--ettr-target", "0.8")[0] == 0
    assert got["ettr"] == Config(ettr_target=0.8, ettr_window=timedelta(days=7))
    RunPaths(run_dir).objective.write_text('{"ettr_target": 0.9}')
    code, said = run("--take-over", "--run-dir", str(run_dir), "--ettr-target", "0.9")
    assert code == 2 and f"error: {RunPaths(run_dir).objective}: missing key(s) 'ettr_window'" in said
    # The help's defaults are GoodputCollector.Config's, the one place they are set.
    shown = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=1000).output.split())
    assert f"[default: {Config().ettr_target}; --take-over: the run's own]" in shown
    assert f"[default: {label(Config().ettr_window.total_seconds())}; --take-over: the run's own]" in shown
