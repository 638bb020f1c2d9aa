"""Where a job's node agents are, whoever started them: `RUN_DIR/launcher/agents.json` ({host: orders URL}),
written by the launcher each time its agents change, read by a healer that takes the run over; and what such a
healer does with an agent found there (tells it to report to itself). Every launcher does it the same way.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from pathlib import Path

from ground.secretfile import SecretError, read_secret, replace_private
from healer.launchers.agent_client import AgentClient, AgentUnreachable, Fenced, OrderFailed
from wire.orders import ReportOrder, ShutdownOrder
from wire.run_paths import RunPaths

log = logging.getLogger(__name__)


def path(run_dir: Path) -> Path:
    return RunPaths(run_dir).agents


def save(run_dir: Path, urls: dict[str, str]) -> dict[str, str]:
    """Record the agents' URLs (whole or not at all: a healer dying meanwhile leaves the previous file); `urls`."""
    target = path(run_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: 0600, as the token: the healer sends its token to the URLs it reads back from here.
    replace_private(target, json.dumps(urls) + "\n")
    return urls


def load(run_dir: Path) -> dict[str, str]:
    """The agents the run's launcher last recorded; {} when none were."""
    where = path(run_dir)
    if not where.exists():
        return {}
    try:
        return dict(json.loads(read_secret(where, "agents' URLs", private=True)))
    except (SecretError, ValueError) as exc:
        # NOTE: a file someone else could have written names where the healer would send its token: not read.
        log.error("the run's agents are not taken from %s: %s", where, exc)
        return {}


def redirect(node: str, url: str, token: str, healer_url: str, tls: ssl.SSLContext | None = None, *,
             epoch: int) -> bool:
    """Tell the agent of `node` at `url` to send its batches to `healer_url` from now on; False when it does not
    answer (or is not this run's: it refuses the token). Fenced when it refuses `epoch`: a newer healer drives it."""
    client = AgentClient(node, url, token, timeout_s=3, attempts=1, tls=tls)
    try:
        client.run(ReportOrder(id=f"report:{node}:{time.time_ns()}", epoch=epoch, healer_url=healer_url), 10)
    except Fenced:
        raise  # NOTE: not a gone agent to replace: the newer healer's
    except (AgentUnreachable, OrderFailed) as exc:
        log.warning("the agent of %s at %s is gone (%s): starting a new one", node, url, exc)
        return False
    return True


def shut_down(node: str, url: str, token: str, tls: ssl.SSLContext | None = None, *, epoch: int) -> bool:
    """Ask the agent of `node` to end (its ranks must already be stopped); False when it did not take the order.
    True too when it refuses `epoch`: a newer healer drives it, and it is that one's to end, never killed from here."""
    try:
        AgentClient(node, url, token, timeout_s=3, attempts=1, tls=tls).order(
            ShutdownOrder(id=f"shutdown:{node}:{time.time_ns()}", epoch=epoch))
    except Fenced as exc:
        log.warning("the agent of %s is left running: %s", node, exc)
        return True
    except (AgentUnreachable, OrderFailed) as exc:
        log.warning("the agent of %s did not take its shutdown: %s", node, exc)
        return False
    return True
