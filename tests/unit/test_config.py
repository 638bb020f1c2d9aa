"""Training config loading: unknown keys and wrong types are errors naming the key; --set overrides apply."""

from __future__ import annotations

import pytest

from ground.typedconfig import ConfigError
from tests.conftest import CONFIGS
from train.config import TrainConfig, load_config

pytestmark = pytest.mark.unit


def _write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


# chaos-*.yaml are fault schedules, not training configs (tests/selfheal/test_chaos.py loads them).
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("chaos-")))
def test_every_shipped_config_loads(name) -> None:
    assert isinstance(load_config(CONFIGS / name), TrainConfig)


def test_unknown_key_is_an_error_naming_file_and_path(tmp_path) -> None:
    path = _write(tmp_path, "model: {dim: 64, hiden: 3}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml\.model: unknown key\(s\) 'hiden'; valid keys: .*dim"):
        load_config(path)


def test_wrong_type_is_an_error_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"\.parallel\.dp: expected int, got 'two'"):
        load_config(_write(tmp_path, "parallel: {dp: two}\n"))


def test_value_errors_carry_the_file_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"c\.yaml: device must be one of cpu, cuda"):
        load_config(_write(tmp_path, "device: tpu\n"))


def test_overrides_parse_yaml_scalars_into_nested_keys(tmp_path) -> None:
    cfg = load_config(_write(tmp_path, "steps: 3\n"), ["steps=6", "model.window=null", "parallel.dp=2",
                                                       "optim.lr=1e-4", "model.parallel_block=true"])
    assert (cfg.steps, cfg.model.window, cfg.parallel.dp, cfg.optim.lr, cfg.model.parallel_block) == (
        6, None, 2, 1e-4, True)


@pytest.mark.parametrize(
    ("overrides", "message"), [(["steps"], "expected KEY=VALUE"), (["steps=3", "steps.x=1"], "is not a section")]
)
def test_malformed_overrides_are_errors(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_malformed_yaml_names_the_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"c\.yaml: invalid YAML"):
        load_config(_write(tmp_path, "model: {dim: [\n"))


def test_an_unknown_checkpoint_fault_stage_is_an_error_naming_the_stages() -> None:
    with pytest.raises(ConfigError, match=r"fail_commit_at: unknown stage\(s\) manfest; stages: manifest, latest, "
                                          r"retention, events"):
        load_config(None, ["checkpoint.fail_commit_at.manfest=[4]"])
