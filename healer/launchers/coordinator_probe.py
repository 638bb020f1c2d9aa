"""The coordinator's probing part: which host runs a rank, what every rank is doing (from its host, touching none),
a runbook on a host, and a signal to one rank (fault injection), each through the host's agent."""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

from healer.launchers.agent_client import AgentUnreachable, OrderFailed
from healer.launchers.coordinator_base import CoordinatorBase, on_each
from wire.orders import EvidenceOrder, RunbookOrder, SignalOrder


class Probes(CoordinatorBase):
    def kill_rank(self, token: str, rank: int, sig: int) -> int:
        """Send `sig` to one rank of the current attempt, through its host's agent (fault injection); its pid."""
        self._check(token)
        self.fence.check()
        node = self.node_of_rank(rank)
        a = self.attempt
        assert a is not None
        name = signal.Signals(sig).name
        order = SignalOrder(id=self._order_id("signal", a.number, node, f":{rank}:{name}:{time.time_ns()}"),
                            epoch=self.epoch, attempt=a.number, rank=rank, signal=name)  # type: ignore[arg-type]
        return self._client(node).run(order, 10).pid

    def run_runbook(self, node: str, runbook: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """`megaheal diagnose RUNBOOK --json` on `node`, through its agent, in the environment its ranks get."""
        order = RunbookOrder(id=f"runbook:{node}:{runbook}:{time.time_ns()}", epoch=self.epoch, runbook=runbook,
                             timeout_s=timeout_s)
        try:
            result = self._client(node).run(order, timeout_s + 30)
        except (AgentUnreachable, OrderFailed) as exc:
            raise TimeoutError(str(exc)) from exc
        if result.timeout or result.returncode is None:
            raise TimeoutError(f"{runbook} on {node} ran past {timeout_s:g} s")
        return subprocess.CompletedProcess(["diagnose", runbook], result.returncode, result.stdout, result.stderr)

    def rank_evidence(self, timeout_s: float) -> dict[str, Any]:
        """What every rank of the current attempt is doing, from each host's agent at once (stacks, states, phases;
        nothing is signalled): {"attempt", "ranks": [... each with its "node"], "unreached": {host: why}}."""
        with self._lock:
            a = self.attempt
            nodes = [n for n in a.nodes if n not in a.ended] if a is not None else []
        if a is None:
            return {"attempt": None, "ranks": [], "unreached": {}}
        found: list[dict[str, Any]] = []
        unreached: dict[str, str] = {}

        def ask(node: str) -> None:
            order = EvidenceOrder(id=self._order_id("evidence", a.number, node, f":{time.time_ns()}"),
                                  epoch=self.epoch, attempt=a.number, timeout_s=timeout_s)
            try:
                answer = self._client(node).run(order, timeout_s + 15)
            except (AgentUnreachable, OrderFailed) as exc:
                unreached[node] = str(exc)[:300]
                return
            found.extend({**r, "node": node} for r in answer.ranks)

        on_each(nodes, ask)
        return {"attempt": a.number, "ranks": sorted(found, key=lambda r: (r.get("rank") is None, r.get("rank"))),
                "unreached": unreached}

    def rank_pids(self) -> list[int]:
        return [s.pid for s in self.view.states() if s.job == self.cfg.job]

    def node_of_rank(self, rank: int) -> str:
        with self._lock:
            a = self.attempt
            node = next((r.node for r in (a.ranks.values() if a else []) if r.rank == rank), None)
        if node is None:
            raise LookupError(f"rank {rank} is not running")
        return node

    def ranks_found(self) -> int:
        with self._lock:
            return len(self.attempt.ranks) if self.attempt else 0
