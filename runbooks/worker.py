"""One runbook step in its own process: `python -m runbooks.worker RESULT_PATH` (request on stdin).

The runner starts this process in a new session so that, past the step's timeout, the whole
process group (this worker and any ranks it forked) can be stopped. The request names the check
by its registry target and carries the check's params and the run context; the params are
validated again here, since they crossed a process boundary. The result is written to
RESULT_PATH as JSON (stdout is left to whatever libraries print).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ground.typedconfig import from_mapping
from runbooks.registry import CheckContext, load_target
from wire.verdict import CheckResult, Status

log = logging.getLogger("runbooks.worker")


def run_request(request: dict) -> CheckResult:
    check_cls = load_target(request["target"])
    config = from_mapping(check_cls.Config, request["params"], "params")
    ctx = CheckContext.from_payload(request["context"])
    try:
        return check_cls().run(config, ctx)
    except Exception as exc:  # noqa: BLE001 -- a probe fails closed: any crash is an ERROR verdict
        log.error("check %s crashed", request["target"], exc_info=True)
        return CheckResult(status=Status.ERROR, summary=f"check crashed: {type(exc).__name__}: {exc}".splitlines()[0])


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if len(argv) != 1:
        print("usage: python -m runbooks.worker RESULT_PATH  (request JSON on stdin)", file=sys.stderr)
        return 2
    result = run_request(json.loads(sys.stdin.read()))
    Path(argv[0]).write_text(json.dumps(result.to_payload()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
