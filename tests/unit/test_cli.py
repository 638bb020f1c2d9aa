"""The `megaheal` command line as a user meets it (issue 35): every option's help shows its default, each flag means
one thing (old names warn), logging options are checked, and bad input is an error naming the file and the key,
with nothing left behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from healer.decide.states import IncidentState
from healer.service import incidents_cli
from megaheal.cli import app
from wire.journal import Start, append
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit
WIDE = {"terminal_width": 1000, "max_content_width": 1000}
"""One option a line in the help, so each line can be checked on its own."""


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """The long-running commands set up the process's logging (on the runner's stderr, gone after the call): put
    the root logger back as pytest had it for the tests after."""
    import logging

    from ground.logsetup import QUIET_LOGGERS

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)


def _invoke(*args: str, **env: str) -> Any:
    return CliRunner().invoke(app, list(args), env=env or None, **WIDE)


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _has_default(option: Any) -> bool:
    """A value the option takes when not given (a flag that is off by default has none to show)."""
    if option.is_flag and not option.secondary_opts:
        return bool(option.default)
    return option.default not in (None, "", (), [])


COMMANDS = list(_commands(typer.main.get_command(app)))


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[" ".join(p) or "megaheal" for p, _ in COMMANDS])
def test_every_option_shows_its_default_in_the_help(path: tuple[str, ...], command: Any) -> None:
    result = _invoke(*path, "--help")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for option in command.params:
        if type(option).__name__ != "TyperOption" or option.hidden:
            continue
        line = next((line for line in lines if line.strip().startswith(", ".join(option.opts))), None)
        assert line is not None, f"{' '.join(path)} {option.opts[0]} is not in the help:\n{result.output}"
        # NOTE: both kinds: Typer's own note for a real default, and the project's note written in the help
        # ("[default: hostname]"), which rich markup used to swallow as a tag.
        if _has_default(option) or "[default:" in (option.help or ""):
            assert "[default:" in line, f"{' '.join(path)} {option.opts[0]}: no default in {line.strip()!r}"


def test_the_take_over_flag_is_the_only_meaning_of_run_and_resume_is_its_old_name(tmp_path: Path) -> None:
    both = _invoke("run", "--resume", "--take-over", "--run-dir", str(tmp_path))
    assert both.exit_code == 2 and "--resume is the old name of --take-over: give --take-over only" in both.output
    old = _invoke("run", "--resume", "--run-dir", str(tmp_path / "gone"))
    assert old.exit_code == 2
    assert "warning: --resume is deprecated" in old.output and "use --take-over" in old.output
    assert "--take-over needs the --run-dir of a supervised run" in old.output
    assert "--resume" not in _invoke("run", "--help").output.replace("checkpoint.resume", "")
    assert "--take-over" in _invoke("run", "--help").output


def test_the_sidecar_takes_its_token_as_token_file_and_refuses_the_old_name_beside_it(tmp_path: Path) -> None:
    result = _invoke("sidecar", "--token-file", str(tmp_path / "a"), "--healer-token-file", str(tmp_path / "b"))
    assert result.exit_code == 2
    assert "--healer-token-file is the old name of --token-file" in result.output
    assert "--healer-token-file" not in _invoke("sidecar", "--help").output


@pytest.mark.parametrize("command", ["run", "healer", "sidecar", "agent", "relay"])
def test_every_long_running_command_takes_a_log_level_and_format_and_checks_them(command: str) -> None:
    shown = _invoke(command, "--help").output
    assert "--log-level" in shown and "--log-format" in shown
    required = {"agent": ["--token-file", "t", "--work-dir", "w"], "relay": ["--healer-url", "h", "--token-file", "t"]}
    extra = required.get(command, [])
    bad = _invoke(command, *extra, "--log-format", "xml")
    assert bad.exit_code == 2 and "--log-format must be one of text, json, got 'xml'" in bad.output
    bad = _invoke(command, *extra, "--log-level", "loud")
    assert bad.exit_code == 2 and "--log-level must be one of debug, info, warning, error, critical" in bad.output


def test_run_has_no_timeout_unless_given_one() -> None:
    option = next(p for p in typer.main.get_command(app).commands["run"].params if p.name == "timeout_min")
    assert option.default is None
    assert _invoke("run", "--timeout-min", "0").output.strip().endswith("--timeout-min must be > 0, got 0.0")


@pytest.mark.parametrize(("args", "said"), [
    (["--ettr-target", "1"], "error: --ettr-target must be a fraction > 0 and < 1 (0.95 is 95%), got 1.0"),
    (["--ettr-target", "0"], "error: --ettr-target must be a fraction > 0 and < 1 (0.95 is 95%), got 0.0"),
    (["--ettr-target", "nan"], "error: --ettr-target must be a fraction > 0 and < 1"),
    (["--ettr-window", "0d"], "error: --ettr-window must be > 0, got 0:00:00"),
    (["--ettr-window", "a week"], "error: --ettr-window: expected a duration such as 30s, 500ms, 2m, 1h or 7d"),
])
def test_run_refuses_an_ettr_objective_out_of_range_naming_the_option(tmp_path: Path, args: list[str],
                                                                      said: str) -> None:
    run_dir = tmp_path / "run"
    result = _invoke("run", *args, "--run-dir", str(run_dir), "--metrics-port", "-1")
    assert result.exit_code == 2 and said in result.output
    assert not run_dir.exists()


def test_a_report_of_a_directory_that_is_not_there_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    result = _invoke("report", str(missing))
    assert result.exit_code == 2 and f"error: {missing}: no such run directory" in result.output
    assert "migrat" not in result.output
    assert not missing.exists()


def test_a_report_of_a_run_without_its_database_names_it_and_creates_none(tmp_path: Path) -> None:
    run = RunPaths(tmp_path / "run")
    run.launcher.mkdir(parents=True)
    append(run.journal, Start(job="j", attempt=1, at=1.0, nodes=["n1"], resume="auto"))
    result = _invoke("report", str(run.path))
    assert result.exit_code == 2 and f"{run.database.absolute()}: no such database" in result.output
    elsewhere = tmp_path / "other" / "h.db"
    result = _invoke("report", str(run.path), "--db", f"sqlite:///{elsewhere}")
    assert result.exit_code == 2 and f"{elsewhere}: no such database (--db)" in result.output
    assert not run.database.exists() and not elsewhere.parent.exists()


def test_a_chaos_fault_on_a_rank_the_job_lacks_names_the_file_and_the_fault(tmp_path: Path) -> None:
    chaos = tmp_path / "chaos.yaml"
    chaos.write_text("faults:\n  - {at_step: 3, kind: kill, rank: 1}\n  - {at_step: 8, kind: stop, rank: 30}\n")
    run_dir = tmp_path / "run"
    # configs/demo.yaml is a 4-rank job (pp 1 x dp 2 x tp 2)
    result = _invoke("run", "--chaos", str(chaos), "--run-dir", str(run_dir), "--metrics-port", "-1")
    assert result.exit_code == 2
    assert f"error: {chaos}: faults[1].rank: 30 is not a rank of a 4-rank job (ranks 0-3)" in result.output
    assert not run_dir.exists()


def test_a_broken_rule_file_names_the_file_the_line_and_the_problem(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text("- name: x\n  when: {detector: crash\n  action: restart\n")
    run_dir = tmp_path / "run"
    result = _invoke("run", "--rules", str(rules), "--run-dir", str(run_dir), "--metrics-port", "-1")
    assert result.exit_code == 2
    assert (f"error: {rules}: invalid YAML at line 3, column 9: expected ',' or '}}', but got ':' "
            "(in a flow mapping that starts at line 2, column 9)") in result.output
    assert "<unicode string>" not in result.output and not run_dir.exists()


def test_the_incidents_command_knows_the_healers_states() -> None:
    assert incidents_cli.STATES == tuple(s.value for s in IncidentState)
    result = _invoke("incidents", "list", "--state", "sleeping")
    assert result.exit_code == 2 and "--state: unknown state 'sleeping'; states: open, diagnosing" in result.output


def test_the_healers_token_file_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from healer.service.config import read_token

    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789\n")
    token_file.chmod(0o600)
    monkeypatch.setenv("MEGAHEAL_TOKEN", "from-the-environment-0123")
    assert read_token(str(token_file)) == ("from-the-file-0123456789", str(token_file))
    assert read_token(None) == ("from-the-environment-0123", "MEGAHEAL_TOKEN")
