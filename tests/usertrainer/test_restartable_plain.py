"""megaheal.rank.restartable outside a warm pool: under plain torchrun the wrapped function runs once, in the process
group torchrun's environment describes, so a script written for megaheal runs unchanged elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

# NOTE: each line goes out in one write(2) of its own: both ranks share torchrun's stdout pipe, and print() writes a
# line's text and its newline apart, so two ranks' lines interleaved ("sum 3rank 1 ...", "returnedreturned done").
# A write of less than PIPE_BUF bytes to a pipe is never split.
SCRIPT = """
import os
import torch, torch.distributed as dist
import megaheal.rank as mh

def say(line):
    os.write(1, (line + "\\n").encode())

@mh.restartable
def train(r):
    t = torch.tensor([r.rank + 1.0])
    dist.all_reduce(t)
    say(f"rank {r.rank} of {r.world_size} generation {r.generation} source {r.source} new {r.is_new} sum {int(t)}")
    return "done"

say(f"returned {train()} enabled {mh.enabled()}")
"""


def test_under_plain_torchrun_the_wrapped_function_runs_once_in_torchruns_group(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAHEAL_")} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 generation 0 source None new True sum 3" in done.stdout, done.stdout
    assert done.stdout.count("returned done enabled False") == 2
