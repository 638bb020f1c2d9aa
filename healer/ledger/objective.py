"""The job's ETTR objective as its run records it, and the run judged against it from its goodput ledger.

    <run_dir>/launcher/objective.json     {"ettr_target": 0.95, "ettr_window": "604800s"}: GoodputCollector.Config

`megaheal run` writes it as it starts (a take-over keeps the run's own unless given another), so `megaheal report`,
the pages and a healer that takes the run over judge the job against the objective it ran under. A run that recorded
none (one from before) is judged against GoodputCollector.Config's defaults, and says so ("default").

`standing` judges the ledger's intervals at a time (the run's end; on an incident's page, when the incident was over):
- the ETTR over the objective's window (the run's time so far where that is shorter): met or missed, by how many points;
- the error budget, 1 - target, and how much of it is spent: unproductive seconds / (budget x that time);
- the burn rate over the last hour and 6 hours, as deploy/prometheus/rules/recording.yml (group megaheal-ettr) makes it
  from the counters `megaheal run` serves: unproductive seconds in the window / the window's length / budget.
  NOTE: two things make it Prometheus's number rather than the ledger's. The counters begin at the job's first step
  (the first attempt's startup is not in them), and the rules divide by at least the window's length (clamp_min), so
  a run shorter than the window is judged as if the part of the window before its first step were productive. The
  ETTR and the budget above are the ledger's: the first startup counts. A gap while no healer served the run (a
  take-over) is in the ledger's intervals and so in the report's burn rates, not in Prometheus's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

from ground.durations import to_mapping
from ground.typedconfig import ConfigError, from_mapping
from healer.ledger.goodput import CATEGORIES, Interval
from healer.ledger.metrics import GoodputCollector
from wire.run_paths import RunPaths

RECORDED, DEFAULT = "run directory", "default"
BURN_WINDOWS = (timedelta(hours=1), timedelta(hours=6))
"""The windows the report and the pages give the burn rate over (two of the recording rules')."""
STEP_KINDS = frozenset({"productive", "checkpointing", "lost"})
"""Interval kinds only steps make: the first of them is where the served counters begin."""


@dataclass(frozen=True, slots=True)
class Objective:
    cfg: GoodputCollector.Config = field(default_factory=GoodputCollector.Config)
    source: str = DEFAULT
    """RECORDED: the run's objective.json; DEFAULT: GoodputCollector.Config's (the run recorded none)."""


# ---- the file ---------------------------------------------------------------------------------------------------

def write_objective(run_dir: Path, cfg: GoodputCollector.Config) -> Path:
    """Record `cfg` as the run's objective, whole or not at all (a new file renamed over the old); returns its path."""
    path = RunPaths(run_dir).objective
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(to_mapping(cfg)) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_objective(run_dir: Path) -> Objective:
    """The run's objective: the one it recorded, else the defaults. ConfigError naming the file, and the key where
    one is wrong, missing or unknown, when the file is not an objective."""
    path = RunPaths(run_dir).objective
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Objective()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON: {exc}") from exc
    # NOTE: megaheal writes every key: one missing is a torn or hand-cut file, not a wish for the default.
    missing = [f.name for f in fields(GoodputCollector.Config) if isinstance(data, dict) and f.name not in data]
    if missing:
        raise ConfigError(f"{path}: missing key(s) {', '.join(map(repr, missing))}")
    return Objective(from_mapping(GoodputCollector.Config, data, str(path)), RECORDED)


# ---- judged against the ledger ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Burn:
    window_s: float
    unproductive_s: float
    """Of the window, the unproductive seconds since the first step."""
    seen_s: float
    """Of the window, the seconds since the first step: less than window_s where the run is shorter."""
    rate: float

    @property
    def short(self) -> bool:
        return self.seen_s < self.window_s


@dataclass(frozen=True, slots=True)
class Standing:
    """The job against its objective at `at`."""

    objective: Objective
    at: float
    judged_s: float
    """The time judged: the objective's window, or the run's time up to `at` where that is shorter."""
    unproductive_s: float
    """Of it, the seconds the ledger did not count productive."""
    burns: tuple[Burn, ...]

    @property
    def target(self) -> float:
        return self.objective.cfg.ettr_target

    @property
    def window_s(self) -> float:
        return self.objective.cfg.ettr_window.total_seconds()

    @property
    def budget(self) -> float:
        return 1 - self.target

    @property
    def ettr(self) -> float:
        return 1 - self.unproductive_s / self.judged_s if self.judged_s > 0 else 0.0

    @property
    def met(self) -> bool:
        return self.ettr >= self.target

    @property
    def points(self) -> float:
        """ETTR less the target, in percentage points (negative: missed)."""
        return 100 * (self.ettr - self.target)

    @property
    def spent(self) -> float:
        """The share of the budget spent (1: all of it)."""
        return self.unproductive_s / (self.budget * self.judged_s) if self.judged_s > 0 else 0.0

    def to_payload(self) -> dict[str, Any]:
        return {"at": self.at, "judged_s": self.judged_s, "shorter_than_window": self.judged_s < self.window_s,
                "ettr": round(self.ettr, 4), "met": self.met, "points": round(self.points, 2),
                "budget": round(self.budget, 6), "budget_s": round(self.budget * self.judged_s, 3),
                "unproductive_s": self.unproductive_s, "spent": round(self.spent, 4),
                "burn_rate": {label(b.window_s): {"rate": b.rate, "unproductive_s": b.unproductive_s,
                                                  "seen_s": b.seen_s, "shorter_than_window": b.short}
                              for b in self.burns}}


def standing(spans: list[Interval], objective: Objective, at: float | None = None,
             windows: tuple[timedelta, ...] = BURN_WINDOWS) -> Standing | None:
    """The run judged at `at` [default: the end of its ledger] from its ledger's intervals (in time order, tiling its
    wall time: healer.ledger.goodput.intervals). None before its first step, and where it has none: a user's program
    writes no step records, so its productive time is unknown, and it is not judged (nor served to Prometheus)."""
    if not spans:
        return None
    t0 = spans[0].start
    at = min(max(at, t0), spans[-1].end) if at is not None else spans[-1].end
    first = next((s.start for s in spans if s.kind in STEP_KINDS), None)
    if first is None or first >= at:
        return None
    since = max(t0, at - objective.cfg.ettr_window.total_seconds())
    budget = 1 - objective.cfg.ettr_target
    # NOTE: the time judged less its productive seconds, as the ledger's ETTR counts its wall: a gap between the
    # intervals (the database's ledger of two runs of one job) is not productive. The burn rate counts the intervals'
    # unproductive seconds instead, as Prometheus does: no counters served the gap.
    unproductive = (at - since) - _seconds(spans, since, at, productive=True)
    return Standing(objective, round(at, 3), round(at - since, 3), round(unproductive, 3),
                    tuple(_burn(spans, first, at, w.total_seconds(), budget) for w in windows))


def _burn(spans: list[Interval], first: float, at: float, window_s: float, budget: float) -> Burn:
    since = max(at - window_s, first)
    unproductive = _seconds(spans, since, at, productive=False)
    # NOTE: over the window's whole length even where less of it was seen: the rules' clamp_min(elapsed, window).
    return Burn(window_s, round(unproductive, 3), round(at - since, 3), round(unproductive / window_s / budget, 4))


def _seconds(spans: list[Interval], since: float, until: float, productive: bool) -> float:
    """The productive (or the other) seconds of `spans` between `since` and `until`."""
    return sum(min(s.end, until) - max(s.start, since) for s in spans
               if (s.kind == "productive") is productive and s.end > since and s.start < until)


def lines(seconds: dict[str, float], wall_s: float) -> list[tuple[str, float, float]]:
    """The ledger's lines, (category, seconds, share of the wall): productive, then the losses, largest first."""
    order = ["productive", *sorted((c for c in CATEGORIES if c != "productive"), key=lambda c: -seconds.get(c, 0.0))]
    return [(c, seconds.get(c, 0.0), seconds.get(c, 0.0) / wall_s if wall_s > 0 else 0.0) for c in order]


def label(seconds: float) -> str:
    """A window as the recording rules name it: 1h, 6h, 7d, 90m, 36h."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
