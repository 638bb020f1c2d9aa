"""Closed forms of a job's ETTR under Poisson failures, to check the simulation against (its `policy: false` mode
makes the same assumptions: every failure costs one fixed restart u0 and the work since the last save).

    lam   failures per second of the job (hosts x per-host rate)
    u0    the restart overhead of one failure (detection, stop, startup, checkpoint load), seconds
    dt    training time between two saves, seconds
    w     the time each save holds the training up, seconds

Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters" (HPCA 2025,
arXiv 2410.21680) estimate ETTR to first order in lam:

    E[ETTR] ~ (1 - lam (u0 + dt/2)) / (1 + w/dt),        best dt ~ sqrt(2 w / lam)  (Young's interval)

Exact for the same model (failures also strike during restarts and saves, and a save is only kept once it has
completed): a stretch of dt + w between saves completes with probability exp(-lam (dt + w)), each failure costs the
restart's expected length (e^(lam u0) - 1) / lam, so a stretch takes (e^(lam u0) / lam) (e^(lam (dt + w)) - 1) of
wall time on average (the renewal argument of checkpoint/restart models, e.g. Daly 2006), and

    ETTR = lam dt e^(-lam u0) / (e^(lam (dt + w)) - 1).

The two agree to first order; the first-order form drifts below the exact one as lam (u0 + dt/2) grows (by about
(lam (u0 + dt/2))^2 / 2).
"""

from __future__ import annotations

import math


def kokolis_ettr(lam: float, u0: float, dt: float, w: float) -> float:
    return (1.0 - lam * (u0 + dt / 2.0)) / (1.0 + w / dt)


def exact_ettr(lam: float, u0: float, dt: float, w: float) -> float:
    return lam * dt * math.exp(-lam * u0) / math.expm1(lam * (dt + w))


def young_interval(lam: float, w: float) -> float:
    """The save interval that maximises the first-order ETTR."""
    return math.sqrt(2.0 * w / lam)
