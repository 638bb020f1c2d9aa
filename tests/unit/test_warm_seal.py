"""A warm pool's store takes values sealed with the pool's key only (wire/warm_seal.py): a byte changed, another key,
a valid value moved under another store key, or a value a store client without the key wrote, is refused as if
absent, and the refusal is logged naming the key and counted. A plan names a checkpoint only inside the root the
worker was started with (wire/warm_plan.py), and the worker builds its config from what it was started with."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ground.secretfile import SecretError
from inprocess.store import BoundStore
from tests.conftest import CONFIGS
from train.warm.worker import Worker
from wire.run_ids import pool_run_id
from wire.warm_plan import Plan, WorkerStart, key, read_plan, resolve_checkpoint, write_plan
from wire.warm_seal import SealedStore, new_key, pool_key, read_key, seal, unseal, write_key

pytestmark = pytest.mark.unit
SECRET = bytes(range(32))


def test_a_sealed_value_opens_with_its_key_under_its_store_key_only() -> None:
    data = seal(SECRET, "warm/plan/3", '{"generation": 3}').encode()
    assert data.startswith(b"v1.") and unseal(SECRET, "warm/plan/3", data) == '{"generation": 3}'
    for i in (3, 40, len(data) - 1):  # in the MAC, and in the value
        tampered = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        assert unseal(SECRET, "warm/plan/3", tampered) is None
    assert unseal(bytes(32), "warm/plan/3", data) is None  # another key
    assert unseal(SECRET, "warm/plan/4", data) is None  # replayed under another generation's key
    assert unseal(SECRET, "warm/ready/3/w0", data) is None
    for junk in (b"", b"v1.", b'{"generation": 3}', b"v1." + b"0" * 64 + b'.{"generation": 3}'):
        assert unseal(SECRET, "warm/plan/3", junk) is None


def test_each_pool_of_a_run_has_its_own_key_derived_from_the_runs_token() -> None:
    token = "t" * 32
    a0 = pool_key(token, pool_run_id("job", 0))
    assert a0 == pool_key(token, pool_run_id("job", 0)) and len(a0) == 32  # the healer and every agent alike
    assert a0 not in (pool_key(token, pool_run_id("job", 5)), pool_key("u" * 32, pool_run_id("job", 0)))


def test_the_key_file_is_private_and_one_open_to_others_is_refused(tmp_path: Path) -> None:
    secret = new_key()
    path = write_key(tmp_path / "warm" / "pool.key", secret)
    assert os.stat(path).st_mode & 0o777 == 0o600 and read_key(path) == secret
    path.chmod(0o644)
    with pytest.raises(SecretError, match="open to"):
        read_key(path)
    path.chmod(0o600)
    path.write_text("not hex\n")
    with pytest.raises(SecretError, match="not a warm pool key"):
        read_key(path)


def test_values_a_client_without_the_key_writes_are_refused_logged_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    bound = BoundStore("127.0.0.1", timedelta(seconds=10))
    pool = SealedStore(bound.store, SECRET)
    foreign = dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=10))
    foreign.set(key("hello", "w0"), "1234")
    foreign.set(key("ready", 0, "w0"), "memory step 8 in 0.1 s")
    with caplog.at_level(logging.WARNING, logger="wire.warm_seal"):
        assert not pool.has(key("hello", "w0")) and pool.get(key("ready", 0, "w0")) is None
        assert not pool.has(key("hello", "w0"))  # the same value again: counted once
    assert pool.refused == {key("hello", "w0"): 1, key("ready", 0, "w0"): 1}
    assert "warm/hello/w0" in caplog.text and "warm/ready/0/w0" in caplog.text
    # A value the pool sealed, copied by the client under another key, is refused there too.
    write_plan(pool, Plan(generation=0, world=1, assign={"w0": 0}, local_rank={"w0": 0}))
    foreign.set(key("plan", 1), foreign.get(key("plan", 0)))
    assert read_plan(pool, 0) is not None and read_plan(pool, 1) is None
    assert pool.get(key("gen")) == "0"


def test_a_plan_names_a_checkpoint_inside_the_root_only(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step-00000004").mkdir(parents=True)
    assert resolve_checkpoint(root, "step-00000004") == root / "step-00000004"
    for bad in ("..", "../x", "/etc", ".hidden", "a/b", ""):
        with pytest.raises(ValueError):
            resolve_checkpoint(root, bad)
    (root / "step-00000009").symlink_to(tmp_path)  # a link out of the root
    with pytest.raises(ValueError, match="not a directory of"):
        resolve_checkpoint(root, "step-00000009")
    with pytest.raises(ValueError, match="does not name a checkpoint"):
        Plan(generation=0, world=1, assign={}, local_rank={}, disk_resume="/tmp/evil/../step-00000004x/..")
    with pytest.raises(ValueError, match="not a path"):
        Plan(generation=0, world=1, assign={}, local_rank={}, disk_resume="/etc/step-00000004")
    with pytest.raises(ValueError, match="not a plan"):
        Plan.from_json('{"generation": 0, "world": 1, "assign": {}, "local_rank": {}, "config": "evil.yaml"}')


class _Store:
    """A store in a dict (the worker below never reaches its pool)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, k: str, value: str) -> None:
        self.values[k] = value.encode()

    def get(self, k: str) -> bytes:
        return self.values[k]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def test_a_workers_config_is_what_it_was_started_with_and_the_plans_rollback(tmp_path: Path) -> None:
    start = WorkerStart(str(CONFIGS / "tiny-dp4.yaml"), str(tmp_path), ("steps=7", "skip_steps=[2]"))
    worker = Worker(_Store(), "w0", start, SECRET)  # type: ignore[arg-type]
    plan = Plan(generation=3, world=1, assign={"w0": 0}, local_rank={"w0": 0}, resume="disk",
                disk_resume="step-00000004", skip_steps=[2, 5])
    cfg = worker._config(plan)
    assert cfg.steps == 7 and cfg.skip_steps == [2, 5]
    assert cfg.checkpoint.resume == str(tmp_path / "checkpoints" / "step-00000004")
    assert worker._config(Plan(generation=4, world=1, assign={}, local_rank={})).checkpoint.resume == "auto"
