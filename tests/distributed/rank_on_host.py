"""A training rank that says it is on host n<1 + RANK // 2> (MEGAHEAL_NODE), as a node agent would tell it: two ranks
a host under one torchrun, for the faults that strike one host's ranks (train/sdc_faults.py)."""

from __future__ import annotations

import os
import sys

from train.__main__ import main

if __name__ == "__main__":
    os.environ["MEGAHEAL_NODE"] = f"n{1 + int(os.environ['RANK']) // 2}"
    sys.exit(main())
