"""The shipped rule set (configs/rules/) with the few knobs the self-healing tests turn: a detector's parameters,
the restart budget, the lemon threshold, the batches skipped at a rollback."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from healer.core.detectors.registry import default_registry
from healer.core.plans import Limits, RestartBudget
from healer.core.rules import DetectorCondition, RuleSet, load_rule_set
from healer.service.config import DEFAULT_RULES
from megaheal.typedconfig import from_mapping


def rule_set(*, max_restarts: int = 5, lemon_incidents: int = 3, skip_steps: int = 2,
             **detectors: dict[str, Any]) -> RuleSet:
    """`detectors`: per detector name, `when:` parameters replacing the shipped rule's (e.g. hang={"floor": "6s"})."""
    shipped = load_rule_set([DEFAULT_RULES])
    rules = []
    for rule in shipped.rules:
        cond = rule.condition
        if isinstance(cond, DetectorCondition) and cond.detector in detectors:
            cls = default_registry().resolve(cond.detector)
            params = from_mapping(cls.Config, detectors[cond.detector], f"test {cond.detector}")
            rule = replace(rule, when=DetectorCondition(detector=cond.detector, params=params))
        rules.append(rule)
    unknown = set(detectors) - {r.condition.detector for r in rules if isinstance(r.condition, DetectorCondition)}
    if unknown:
        raise ValueError(f"no shipped rule for detector(s) {sorted(unknown)}")
    limits = Limits(budget=RestartBudget(max_restarts=max_restarts), lemon_incidents=lemon_incidents,
                    skip_steps=skip_steps)
    return RuleSet(rules, limits)
