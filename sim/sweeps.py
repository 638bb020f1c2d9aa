"""Runs of the simulation: the headline (the config as it is, in each restart mode), the sweeps (one parameter varied at a
time around the config) and the analytic check (the `policy: false` baseline against sim/analytic.py's closed
forms). Each point is the mean of `sweeps.seeds` seeds; everything is seeded, so a rerun gives the same numbers."""

from __future__ import annotations

import statistics
from dataclasses import replace
from datetime import timedelta
from typing import Any

from healer.decide.rules import RuleSet
from sim.analytic import exact_ettr, kokolis_ettr, young_interval
from sim.config import SimConfig
from sim.engine import SimResult, Simulation
from sim.ledger import LOSSES

MODES = ("warm", "cold", "replica")
"""Every restart mode the headline and the sweeps compare (sim/config.py, SimConfig.restart)."""


def run_seeds(cfg: SimConfig, rules: RuleSet, seeds: int) -> list[SimResult]:
    return [Simulation(cfg, rules, seed=cfg.seed + i).run() for i in range(seeds)]


def point(results: list[SimResult]) -> dict[str, Any]:
    """The mean of a point's runs (and the spread of its ETTR)."""
    ettrs = [r.ettr for r in results]
    hours = {k: statistics.fmean(r.ledger.gpu_hours()[k] for r in results) for k in ("productive", *LOSSES)}
    return {"ettr": round(statistics.fmean(ettrs), 5), "ettr_min": round(min(ettrs), 5),
            "ettr_max": round(max(ettrs), 5), "pages": statistics.fmean(sum(p["paged"] for p in r.pages) for r in results),
            "person_actions": statistics.fmean(len(r.pages) for r in results),
            "spares_taken": statistics.fmean(r.spares_taken for r in results),
            "failures": statistics.fmean(r.failures for r in results),
            "gpu_hours": {k: round(v, 1) for k, v in hours.items()}, "runs": len(results)}


def with_mode(cfg: SimConfig, mode: str) -> SimConfig:
    return replace(cfg, restart=mode)


def headline(cfg: SimConfig, rules: RuleSet) -> dict[str, Any]:
    """The config as it is, once per restart mode, with the first seed's run in full."""
    out: dict[str, Any] = {}
    for mode in MODES:
        runs = run_seeds(with_mode(cfg, mode), rules, cfg.sweeps.seeds)
        out[mode] = point(runs) | {"first_run": runs[0].to_payload()}
    return out


def _interval(cfg: SimConfig, t: timedelta) -> SimConfig:
    """The saves every `t`, fixed (not tuned)."""
    return replace(cfg, checkpoint=replace(cfg.checkpoint, interval=t), tuning=replace(cfg.tuning, enabled=False))


def _resumes_from_snapshots(cfg: SimConfig) -> bool:
    """Whether the job's restarts resume from snapshots (a warm job with snapshots), else from its saves."""
    return cfg.restart == "warm" and cfg.checkpoint.snapshot_interval is not None


def _resumed_interval(cfg: SimConfig, t: timedelta) -> SimConfig:
    """The interval restarts resume from fixed at `t`, untuned."""
    fixed = replace(cfg, tuning=replace(cfg.tuning, enabled=False))
    if _resumes_from_snapshots(cfg):
        return replace(fixed, checkpoint=replace(cfg.checkpoint, snapshot_interval=t))
    return _interval(fixed, t)


def _scaled(cfg: SimConfig, scale: float) -> SimConfig:
    return replace(cfg, failures=replace(cfg.failures, scale=cfg.failures.scale * scale))


def _sized(cfg: SimConfig, gpus: int) -> SimConfig:
    """The job at `gpus` GPUs: hosts (whole replicas), and spares in the config's proportion."""
    job = cfg.job
    per_replica = job.hosts_per_replica * job.gpus_per_node
    nodes = max(1, round(gpus / per_replica)) * job.hosts_per_replica
    spares = max(1, round(job.spares * nodes / job.nodes)) if job.spares else 0
    return replace(cfg, job=replace(job, nodes=nodes, spares=spares))


def _cold_start(cfg: SimConfig, t: timedelta) -> SimConfig:
    return replace(cfg, stages=replace(cfg.stages, cold_start=t))


