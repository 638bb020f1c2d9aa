"""Rule files: typed, validated, and every error names the file, the line and the key."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from ground.typedconfig import ConfigError
from healer.decide.rules import DEFAULT_RULES, AlertCondition, DetectorCondition, PromqlCondition, load_rules
from healer.service.config import HealerConfig, load_config

pytestmark = pytest.mark.unit

GOOD = """\
- name: stale
  when: {detector: heartbeat_stale, after: 45s, min_ranks: 2}
  severity: critical
  cooldown: 5m
- name: xid-79
  when:
    alert: GpuXid
    labels: {xid: "79"}
  remediate: escalate
  page: always
- name: mfu-drop
  when: {promql: 'avg(megaheal_mfu) < 0.2', for: 2m}
"""


def _write(tmp_path: Path, text: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_it_loads_every_condition_kind_into_typed_configs(tmp_path: Path) -> None:
    stale, xid, mfu = load_rules([_write(tmp_path, GOOD)])
    assert isinstance(stale.when, DetectorCondition) and stale.when.params.after == timedelta(seconds=45)
    assert stale.when.params.min_ranks == 2 and stale.cooldown == timedelta(minutes=5)
    assert stale.incident_kind == "heartbeat_stale" and stale.source.endswith("rules.yaml:1")
    assert isinstance(xid.when, AlertCondition) and xid.when.labels == {"xid": "79"} and xid.page == "always"
    assert isinstance(mfu.when, PromqlCondition) and mfu.when.for_ == timedelta(minutes=2)
    assert mfu.source.endswith("rules.yaml:11")


def test_the_shipped_rules_enable_every_detector_with_the_catalogues_remedies() -> None:
    from healer.decide.catalogue import DETECTED
    from healer.decide.rules import DetectorCondition, load_rule_set
    from healer.detect.registry import default_registry

    rules = load_rule_set([DEFAULT_RULES])
    detectors = {r.condition.detector for r in rules.rules if isinstance(r.condition, DetectorCondition)}
    assert detectors == set(default_registry().names()) == DETECTED
    # Remedies come from the catalogue: no shipped rule pins one (collective-slowdown once pinned notify, so that
    # the host network-triage names did not turn into a restart; the fail-slow call decides that now).
    assert [r.name for r in rules.rules if r.remediate is not None] == []
    by_name = {r.name: r for r in rules.rules}
    assert by_name["crash"].runbook == by_name["hang"].runbook == "node-health"
    assert by_name["collective-slowdown"].runbook == "network-triage"
    assert by_name["collective-slowdown"].runbook_scope == "job" and by_name["crash"].runbook_scope == "host"
    assert rules.limits.budget.max_restarts == 5 and rules.job_actions() == []


@pytest.mark.parametrize(("text", "message"), [
    ("- name: a\n  when: {detector: heartbeat_stale}\n  severty: critical\n",
     r"rules\.yaml: rules\[0\]: unknown key\(s\) 'severty'.* \(line 3\)"),
    ("- name: a\n  when: {detector: heartbeat_stale}\n  severity: loud\n",
     r"rules\.yaml: rules\[0\]: severity must be one of info, warning, critical, got 'loud' \(line 3\)"),
    ("- name: a\n  when: {detector: heartbeat_stale}\n  cooldown: soon\n",
     r"rules\.yaml: rules\[0\]\.cooldown: expected a duration .* got 'soon' \(line 3\)"),
    ("- name: a\n  when:\n    detector: heartbeat_stale\n    afterr: 3s\n",
     r"rules\[0\]\.when: unknown key\(s\) 'afterr'; valid keys: after, min_ranks \(line 4\)"),
    ("- name: a\n  when:\n    detector: heartbeat_stale\n    after: -3\n",
     r"rules\[0\]\.when: after must be > 0.* \(line 4\)"),
    ("- name: a\n  when: {detector: gpu_magic}\n",
     r"rules\[0\]\.when\.detector: unknown detector 'gpu_magic'; known detectors: collective_slowdown, crash, gpu_fault, hang, "
     r"healer_blind, heartbeat_stale, host_lost, job_slowdown, loss_spike, nonfinite, rerun, sdc, straggler "
     r"\(line 2\)"),
    ("- name: a\n  when:\n    promql: up == 0\n    for: forever\n",
     r"rules\[0\]\.when\.for: expected a duration .* \(line 4\)"),
    ("- name: a\n  when: {promql: up, alert: X}\n", r"rules\[0\]\.when: give exactly one of detector, promql, alert"),
    ("- name: a\n  when: {alert: X, labels: {xid: 79}}\n", r"rules\[0\]\.when\.labels: expected a mapping .* \(line 2\)"),
    ("- name: a\n  severity: info\n", r"rules\[0\]: missing key 'when'.* \(line 1\)"),
    ("- name: a\n  when: {alert: X}\n  runbook: no-such-runbook\n", r"rules\[0\]\.runbook: no runbook 'no-such-runbook'.* \(line 3\)"),
    ("- name: a\n  when: {alert: X}\n  remediate: reboot-the-world\n", r"remediate must be one of restart, exclude-node-and-restart, rollback-and-skip, notify, escalate.* \(line 3\)"),
    ("- name: Bad Name\n  when: {alert: X}\n", r"rules\[0\]: name 'Bad Name' must be .* \(line 1\)"),
    ("rulez: []\n", r"rules\.yaml: unknown key\(s\) 'rulez'.* \(line 1\)"),
    ("- name: a\n  when: {alert: X}\n  page: [always\n", r"rules\.yaml: invalid YAML"),
])
def test_it_names_file_line_and_key_of_every_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_rules([_write(tmp_path, text)])


def test_it_refuses_a_rule_name_used_twice_naming_both_places(tmp_path: Path) -> None:
    _write(tmp_path, "- name: a\n  when: {alert: X}\n", "1.yaml")
    _write(tmp_path, "\n- name: a\n  when: {alert: Y}\n", "2.yaml")
    with pytest.raises(ConfigError, match=r"2\.yaml:2: rule name 'a' is already used at .*1\.yaml:1"):
        load_rules([tmp_path])


def test_the_healer_config_rejects_unknown_keys_with_their_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "listen: 127.0.0.1:9000\nprometeus_url: http://x\n", "healer.yaml")
    with pytest.raises(ConfigError, match=r"healer\.yaml: unknown key\(s\) 'prometeus_url'.* \(line 2\)"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"listen must be HOST:PORT.* \(line 1\)"):
        load_config(str(_write(tmp_path, "listen: nowhere\n", "h2.yaml")))
    assert load_config(None) == HealerConfig()


def test_the_healer_config_refuses_a_relative_runbook_base_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"runbook_base must be the absolute URL .*'docs'.* \(line 2\)"):
        load_config(str(_write(tmp_path, "listen: 127.0.0.1:9000\nrunbook_base: docs\n", "healer.yaml")))
    base = "https://github.com/example/megaheal/blob/v1.0/docs"
    assert load_config(str(_write(tmp_path, f"runbook_base: {base}\n", "h2.yaml"))).runbook_base == base
