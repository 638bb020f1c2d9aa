"""`dcgm_diag`: NVIDIA DCGM's own diagnostic, `dcgmi diag -r LEVEL -j`, turned into a verdict.

Level 1 (seconds: the deployment checks, software, driver, permissions) is what a preflight can afford; 2 and 3 run
the GPUs' memory, PCIe and compute tests for minutes, for a host that comes back from repair. Where DCGM is not
installed (no `dcgmi` on PATH) the check is skipped with the reason. The command is an argument list with a timeout;
nothing from outside reaches it but the level, a number checked here.

The JSON's shape moved between DCGM releases (a top-level "DCGM GPU Diagnostic" with `test_categories`, or other
names around the same `tests`): every test found anywhere in it counts, each with its `results` per GPU. A result
`Fail` fails the GPU it names, `Warn` degrades it; `Pass`, `Skip` and `Not Run` pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ground.commands import run_command
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Status, Suspect

DCGMI = "dcgmi"
_BAD = {"fail": Status.FAIL, "warn": Status.DEGRADED}


@dataclass(frozen=True, slots=True)
class Outcome:
    test: str
    gpu: str | None
    status: str
    said: str


class DcgmDiagCheck(Check):
    name = "dcgm_diag"

    @dataclass(kw_only=True, slots=True)
    class Config:
        level: int = 1
        """dcgmi diag's run level: 1 quick (seconds), 2 medium, 3 long, 4 extended (an hour and more)."""

        def __post_init__(self) -> None:
            if self.level not in (1, 2, 3, 4):
                raise ValueError(f"level must be 1, 2, 3 or 4, got {self.level}")

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        # NOTE: a little under the step's own timeout, so that a hung dcgmi is this check's error, not the step's.
        result = run_command([DCGMI, "diag", "-r", str(config.level), "-j"],
                             timedelta(seconds=max(1.0, ctx.timeout_s - 1.0)))
        if result.rc is None and "not found on PATH" in result.err:
            return CheckResult(status=Status.SKIPPED, summary="DCGM diag skipped: dcgmi (DCGM) not found on PATH",
                               details={"dcgm_diag": {"skipped": "no dcgmi"}})
        try:
            outcomes = parse(result.out)
        except ValueError as exc:
            why = (result.err or str(exc)).strip()[-300:]
            return CheckResult(status=Status.ERROR, summary=f"dcgmi diag -r {config.level}: {why}",
                               details={"dcgm_diag": {"rc": result.rc}})
        return verdict(outcomes, config.level, ctx.hostname)


def parse(text: str) -> list[Outcome]:
    """Every test result in dcgmi diag's JSON; ValueError when the text holds none."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON in dcgmi's output")
    doc = json.loads(text[start:end + 1])
    found: list[Outcome] = []
    _walk(doc, found)
    if not found:
        raise ValueError("no test results in dcgmi's output")
    return found


def _walk(node: Any, found: list[Outcome]) -> None:
    if isinstance(node, dict):
        tests = node.get("tests")
        if isinstance(tests, list):
            for test in tests:
                if isinstance(test, dict):
                    _test(test, found)
        for key, value in node.items():
            if key != "tests":
                _walk(value, found)
    elif isinstance(node, list):
        for item in node:
            _walk(item, found)


def _test(test: dict[str, Any], found: list[Outcome]) -> None:
    name = str(test.get("name") or test.get("test") or "?")[:80]
    for result in test.get("results") or []:
        if not isinstance(result, dict) or "status" not in result:
            continue
        gpu = result.get("gpu_ids", result.get("gpu_id", result.get("entity_id")))
        found.append(Outcome(test=name, gpu=None if gpu is None else str(gpu)[:16],
                             status=str(result["status"]).strip().lower(), said=_said(result)))


def _said(result: dict[str, Any]) -> str:
    warnings = result.get("warnings") or []
    texts = [w.get("warning", "") if isinstance(w, dict) else str(w) for w in warnings]
    return "; ".join(t for t in texts if t)[:200] or str(result.get("info") or "")[:200]


def verdict(outcomes: list[Outcome], level: int, host: str) -> CheckResult:
    bad = [o for o in outcomes if o.status in _BAD]
    status = max((_BAD[o.status] for o in bad), key=lambda s: s is Status.FAIL, default=Status.PASS)
    tests = len({o.test for o in outcomes})
    if not bad:
        return CheckResult(status=Status.PASS, summary=f"dcgmi diag -r {level}: {tests} test(s) passed",
                           details={"dcgm_diag": {"tests": tests}})
    said = "; ".join(f"{o.test}{f' GPU {o.gpu}' if o.gpu is not None else ''} {o.status}"
                     f"{f': {o.said}' if o.said else ''}" for o in bad[:4])
    suspects = tuple(Suspect(kind="gpu" if o.gpu is not None else "host",
                             name=f"{host}/gpu{o.gpu}" if o.gpu is not None else host, reason=f"{o.test}: {o.status}")
                     for o in bad if _BAD[o.status] is status)
    return CheckResult(status=status, summary=f"dcgmi diag -r {level}: {said}", suspects=suspects,
                       details={"dcgm_diag": {"tests": tests, "failed": [o.test for o in bad]}})
