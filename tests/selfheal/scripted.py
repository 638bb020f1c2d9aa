"""A remediator whose hands are scripted: it records the orders the healer gives and carries them out when the
test says so, so the engine's lifecycle (decide, diagnose, restart, recover, take over) can be driven tick by tick
without processes. The real hands (AgentRemediator over torchrun agents) are in the end-to-end tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from healer.observe.processes import ProcessView
from healer.ports import Failed, HostVerdict, JobState, RestartOrder, Started


@dataclass
class ScriptedRemediator:
    job: str
    view: ProcessView
    clock: Callable[[], float]
    nodes: tuple[str, ...] = ("n1", "n2")
    spares: tuple[str, ...] = ("n3",)
    dp: int = 2
    attempt: int = 0
    running: bool = True
    succeeded: bool = False
    checkpoints: tuple[int, ...] = (4, 8)
    first_steps: dict[int, int] = field(default_factory=dict)
    highest: dict[int, int] = field(default_factory=dict)
    orders: list[tuple[str, Any]] = field(default_factory=list)
    diagnoses: list[Callable[[list[HostVerdict]], None]] = field(default_factory=list)
    """Diagnoses in flight: call one with the verdicts to finish it."""
    fail_restarts: bool = False
    trained_on: int = 0
    """Steps the attempt finishes between the restart's decision and its stop (a rank still training)."""
    evidence: dict[int, dict[str, Any]] = field(default_factory=dict)
    """attempt -> what rank_evidence answers (the ranks' stacks, states and phases)."""
    total_steps: int | None = None
    """The job's length as its launcher knows it (None: a program's, not known)."""

    def __post_init__(self) -> None:
        self.view.started(self.job, self.attempt)

    def state(self) -> JobState:
        return JobState(job=self.job, nodes=self.nodes, spares=self.spares, dp=self.dp, valid_dp=(1, 2),
                        attempt=self.attempt, running=self.running, succeeded=self.succeeded,
                        total_steps=self.total_steps)

    def checkpoint_steps(self) -> tuple[int, ...]:
        return self.checkpoints

    def stop(self, reason: str, grace: timedelta) -> None:
        self.orders.append(("stop", reason))
        self.view.stopping(self.job)
        self.running = False

    def diagnose(self, nodes: list[str], runbook: str, stop_first: bool,
                 done: Callable[[list[HostVerdict]], None]) -> None:
        self.orders.append(("diagnose", (tuple(nodes), runbook, stop_first)))
        if stop_first:
            self.stop("diagnosis", timedelta(0))
        self.diagnoses.append(done)

    def diagnose_across(self, nodes: list[str], runbook: str, done: Callable[[list[HostVerdict]], None]) -> None:
        self.orders.append(("diagnose_across", (tuple(nodes), runbook)))
        self.diagnoses.append(done)

    def restart(self, order: RestartOrder, done: Callable[[Started | Failed], None]) -> None:
        self.orders.append(("restart", order))
        if self.fail_restarts:
            done(Failed("the launcher refused"))
            return
        if self.attempt in self.highest:
            self.highest[self.attempt] += self.trained_on
        self.attempt += 1
        self.nodes, self.dp = order.nodes, order.dp
        self.spares = tuple(s for s in self.spares if s not in order.nodes)
        self.view.started(self.job, self.attempt)
        self.running = True
        from_step = order.resume_step if order.resume_step is not None else max(self.checkpoints)
        done(Started(attempt=self.attempt, at=datetime.fromtimestamp(self.clock(), UTC), from_step=from_step,
                     resume="auto" if order.resume_step is None else f"step-{from_step}", nodes=order.nodes,
                     dp=order.dp))

    records_steps = True

    def first_step(self, attempt: int) -> int | None:
        return self.first_steps.get(attempt)

    def highest_step(self, attempt: int) -> int | None:
        return self.highest.get(attempt)

    def groups_trained(self, nodes: tuple[str, ...], since: float) -> int | None:
        return None  # NOTE: a scripted job never regroups

    def first_bad_step(self, kind: str, attempt: int, detector_config: Any, seen: int | None = None) -> int | None:
        return None

    def rank_evidence(self, attempt: int) -> dict[str, Any] | None:
        return self.evidence.get(attempt)
