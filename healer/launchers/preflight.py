"""Screening hosts before they take work: every host of the job and every spare runs the `preflight` runbook
(runbooks/library/preflight.yaml: node-health's fast checks, ~15 s at most) on itself, through its node agent, all
at once, before the first attempt starts. A host that fails is left out before it costs anything: a spare is no
longer one, and a host of the job gives its place to a spare that passed (or, with none, the job starts smaller where
its layout allows). While the job runs, its idle spares are screened again now and then (AgentRemediator.rescreen):
one that fails is a spare no more; so are the hosts it left out, but a lemon or a host convicted of silent data
corruption (which no screening can clear): one that passes is a spare again, and a job that came back smaller grows
back onto it (AgentRemediator.grow). A host whose runbook could not run (`error`) is not blamed: screening must not
take a healthy host out on a guess, as no diagnosis does.

NOTE: HyperPod, NVRx and NVSentinel screen a node before it takes work for the same reason: a broken spare found
only when it joins costs a second incident and a second restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from healer.launchers.placement import Placement
from healer.ports import HostVerdict
from wire.verdict import Status

PREFLIGHT_RUNBOOK = "preflight"


class PreflightError(RuntimeError):
    """The job cannot start: hosts of it failed screening and neither spares nor a smaller layout can take their
    place. The message names each failed host and why."""


def failed(verdicts: list[HostVerdict]) -> dict[str, str]:
    """The hosts that failed screening, with what failed; degraded and error verdicts blame no host."""
    return {v.node: v.summary for v in verdicts if v.status is Status.FAIL}


def screened_placement(placement: Placement, bad: Mapping[str, str], valid_dp: tuple[int, ...]) -> Placement:
    """Where the job starts once the hosts in `bad` (host -> why) are left out: each failed host of the job replaced
    by a spare that passed, in its node-rank place; with too few, the job on fewer hosts, its data-parallel degree
    shrunk with them (one replica a host's worth), where `valid_dp` accepts it. Raises PreflightError otherwise."""
    spares = [s for s in placement.spares if s not in bad]
    failing = [n for n in placement.nodes if n in bad]
    instead = dict(zip(failing, spares))
    missing = [n for n in failing if n not in instead]
    nodes = tuple(instead.get(n, n) for n in placement.nodes if n not in missing)
    dp = placement.dp
    if missing:
        n_old = len(placement.nodes)
        fits = nodes and (placement.dp * len(nodes)) % n_old == 0
        dp = placement.dp * len(nodes) // n_old if fits else 0
        if not fits or (valid_dp and dp not in valid_dp):
            why = "; ".join(f"{n}: {bad[n]}" for n in failing)
            raise PreflightError(f"the job cannot start: {', '.join(failing)} failed preflight ({why}), no spare that "
                                 f"passed is left for {', '.join(missing)}, and the job's layout does not fit on "
                                 f"{len(nodes)} host(s)")
    return replace(placement, nodes=nodes, dp=dp, spares=tuple(s for s in spares if s not in nodes),
                   excluded=placement.excluded | set(bad))
