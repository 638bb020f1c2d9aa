"""Rules: YAML files of condition -> action, validated into typed configs before the healer starts.

    - name: node-heartbeat-stale
      when: {detector: heartbeat_stale, after: 30s}       # or {promql: EXPR, for: 2m} or {alert: NAME, labels: {...}}
      severity: critical                                   # info | warning | critical [default: the catalogue's]
      runbook: node-health                                 # optional: a shipped runbook or a runbook .yaml
      remediate: restart                                   # restart | exclude-node-and-restart | rollback-and-skip
                                                           # | notify | escalate [default: the catalogue's]
      budget: {max_restarts: 5, window: 1h, backoff: 10s}  # optional: this rule's restart budget
      page: on-escalation                                  # always | never | on-escalation
      cooldown: 15m

A file holds a list of rules, or a mapping with `rules:` and, in at most one file, `remediation:` (the policy's
limits for the job: the default restart budget, lemon hosts, min_nodes, skip_steps; see healer.decide.plans.Limits).
An unknown key or a bad value anywhere is a ConfigError naming the file, the key and its line.

Remedies that act on the job (restart, exclude-node-and-restart, rollback-and-skip) need a launcher: `megaheal run`
carries them out; the service alone refuses a rule that names one (see `job_actions`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from ground.shipped import CONFIGS
from ground.typedconfig import ConfigError, LineDict, from_mapping, line_of, parse_duration, read_yaml
from healer.decide.catalogue import Remedy, fault
from healer.decide.plans import Limits, RestartBudget
from healer.detect.registry import DetectorRegistry, default_registry

DEFAULT_RULES = (CONFIGS / "rules").resolve()
"""The shipped rules (every file of configs/rules/, package data in a wheel: ground/shipped.py), what both front doors
and the simulator load when given none."""

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
SEVERITIES = ("info", "warning", "critical")
PAGE_POLICIES = ("always", "never", "on-escalation")
REMEDIATIONS = tuple(r.value for r in Remedy)


@dataclass(frozen=True, slots=True)
class DetectorCondition:
    detector: str
    params: Any
    """The detector's own typed Config, built from the other keys of `when`."""


@dataclass(frozen=True, slots=True)
class PromqlCondition:
    promql: str
    for_: timedelta = timedelta(0)
    """How long a series must keep being returned before it fires (YAML key `for`)."""


@dataclass(frozen=True, slots=True)
class AlertCondition:
    alert: str
    """The Alertmanager alert's `alertname`."""
    labels: dict[str, str] = field(default_factory=dict)
    """Labels the alert must carry, with these exact values."""


Condition = DetectorCondition | PromqlCondition | AlertCondition


