"""`dcgm_diag` (runbooks/checks/dcgm_diag.py) against a `dcgmi` on PATH that prints what DCGM prints (a recorded
level-1 run's JSON, with one GPU's row remapping failed): the command as an argument list, its result a verdict, and
a host without DCGM skipped with the reason."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from runbooks.checks.dcgm_diag import DcgmDiagCheck, parse
from runbooks.registry import CheckContext
from wire.verdict import Status

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parent / "fixtures" / "dcgmi-diag-r1-fail.json"
CTX = CheckContext(hostname="node-a", timeout_s=5)


def fake_dcgmi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, rc: int = 0) -> Path:
    """A `dcgmi` first on PATH that records its arguments and prints `output`."""
    (tmp_path / "out.txt").write_text(output)
    script = tmp_path / "bin" / "dcgmi"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv.txt'}\ncat {tmp_path / 'out.txt'}\nexit {rc}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "argv.txt"


def test_a_failed_gpu_fails_the_host_naming_the_test_and_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    argv = fake_dcgmi(tmp_path, monkeypatch, FIXTURE.read_text(), rc=226)
    result = DcgmDiagCheck().run(DcgmDiagCheck.Config(level=1), CTX)
    assert argv.read_text().split() == ["diag", "-r", "1", "-j"]
    assert result.status is Status.FAIL, result.summary
    assert "Page Retirement/Row Remap GPU 1 fail: GPU 1 had uncorrectable memory errors" in result.summary
    assert [(s.kind, s.name) for s in result.suspects] == [("gpu", "node-a/gpu1")]


def test_a_warning_alone_degrades_and_all_passed_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(FIXTURE.read_text())
    tests = doc["DCGM GPU Diagnostic"]["test_categories"][0]["tests"]
    tests[6]["results"][1] = {"gpu_ids": "1", "status": "Pass"}
    fake_dcgmi(tmp_path, monkeypatch, json.dumps(doc))
    result = DcgmDiagCheck().run(DcgmDiagCheck.Config(), CTX)
    assert result.status is Status.DEGRADED and "Persistence Mode warn" in result.summary
    tests[4]["results"] = [{"status": "Pass"}]
    assert {o.status for o in parse(json.dumps(doc))} == {"pass", "skip"}


def test_without_dcgm_it_is_skipped_and_output_that_is_no_diagnosis_is_an_error(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = DcgmDiagCheck().run(DcgmDiagCheck.Config(), CTX)
    assert result.status is Status.SKIPPED and "dcgmi (DCGM) not found on PATH" in result.summary
    fake_dcgmi(tmp_path, monkeypatch, "Error: unable to establish a connection to the host engine\n", rc=255)
    assert DcgmDiagCheck().run(DcgmDiagCheck.Config(), CTX).status is Status.ERROR
    with pytest.raises(ValueError, match="level must be 1, 2, 3 or 4"):
        DcgmDiagCheck.Config(level=5)
