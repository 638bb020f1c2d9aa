"""Names of jobs and nodes: one rule (ground/names.py) wherever a name enters (the CLI's run directory, training
configs and `--set`, the sidecar's node, rank datagrams, heartbeat batches), and `--set` values for string fields
kept as typed (a run directory named after a date once became a YAML date in every rank's config)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from exporters.sidecar import Sidecar
from ground.names import check_name, derive_name, is_name
from ground.typedconfig import ConfigError
from healer.agent.rank_start import torchrun_argv
from healer.launchers.coordinator import Coordinator
from healer.launchers.remediator import AgentRemediator
from healer.runner.run import job_name
from runbooks.spec import load_runbook
from tests.conftest import CONFIGS
from tests.healer.helpers import batch
from train.config import load_config
from wire.orders import decode_order
from wire.telemetry import SchemaError, build_record, decode_batch

pytestmark = pytest.mark.unit

BAD = ["my run", "jöb", "job\n", "-job", "", "a" * 254, "job\x00", "a/../../../etc", "team/job", "a..b", ".hidden"]
HELLO = {"local_rank": 0, "node": "h", "world_size": 1, "mesh": {}}


@pytest.mark.parametrize("name", BAD)
def test_it_refuses_a_bad_name_wherever_a_job_or_node_name_enters(tmp_path: Path, name: str) -> None:
    assert not is_name(name)
    with pytest.raises(ValueError, match="job must be a name of letters, digits"):
        check_name(name, "job")
    with pytest.raises(msgspec.ValidationError):  # a rank's datagram: refused at the rank, before it is sent
        build_record("hello", name, 0, 1, 0, HELLO)
    with pytest.raises(SchemaError):  # a heartbeat batch the healer gets: refused whole, naming the field
        decode_batch(json.dumps(batch("n1", [0], job=name)).encode())
    with pytest.raises(SchemaError):
        decode_batch(json.dumps(batch(name, [0])).encode())
    with pytest.raises(ValueError, match="node must be a name"):  # `megaheal sidecar --node`
        Sidecar.Config(node=name, socket_path=str(tmp_path / "s.sock"))
    config = tmp_path / "c.yaml"
    config.write_text(f"job: {json.dumps(name)}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: job must be a name .*\(line 1\)"):
        load_config(config)
    # NOTE: `--set` reads a YAML scalar: "job\n" is "job" there, "" is null (unset), and a NUL is a YAML error.
    if name and name.strip() == name and "\x00" not in name:
        with pytest.raises(ConfigError, match=r"job must be a name .*\(from --set"):
            load_config(None, [f"job={name}"])
    with pytest.raises(ValueError, match="job must be a name"):
        Coordinator.Config(job=name, config="c.yaml", run_dir=tmp_path)
    with pytest.raises(ValueError, match="node must be a name"):
        AgentRemediator.Config(nodes=("n1", name), spares=(), dp=1)


def test_it_accepts_the_names_clusters_use() -> None:
    for name in ("job-7", "llama3_70b.run2", "2024-06-01", "node-001.cluster.local", "team.job@v2", "a" * 253):
        assert check_name(name, "job") == name
        build_record("hello", name, 0, 1, 0, HELLO)


def test_a_path_made_from_names_stays_under_its_parent(tmp_path: Path) -> None:
    from ground.names import name_path

    assert name_path(tmp_path, "job-7-attempt-003") == tmp_path / "job-7-attempt-003"
    assert name_path(tmp_path, "a" * 243 + "-attempt-003").parent == tmp_path  # 255: the longest a file name is
    for part in ("..", "../x", "a/../../etc", "/etc", ".hidden", "a..b", "", "a" * 256):
        with pytest.raises(ValueError, match="cannot name a directory under"):
            name_path(tmp_path, "fine", part)


def test_an_agent_refuses_a_start_order_for_a_job_whose_name_would_leave_its_directory() -> None:
    import msgspec

    from wire.orders import decode_order

    order = {"kind": "start", "id": "x", "epoch": 1, "job": "a/../../../etc", "attempt": 0, "nnodes": 1, "node_rank": 0,
             "nproc_per_node": 1, "run_dir": "/tmp/r", "config": "c.yaml"}
    with pytest.raises(msgspec.ValidationError, match=r"\$\.job"):
        decode_order(json.dumps(order).encode())
    decode_order(json.dumps({**order, "job": "a-etc"}).encode())  # the same order with a name


def test_it_makes_a_valid_job_name_from_any_run_directory() -> None:
    assert derive_name("my run") == "my-run"
    assert derive_name("2024-06-01") == "2024-06-01"
    assert derive_name("..hidden run ☃") == "hidden-run-"
    assert derive_name("team/job..v2") == "team-job.v2"
    unusable = derive_name("ランダム")
    assert unusable.startswith("run-") and unusable != derive_name("別の")  # two such directories stay apart
    assert job_name(None, Path("runs/my run"), resume=False) == "my-run"
    assert job_name("chosen", Path("runs/my run"), resume=False) == "chosen"


def test_it_keeps_set_values_of_string_fields_as_typed_and_types_the_rest() -> None:
    cfg = load_config(CONFIGS / "demo.yaml", ["job=2024-06-01", "steps=6", "model.window=null", "skip_steps=[3, 4]",
                                               "data.paths=[2024-01-01.txt, 'x y']", "optim.lr=1e-4"])
    assert (cfg.job, cfg.steps, cfg.model.window, cfg.skip_steps, cfg.data.paths, cfg.optim.lr) == (
        "2024-06-01", 6, None, [3, 4], ["2024-01-01.txt", "x y"], 1e-4)
    for text in ("123", "yes", "0x1f", "1e3", "0.5"):
        assert load_config(None, [f"job={text}"]).job == text
    assert load_config(None, ["job=null"]).job is None  # unset: the name comes from the run directory
    with pytest.raises(ConfigError, match=r"config\.steps: expected int, got datetime\.date\(2024, 6, 1\) \(from --set"):
        load_config(None, ["steps=2024-06-01"])
    # The same typing for a runbook's step parameters (`megaheal diagnose --set`).
    (host,) = [s for s in load_runbook("node-health", ["host.checkpoint_dir=2024-06-01"]).steps if s.name == "host"]
    assert host.config.checkpoint_dir == "2024-06-01"


def test_every_rank_of_a_run_in_a_directory_named_after_a_date_loads_its_config(tmp_path: Path) -> None:
    """What `megaheal run --run-dir runs/2024-06-01` hands each rank: the torchrun argv's --set items, loaded the way
    a rank loads them (this once made the job name a date, failed every rank, and restart-looped the job)."""
    run_dir = tmp_path / "2024-06-01"
    job = job_name(None, run_dir, resume=False)
    coordinator = Coordinator(Coordinator.Config(job=job, config=str(CONFIGS / "demo.yaml"), run_dir=run_dir,
                                                 overrides=("checkpoint.every_steps=5",), grace=timedelta(seconds=1)),
                              view=None, token="t" * 16, epoch=1)  # type: ignore[arg-type]  # start() is not called
    order = decode_order(msgspec.json.encode(coordinator.start_order(0, ("n1", "n2"), 1, "127.0.0.1:29500", "auto",
                                                                     coordinator.overrides(dp=2))))
    argv = torchrun_argv(order, "127.0.0.1:29500", sys.executable, tmp_path / "logs")  # type: ignore[arg-type]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert load_config(argv[argv.index("--config") + 1], sets).job == "2024-06-01"
    assert argv[argv.index("--rdzv-id") + 1] == "2024-06-01-0"
