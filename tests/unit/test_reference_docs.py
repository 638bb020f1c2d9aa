"""The reference pages (docs/reference/) are what the code writes: a renamed key, a new detector or metric, a changed
default or help text shows up as a stale page, as a stale dashboard does (tests/deploy/test_dashboards.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_reference.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_pages_are_what_the_code_writes() -> None:
    gen = _generator()
    assert gen.stale() == [], f"run `{gen.COMMAND}` and commit docs/reference/"


def test_the_check_flag_names_a_missing_or_edited_page_and_passes_once_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = _generator()
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    assert gen.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.md", "configs.md", "metrics.md", "rules.md"]
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text().replace("megaheal_step_duration_seconds", "megaheal_step_time"))
    capsys.readouterr()
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    assert "metrics.md is stale" in capsys.readouterr().err


def test_the_pages_come_from_the_code_they_describe() -> None:
    from exporters.nvml_collector import GPU_LABELS
    from healer.decide.catalogue import CATALOGUE
    from healer.decide.rules import DEFAULT_RULES, load_rule_set
    from healer.detect.registry import default_registry

    pages = _generator().render_all()
    # Every training key with its docstring and default, nested sections by their dotted name.
    assert "| `checkpoint.every_steps` |" in pages["configs.md"]
    assert "| `steps` | `int` | `20` | Optimizer steps to run. |" in pages["configs.md"]
    assert "| `db_timeout` | `timedelta` | `10s` |" in pages["configs.md"]
    # Every kind of the catalogue, every detector, every shipped rule.
    for kind in CATALOGUE:
        assert f"| `{kind}` |" in pages["rules.md"]
    for name in default_registry().names():
        assert f"### `{name}` (" in pages["rules.md"]
    for rule in load_rule_set([DEFAULT_RULES]).rules:
        assert f"| `{rule.name}` |" in pages["rules.md"]
    # The sidecar's, the run's, the healer's and the relay's series, with their labels and types.
    metrics = pages["metrics.md"]
    assert "| `megaheal_step_duration_seconds` | histogram | `job`, `node` |" in metrics
    assert "| `megaheal_incidents_open` | gauge | `kind`, `severity` |" in metrics
    assert "| `megaheal_goodput_ettr_ratio` | gauge | `job` |" in metrics
    assert "| `megaheal_relay_batches_refused_total` | counter | `why` |" in metrics
    assert all(f"`{label}`" in metrics for label in GPU_LABELS)
    # Every command and subcommand with its help, hidden old names left out.
    assert "### `megaheal incidents ack`" in pages["cli.md"] and "--take-over" in pages["cli.md"]
    assert "--healer-token-file" not in pages["cli.md"]
    # Nothing of this checkout, this host or this time: the same code writes the same bytes anywhere.
    assert str(ROOT) not in "".join(pages.values())
