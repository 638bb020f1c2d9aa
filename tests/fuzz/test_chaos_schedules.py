"""Fuzz: chaos schedules (healer/runner/chaos.py, `megaheal run --chaos FILE`). Any file gives a Schedule or a
ConfigError naming the file (and the fault and key where it can), never another exception."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ground.typedconfig import ConfigError
from healer.runner.chaos import KINDS, Schedule, load_schedule
from tests.conftest import CONFIGS
from tests.fuzz.strategies import dump, mutated, values, yaml_text

pytestmark = pytest.mark.unit

DEMO = yaml.safe_load((CONFIGS / "chaos-demo.yaml").read_text())
faults = st.fixed_dictionaries({"at_step": st.integers(-2, 10**20) | values, "kind": st.sampled_from(KINDS) | values},
                               optional={"rank": st.integers(-1, 10**6) | values,
                                         "duty": st.floats() | st.sampled_from(["0.5", "1e-3", "nan"]) | values,
                                         "for": st.sampled_from(["60s", "1e400s", "99999999999999999999d", "-1s",
                                                                 "0s", ".inf", "nan"]) | st.floats() | values})


def load(text: str) -> Schedule | None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8") as handle:
        handle.write(text)
    path = Path(handle.name)
    try:
        schedule = load_schedule(path)
    except ConfigError as exc:
        assert path.name in str(exc), str(exc)
        return None
    finally:
        path.unlink()
    for f in schedule.faults:  # what Chaos acts on is in range
        assert f.kind in KINDS and f.at_step >= 0 and f.rank >= 0 and 0 < f.duty < 1
        assert timedelta(0) < f.for_ and f.for_.total_seconds() > 0
    return schedule


@given(mutated(DEMO))
def test_a_changed_demo_schedule_loads_or_is_refused_naming_the_file(doc: dict) -> None:
    load(dump(doc))


@given(st.lists(faults, max_size=6).map(lambda fs: {"faults": fs}) | values | yaml_text)
def test_any_schedule_loads_or_is_refused_naming_the_file(doc: object) -> None:
    load(doc if isinstance(doc, str) else dump(doc))
