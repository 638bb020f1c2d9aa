"""The paths of a run directory, named once: every writer and reader of a run (the trainer, the launchers, the
healer, the pages, the benches) takes them from here.

    <run_dir>/ranks/<rank>.jsonl          one step record per line (train/records.py), every attempt appended
    <run_dir>/checkpoints/                the trainer's checkpoints (train/checkpoint/)
    <run_dir>/warm/                       a warm pool's workers' logs (train/warm/pool.py)
    <run_dir>/launcher/attempts.jsonl     the attempts' journal (wire/journal.py)
    <run_dir>/launcher/agents.json        each host's node agent URL (healer/launchers/agent_registry.py)
    <run_dir>/launcher/hosts.json         each host's scheduler state at the end of the run
    <run_dir>/launcher/token              the run's token, private to its user
    <run_dir>/launcher/healer.url         where the healer driving the run serves (https; `megaheal incidents`)
    <run_dir>/launcher/tls/               the run's certificate authority and certificates (run_authority.py)
    <run_dir>/launcher/runner.lock        held by the `megaheal run` that drives the run
    <run_dir>/launcher/objective.json     the job's ETTR objective the run was started with (healer/ledger/objective.py)
    <run_dir>/healer.db                   the embedded healer's database (SQLite)
    <run_dir>/report.html                 the run's report

NOTE: `launcher/` was `supervisor/`, named after a module that is gone. A run written before keeps its files there:
readers take the old folder when the new one is not there (one release: drop `LEGACY` after 0.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LEGACY = "supervisor"


@dataclass(frozen=True, slots=True)
class RunPaths:
    path: Path

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    def rank_records(self, rank: int) -> Path:
        return self.ranks / f"{rank}.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def warm(self) -> Path:
        return self.path / "warm"

    @property
    def launcher(self) -> Path:
        """The launcher's records; a run of the release before keeps them in `supervisor/` (read, never written)."""
        new = self.path / "launcher"
        old = self.path / LEGACY
        return old if not new.exists() and old.is_dir() else new

    @property
    def journal(self) -> Path:
        return self.launcher / "attempts.jsonl"

    @property
    def agents(self) -> Path:
        return self.launcher / "agents.json"

    @property
    def host_states(self) -> Path:
        return self.launcher / "hosts.json"

    @property
    def token(self) -> Path:
        return self.launcher / "token"

    @property
    def healer_url(self) -> Path:
        return self.launcher / "healer.url"

    @property
    def runner_lock(self) -> Path:
        return self.launcher / "runner.lock"

    @property
    def objective(self) -> Path:
        return self.launcher / "objective.json"

    @property
    def database(self) -> Path:
        return self.path / "healer.db"

    @property
    def database_url(self) -> str:
        return f"sqlite:///{self.database.absolute()}"

    @property
    def report(self) -> Path:
        return self.path / "report.html"
