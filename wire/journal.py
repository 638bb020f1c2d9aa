"""The attempts' journal, `<run_dir>/launcher/attempts.jsonl` (wire/run_paths.py): one event per line, appended by the
launcher (the coordinator, the agent keeper) and read by everything that needs a run's history: the goodput ledger's
clock, the pages and the report, a healer that takes a run over (what the dead one left running), the benches.

    {"event": "start", "job": "demo", "attempt": 3, "at": 1733390000.1, "nodes": ["n1", "n2"], "dp": 2, ...}
    {"event": "launched", "attempt": 3, "at": ..., "agents": {"n1": 4242}, "agents_started": {"n1": 1733390000.2}}
    {"event": "ranks", "attempt": 3, "at": ..., "ranks": {"4250": 0}, "started": {...}, "nodes": {"0": "n1"}}
    {"event": "end", "attempt": 3, "at": ..., "exit_codes": {"n1": 0}, "stopped": false}

Every event is a struct here, written and read through this module only. A line that is torn (a writer killed mid-
line) is skipped, as in every journal of a run (ground/jsonl.py); an event of a kind this release does not know is
skipped too (a newer writer's), and so is one that does not fit its kind, with a warning naming the file and line
(what reads a journal acts on what it can trust: a take-over kills only processes the journal surely names).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct

from ground.jsonl import append_jsonl

log = logging.getLogger(__name__)


class _Event(Struct, frozen=True, kw_only=True, tag_field="event"):
    at: float
    """When it happened (the launcher's wall clock, seconds since the epoch)."""
    attempt: int


class WarmNote(Struct, frozen=True, kw_only=True):
    """A start's warm pool: a formation (a new pool) or a generation that replaced ranks of the running one."""

    formed_in: int | None = None
    """The attempt that formed the pool: its workers carry that attempt's run id (wire/run_ids.py)."""
    formation: bool = False
    replaced: dict[int, str] = {}
    """rank -> the standby worker that took it."""
    why: str = ""


class Start(_Event, frozen=True, tag="start"):
    job: str = ""
    nodes: list[str] = []
    dp: int | None = None
    resume: str | None = None
    """What the ranks were told to resume from: auto, a checkpoint path, memory (a warm generation), or None."""
    agent_urls: dict[str, str] = {}
    warm: WarmNote | None = None


class Launched(_Event, frozen=True, tag="launched"):
    """Each host's torchrun as the coordinator started it: what a take-over checks before it signals that pid."""

    agents: dict[str, int | None] = {}
    agents_started: dict[str, float | None] = {}


class Ranks(_Event, frozen=True, tag="ranks"):
    ranks: dict[str, int] = {}
    """pid -> rank."""
    started: dict[str, float] = {}
    """pid -> its start time on its host."""
    nodes: dict[str, str] = {}
    """rank -> the host it runs on."""


class End(_Event, frozen=True, tag="end"):
    exit_codes: dict[str, int] = {}
    """host -> its torchrun's exit code."""
    stopped: bool | None = None
    """The healer stopped it (None: not said, in journals of an older release)."""
    superseded: bool = False
    """A warm restart took its place: its survivors train on in the next attempt."""
    taken_over: bool = False
    killed: list[int] = []
    lost: list[str] = []
    """Hosts whose agent could not be reached when it was stopped."""


class WarmReady(_Event, frozen=True, tag="warm-ready"):
    resumed: dict[str, str] = {}
    """worker -> where it took its state from, in its own words ("memory step 12 in 0.310 s")."""


class Adopted(_Event, frozen=True, tag="adopted"):
    node: str


class LeftoverStopped(_Event, frozen=True, tag="leftover-stopped"):
    node: str


class AgentRestarted(Struct, frozen=True, kw_only=True, tag_field="event", tag="agent-restarted"):
    """A host's node agent replaced (the agent keeper), whatever attempt runs."""

    at: float
    node: str
    url: str = ""
    adopted: int | None = None
    """The attempt the new agent took on there (None: none ran)."""
    attempt: None = None


class Screened(_Event, frozen=True, tag="screened"):
    """A host screened before it took work (runbooks/library/preflight.yaml): before the attempt `attempt` started,
    or as an idle spare while it ran. A host that failed is left out of the job."""

    node: str
    status: str
    """pass, degraded, fail or error (error: the runbook could not run; it blames no host)."""
    summary: str = ""
    seconds: float = 0.0
    drain: dict[str, Any] | None = None
    """A failed host's drain: the reason given, whether it was drained, and why not (healer/launchers/drain.py)."""


class Returned(_Event, frozen=True, tag="returned"):
    """A host the healer had left out passed its screening again (a repaired host): a spare from now on, and given
    back to the scheduler where megaheal had drained it (`scheduler`: what was done there)."""

    node: str
    scheduler: dict[str, Any] | None = None


class Grown(_Event, frozen=True, tag="grown"):
    """A planned change, not an incident: the job that came back smaller grows back onto spares again, attempt
    `attempt` on `nodes` at `dp` (it ran on `from_nodes` at `from_dp`), from the checkpoint of `resume_step`."""

    nodes: list[str]
    dp: int
    from_nodes: list[str]
    from_dp: int
    resume_step: int | None = None


class Regrouped(_Event, frozen=True, tag="regrouped"):
    """In a job of replica groups (train/ft/), attempt `attempt` goes on on `nodes`: the groups of `left` were
    stopped (or lost), and those of `started` started, a joining one in a leaving one's place (`groups`: host ->
    its group's index), while every other group trained on."""

    nodes: list[str]
    left: list[str] = []
    started: list[str] = []
    groups: dict[str, int] = {}
    why: str = ""


class Retuned(_Event, frozen=True, tag="retuned"):
    """The job's save (`what`: save) or snapshot interval moved by the healer (healer/launchers/save_tuning.py) from
    attempt `attempt` on: every `steps` steps, was `previous_steps`; `why` gives the failures, the stall and the
    optimum it aimed at."""

    what: str
    steps: int
    previous_steps: int
    why: str = ""


Event = (Start | Launched | Ranks | End | WarmReady | Adopted | LeftoverStopped | AgentRestarted | Screened | Returned
         | Grown | Regrouped | Retuned)
_decode = msgspec.json.Decoder(Event).decode  # type: ignore[arg-type]
KINDS = frozenset(str(t.__struct_config__.tag) for t in Event.__args__)  # type: ignore[attr-defined]


def append(path: Path, event: Event) -> None:
    """One event at the end of the journal, whole (one write of one line)."""
    append_jsonl(path, msgspec.to_builtins(event))


def read(path: Path) -> list[Event]:
    """Every event of the journal in order that fits its kind; [] when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    events: list[Event] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            raw = json.loads(line)
        except ValueError:
            continue  # torn: a writer killed mid-line
        if not isinstance(raw, dict) or raw.get("event") not in KINDS:
            continue
        try:
            # NOTE: decoded from the line, not converted from `raw`: JSON keys are strings, and only the JSON decoder
            # reads a rank's key ("3") into the int it stands for.
            events.append(_decode(line))
        except msgspec.ValidationError as exc:
            log.warning("%s:%d: a %s event that does not fit its kind, skipped: %s", path, lineno, raw["event"], exc)
    return events


class Journal:
    """A run's journal, read once: its attempts' starts and ends, and the events of one attempt."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    @classmethod
    def of(cls, path: Path) -> Journal:
        return cls(read(path))

    @property
    def starts(self) -> list[Start]:
        return [e for e in self.events if isinstance(e, Start)]

    @property
    def ends(self) -> list[End]:
        return [e for e in self.events if isinstance(e, End)]

    def last_start(self) -> Start | None:
        starts = self.starts
        return starts[-1] if starts else None

    def job(self) -> str | None:
        """The job the run ran (its first start that names one)."""
        return next((s.job for s in self.starts if s.job), None)

    def last_attempt(self) -> int | None:
        numbers = [e.attempt for e in self.events if e.attempt is not None]
        return max(numbers) if numbers else None

    def of_attempt(self, attempt: int) -> list[Event]:
        return [e for e in self.events if e.attempt == attempt]

    def unfinished(self) -> int | None:
        """The number of the last attempt when it has no end (its healer died while it ran), else None."""
        last = self.last_attempt()
        if last is None:
            return None
        return None if any(isinstance(e, End) for e in self.of_attempt(last)) else last

    def window(self, attempt: int) -> tuple[float, float | None] | None:
        """(start, start of the next attempt or None) of `attempt`; None when it never started."""
        starts = sorted((s.at, s.attempt) for s in self.starts)
        for i, (at, number) in enumerate(starts):
            if number == attempt:
                return at, starts[i + 1][0] if i + 1 < len(starts) else None
        return None
