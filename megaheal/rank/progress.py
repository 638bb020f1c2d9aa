"""Progress of a rank that says nothing itself: the collectives its process groups complete, as the flight recorder
counts them, reported as the rank's step while its trainer reports no steps of its own.

A daemon thread waits for the script to set up torch.distributed, then starts the flight recorder's dump thread
(exporters/flight_recorder.py: what a hang's evidence reads) and, every `interval_s`, reads the count of completed
collectives (~0.07 ms) and reports it when it grew. A job whose ranks stop completing collectives stops "stepping",
which is what the hang detector looks for; the healer reads the stacks and the flight recorder to say where. Once
the trainer calls megaheal.rank.step, its steps are the progress and this thread only keeps the dump thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from exporters.flight_recorder import FlightRecorderDumper, completed_collectives
from megaheal.rank.reporter import Reporter
from wire import phase_now

log = logging.getLogger("megaheal.rank")


class CollectiveProgress:
    def __init__(self, reporter: Reporter, interval_s: float = 1.0) -> None:
        self.reporter, self.interval_s = reporter, interval_s
        self.dumper: FlightRecorderDumper | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megaheal-progress", daemon=True)

    def start(self) -> CollectiveProgress:
        self._thread.start()
        return self

    def _run(self) -> None:
        import torch.distributed as dist  # NOTE: on this thread: the script's own start does not wait for it

        while not dist.is_initialized():
            if self._stop.wait(self.interval_s / 2):
                return
        self.dumper = FlightRecorderDumper.from_env(os.environ.get(phase_now.ENV))
        last, last_at = None, time.monotonic()
        while not self._stop.wait(self.interval_s):
            if self.reporter.reports_steps or not dist.is_initialized():
                continue  # NOTE: and never beside the script's own destroy_process_group
            try:
                count = completed_collectives()
            except (RuntimeError, ValueError, TypeError):
                log.warning("megaheal.rank: cannot read the flight recorder's status; no progress is reported",
                            exc_info=True)
                return
            if count is None or count == last:
                continue
            now = time.monotonic()
            self.reporter.progress(count, now - last_at)
            last, last_at = count, now

    def close(self) -> None:
        """Stop the thread and wait for it. NOTE: joined, not left to die with the interpreter: a daemon thread caught
        in the flight recorder's C++ at exit aborts the process ("terminate called without an active exception",
        SIGABRT) after the script's last line, and its job then counts as crashed (an FSDP2 script's rank, twice in
        a fresh run of tests/usertrainer)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self.dumper is not None:
            self.dumper.close()
