"""The replica groups' config, environment and batch sharing (train/ft/, wire/ft_env.py), without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train.config import load_config
from train.data import SyntheticTokens, TokenStream
from train.ft.batches import SharedBatches
from train.ft.config import FtConfig
from wire import ft_env

pytestmark = pytest.mark.unit


def test_a_batch_that_does_not_split_over_every_number_of_groups_is_refused_naming_the_number() -> None:
    with pytest.raises(ValueError, match=r"global_batch \(8\) must split over 3 replica group\(s\) x parallel.dp "
                                         r"\(2\) x parallel.microbatches \(1\) = 6"):
        load_config(None, ["ft.enabled=true", "ft.groups=3", "ft.min_groups=2", "parallel.dp=2", "global_batch=8"])
    load_config(None, ["ft.enabled=true", "ft.groups=3", "ft.min_groups=2", "parallel.dp=2", "global_batch=12"])
    # Off, the groups' numbers do not constrain the batch.
    load_config(None, ["ft.groups=3", "ft.min_groups=2", "parallel.dp=2", "global_batch=8"])
    # A pipeline cannot take part: its shapes are fixed at the first step, a group's share is not.
    with pytest.raises(ValueError, match=r"ft.enabled needs parallel.pp 1 \(got 2\)"):
        load_config(None, ["ft.enabled=true", "parallel.pp=2", "parallel.microbatches=2", "model.n_layers=2",
                           "global_batch=8"])


@pytest.mark.parametrize("overrides, message", [
    (["ft.groups=0"], "ft.groups must be >= 1"),
    (["ft.groups=2", "ft.min_groups=3"], r"ft.min_groups must be between 1 and ft.groups \(2\)"),
    (["ft.timeout_s=0"], "ft.timeout_s must be > 0"),
    (["ft.quorum=3"], "quorum"),
])
def test_a_wrong_ft_setting_is_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_the_environment_names_the_variable_that_is_missing_or_wrong(tmp_path: Path) -> None:
    good = {ft_env.GROUP: "1", ft_env.LIGHTHOUSE: "http://10.0.0.1:29510", ft_env.KEY_FILE: str(tmp_path / "k")}
    env = ft_env.read(good, groups=2)
    assert (env.group, env.lighthouse, env.address) == (1, "http://10.0.0.1:29510", "127.0.0.1")
    with pytest.raises(ValueError, match=ft_env.KEY_FILE):
        ft_env.read({k: v for k, v in good.items() if k != ft_env.KEY_FILE}, groups=2)
    with pytest.raises(ValueError, match=rf"{ft_env.GROUP}='2': expected a group index from 0 to .* 1"):
        ft_env.read(good | {ft_env.GROUP: "2"}, groups=2)
    with pytest.raises(ValueError, match=ft_env.LIGHTHOUSE):
        ft_env.read(good | {ft_env.LIGHTHOUSE: "http://host:1/; rm -rf /"}, groups=2)
    with pytest.raises(ValueError, match=ft_env.ADDRESS):
        ft_env.read(good | {ft_env.ADDRESS: "10.0.0.1 --evil"}, groups=2)
    assert ft_env.read(good | {ft_env.AT_LEAST: "161"}, groups=2).at_least == 161
    with pytest.raises(ValueError, match=ft_env.AT_LEAST):
        ft_env.read(good | {ft_env.AT_LEAST: "-1"}, groups=2)


def test_the_groups_that_take_part_share_each_steps_whole_batch_once() -> None:
    source, seq, batch, dp = SyntheticTokens(256, 0), 8, 12, 2
    whole = TokenStream(source, seq, batch, dp_rank=0, dp_degree=1, start_sample=24).next_batch()[0]
    for participants in (3, 2, 1):
        shares = []
        for rank in range(participants):
            for d in range(dp):
                loader = SharedBatches(source, seq, batch, d, dp, start_sample=24)
                loader.share(participants, rank)
                shares.append(loader.next()[0])
                assert loader.position == 36
        assert torch.equal(torch.cat(shares), whole), participants
    loader = SharedBatches(source, seq, batch, 0, dp, start_sample=0)
    with pytest.raises(RuntimeError, match="share"):
        loader.next()
    loader.share(2, 1)
    loader.next()
    loader.load_state_dict({"sample_index": 0})  # a step not committed: its batch again
    assert loader.position == 0


def test_the_defaults_leave_fault_tolerance_off() -> None:
    assert FtConfig().enabled is False and load_config(None, []).ft.enabled is False