@dataclass(kw_only=True, slots=True)
class Rule:
    """A condition and what to do when it holds."""

    name: str
    """Unique across all rule files; part of every incident's fingerprint."""
    when: Any
    """The condition (see the module docstring); typed into a Condition by the loader."""
    kind: str | None = None
    """Incident kind in labels and metrics; default: the detector's name, the alert's name, or the rule's name."""
    severity: str | None = None
    """info, warning or critical; sent to Alertmanager as the `severity` label. Default: the catalogue's for the
    incident's kind (warning for a kind it does not know)."""
    runbook: str | None = None
    """Diagnostic runbook to run before remediating (a shipped runbook's name or a .yaml path). A runbook of scope
    host (node-health) runs on each suspect host, for kinds whose suspects are diagnosed first (crash, hang); one of
    scope job (network-triage) runs once across the job's hosts, beside the training, for any kind."""
    remediate: str | None = None
    """restart, exclude-node-and-restart, rollback-and-skip, notify (tell the sinks, wait for the condition to
    clear) or escalate (page a person at once). Default: the fault catalogue's remedy for the kind."""
    budget: RestartBudget | None = None
    """This rule's restart budget (max_restarts, window, backoff, max_backoff, per_hosts); default: the rule set's."""
    page: str = "on-escalation"
    """always, never, or on-escalation: when the incident carries page="true" for Alertmanager's routing."""
    cooldown: timedelta = timedelta(minutes=15)
    """A recurrence within this long after resolution reopens the incident instead of opening another."""
    diagnosis_deadline: timedelta = timedelta(minutes=10)
    """An incident still diagnosing after this long is escalated."""
    recovery_deadline: timedelta = timedelta(minutes=30)
    """An incident still remediating (its condition not cleared) after this long is escalated."""
    description: str = ""
    """What the rule means, for people reading incidents."""
    source: str = field(default="", init=False, compare=False)
    """file:line the rule was loaded from (set by the loader)."""

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must be lower-case letters, digits, '.', '_' or '-' (at most 100)")
        if self.severity is not None:
            _one_of("severity", self.severity, SEVERITIES)
        _one_of("page", self.page, PAGE_POLICIES)
        if self.remediate is not None:
            _one_of("remediate", self.remediate, REMEDIATIONS)
        if self.kind is not None and not NAME.match(self.kind):
            raise ValueError(f"kind {self.kind!r} must be lower-case letters, digits, '.', '_' or '-'")
        for name in ("cooldown", "diagnosis_deadline", "recovery_deadline"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def condition(self) -> Condition:
        assert isinstance(self.when, (DetectorCondition, PromqlCondition, AlertCondition))
        return self.when

    @property
    def runbook_scope(self) -> str | None:
        """host or job (the runbook's own `scope:`, see runbooks/spec.py); None without a runbook."""
        return runbook_scope(self.runbook) if self.runbook else None

    @property
    def remedy(self) -> Remedy | None:
        """The remedy the rule asks for; None: the catalogue's default for its kind."""
        return Remedy(self.remediate) if self.remediate is not None else None

    @property
    def incident_severity(self) -> str:
        return self.severity or fault(self.incident_kind).severity

    @property
    def incident_kind(self) -> str:
        if self.kind:
            return self.kind
        cond = self.condition
        if isinstance(cond, DetectorCondition):
            return cond.detector
        if isinstance(cond, AlertCondition):
            return re.sub(r"[^a-z0-9_.-]", "_", cond.alert.lower())[:100] or self.name
        return self.name


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(slots=True)
class RuleSet:
    rules: list[Rule]
    limits: Limits = field(default_factory=Limits)
    """The `remediation:` section (the policy's limits), or the defaults."""

    def job_actions(self) -> list[Rule]:
        """Rules that name a remedy acting on the job (they need a launcher)."""
        return [r for r in self.rules if r.remedy is not None and r.remedy.restarts]

    def budget(self, rule: Rule | None) -> RestartBudget:
        return rule.budget if rule is not None and rule.budget is not None else self.limits.budget


def load_rules(paths: list[str | Path], detectors: DetectorRegistry | None = None) -> list[Rule]:
    """Every rule of the given files and directories (*.yaml in name order), validated; ConfigError otherwise."""
    return load_rule_set(paths, detectors).rules


def load_rule_set(paths: list[str | Path], detectors: DetectorRegistry | None = None) -> RuleSet:
    """The rules and the `remediation:` limits of the given files and directories (*.yaml in name order)."""
    detectors = detectors or default_registry()
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    limits: tuple[Limits, Path] | None = None
    for path in _files(paths):
        file_rules, file_limits = load_rule_file(path, detectors)
        if file_limits is not None:
            if limits is not None:
                raise ConfigError(f"{path}: `remediation:` is already set in {limits[1]}; set it in one file")
            limits = (file_limits, path)
        for rule in file_rules:
            if rule.name in seen:
                raise ConfigError(f"{rule.source}: rule name {rule.name!r} is already used at {seen[rule.name]}")
            seen[rule.name] = rule.source
            rules.append(rule)
    return RuleSet(rules, limits[0] if limits else Limits())


def _files(paths: list[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        elif path.is_file():
            out.append(path)
        else:
            raise ConfigError(f"{path}: no such rule file or directory")
    return out


def load_rule_file(path: Path, detectors: DetectorRegistry) -> tuple[list[Rule], Limits | None]:
    data = read_yaml(path)
    if data is None:
        return [], None
    limits = None
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"rules", "remediation"}, key=str)
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; a rule file is a list of "
                              f"rules or a mapping with `rules:` and `remediation:`{line_of(data, unknown[0])}")
        if "remediation" in data:
            limits = from_mapping(Limits, data["remediation"] or {}, f"{path}: remediation")
        data = data.get("rules") or []
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list of rules, got {type(data).__name__}")
    return [_load_rule(item, f"{path}: rules[{i}]", path, detectors) for i, item in enumerate(data)], limits


