"""The healer's side of an attempt run by node agents: it orders each host's agent to start its part (the first host
first: it picks the rendezvous port and says which), to stop, to signal a rank; what the processes do it learns from
the agents' batches (healer/observe/processes.py: ProcessView.report). It never touches a process itself.

It answers as the single-machine supervisor of old did (start, poll, stop, kill_rank, take_over, the attempt and its
history), so the remediator and the loop above it do not care where the hosts are. Every call that kills or
restarts work needs the run's token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from healer.launchers.agent_client import AgentClient, AgentUnreachable, Fence, OrderFailed
from healer.launchers.attempt import AgentAttempt, AgentRank
from healer.launchers.coordinator_base import START_TIMEOUT_S, CoordinatorBase, Unauthorized, on_each
from healer.launchers.coordinator_groups import Groups
from healer.launchers.coordinator_probe import Probes
from healer.launchers.coordinator_stop import Stops
from healer.launchers.coordinator_takeover import TakeOvers
from healer.launchers.coordinator_warm import WarmGenerations
from healer.launchers.warm_control import WarmControl
from healer.observe.processes import ProcessView
from wire import journal
from wire.run_paths import RunPaths

__all__ = ["AgentAttempt", "AgentRank", "Coordinator", "Unauthorized"]
log = logging.getLogger(__name__)


class Coordinator(WarmGenerations, Groups, Stops, Probes, TakeOvers):
    """The healer's side of one job's attempts on its hosts' node agents (its parts: coordinator_base.py)."""

    def __init__(self, cfg: CoordinatorBase.Config, view: ProcessView, token: str,
                 agents: dict[str, AgentClient] | None = None,
                 env: dict[str, str] | None = None, clock: Callable[[], float] = time.time, *, epoch: int) -> None:
        """`agents`: one client per host (spares included; filled in when the launcher has started them); `env`:
        GLOO_/NCCL_/... settings for every rank; `epoch`: this healer's, claimed before its first order
        (healer/incidents/epochs.py)."""
        if len(token) < 16:
            raise ValueError("the coordinator needs the run's token (at least 16 characters)")
        self.cfg, self.view, self.clock = cfg, view, clock
        self._paths = RunPaths(Path(cfg.run_dir))
        self.agents: dict[str, AgentClient] = dict(agents or {})
        self.env = dict(env or {})
        self._token = token
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch
        self.fence = Fence()
        self.attempt: AgentAttempt | None = None
        self.history: list[AgentAttempt] = []
        self._first_number = 0
        self.closed = False
        """Set on the way out (`close`): no attempt starts any more, so a restart in flight cannot outlive us."""
        self._lock = threading.RLock()
        self._leftovers_stopping: set[tuple[str, int]] = set()
        """(host, attempt) of each older attempt found still running that is being (or was) stopped there."""
        self.warm = (WarmControl(cfg.warm, token=token, job=cfg.job, nproc_per_node=cfg.nproc_per_node)
                     if cfg.warm is not None else None)
        self.group_of = {}
        self._group_overrides, self._regroups = (), 0

    def start(self, token: str, nodes: tuple[str, ...], dp: int | None = None, resume: str | None = "auto",
              extra: tuple[str, ...] = (), spares: tuple[str, ...] = ()) -> AgentAttempt:
        """Start the next attempt on `nodes` (the previous one must be over). RuntimeError when a host's agent
        refuses or cannot be reached (the attempt is then stopped where it did start). `spares`: a warm job's spare
        hosts, which run standbys only."""
        self._check(token)
        self.fence.check()
        with self._lock:
            if self.closed:
                raise RuntimeError(f"the coordinator of {self.cfg.job} is shutting down: no new attempt")
            if self.attempt is not None and not self.attempt.done:
                raise RuntimeError(f"attempt {self.attempt.number} still runs; stop it first")
            number = self.attempt.number + 1 if self.attempt is not None else self._first_number
            # NOTE: replica groups: the healer's dp is the number of groups; each group's own is the config's
            overrides = self.overrides(dp if self.cfg.groups is None else None, extra)
            self.view.started(self.cfg.job, number, tuple(nodes), self.clock())
            self.attempt = AgentAttempt(number=number, nodes=tuple(nodes), started_at=self.clock(), dp=dp, resume=resume)
            self.history.append(self.attempt)
            self._journal(journal.Start(job=self.cfg.job, attempt=number, at=self.attempt.started_at,
                                        nodes=list(nodes), dp=dp, resume=resume,
                                        agent_urls={n: self.agents[n].url for n in nodes},
                                        warm=journal.WarmNote(formation=True, formed_in=number) if self.warm else None))
        if self.warm is not None:
            return self._form_warm(token, number, nodes, resume, overrides, spares)
        if self.cfg.groups is not None:
            failures = self._start_groups(number, tuple(nodes), resume, overrides)
            if failures:
                log.error("attempt %d of %s could not start: %s", number, self.cfg.job, failures[0])
                self.stop(token, timedelta(0))
                raise RuntimeError(f"attempt {number} could not start: {failures[0]}")
            log.info("attempt %d of %s started as replica groups on %s", number, self.cfg.job, ", ".join(nodes))
            return self.attempt
        failures: list[Exception] = []

        def launch(node_rank: int, endpoint: str | None) -> str:
            node = nodes[node_rank]
            result = self._client(node).run(self.start_order(number, nodes, node_rank, endpoint, resume, overrides),
                                           START_TIMEOUT_S)
            # Each host's torchrun and when it started: what a take-over checks before it signals that pid.
            self._journal(journal.Launched(attempt=number, at=self.clock(), agents={node: result.pid},
                                           agents_started={node: result.started}))
            return str(result.rdzv_endpoint)

        def launch_rest(node_rank: int) -> None:
            try:
                launch(node_rank, endpoint)
            except (AgentUnreachable, OrderFailed) as exc:
                failures.append(exc)

        try:
            # The first host picks the rendezvous endpoint (it holds the store); the others join it, all at once.
            endpoint = launch(0, None)
            on_each(list(range(1, len(nodes))), launch_rest)
            if failures:
                raise failures[0]
        except (AgentUnreachable, OrderFailed) as exc:
            log.error("attempt %d of %s could not start: %s", number, self.cfg.job, exc)
            self.stop(token, timedelta(0))
            raise RuntimeError(f"attempt {number} could not start: {exc}") from exc
        log.info("attempt %d of %s started on %s (resume %s)", number, self.cfg.job, ", ".join(nodes), resume)
        return self.attempt

    def poll(self) -> None:
        """Bring the attempt up to date with what the agents reported (cheap: in memory)."""
        with self._lock:
            a = self.attempt
            if a is None:
                return
            found = len(a.ranks)
            for node, pid, rank, local, started in self.view.reported_ranks(self.cfg.job):
                a.ranks.setdefault(pid, AgentRank(rank, local, node, pid, started))
            for node, code in self.view.ended_nodes(self.cfg.job).items():
                if a.host_ended(node, code):
                    self._journal(journal.End(attempt=a.number, at=self.clock(), exit_codes=dict(a.exit_codes),
                                              stopped=a.stopping))
                    if a.succeeded and self.warm is not None:
                        self.warm.end(a.number)  # the job is done: the standbys leave
            self.finish_groups(a)
            for node, old in self.view.leftovers(self.cfg.job).items():
                self._stop_leftover(node, old)
            if len(a.ranks) > found:
                # `started`: for a take-over's checks; `nodes`: which host each rank ran on (the pages' heat maps).
                self._journal(journal.Ranks(
                    attempt=a.number, at=self.clock(), ranks={str(pid): r.rank for pid, r in a.ranks.items()},
                    started={str(pid): r.started for pid, r in a.ranks.items() if r.started is not None},
                    nodes={str(r.rank): r.node for r in a.ranks.values()}))
