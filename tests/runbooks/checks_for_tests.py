"""Checks used only by the runner tests; the step worker imports them by their registry target."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Status


class SleepCheck(Check):
    """Records its pid (and a child's) and its start/end times, then sleeps, then passes."""

    name = "sleeper"

    @dataclass(kw_only=True, slots=True)
    class Config:
        sleep: timedelta = timedelta(seconds=1)
        """How long to sleep."""
        record: str = ""
        """File to append "pid child_pid start end" lines to (end written after the sleep)."""
        with_child: bool = False
        """Also start a child process that sleeps as long (it must be stopped with the step)."""

        def __post_init__(self) -> None:
            if self.sleep <= timedelta(0):
                raise ValueError(f"sleep must be > 0, got {self.sleep}")

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        child = 0
        if config.with_child:
            child = subprocess.Popen(
                [sys.executable, "-c", f"import time; time.sleep({config.sleep.total_seconds()})"]
            ).pid
        start = time.time()
        with open(config.record, "a") as f:
            f.write(f"start {os.getpid()} {child} {start}\n")
        time.sleep(config.sleep.total_seconds())
        with open(config.record, "a") as f:
            f.write(f"end {os.getpid()} {child} {time.time()}\n")
        return CheckResult(status=Status.PASS, summary=f"slept {config.sleep.total_seconds():g}s")
