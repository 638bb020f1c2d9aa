"""`--log-format json`: one JSON object a line with time, level, logger, message and the exception's traceback, and
a level that filters (ground/logsetup.py)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import datetime

import pytest

from ground.logsetup import QUIET_LOGGERS, configure

pytestmark = pytest.mark.unit


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)


def test_json_lines_carry_time_level_logger_message_and_the_traceback(stream: io.StringIO) -> None:
    configure("info", "json", stream)
    log = logging.getLogger("megaheal.test")
    log.debug("not shown at info")
    log.info("incident %d opened\non two lines", 7)
    try:
        raise RuntimeError("the database went away")
    except RuntimeError:
        log.error("tick failed", exc_info=True)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first == {"time": first["time"], "level": "info", "logger": "megaheal.test",
                     "message": "incident 7 opened\non two lines"}
    assert datetime.fromisoformat(first["time"]).utcoffset().total_seconds() == 0
    assert second["level"] == "error" and second["message"] == "tick failed"
    assert second["exception"].startswith("Traceback") and "RuntimeError: the database went away" in second["exception"]


def test_text_lines_and_a_second_setup_replaces_the_first(stream: io.StringIO) -> None:
    configure("info", "json", stream)
    configure("warning", "text", stream)
    logging.getLogger("megaheal.test").info("filtered out")
    logging.getLogger("megaheal.test").warning("kept")
    assert stream.getvalue().endswith(" WARNING megaheal.test: kept\n") and stream.getvalue().count("\n") == 1
    logging.basicConfig(level=logging.DEBUG, format="%(message)s")  # a library's: the setup above stays
    logging.getLogger("megaheal.test").info("still filtered out")
    assert stream.getvalue().count("\n") == 1


def test_the_schedulers_chatter_stays_quiet_unless_debugging(stream: io.StringIO) -> None:
    configure("info", "text", stream)
    assert logging.getLogger("apscheduler").getEffectiveLevel() == logging.WARNING
    configure("debug", "text", stream)
    assert logging.getLogger("apscheduler").getEffectiveLevel() == logging.DEBUG


@pytest.mark.parametrize(("level", "fmt", "message"), [("loud", "text", "--log-level must be one of"),
                                                       ("info", "xml", "--log-format must be one of text, json")])
def test_an_unknown_level_or_format_is_an_error_naming_the_option(level: str, fmt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        configure(level, fmt, io.StringIO())
