"""What the coordinator's parts share (healer/launchers/coordinator.py puts them together): the job's configuration,
its node agents, the current attempt and its history, the run's token and journal, and the helpers every part uses
to order a host. Each part is a class of its own module, one job each: starting and watching attempts
(coordinator.py), warm generations (coordinator_warm.py), stopping (coordinator_stop.py), looking at ranks and
signalling them (coordinator_probe.py), taking a run over and re-attaching agents (coordinator_takeover.py)."""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from ground.names import check_name
from healer.launchers.agent_client import AgentClient, Fence
from healer.launchers.attempt import AgentAttempt
from healer.launchers.warm_control import WarmControl, WarmSettings
from healer.observe.processes import ProcessView
from wire import journal
from wire.orders import StartOrder, UserProgram
from wire.run_paths import RunPaths

START_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """A job that trains as replica groups, one per host (train/ft/, healer/launchers/coordinator_groups.py)."""

    lighthouse: str
    """The Lighthouse's URL as the groups reach it (http://HOST:PORT): the healer runs it (healer/runner/build.py)."""


class Unauthorized(PermissionError):
    """A kill or restart was asked for without the run's token."""


class CoordinatorBase:
    @dataclass(kw_only=True, slots=True)
    class Config:
        job: str
        """The job's name (its ranks report it; the detectors key on it)."""
        config: str | None
        """megaheal's trainer: its config's path (on the shared filesystem: every host reads it); None with
        `program`."""
        run_dir: Path
        """Shared by every attempt and host: checkpoints and the ranks' JSON lines."""
        nproc_per_node: int = 2
        """Ranks per host."""
        overrides: tuple[str, ...] = ()
        """`--set` items for every attempt (the dp degree is added per attempt)."""
        grace: timedelta = timedelta(seconds=30)
        """SIGTERM to SIGKILL in a graceful stop: time for the final checkpoint."""
        hosts_are_local: bool = False
        """Every host's processes are this machine's (local agents): at a take-over, what a host whose agent is gone
        left running is found from the journal and killed here, checked like every signal (ground.kill)."""
        warm: WarmSettings | None = None
        """Run the attempts as generations of warm workers that outlive them (healer/launchers/warm_control.py), so a
        restart can be warm; None: a torchrun agent per host and attempt."""
        program: UserProgram | None = None
        """A user's program instead of megaheal's trainer: the same on every rank, told its attempt and what to skip
        through the environment (wire/rank_env.py), never through `--set` items."""
        groups: GroupSettings | None = None
        """Each host runs one replica group of megaheal's trainer (ft.enabled), a world of its own joined to the others
        by the Lighthouse; None: the attempt is one world over every host."""

        def __post_init__(self) -> None:
            check_name(self.job, "job")
            if (self.config is None) == (self.program is None):
                raise ValueError("a job runs either megaheal's trainer (config) or a user's program (program)")
            if self.nproc_per_node < 1:
                raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
            if self.grace < timedelta(0):
                raise ValueError(f"grace must be >= 0, got {self.grace}")
            if self.groups is not None and (self.warm is not None or self.program is not None):
                raise ValueError("replica groups are megaheal's trainer's (ft.enabled), and not warm: a lost group's "
                                 "peers train on, there is nothing to restart warm")

    cfg: Config
    view: ProcessView
    clock: Callable[[], float]
    agents: dict[str, AgentClient]
    env: dict[str, str]
    attempt: AgentAttempt | None
    history: list[AgentAttempt]
    closed: bool
    """Set on the way out (`close`): no attempt starts any more, so a restart in flight cannot outlive us."""
    warm: WarmControl | None
    epoch: int
    """This healer's epoch (healer/incidents/epochs.py), in every order: an agent that took a newer one refuses it."""
    fence: Fence
    """Tripped by the first order an agent refused for its epoch: from then on this healer orders nothing and writes
    nothing to the run's journal (a newer healer drives the job; the loop ends, healer/runner/loop.py)."""
    _paths: RunPaths
    _token: str
    _first_number: int
    _lock: threading.RLock
    _leftovers_stopping: set[tuple[str, int]]

    def _check(self, token: str) -> None:
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            raise Unauthorized("killing or restarting training needs the run's token")

    def _order_id(self, kind: str, attempt: int, node: str, extra: str = "") -> str:
        # NOTE: the epoch too: a later healer of the job (a plain run in the same run directory numbers its attempts
        # from 0 again) must not find its order taken for one an agent carried out for the healer before.
        return f"{self.cfg.job}-{attempt}:{kind}:{node}{extra}@{self.epoch}"

    def _client(self, node: str) -> AgentClient:
        """The host's client, telling this healer's fence when the agent refuses its epoch."""
        return replace(self.agents[node], fence=self.fence)

    def overrides(self, dp: int | None, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The `--set` items of an attempt: the job's name first (the ranks report under it), the run's, the dp degree
        of the attempt, and `extra` (batches to skip after a rollback)."""
        return (f"job={self.cfg.job}", *self.cfg.overrides, *((f"parallel.dp={dp}",) if dp is not None else ()), *extra)

    def start_order(self, number: int, nodes: tuple[str, ...], node_rank: int, endpoint: str | None,
                    resume: str | None, overrides: tuple[str, ...]) -> StartOrder:
        """The start order of host `nodes[node_rank]` for attempt `number`."""
        node = nodes[node_rank]
        common = dict(id=self._order_id("start", number, node), job=self.cfg.job, attempt=number, nnodes=len(nodes),
                      node_rank=node_rank, nproc_per_node=self.cfg.nproc_per_node, rdzv_endpoint=endpoint,
                      run_dir=str(Path(self.cfg.run_dir).absolute()), env=self.env, epoch=self.epoch)
        if self.cfg.program is not None:
            # NOTE: a program resumes from its own checkpoints (its business); of a rollback it hears which batches
            # to pass over.
            return StartOrder(**common, program=self.cfg.program, resume=None, skip_steps=skipped_steps(overrides),
                              resume_step=program_resume_step(resume))
        return StartOrder(**common, config=self.cfg.config, resume=resume, overrides=list(overrides))

    def _quick(self, node: str) -> AgentClient:
        """The host's client for an order that only has to be queued (the agent answers at once): a host that does
        not answer within seconds is taken as lost instead of holding up the stop of every other host."""
        return replace(self._client(node), timeout_s=min(self.agents[node].timeout_s, 2.0), attempts=2)

    def journal_event(self, event: journal.Event) -> None:
        """An event of another part of the launcher (a host screened) in the run's journal."""
        self._journal(event)

    def _journal(self, event: journal.Event) -> None:
        if self.fence.by is not None:
            log.warning("fenced: not journalled (a newer healer keeps the journal): %s", event)
            return
        journal.append(self._paths.journal, event)

    # ---- what one part asks of another (coordinator.py and coordinator_stop.py answer) -----------------------

    def poll(self) -> None:
        raise NotImplementedError

    def stop(self, token: str, grace: timedelta | None = None, hurry: Callable[[], bool] = lambda: False) -> None:
        raise NotImplementedError


T = TypeVar("T")


PROGRAM_STEP = "step-"
"""How a program's attempt is told to resume from the checkpoint of a step (`resume` = "step-N"; "auto": its own
choice), as megaheal's trainer is told a checkpoint's path."""


def program_resume(step: int | None) -> str:
    return "auto" if step is None else f"{PROGRAM_STEP}{step}"


def program_resume_step(resume: str | None) -> int | None:
    return int(resume[len(PROGRAM_STEP):]) if resume and resume.startswith(PROGRAM_STEP) else None


def skipped_steps(overrides: tuple[str, ...]) -> list[int]:
    """The steps of the `skip_steps=[a,b]` item among an attempt's overrides (healer/launchers/placement.py writes
    it), for a program that takes them from its environment instead."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "skip_steps":
            return [int(s) for s in value.strip("[]").split(",") if s.strip()]
    return []


def on_each(items: list[T], act: Callable[[T], None]) -> None:
    """`act` on every host at once (one slow or lost host must not hold up the others; a cluster has thousands)."""
    if len(items) <= 1:
        for item in items:
            act(item)
        return
    with ThreadPoolExecutor(max_workers=min(64, len(items)), thread_name_prefix="megaheal-order") as pool:
        list(pool.map(act, items))
