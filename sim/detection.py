"""How long each fault kind takes to be detected, from the rule set's own detector parameters.

    crash       a rank's exit to the incident: Stages.crash_detection (the exit status, or torchrun's report)
    gpu_fault   an Xid or ECC error to the incident: Stages.gpu_fault_detection (NVML read on every batch)
    hang        the hang rule's timeout of a step, max(floor, k x p99 step time), plus a heartbeat
    host_lost   the host-lost rule's `after` of silence, plus a heartbeat
    nonfinite   the next step's record (a NaN shows in the loss of the step after the bad batch), plus a heartbeat
    sdc         the anomalous step, the trainer's re-run of it (Stages.rerun) and its verdict's heartbeat

A kind whose rule is not in the rule set is never detected by the healer: the simulation then pages a person
(sim/engine.py), as nothing else would notice.
"""

from __future__ import annotations

from healer.decide.rules import DetectorCondition, RuleSet
from sim.config import SimConfig


def rule_params(rules: RuleSet, detector: str) -> object | None:
    """The `when:` parameters (the detector's Config) of the first rule on `detector`; None if no rule has it."""
    for rule in rules.rules:
        cond = rule.condition
        if isinstance(cond, DetectorCondition) and cond.detector == detector:
            return cond.params
    return None


def detection_seconds(rules: RuleSet, cfg: SimConfig) -> dict[str, float]:
    """Fault kind -> seconds from the fault to its incident, for the kinds the rule set detects."""
    stages, beat = cfg.stages, cfg.stages.heartbeat.total_seconds()
    out: dict[str, float] = {}
    if rule_params(rules, "crash") is not None:
        out["crash"] = stages.crash_detection.total_seconds()
    if rule_params(rules, "gpu_fault") is not None:
        out["gpu_fault"] = stages.gpu_fault_detection.total_seconds()
    if (hang := rule_params(rules, "hang")) is not None:
        floor, k = hang.floor.total_seconds(), hang.k  # type: ignore[attr-defined]
        out["hang"] = max(floor, k * cfg.job.p99.total_seconds()) + beat
    if (lost := rule_params(rules, "host_lost")) is not None:
        out["host_lost"] = lost.after.total_seconds() + beat  # type: ignore[attr-defined]
    if rule_params(rules, "nonfinite") is not None:
        out["nonfinite"] = cfg.job.step_time.total_seconds() + beat
    if rule_params(rules, "sdc") is not None:
        out["sdc"] = cfg.job.step_time.total_seconds() + stages.rerun.total_seconds() + beat
    return out
