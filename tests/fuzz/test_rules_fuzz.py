"""Fuzz: healer rule files (YAML). Whatever a file holds, loading it gives the rules or a ConfigError naming the
file, never another exception: the healer either starts with its rules or says which line is wrong."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ground.typedconfig import ConfigError
from healer.decide.rules import RuleSet, load_rule_set
from tests.fuzz.json_strategies import JSON, TEXT, mutated

pytestmark = pytest.mark.unit

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "rules" / "default.yaml"
DURATIONS = st.one_of(st.sampled_from(["30s", "500ms", "2m", "1h", "0s", "-1s", "10x", "1e9h", "", "P1D"]),
                      st.integers(-10, 10**12), st.floats(allow_nan=True, allow_infinity=True))
WHEN = st.one_of(
    st.fixed_dictionaries({"detector": st.sampled_from(["crash", "hang", "straggler", "nonfinite", "gpu_fault",
                                                        "heartbeat_stale", "nope"])},
                          optional={"floor": DURATIONS, "k": JSON, "after": DURATIONS, "xid": JSON}),
    st.fixed_dictionaries({"promql": TEXT}, optional={"for": DURATIONS}),
    st.fixed_dictionaries({"alert": TEXT}, optional={"labels": JSON}),
    JSON)
RULE = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["r1", "r2", "crash"]), TEXT), "when": WHEN},
    optional={"severity": st.one_of(st.sampled_from(["info", "warning", "critical"]), TEXT),
              "remediate": st.one_of(st.sampled_from(["restart", "notify", "escalate", "rollback-and-skip"]), TEXT),
              "page": st.one_of(st.sampled_from(["always", "never", "on-escalation"]), TEXT),
              "cooldown": DURATIONS, "recovery_deadline": DURATIONS, "kind": TEXT, "runbook": st.one_of(
                  st.sampled_from(["node-health", "gpu-triage", "missing"]), TEXT),
              "budget": st.one_of(st.fixed_dictionaries({}, optional={"max_restarts": JSON, "window": DURATIONS,
                                                                      "backoff": DURATIONS}), JSON),
              "extra": JSON})
FILES = st.one_of(st.lists(RULE, max_size=3).map(yaml.safe_dump),
                  st.fixed_dictionaries({"rules": st.lists(RULE, max_size=2)},
                                        optional={"remediation": JSON, "other": JSON}).map(yaml.safe_dump),
                  mutated(yaml.safe_load(SHIPPED.read_text())).map(lambda case: yaml.safe_dump(case[0])),
                  st.text(max_size=200), st.sampled_from(["- &a [*a]", "a: &a\n  b: *a\n", "!!python/object:os.system {}",
                                                          "rules: !!binary aGVsbG8=", "- name: x\n  when: {alert: A}\n" * 2]))


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="megaheal-rules-fuzz-") as tmp:
        yield Path(tmp)


def _load(folder: Path, text: str) -> RuleSet | ConfigError:
    path = folder / "rules.yaml"
    path.write_text(text, errors="surrogatepass")
    try:
        return load_rule_set([path])
    except ConfigError as exc:
        assert str(path) in str(exc), exc  # the error names the file
        return exc


@given(FILES)
def test_a_rule_file_loads_or_is_refused_naming_the_file(folder: Path, text: str) -> None:
    _load(folder, text)


def test_the_shipped_rules_load(folder: Path) -> None:
    assert isinstance(_load(folder, SHIPPED.read_text()), RuleSet)


