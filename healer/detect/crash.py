"""`crash`: ranks that ended with a failure, from the launcher's view, one finding per (job, attempt).

When one rank dies, the others fail after it (their peers closed the connection) and the torchrun agent
stops the rest. The finding names the rank most likely to be the cause: the earliest failed exit whose
log does not merely say that a peer went away, and classifies its log tail (out of memory, NCCL, gloo,
segfault, Python exception). An attempt's incident is healthy once a later attempt of the job runs.

When every failure is such an echo (looked at `silent_after` past the first, so that a host's silence can show)
and a host of the attempt has gone silent (no batch from its node agent), the cause died with its host and
nothing of it will be reported: the crash is held back for `silent_host_hold` so
that the host_lost detector can name the host (its remedy leaves the host out; a crash's would diagnose a host that
cannot answer). Past the hold it fires, naming the silent host.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from healer.detect.base import Detector, Evaluation, Finding
from healer.detect.logtail import classify, signal_name, signature
from healer.detect.silence import silent_hosts
from healer.detect.suspects import Suspect
from healer.observe.jobview import Readings
from healer.observe.processes import ProcessExit
from wire.telemetry import RankEntry

MAX_LISTED = 32


class Crash(Detector):
    name = "crash"
    reads_processes = True

    @dataclass(kw_only=True, slots=True)
    class Config:
        settle: timedelta = timedelta(seconds=0)
        """Wait this long after the first failed exit before firing, so that the other ranks' exits (the
        evidence for which rank was first) are in. 0: fire on the first cycle that sees a failure."""
        report_wait: timedelta = timedelta(seconds=30)
        """When the first rank's exit status could not be read (torchrun reaped it first), wait for torchrun's
        failure report, which says how it died: it is in once the host's part of the attempt has ended (torchrun
        exits right after it, the launcher gives it a short grace), and this long at most (a torchrun that hangs)."""
        tail_lines: int = 20
        """Log lines of the suspect rank kept as evidence."""
        silent_host_hold: timedelta = timedelta(seconds=30)
        """How long a crash of peer echoes only is held back while a host of the attempt is silent (see above)."""
        silent_after: timedelta = timedelta(seconds=3)
        """A host is silent when its agent's last batch is older than this."""
        signature_wait: timedelta = timedelta(seconds=2)
        """A crash whose cause is the program's own exception (it has a signature, healer/detect/logtail.py) waits
        this long after the first failed exit for the attempt's other ranks to exit: whether the same exception
        struck other hosts too is what tells a crash loop (healer.decide.plans.crash_loop). NOTE: the ranks of a
        data-parallel job reach a bug's step together, but whichever exits first was seen alone, and a loop on
        two hosts went unseen for an attempt (a fresh make test's run, the first raiser on the same host twice)."""

        def __post_init__(self) -> None:
            if min(self.settle, self.report_wait, self.silent_host_hold, self.signature_wait) < timedelta(0):
                raise ValueError(f"settle, report_wait, silent_host_hold and signature_wait must be >= 0, got "
                                 f"{self.settle}, {self.report_wait}, {self.silent_host_hold}, {self.signature_wait}")
            if self.silent_after <= timedelta(0):
                raise ValueError(f"silent_after must be > 0, got {self.silent_after}")
            if not 1 <= self.tail_lines <= 200:
                raise ValueError(f"tail_lines must be in 1..200, got {self.tail_lines}")

    config: Config

    def evaluate(self, table: Readings, now: float) -> Evaluation:
        view = table.processes
        by_attempt: dict[tuple[str, int], list[ProcessExit]] = {}
        for ex in view.exits():
            by_attempt.setdefault((ex.job, ex.attempt), []).append(ex)
        firing, healthy = [], set()
        for (job, attempt), exits in by_attempt.items():
            current = view.attempt(job)
            # NOTE: a job of replica groups goes on in the same attempt after a group is replaced: a group that fails
            # after that (the one started, or another) is a fault of its own, decided again
            regroups = view.regroups(job) if current == attempt else 0
            key = f"{job}/attempt-{attempt}" + (f"/regroup-{regroups}" if regroups else "")
            if current is not None and current > attempt:
                healthy.add(key)  # a later attempt runs: this attempt's crash was dealt with
                continue
            finishing = _finishing_ranks(table, job, {e.rank for e in exits if e.vanished and e.rank is not None})
            ended = view.ended_nodes(job)
            # A rank that vanished (its agent reaped it first) ended normally when it said it was finishing, or when
            # its host's part exited 0: torchrun exits 0 only when every worker did. Its last heartbeat may be lost.
            failed = sorted((e for e in exits if e.failed and not (e.vanished and (e.rank in finishing or
                                                                                 ended.get(e.node) == 0))),
                            key=lambda e: e.at)
            if not failed or now - failed[0].waited_from < self.config.settle.total_seconds():
                continue
            # NOTE: any exit without its status, not only the first: a peer's echo seen at the same moment (its
            # status read from its zombie) once came first, and the crash fired naming the cause "vanished".
            unknown = [e for e in failed if e.vanished and e.node not in ended]
            if unknown and now - min(e.waited_from for e in unknown) < self.config.report_wait.total_seconds():
                continue  # how it died is on its way: torchrun's report, once its host's part has ended
            echoes = all(classify(e.exit_code, e.signal, e.log_tail).peer_failure for e in failed if e.rank is not None)
            if echoes and now - failed[0].waited_from < self.config.silent_after.total_seconds():
                continue  # only echoes so far: long enough to tell whether the cause's host went silent
            silent = self._silent_hosts(table, job, now) if echoes else []
            if silent and now - failed[0].waited_from < self.config.silent_host_hold.total_seconds():
                continue  # the cause is on a host that went silent: host_lost names it
            if not silent and now - failed[0].waited_from < self.config.signature_wait.total_seconds() and \
                    _signed(failed):
                continue  # the program's own exception: whether it struck other hosts too is on its way
            firing.append(self._finding(key, job, attempt, failed, silent))
        return Evaluation(firing=tuple(firing), healthy=frozenset(healthy))

    def _silent_hosts(self, table: Readings, job: str, now: float) -> list[str]:
        """The hosts of the job's attempt whose agents went silent."""
        return list(silent_hosts(table, job, now, self.config.silent_after.total_seconds()))

    def _finding(self, key: str, job: str, attempt: int, failed: list[ProcessExit],
                 silent: list[str] | None = None) -> Finding:
        classes = [(e, classify(e.exit_code, e.signal, e.log_tail)) for e in failed]
        if silent:
            return self._host_finding(key, job, attempt, classes, silent)
        # The cause: the first exit that is not a peer's echo; failing that, simply the first one.
        cause, cls = next(((e, c) for e, c in classes if not c.peer_failure and e.rank is not None), classes[0])
        how = (f"killed by {signal_name(cause.signal)}" if cause.signal is not None else
               "vanished (exit status unknown)" if cause.vanished else f"exited with code {cause.exit_code}")
        why = "" if cls.category in ("signal", "exit-code", "unknown") else f" ({cls.category}: {cls.detail})"
        who = f"rank {cause.rank}" if cause.rank is not None else "the agent"
        others = len(failed) - 1
        # The application's own failure, and the hosts it struck in this attempt (every rank that failed the same way):
        # the same one in another attempt on another host is a crash loop (healer.decide.plans.crash_loop).
        sig = signature(cls, cause.log_tail)
        struck = sorted({e.node for e, c in classes if sig is not None and signature(c, e.log_tail) == sig})
        return Finding(
            key=key, job=job, node=cause.node,
            summary=f"{who} on {cause.node} {how}{why}" + (f"; {others} more process(es) failed after it"
                                                              if others else ""),
            evidence={"attempt": attempt, "exit_code": cause.exit_code, "signal": signal_name(cause.signal) if cause.signal else None,
                      "vanished": cause.vanished,
                      "class": cls.to_payload(), "log_tail": list(cause.log_tail[-self.config.tail_lines:]),
                      "signature": sig, "signature_nodes": struck,
                      "failed": [{"rank": e.rank, "node": e.node, "exit_code": e.exit_code,
                                  "signal": signal_name(e.signal) if e.signal else None, "at": e.at,
                                  "category": c.category, "peer_failure": c.peer_failure}
                                 for e, c in classes[:MAX_LISTED]]},
            labels={"suspect_node": cause.node, "category": cls.category},
            suspects=(Suspect(node=cause.node, rank=cause.rank),),
        )


    def _host_finding(self, key: str, job: str, attempt: int, classes: list[tuple[ProcessExit, Any]],
                      silent: list[str]) -> Finding:
        node = silent[0]
        return Finding(
            key=key, job=job, node=node,
            summary=(f"the ranks on {node} were lost with their host (silent); {len(classes)} process(es) on other "
                     "hosts failed after it"),
            evidence={"attempt": attempt, "silent_hosts": silent,
                      "failed": [{"rank": e.rank, "node": e.node, "exit_code": e.exit_code,
                                  "signal": signal_name(e.signal) if e.signal else None, "at": e.at,
                                  "category": c.category, "peer_failure": c.peer_failure}
                                 for e, c in classes[:MAX_LISTED]]},
            labels={"suspect_node": node, "category": "host-lost"},
            suspects=(Suspect(node=node),),
        )


def _signed(failed: list[ProcessExit]) -> bool:
    """Whether the cause of a crash (its first exit that is not a peer's echo, as _finding picks it) is the
    program's own exception."""
    for e in failed:
        cls = classify(e.exit_code, e.signal, e.log_tail)
        if not cls.peer_failure and e.rank is not None:
            return signature(cls, e.log_tail) is not None
    return False


def _finishing_ranks(table: Readings, job: str, ranks: set[int]) -> set[int]:
    """Those of `ranks` (of `job`) whose latest heartbeat said they are finishing.

    NOTE: looked up through the job's columns, and each named rank's entry read alone: a pass over every rank's
    entry would build 131,072 of them (relayed ranks keep none of their own) in every cycle an exit stands."""
    cols = table.columns().get(job)
    if not ranks or cols is None:
        return set()
    wanted = np.fromiter(ranks, dtype=np.int64, count=len(ranks))
    slots = np.flatnonzero(cols.counts & np.isin(cols.rank, wanted))
    return {beat.rank for i in slots if (beat := cols.beats[i]) is not None and _finishing(beat.entry)}


def _finishing(entry: RankEntry) -> bool:
    return entry.last_event is not None and entry.last_event.name == "finishing"
