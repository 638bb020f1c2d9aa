"""Fuzz: training configs (train/config.py) and their `--set` items (ground/typedconfig.py), and the one name rule
(ground/names.py). Any file and any items give a TrainConfig or a ConfigError naming the file or the `--set` item,
never another exception; `megaheal train`'s layout check then gives a layout or a LayoutError (a ConfigError). A
string field takes a `--set` value as typed. A name is valid in a config exactly when the wire takes it."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import typing
from pathlib import Path

import msgspec
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ground.names import NAME_PATTERN, check_name, derive_name, is_name
from ground.typedconfig import ConfigError
from tests.conftest import CONFIGS
from tests.fuzz.strategies import dump, mutated, values, yaml_text
from train.config import TrainConfig, load_config
from train.layout import LayoutError, validate_layout
from wire.telemetry import build_record

pytestmark = pytest.mark.unit

SHIPPED = {p.name: yaml.safe_load(p.read_text()) for p in sorted(CONFIGS.glob("*.yaml"))
           if not p.name.startswith("chaos-")}


def key_paths(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config tree (what `--set` addresses)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            out += key_paths(hints[f.name], f"{path}.")
    return out


KEYS = key_paths(TrainConfig)
HELLO = {"local_rank": 0, "node": "h", "world_size": 1, "mesh": {}}


def load_checked(path: Path | None, items: list[str]) -> TrainConfig | None:
    """load_config plus the layout check `megaheal train` makes: the config, or None after a clear error."""
    try:
        cfg = load_config(path, items)
    except ConfigError as exc:
        # Every error says where: the file, or the `--set` item (defaults alone are "config").
        where = path.name if path is not None else "config"
        assert where in str(exc) or "--set " in str(exc), str(exc)
        return None
    assert all(math.isfinite(x) for x in floats(cfg)), cfg  # NaN and infinities are refused by name
    try:
        validate_layout(cfg.parallel, cfg.model, cfg.global_batch, cfg.parallel.world_size)
    except LayoutError as exc:
        assert str(exc).strip()
        return None
    return cfg


def floats(config: object) -> list[float]:
    out: list[float] = []
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += floats(value)
        out += [x for x in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(x, float)]
    return out


def write(text: str) -> Path:
    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, encoding="utf-8")
    with handle:
        handle.write(text)
    return Path(handle.name)


@given(st.sampled_from(sorted(SHIPPED)).flatmap(lambda name: mutated(SHIPPED[name])))
def test_a_changed_shipped_config_loads_or_is_refused_naming_the_file(doc: dict) -> None:
    path = write(dump(doc))
    try:
        load_checked(path, [])
    finally:
        path.unlink()


@given(values | yaml_text)
def test_any_yaml_document_loads_or_is_refused_naming_the_file(value: object) -> None:
    path = write(value if isinstance(value, str) else dump(value))
    try:
        load_checked(path, [])
    finally:
        path.unlink()


set_keys = st.sampled_from(KEYS) | st.text(max_size=20) | st.sampled_from(["", ".", "model.", ".steps", "a.b.c"])
set_values = yaml_text | st.sampled_from(["6", "null", "[3, 4]", "{dp: 2}", "true", "1e-4", "2", "cpu", "-1"])
set_items = st.tuples(set_keys, st.sampled_from(["=", "", "=="]), set_values).map(lambda t: "".join(t))


@given(st.sampled_from([None, *sorted(SHIPPED)]), st.lists(set_items, max_size=5))
def test_any_set_items_give_a_config_or_an_error_naming_them(config: str | None, items: list[str]) -> None:
    load_checked(CONFIGS / config if config else None, items)


@given(st.from_regex(NAME_PATTERN, fullmatch=True))
def test_a_set_value_for_a_string_field_stays_as_typed(name: str) -> None:
    # NOTE: `--set` reads a YAML scalar, so YAML's own null spellings clear an optional field, as in a file.
    expected = None if name in ("null", "Null", "NULL") else name
    assert load_config(None, [f"job={name}"]).job == expected
    assert load_config(None, [f"data.paths=[{name!r}]"]).data.paths == [name]


@given(st.text(max_size=300))
def test_one_name_rule_for_the_config_the_wire_and_derived_names(text: str) -> None:
    assert is_name(derive_name(text))
    try:
        build_record("hello", text, 0, 1, 0, HELLO)
        on_wire = True
    except msgspec.ValidationError:
        on_wire = False
    assert on_wire == is_name(text)
    path = write(dump({"job": text}))
    try:
        try:
            assert load_config(path).job == text
            assert is_name(text)
        except ConfigError:
            assert not is_name(text)
    finally:
        path.unlink()
    if is_name(text):
        assert check_name(text, "job") == text
