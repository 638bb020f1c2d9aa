"""Fail-slow: whether a host that persistently slows the job is worth replacing with a spare, or cheaper to bear.

A straggler, or a host's slow link, costs every step the seconds it adds (`excess_s`), for as long as it stays; a
swap costs one restart once (the job stopped, the spare started, its first step). Like renting skis against buying
them, the healer pays the slowdown while what it projects to cost stays under what the swap costs, and swaps once it
would not: the projected loss is the excess times the steps left (the job's own length where its launcher knows it,
else `Limits.slow_horizon` of steps at the current step time, and never where that is not set either), the swap's
cost the median of this job's own recovered restarts (decision to the new attempt's first step), or
`Limits.swap_cost` until the job has one. A small slowdown is borne: it costs nothing to leave it. Pure: the policy
(healer/decide/policy.py) calls it with facts.

The swap is a cold restart without the slow host, the spare in its place, at a checkpoint boundary: the policy waits
for a checkpoint newer than the step the slowdown was named at, so that the swap loses no step (the steps since
that checkpoint are all it redoes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from healer.decide.plans import JobFacts, Limits


@dataclass(frozen=True, slots=True)
class Slowdown:
    """A persistent slowdown as the swap decision reads it (a straggler's evidence, or a slow link's)."""

    host: str
    """The host of the rank that holds the job up."""
    excess_s: float
    """Seconds each step of the job loses to it (the slow rank's extra compute or data wait, or how late it reaches
    the reduce, over its peers')."""
    step_s: float
    """The job's step time now (the median rank's, with the slowdown)."""
    step: int | None
    """The job step at which it was named; None: not known."""


def slowdown_from(evidence: dict[str, Any], host: str | None) -> Slowdown | None:
    """A straggler's or a slow link's Slowdown from its incident's evidence (healer/detect/straggler.py and
    collective_slowdown.py: excess_s, step_s, step); its host the incident's, else the one host a runbook across the
    job's hosts named (network-triage: `named_by`). None where the evidence does not hold them (an older healer's
    incident) or names no host, or several (a switch, or the healer's own link: no one spare mends that)."""
    if host is None:
        named = list((evidence.get("named_by") or {}).get("hosts") or {})
        host = named[0] if len(named) == 1 else None
    excess, step_s, step = evidence.get("excess_s"), evidence.get("step_s"), evidence.get("step")
    if host is None or not isinstance(excess, (int, float)) or not isinstance(step_s, (int, float)) or excess <= 0:
        return None
    return Slowdown(host=host, excess_s=float(excess), step_s=float(step_s),
                    step=step if isinstance(step, int) and not isinstance(step, bool) else None)


def swap_or_bear(s: Slowdown, job: JobFacts, limits: Limits) -> dict[str, Any]:
    """The decision and its numbers, for the incident's basis: `swap` (True: replace s.host with a spare) and `reason`
    say it in words."""
    if job.total_steps is not None and s.step is not None:
        steps_left = max(0, job.total_steps - s.step - 1)
        left_from = f"the job's {job.total_steps} steps, named at step {s.step}"
    elif limits.slow_horizon is not None:
        steps_left = int(limits.slow_horizon.total_seconds() / s.step_s) if s.step_s > 0 else 0
        left_from = f"the job's length is not known: {limits.slow_horizon.total_seconds():.0f} s ahead (slow_horizon)"
    else:
        return {"host": s.host, "excess_s": round(s.excess_s, 4), "step_s": round(s.step_s, 4), "swap": False,
                "reason": "the job's length is not known (a program's) and no slow_horizon is set to project its "
                          "cost over: notify"}
    if job.restart_cost_s is not None:
        cost, cost_from = job.restart_cost_s, "measured: the median of this job's recovered restarts"
    else:
        cost, cost_from = limits.swap_cost.total_seconds(), "swap_cost: this job has no recovered restart to measure"
    loss = s.excess_s * steps_left
    out: dict[str, Any] = {"host": s.host, "excess_s": round(s.excess_s, 4), "step_s": round(s.step_s, 4),
                           "steps_left": steps_left, "steps_left_from": left_from,
                           "projected_loss_s": round(loss, 1), "swap_cost_s": round(cost, 1),
                           "swap_cost_from": cost_from}
    numbers = f"{s.excess_s:.3f} s a step x {steps_left} steps left = {loss:.0f} s"
    if loss <= cost:
        return out | {"swap": False, "reason": f"a slowdown cheaper to bear than to mend: {numbers}, not more than a "
                                               f"swap's {cost:.0f} s; notify"}
    if s.host not in job.nodes:
        return out | {"swap": False, "reason": f"{numbers}, more than a swap's {cost:.0f} s, but {s.host} is no longer "
                                               "in the job; notify"}
    if not job.spares:
        return out | {"swap": False, "reason": f"{numbers}, more than a swap's {cost:.0f} s, but there is no spare to "
                                               f"take {s.host}'s place (leaving it out would cost its share of the "
                                               "job); notify"}
    return out | {"swap": True, "reason": f"fail-slow: {numbers}, more than a swap's {cost:.0f} s: {s.host} is "
                                          f"replaced by a spare at the next checkpoint"}
