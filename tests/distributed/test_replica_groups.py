"""megaheal's trainer as three replica groups (train/ft/): each group a torchrun of 2 data-parallel ranks (FSDP2
inside it), the groups joined each step through a real torchft Lighthouse. One group is SIGKILLed mid-run: the
other two go on stepping with 2 where there were 3, sharing each step's whole batch between them; started again, it
takes a live peer's state (through the run's authenticated transport, not the disk) and trains to the end with them
(the Lighthouse, started again meanwhile, holds the two at a quorum until it is back). No sample is skipped or seen twice, and every group ends with the same weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import CONFIGS, REPO, job_env, kill_job
from tests.support import wait_for
from wire import ft_env
from wire.warm_seal import new_key, write_key

pytestmark = pytest.mark.multiprocess
STEPS, BATCH, GROUPS = 150, 12, 3  # 12 samples split over 3 or 2 groups of 2 ranks; ~0.15 s a step here
QUORUM_S = 150  # how long the two others may wait at a quorum for group 2 to start again (~10 s here, unloaded)


def records(run: Path, rank: int) -> list[dict[str, Any]]:
    path = run / "ranks" / f"{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def relight(port: str) -> Any:
    """A Lighthouse on `port` that forms a quorum only of all the groups; None while the last one's socket is not
    closed yet (its server shuts down in the background)."""
    from torchft._torchft import LighthouseServer

    try:
        return LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=GROUPS, join_timeout_ms=1000,
                                quorum_tick_ms=50, heartbeat_timeout_ms=2000)
    except RuntimeError as e:
        if "Address already in use" not in str(e):
            raise
        return None


def final_model(run: Path, group: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run.parent / f"group{group}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"group-{group}" / f"step-{STEPS:08d}", out)
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.timeout(300)
def test_a_killed_replica_group_costs_the_others_a_step_and_rejoins_from_a_live_peer(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
    url = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    key = write_key(tmp_path / "ft.key", new_key())
    run = tmp_path / "run"

    def start(group: int, where: Path = run, lighthouse: str = url, groups: int = GROUPS) -> subprocess.Popen[bytes]:
        env = job_env() | {ft_env.GROUP: str(group), ft_env.LIGHTHOUSE: lighthouse, ft_env.KEY_FILE: str(key),
                           "RUST_LOG": "warn"}
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "train",
             "--config", str(CONFIGS / "tiny-dp4.yaml"), "--run-dir", str(where),
             *[a for kv in (f"steps={STEPS}", f"global_batch={BATCH}", "parallel.dp=2", "ft.enabled=true",
                            f"ft.groups={groups}", f"ft.min_groups={min(2, groups)}", "checkpoint.every_steps=50",
                            f"ft.quorum_timeout_s={QUORUM_S}")
               for a in ("--set", kv)]],
            cwd=REPO, env=env, stdout=(where.parent / f"{where.name}-group{group}.log").open("ab"),
            stderr=subprocess.STDOUT, start_new_session=True)

    procs = [start(g) for g in range(GROUPS)]

    def past(step: int) -> bool:
        for g, p in enumerate(procs):
            if p.poll() not in (None, 0):
                raise AssertionError((tmp_path / f"run-group{g}.log").read_text()[-3000:])
        return all(any(r["step"] >= step for r in records(run, 2 * g)) for g in range(GROUPS))

    try:
        wait_for("every group past step 6", lambda: past(6), 120, every_s=0.1)
        kill_job(procs[2])  # its torchrun and both its ranks at once, as when its host dies
        killed_at, killed_step = time.time(), max(r["step"] for r in records(run, 4))
        wait_for("the two others step on without it",
                 lambda: any(r["replicas"] == 2 and r["time"] > killed_at for r in records(run, 0)), 60, every_s=0.1)
        # NOTE: the Lighthouse is started again (as its keeper does, on the same address) waiting for all three, so
        # that the two wait at their next quorum for group 2 however slowly it starts: under a loaded make test
        # it started after the two had trained to the end, and found no quorum to join.
        port = lighthouse.address().rsplit(":", 1)[1]
        lighthouse.shutdown()
        lighthouse = wait_for("the Lighthouse's address free again", lambda: relight(port), 30)
        procs[2] = start(2)
        for g, p in enumerate(procs):
            assert p.wait(180) == 0, (tmp_path / f"run-group{g}.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_job(p)
        lighthouse.shutdown()

    # The two groups never killed recorded each step once, each on the next 12 samples, and from the step group 2
    # was killed at to the last without a gap: a step that lost a group mid-way was tried again, not recorded twice
    # or skipped. (At the start, a group that missed the first quorums joins by a peer's state as well.)
    for rank in (0, 1, 2, 3):
        rows = records(run, rank)
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS - 1, (rank, steps)
        assert [s for s in steps if s >= killed_step] == list(range(killed_step, STEPS)), (rank, steps)
        assert all(r["sample_index"] == (r["step"] + 1) * BATCH for r in rows), (rank, rows[:3])
        assert {r["replica_group"] for r in rows} == {rank // 2}
    # Two groups from the step after group 2's last at the latest, until it was back.
    two = [r["step"] for r in records(run, 0) if r["replicas"] == 2 and r["time"] > killed_at]
    assert two and min(two) <= killed_step + 2, (two, killed_step)
    # Started again, group 2 did not start over (it was killed before its first checkpoint, at step 50): it took a
    # peer's state at the step the others had reached while it was away, and its log says so.
    again = [r for r in records(run, 4) if r["time"] > killed_at]
    assert again and again[0]["step"] > killed_step + 1 and again[-1]["step"] == STEPS - 1, again[:2]
    assert killed_step < 50 and f"took a live peer's state at step {again[0]['step']} (was at 0)" in \
        (tmp_path / "run-group2.log").read_text()
    # Each step's update is the same whoever took part: every group's loss is the same at every step all recorded,
    # and the three end with the same weights.
    losses: dict[int, set[float]] = {}
    for rank in range(2 * GROUPS):
        for r in records(run, rank):
            losses.setdefault(r["step"], set()).add(r["loss"])
    assert all(len(v) == 1 for v in losses.values()), {s: v for s, v in losses.items() if len(v) > 1}
    models = [final_model(run, g) for g in range(GROUPS)]
    for name, tensor in models[0].items():
        assert all(torch.equal(tensor, m[name]) for m in models[1:]), name
    # Against a run that never lost a group, of two groups all along (so: each step the same batch, split in two):
    # the losses agree to float rounding (the averages over 2 and 3 groups sum the same gradients in another order).
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
    ref = tmp_path / "ref"
    try:
        two = [start(g, ref, "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1], groups=2) for g in (0, 1)]
        for g, p in enumerate(two):
            assert p.wait(180) == 0, (tmp_path / f"ref-group{g}.log").read_text()[-3000:]
    finally:
        lighthouse.shutdown()
    reference = {r["step"]: r["loss"] for r in records(ref, 0)}
    drift = max(abs(r["loss"] - reference[r["step"]]) / reference[r["step"]] for r in records(run, 0))
    assert drift < 1e-4, drift
    gaps = [b["time"] - a["time"] for a, b in zip(records(run, 0), records(run, 0)[1:])]
    print(f"\ngroup 2 killed after step {killed_step}; the others' longest step gap {max(gaps):.2f} s; group 2 back "
          f"at step {again[0]['step']}; largest loss difference from an uninterrupted run of 2 groups {drift:.1e}")
