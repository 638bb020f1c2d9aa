"""What a check and a runbook return: a status, the suspects, the measurements and a one-line summary.

Everything here is plain data that turns into JSON (`to_payload`) for `megaheal diagnose --json`
and for the healer's incident store, and back again (`from_payload`) when a check's result
crosses the process boundary between the step worker and the runner.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Outcome of a check, a step or a whole runbook."""

    PASS = "pass"
    DEGRADED = "degraded"
    FAIL = "fail"
    ERROR = "error"
    SKIPPED = "skipped"


# NOTE: fail outranks error: a failure carries evidence the healer can act on (a suspect to leave
# out), while an error only says that part of the diagnosis is missing. Skipped steps (nothing to
# test here, e.g. no GPU) do not count towards a verdict at all.
_RANK = {Status.SKIPPED: 0, Status.PASS: 1, Status.DEGRADED: 2, Status.ERROR: 3, Status.FAIL: 4}


def worst(statuses: list[Status]) -> Status:
    """The most severe status that counts (skipped ones do not); SKIPPED when nothing counted."""
    return max(statuses, key=_RANK.__getitem__, default=Status.SKIPPED)


SUSPECT_KINDS = ("node", "rank", "link", "gpu", "path", "process", "host")


@dataclass(frozen=True, slots=True)
class Suspect:
    """One thing a check blames: a node, a rank, a link between two nodes, a GPU, a path, a process."""

    kind: str
    """What is blamed: one of SUSPECT_KINDS."""
    name: str
    """Its identity: node name, rank number, "a<->b" for a link, GPU UUID or index, a path, a pid."""
    reason: str
    """Why, in a few words, with the number that made the call."""

    def __post_init__(self) -> None:
        if self.kind not in SUSPECT_KINDS:
            raise ValueError(f"Suspect.kind must be one of {', '.join(SUSPECT_KINDS)}, got {self.kind!r}")
        if not self.name:
            raise ValueError("Suspect.name must not be empty")

    def to_payload(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Measurement:
    """One number a check measured, with what it was measured on and, where stored, its baseline."""

    name: str
    """What was measured, e.g. "busbw", "tcp_throughput", "free_bytes"."""
    value: float
    """The measured value, in `unit`."""
    unit: str
    """Unit of `value` and `baseline`, e.g. "GB/s", "s", "bytes"."""
    labels: dict[str, str] = field(default_factory=dict)
    """What it was measured on: collective, size, node, gpu, path..."""
    baseline: float | None = None
    """The stored baseline this value was compared against, if any."""
    key: str | None = None
    """Stable key under which `megaheal diagnose --calibrate` stores this value as a baseline."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.value):
            raise ValueError(f"Measurement.value of {self.name!r} must be finite, got {self.value}")

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "value": self.value, "unit": self.unit, "labels": dict(self.labels)}
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.key is not None:
            out["key"] = self.key
        return out

    @classmethod
    def from_payload(cls, data: dict[str, Any]) -> Measurement:
        return cls(
            name=data["name"],
            value=float(data["value"]),
            unit=data["unit"],
            labels=dict(data["labels"]),
            baseline=data.get("baseline"),
            key=data.get("key"),
        )


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What one check concluded."""

    status: Status
    """pass, degraded, fail, error, or skipped (nothing to test on this machine)."""
    summary: str
    """One line a person can act on: what failed, where, and the number."""
    suspects: tuple[Suspect, ...] = ()
    """What the check blames; empty when it blames nothing."""
    measurements: tuple[Measurement, ...] = ()
    """Everything it measured."""
    details: dict[str, Any] = field(default_factory=dict)
    """Extra JSON-able evidence (per-device NVML snapshot, per-rank timings...)."""

    def __post_init__(self) -> None:
        if "\n" in self.summary:
            raise ValueError(f"CheckResult.summary must be one line, got {self.summary!r}")

    def to_payload(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "summary": self.summary,
            "suspects": [s.to_payload() for s in self.suspects],
            "measurements": [m.to_payload() for m in self.measurements],
            "details": self.details,
        }

    @classmethod
    def from_payload(cls, data: dict[str, Any]) -> CheckResult:
        return cls(
            status=Status(data["status"]),
            summary=data["summary"],
            suspects=tuple(Suspect(**s) for s in data["suspects"]),
            measurements=tuple(Measurement.from_payload(m) for m in data["measurements"]),
            details=dict(data.get("details", {})),
        )


@dataclass(frozen=True, slots=True)
class StepResult:
    """One runbook step: which check ran, for how long, and what it concluded."""

    step: str
    """The step's name in the runbook."""
    check: str
    """The registered check it called."""
    result: CheckResult
    """The check's conclusion (an ERROR result when it crashed or ran past its timeout)."""
    seconds: float
    """Wall time of the step, start of its process to its result."""

    def to_payload(self) -> dict[str, Any]:
        return {"step": self.step, "check": self.check, "seconds": round(self.seconds, 3), **self.result.to_payload()}


@dataclass(frozen=True, slots=True)
class RunbookResult:
    """The verdict of a whole runbook run."""

    runbook: str
    """The runbook's name."""
    verdict: Status
    """pass, degraded, fail or error (error also when no step could test anything)."""
    summary: str
    """One line: the verdict and what drove it."""
    steps: tuple[StepResult, ...]
    """Every step's result, in runbook order."""
    started_at: str
    """UTC start time, ISO 8601."""
    seconds: float
    """Wall time of the whole run."""

    @property
    def suspects(self) -> tuple[Suspect, ...]:
        """Every suspect named by any step, each once, in step order."""
        seen: dict[tuple[str, str], Suspect] = {}
        for step in self.steps:
            for s in step.result.suspects:
                seen.setdefault((s.kind, s.name), s)
        return tuple(seen.values())

    @property
    def measurements(self) -> tuple[Measurement, ...]:
        return tuple(m for step in self.steps for m in step.result.measurements)

    @property
    def exit_code(self) -> int:
        """What `megaheal diagnose` exits with: 0 pass, 1 degraded or fail, 2 error."""
        return {Status.PASS: 0, Status.DEGRADED: 1, Status.FAIL: 1}.get(self.verdict, 2)

    def to_payload(self) -> dict[str, Any]:
        return {
            "runbook": self.runbook,
            "verdict": self.verdict.value,
            "summary": self.summary,
            "suspects": [s.to_payload() for s in self.suspects],
            "started_at": self.started_at,
            "seconds": round(self.seconds, 3),
            "steps": [s.to_payload() for s in self.steps],
        }
