"""How the healer acts: the interface between its core, which decides, and its hands (a launcher and the agents
on the hosts), which carry orders out. The core never touches a process itself.

Every order returns at once: the work (stopping an attempt, a 90 s diagnosis, starting the next attempt) runs off
the healer's loop, in order, and reports back through a callback; the loop goes on ingesting heartbeats and
acting on other incidents meanwhile. The service alone has no remediator (it can only notify); a
`Diagnoser` may still run rules' runbooks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from healer.decide.plans import Verdict
from wire.verdict import Status, worst


@dataclass(frozen=True, slots=True)
class HostVerdict:
    """One host's diagnosis."""

    node: str
    status: Status
    """pass, degraded, fail or error (error: the runbook could not run; it blames no host)."""
    summary: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    """What a runbook across hosts measured on this host (its pairs' bandwidth, links it named); empty otherwise."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))  # a status's name is taken too; a typo is an error

    def to_payload(self) -> dict[str, Any]:
        payload = {**asdict(self), "status": self.status.value}
        if not self.details:
            del payload["details"]
        return payload


def to_verdict(verdicts: list[HostVerdict]) -> Verdict:
    """The worst status over the hosts (runbooks' own ranking: fail outranks error), and the hosts that failed."""
    status = worst([v.status for v in verdicts])
    return Verdict(status=Status.PASS if status is Status.SKIPPED else status,
                   bad_nodes=tuple(v.node for v in verdicts if v.status is Status.FAIL))


@dataclass(frozen=True, slots=True)
class JobState:
    """The job as its launcher sees it."""

    job: str
    nodes: tuple[str, ...]
    """Hosts of the current (or next) attempt, in node-rank order."""
    spares: tuple[str, ...]
    dp: int
    valid_dp: tuple[int, ...]
    """Data-parallel degrees the training layout accepts for this job."""
    excluded: tuple[str, ...] = ()
    """Hosts the healer left out of this job: their faults are known and no longer the job's."""
    attempt: int | None = None
    """The current attempt's number (None before the first start)."""
    attempt_started_at: datetime | None = None
    running: bool = False
    """The current attempt runs and the healer is not stopping it."""
    succeeded: bool = False
    """The current attempt finished every step."""
    busy: bool = False
    """An order is still being carried out."""
    warm_unavailable: str | None = "the job does not run warm"
    """Why the next restart cannot be warm; None: it can."""
    replica_hosts: dict[str, str] = field(default_factory=dict)
    """Per host, the host keeping its ranks' replicas in memory (healer.decide.plans.JobFacts.replica_hosts)."""
    total_steps: int | None = None
    """The steps the job trains in all, where the launcher knows them (megaheal's trainer); None: a program's."""
    replica_groups: int = 0
    """The job trains as replica groups, one per host, at most this many (healer.decide.plans.JobFacts)."""


@dataclass(frozen=True, slots=True)
class RestartOrder:
    incident_id: int
    restart_id: int
    nodes: tuple[str, ...]
    dp: int
    resume_step: int | None = None
    """Resume from this checkpoint step; None: the newest good checkpoint."""
    skip_steps: tuple[int, ...] = ()
    """Steps whose batches this and every later attempt pass over (added to those of earlier rollbacks)."""
    warm: bool = False
    """Restart warm where the launcher can (else cold, saying why)."""
    mode_why: str = ""
    """The policy's reason for the mode (healer.decide.plans.restart_mode)."""
    released: tuple[str, ...] = ()
    """Healthy hosts of the job this restart leaves idle: spares again, never drained (healer.decide.plans.Plan)."""
    replace_ranks: tuple[int, ...] = ()
    """Ranks whose live processes a warm restart replaces (healer.decide.plans.Plan.replace_ranks)."""
    keep_out: tuple[str, ...] = ()
    """Hosts this restart leaves out that no screening takes back (a lemon, a host convicted of silent data
    corruption): only a person returns them."""
    replica: bool = False
    """Replace the replica groups of the hosts that leave (and of those whose group ended) within the running
    attempt, every other group training on (healer.decide.plans.Plan.replica)."""


@dataclass(frozen=True, slots=True)
class Started:
    """A restart that was carried out."""

    attempt: int
    at: datetime
    from_step: int | None
    """The checkpoint step the new attempt resumes from (0: from scratch)."""
    resume: str | None
    """What its ranks were told: auto or a checkpoint path."""
    nodes: tuple[str, ...]
    dp: int
    mode: str = "cold"
    """warm (the survivors kept their processes and state) or cold (every rank a new process, state from disk)."""
    mode_why: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    """Where the restart's time went, in seconds: stop (the order to the new attempt's start: a warm restart's
    kills, standbys and plan; a cold one's stop), and for a warm one state_transfer (the slowest rank's group and
    state, as it reported)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """An order that could not be carried out; `permanent`: trying again cannot help."""

    reason: str
    permanent: bool = False


@dataclass(frozen=True, slots=True)
class TakenOver:
    """What a launcher found when a healer took its job over from one that died."""

    killed: tuple[int, ...]
    """Processes of the dead healer's last attempt that were still running, now stopped."""
    nodes: tuple[str, ...]
    dp: int
    attempt: int | None
    """The last attempt the dead healer started."""
    adopted: bool = False
    """That attempt still ran on every host and was taken over as it is (nothing restarts)."""
    elsewhere: tuple[str, ...] = ()
    """Hosts of that attempt this healer does not have (it runs in a successor's allocation: they were lost)."""
    extra: dict[str, Any] = field(default_factory=dict)


class Remediator(Protocol):
    """The hands of one job's healer."""

    job: str

    def state(self) -> JobState: ...

    def checkpoint_steps(self) -> tuple[int, ...]:
        """Steps of the job's good (verified) checkpoints."""

    def stop(self, reason: str, grace: timedelta) -> None:
        """Stop the current attempt (SIGTERM, SIGKILL after `grace`); the job stays down until `restart`."""

    def diagnose(self, nodes: list[str], runbook: str, stop_first: bool,
                 done: Callable[[list[HostVerdict]], None]) -> None:
        """Run `runbook` on each host (stopping the attempt first when `stop_first`) and hand the verdicts on."""

    def diagnose_across(self, nodes: list[str], runbook: str, done: Callable[[list[HostVerdict]], None]) -> None:
        """Run `runbook` (of scope job) once across `nodes` while the job goes on, and hand a verdict per host on."""

    def restart(self, order: RestartOrder, done: Callable[[Started | Failed], None]) -> None:
        """Stop what is left of the current attempt and start the next one as ordered."""

    records_steps: bool
    """The ranks record every step where first_step and highest_step read them (megaheal's trainer); False for a
    user's program, whose first step after a restart is read from the heartbeats instead."""

    def first_step(self, attempt: int) -> int | None:
        """The first step the attempt finished (from every step the ranks recorded), or None yet."""

    def highest_step(self, attempt: int) -> int | None:
        """The highest step the attempt finished, or None."""

    def groups_trained(self, nodes: tuple[str, ...], since: float) -> int | None:
        """A job of replica groups: once every host of `nodes` recorded a step since `since` (after a regroup, the
        joining groups trained too), the lowest of their first steps; else None."""

    def first_bad_step(self, kind: str, attempt: int, detector_config: Any, seen: int | None = None) -> int | None:
        """For nonfinite and loss_spike: the first bad step among every step the attempt recorded (heartbeats only
        sample steps, and a rollback one step late skips the wrong batches), of the fault the detector saw at step
        `seen`; None if it cannot tell."""

    def rank_evidence(self, attempt: int) -> dict[str, Any] | None:
        """What every rank of `attempt` is doing, looked at from its host without touching it (kernel state, phase,
        Python stack: healer/agent/rank_evidence.py), as {"ranks": [...], "unreached": {host: why}}; None when
        `attempt` is not the one running."""


class Diagnoser(Protocol):
    """Runs a rule's runbook for an incident without a launcher (the service's `diagnosis: local`)."""

    def submit(self, runbook: str, nodes: list[str],
               done: Callable[[str, str, dict[str, Any] | None], None]) -> None: ...

    def shutdown(self) -> None: ...