def sweep(cfg: SimConfig, rules: RuleSet) -> dict[str, Any]:
    sw, n = cfg.sweeps, cfg.sweeps.seeds
    out: dict[str, Any] = {}

    def both(make: Any, values: list[Any], label: Any) -> list[dict[str, Any]]:
        return [{"value": label(v), **{mode: point(run_seeds(with_mode(make(cfg, v), mode), rules, n))
                                      for mode in MODES}} for v in values]

    out["checkpoint_interval_s"] = both(_interval, sw.checkpoint_interval, lambda t: t.total_seconds())
    out["failure_scale"] = both(_scaled, sw.failure_scale, float)
    out["gpus"] = both(_sized, sw.gpus, int)
    out["cold_start_s"] = [{"value": t.total_seconds(),
                            "cold": point(run_seeds(with_mode(_cold_start(cfg, t), "cold"), rules, n))}
                           for t in sw.cold_start]
    out["warm"] = point(run_seeds(with_mode(cfg, "warm"), rules, n))
    out["rate_change"] = rate_change(cfg, rules)
    for name in ("checkpoint_interval_s",):
        for mode in MODES:
            best = max(out[name], key=lambda p, m=mode: p[m]["ettr"])
            out[f"best_{name}_{mode}"] = {"value": best["value"], "ettr": best[mode]["ettr"]}
    return out


def rate_change(cfg: SimConfig, rules: RuleSet, modes: tuple[str, ...] = ("warm", "cold")) -> dict[str, Any]:
    """The failure rate doubles halfway through the run: the tuned intervals (healer/decide/save_interval.py)
    against each fixed interval of the sweep for the interval restarts resume from, per mode."""
    days = timedelta(days=cfg.days / 2)
    doubled = replace(cfg, failures=replace(cfg.failures, change_at=days, change_scale=2.0))
    n, out = cfg.sweeps.seeds, {}
    for mode in modes:
        base = with_mode(doubled, mode)
        tuned = point(run_seeds(replace(base, tuning=replace(base.tuning, enabled=True)), rules, n))
        fixed = [{"value": t.total_seconds(), **point(run_seeds(_resumed_interval(base, t), rules, n))}
                 for t in cfg.sweeps.checkpoint_interval]
        best = max(fixed, key=lambda p: p["ettr"])
        ck = base.checkpoint
        as_configured = ck.snapshot_interval if _resumes_from_snapshots(base) and ck.snapshot_interval else ck.interval
        # NOTE: the configured interval is usually one of the sweep's: its runs are those, not run again
        configured = next((f for f in fixed if f["value"] == as_configured.total_seconds()), None) or \
            {"value": as_configured.total_seconds(), **point(run_seeds(_resumed_interval(base, as_configured), rules, n))}
        out[mode] = {"tuned": tuned, "fixed": fixed, "configured": configured,
                     "best_fixed": {"value": best["value"], "ettr": best["ettr"]},
                     "gain_vs_best_fixed": round(tuned["ettr"] - best["ettr"], 5),
                     "gain_vs_configured": round(tuned["ettr"] - configured["ettr"], 5)}
    return out


def analytic_check(cfg: SimConfig, rules: RuleSet, days: float = 540.0) -> list[dict[str, Any]]:
    """The `policy: false` simulation against the closed forms, at every interval and failure scale of the sweeps
    (and the config itself), over `days` per seed: the deviation says whether the event loop is right."""
    base = replace(cfg, policy=False, days=days, checkpoint=replace(cfg.checkpoint, persist=timedelta(0)))
    points = [("config", base)]
    points += [(f"interval {t.total_seconds():g} s", _interval(base, t)) for t in cfg.sweeps.checkpoint_interval]
    points += [(f"failures x{s:g}", _scaled(base, s)) for s in cfg.sweeps.failure_scale]
    out = []
    for label, c in points:
        runs = run_seeds(c, rules, cfg.sweeps.seeds)
        simulated = statistics.fmean(r.ettr for r in runs)
        lam = c.failures.rate_per_node * c.job.nodes
        u0 = Simulation(c, rules).u0
        dt, w = c.checkpoint.interval.total_seconds(), c.checkpoint.stall.total_seconds()
        exact, first = exact_ettr(lam, u0, dt, w), kokolis_ettr(lam, u0, dt, w)
        out.append({"point": label, "lam_per_day": round(lam * 86400, 3), "u0_s": round(u0, 2), "dt_s": dt, "w_s": w,
                    "x": round(lam * (u0 + dt / 2), 4), "simulated": round(simulated, 5), "exact": round(exact, 5),
                    "kokolis": round(first, 5), "vs_exact": round(simulated / exact - 1, 5),
                    "vs_kokolis": round(simulated / first - 1, 5), "young_interval_s": round(young_interval(lam, w), 1)})
    return out