def _load_rule(item: Any, where: str, path: Path, detectors: DetectorRegistry) -> Rule:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a mapping (a rule), got {item!r}")
    if "when" not in item:
        raise ConfigError(f"{where}: missing key 'when' (the rule's condition){line_of(item)}")
    rule = from_mapping(Rule, item, where)
    rule.when = _condition(item["when"], f"{where}.when", detectors)
    rule.source = f"{path}:{getattr(item, 'line', '?')}"
    if rule.runbook is not None:
        _check_runbook(rule.runbook, f"{where}.runbook", line_of(item, "runbook"))
    return rule


def _condition(data: Any, where: str, detectors: DetectorRegistry) -> Condition:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with one of detector, promql, alert, got {data!r}{line_of(data)}")
    kinds = [k for k in ("detector", "promql", "alert") if k in data]
    if len(kinds) != 1:
        raise ConfigError(f"{where}: give exactly one of detector, promql, alert (got {', '.join(kinds) or 'none'})"
                          f"{line_of(data)}")
    if kinds[0] == "detector":
        name = data["detector"]
        try:
            cls = detectors.resolve(name) if isinstance(name, str) else None
        except KeyError as exc:
            raise ConfigError(f"{where}.detector: {exc.args[0]}{line_of(data, 'detector')}") from exc
        if cls is None:
            raise ConfigError(f"{where}.detector: expected a detector name, got {name!r}{line_of(data, 'detector')}")
        params = LineDict({k: v for k, v in data.items() if k != "detector"}, line=getattr(data, "line", None),
                          key_lines=getattr(data, "key_lines", {}))
        return DetectorCondition(detector=name, params=from_mapping(cls.Config, params, where))
    allowed = {"promql": {"promql", "for"}, "alert": {"alert", "labels"}}[kinds[0]]
    unknown = sorted(set(data) - allowed, key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: "
                          f"{', '.join(sorted(allowed))}{line_of(data, unknown[0])}")
    if kinds[0] == "promql":
        expr = data["promql"]
        if not isinstance(expr, str) or not expr.strip():
            raise ConfigError(f"{where}.promql: expected a PromQL expression, got {expr!r}{line_of(data, 'promql')}")
        try:
            duration = parse_duration(data.get("for", 0), f"{where}.for")
        except ConfigError as exc:
            raise ConfigError(f"{exc}{line_of(data, 'for')}") from exc
        if duration < timedelta(0):
            raise ConfigError(f"{where}.for: must be >= 0{line_of(data, 'for')}")
        return PromqlCondition(promql=expr.strip(), for_=duration)
    return _alert_condition(data, where)


def _alert_condition(data: dict[str, Any], where: str) -> AlertCondition:
    name = data["alert"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.alert: expected an alert name, got {name!r}{line_of(data, 'alert')}")
    labels = data.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ConfigError(f"{where}.labels: expected a mapping of label names to string values, got {labels!r}"
                          f"{line_of(data, 'labels')}")
    return AlertCondition(alert=name, labels=dict(labels))


@lru_cache(maxsize=64)
def runbook_scope(name: str) -> str:
    """The scope of runbook `name` (read once per process: the healer asks at every decision)."""
    from runbooks.spec import load_runbook

    return load_runbook(name).scope


def _check_runbook(name: str, where: str, line: str) -> None:
    try:
        from runbooks.spec import find_runbook
    except ImportError as exc:
        raise ConfigError(f"{where}: runbooks are not available in this installation ({exc}){line}") from exc
    try:
        find_runbook(name)
        runbook_scope(name)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}{line}") from exc
