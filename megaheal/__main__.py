"""`python -m megaheal ...`: the CLI without the console script (what a launcher runs on a node)."""

import os
import sys
from pathlib import Path

# NOTE: `python -m` puts the working directory first on sys.path, where a user's own `train.py` (or `sim.py`,
# `wire.py`, ...) would then stand in for megaheal's package of that name: `megaheal run train.py` from a user's
# project once imported the user's script as megaheal's trainer. Unless megaheal itself is being run from a
# checkout in this directory, that entry goes (as `python -P` would have it).
if sys.path and Path(sys.path[0] or os.getcwd()).resolve() == Path.cwd().resolve() and \
        Path(__file__).resolve().parents[1] != Path.cwd().resolve():
    del sys.path[0]

from megaheal.cli import app  # noqa: E402 - after the path is made safe

app(prog_name="megaheal")
