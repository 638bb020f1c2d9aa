"""`python -m megaheal.rank.bootstrap [-m] TARGET [ARGS...]`: how a node agent starts each rank of a user's program
under torchrun, so that an unchanged script is seen: the rank says hello to its node's sidecar, a thread reports the
progress of its collectives (megaheal/rank/progress.py) and answers flight-recorder dump requests, and
TORCHELASTIC_RESTART_COUNT counts the healer's restarts. Then the script runs in this same interpreter as
`python SCRIPT ARGS` (or `python -m MODULE ARGS`) would run it: as __main__, with sys.argv and sys.path[0] as they
would be. Its exit status and traceback are the script's own.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

import megaheal.rank as api
from megaheal.rank.progress import CollectiveProgress
from megaheal.rank.reporter import Reporter
from wire import rank_env

USAGE = "usage: python -m megaheal.rank.bootstrap [-m] SCRIPT.py|MODULE [ARGS...]"


def main(argv: list[str]) -> None:
    module = argv[:1] == ["-m"]
    argv = argv[1:] if module else argv
    if not argv:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    target, args = argv[0], argv[1:]
    if os.environ.get(rank_env.RESTART_COUNT):
        # NOTE: every attempt is a torchrun of its own, whose count starts at 0: the script's resume logic reads this.
        os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ[rank_env.RESTART_COUNT]
    reporter = Reporter.from_env()
    progress = None
    if reporter is not None:
        api._install(reporter)
        if reporter.beacon is not None:
            reporter.beacon.enter("startup", 0)
        progress = CollectiveProgress(reporter).start()
    sys.argv = [target, *args]
    # Where `python SCRIPT` (its directory) or `python -m MODULE` (the working directory) would put the program's own
    # first on the path: in place of ours, or before everything when the agent started us on a safe path.
    own = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    if os.environ.pop(rank_env.SAFE_PATH_SET, None):
        os.environ.pop("PYTHONSAFEPATH", None)
        sys.path.insert(0, own)
    else:
        sys.path[0] = own
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except BaseException as exc:
        if reporter is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            reporter.event("exception", {"type": type(exc).__name__, "message": str(exc)[:500]})
        raise
    finally:
        if progress is not None:
            progress.close()
        # NOTE: what the script built (its model's DTensors, its process group's works) is collected while the
        # interpreter is whole, as leave_process_group does for megaheal's trainer: a gloo work freed during
        # finalisation aborts the process.
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:])
