"""Logging of megaheal's long-running commands (`run`, `healer`, `sidecar`, `agent`, `relay`): one handler on the
root logger, on stderr, as text for a person or as JSON lines for a log shipper (`--log-level`, `--log-format`).

A JSON line holds `time` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`, and `exception` (the
formatted traceback) when the record carries one, so Loki, Elasticsearch or `jq` read it without a parser of its own.

NOTE: stdlib only: this runs in every process megaheal starts, the sidecar on each training node included.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("apscheduler", "alembic")
"""Libraries that narrate every job and migration at INFO: kept at WARNING unless the level asked for is DEBUG."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback's newlines are escaped inside its string)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # NOTE: default=str: a message's arguments are formatted already; only odd `extra` values could get here.
        return json.dumps(line, ensure_ascii=False, default=str)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure` installs (told apart from others so that a second call replaces only it)."""


def check(level: str, fmt: str) -> None:
    """ValueError naming the option when `level` or `fmt` is not one megaheal knows."""
    if level.lower() not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def configure(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send every record at `level` or above to `stream` (stderr) as `fmt`; returns the handler installed.

    A root logger with a handler ignores a later `logging.basicConfig` (a library's, or a module's run on its own),
    so this one is what the process logs with. Called again, it replaces its own handler, not anyone else's (pytest's
    capture). ValueError for an unknown level or format."""
    check(level, fmt)
    handler = _Handler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    return handler
