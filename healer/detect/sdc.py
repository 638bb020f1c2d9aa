"""The re-run verdicts of megaheal's trainer (train/rerun.py, wire/rerun.py), as two detectors:

- `sdc`: a host convicted of silent data corruption: a `persistent` verdict blamed its ranks, or `convict_after`
  strikes did: `transient` verdicts (a host whose arithmetic fails now and then is not cured by a second try that
  happened to pass) and `diverged` ones (its rank's gathered copy of the weights was not its peers'). One finding per convicted host, with every verdict that counted against it; the catalogue's remedy leaves
  the host out, drains it, and a spare takes its place.
- `rerun`: what the trainer mended in place and no host is convicted of yet: a batch judged `data` (its update
  skipped), a `transient` fault (the re-run's result used), a `diverged` copy of the weights (its step skipped), an
  `inconclusive` re-run. One finding per verdict, seen
  once: a notice, resolved at the next cycle (nothing is left to mend).

A `state` verdict is neither's: the model itself went bad, every rank reports the anomalous loss, and the nonfinite or
loss_spike detector rolls the job back.

A verdict names ranks; the hosts are the ones the ranks' heartbeats come from when the verdict is first seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.suspects import Suspect, on_hosts
from healer.observe.jobview import Readings
from healer.observe.rank_columns import JobView
from wire.rerun import RerunVerdict

CONVICTING = ("persistent", "transient", "diverged")
STRIKES = ("transient", "diverged")
"""Verdicts that convict a host only together (convict_after of them)."""
NOTICED = ("transient", "data", "inconclusive", "diverged")


def rank_nodes(cols: JobView) -> dict[int, str]:
    """The host of each rank that counts now."""
    return {beat.rank: beat.node for beat in cols.counted_beats()}


def evidence_of(verdict: RerunVerdict, nodes: dict[int, str]) -> dict[str, Any]:
    """What a person reads of one verdict."""
    named = sorted({nodes[r] for r in verdict.ranks if r in nodes})
    out: dict[str, Any] = {"step": verdict.step, "attempt": verdict.attempt, "verdict": verdict.verdict,
                           "what": verdict.what, "ranks": list(verdict.ranks), "nodes": named,
                           "flagged_ranks": list(verdict.flagged), "reproduced": verdict.reproduced,
                           "moved_same": verdict.moved, "skipped": verdict.skipped, "rerun_s": verdict.seconds}
    if verdict.samples:
        out["samples"] = [verdict.samples[i:i + 2] for i in range(0, len(verdict.samples), 2)]
    return out


@dataclass(slots=True)
class _Host:
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    strikes: int = 0
    convicted_in: int | None = None
    """The attempt it was convicted in (None: not yet, or outside a launcher)."""
    convicted: bool = False


class Sdc(Detector):
    name = "sdc"

    @dataclass(kw_only=True, slots=True)
    class Config:
        convict_after: int = 2
        """Strikes on one host that convict it (transient or diverged verdicts; a persistent one convicts at once)."""

        def __post_init__(self) -> None:
            if self.convict_after < 1:
                raise ValueError(f"convict_after must be >= 1, got {self.convict_after}")

    config: Config

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._seen: dict[str, set[tuple[int | None, int]]] = {}
        self._hosts: dict[tuple[str, str], _Host] = {}

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        firing, healthy = [], set()
        for job, cols in table.columns().items():
            seen = self._seen.setdefault(job, set())
            fresh = [v for v in cols.verdicts if (v.attempt, v.step) not in seen and v.verdict in CONVICTING]
            seen.update((v.attempt, v.step) for v in cols.verdicts)
            nodes = rank_nodes(cols) if fresh else {}
            for verdict in fresh:
                for node in sorted({nodes[r] for r in verdict.ranks if r in nodes}):
                    self._count(self._hosts.setdefault((job, node), _Host()), verdict, nodes)
            attempt = table.processes.attempt(job)
            placed, _ = table.processes.placement(job)
            for (name, node), host in self._hosts.items():
                if name != job or not host.convicted:
                    continue
                key = f"{job}/{node}"
                # NOTE: by the hosts the job runs on where the launcher said them: a restart for another incident
                # (the rollback of the NaN the corruption made) keeps the host, and the conviction must stand until
                # one leaves it out. On the bed one that went by the attempt's number resolved with that rollback,
                # and the NaN that came back next step named both hosts.
                left_out = node not in placed if placed else \
                    attempt is not None and host.convicted_in is not None and host.convicted_in != attempt
                if left_out:
                    healthy.add(key)  # left out by the restart that convicted it
                    continue
                firing.append(self._finding(job, node, host))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _count(self, host: _Host, verdict: RerunVerdict, nodes: dict[int, str]) -> None:
        host.verdicts.append(evidence_of(verdict, nodes))
        host.strikes += verdict.verdict in STRIKES
        if not host.convicted and (verdict.verdict == "persistent" or host.strikes >= self.config.convict_after):
            host.convicted, host.convicted_in = True, verdict.attempt

    def _finding(self, job: str, node: str, host: _Host) -> Finding:
        last = host.verdicts[-1]
        why = ("its ranks gave other results for the same work" if last["verdict"] == "persistent"
               else f"{host.strikes} faults of its ranks were caught and mended (re-runs that came out clean, copies "
                    "of the weights that were not their peers')")
        ranks = sorted({r for v in host.verdicts for r in v["ranks"]})
        return Finding(
            key=f"{job}/{node}", job=job, node=node,
            summary=f"silent data corruption on {node}: {why} (step {last['step']}, ranks "
                    f"{', '.join(map(str, last['ranks']))})",
            evidence={"verdicts": host.verdicts, "strikes": host.strikes,
                      "convict_after": self.config.convict_after},
            labels={"verdict": last["verdict"]},
            suspects=(*on_hosts([node]), *(Suspect(rank=r, node=node) for r in ranks)),
            # The first step the host was seen at fault: the checkpoints saved since are tainted (plans.untainted).
            first_bad_step=min(v["step"] for v in host.verdicts))


class RerunNotice(Detector):
    name = "rerun"

    @dataclass(kw_only=True, slots=True)
    class Config:
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._seen: dict[str, set[tuple[int | None, int]]] = {}
        self._shown: set[str] = set()

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        firing = []
        healthy = set(self._shown)  # a notice is shown for one cycle: nothing is left to mend
        self._shown = set()
        for job, cols in table.columns().items():
            seen = self._seen.setdefault(job, set())
            fresh = [v for v in cols.verdicts if (v.attempt, v.step) not in seen]
            seen.update((v.attempt, v.step) for v in cols.verdicts)
            fresh = [v for v in fresh if v.verdict in NOTICED]
            nodes = rank_nodes(cols) if fresh else {}
            for verdict in fresh:
                key = f"{job}/{verdict.attempt}/{verdict.step}"
                firing.append(notice(job, key, verdict, nodes))
                self._shown.add(key)
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy - self._shown))


def notice(job: str, key: str, verdict: RerunVerdict, nodes: dict[int, str]) -> Finding:
    evidence = evidence_of(verdict, nodes)
    named = evidence["nodes"]
    if verdict.verdict == "data":
        spans = ", ".join(f"{a}-{b - 1}" for a, b in evidence.get("samples", []))
        summary = (f"step {verdict.step}'s batch (samples {spans}) gave the same {verdict.what} on other ranks: "
                   "judged data, its update skipped")
    elif verdict.verdict == "diverged":
        summary = (f"{', '.join(named) or 'ranks ' + ', '.join(map(str, verdict.ranks))} trained step {verdict.step} "
                   "on a copy of the weights that was not its peers': named before the update, which was skipped")
    elif verdict.verdict == "transient":
        summary = (f"step {verdict.step} came out clean when re-run: a one-off {verdict.what} on "
                   f"{', '.join(named) or 'ranks ' + ', '.join(map(str, verdict.ranks))}")
    else:
        summary = f"step {verdict.step}'s re-runs could not tell a host from the data ({verdict.what}): update skipped"
    return Finding(key=key, job=job, node=named[0] if len(named) == 1 else None, summary=summary,
                   evidence=evidence, labels={"verdict": verdict.verdict},
                   suspects=tuple(Suspect(rank=r, node=nodes.get(r)) for r in verdict.ranks))
