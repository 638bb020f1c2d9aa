"""Fault injection on real processes, from a schedule (YAML): what `megaheal run --chaos FILE` plays.

    faults:
      - {at_step: 8,  kind: kill,  rank: 3}                     # SIGKILL: a crash
      - {at_step: 20, kind: stop,  rank: 1}                     # SIGSTOP: a hang
      - {at_step: 30, kind: slow,  rank: 2, duty: 0.6, for: 40s} # SIGSTOP/SIGCONT duty cycle: a straggler
      - {at_step: 40, kind: slow-job, duty: 0.5, for: 30s}     # every rank at once: the whole job slower
      - {at_step: 45, kind: corrupt-checkpoint, rank: 0}        # truncate the newest checkpoint, then SIGKILL
      - {at_step: 50, kind: nan}                                # a poisoned batch: NaN weights from step 51 on
      - {at_step: 56, kind: break-node, rank: 2}                # rank 2's node loses its local disk, rank 2 dies
      - {at_step: 60, kind: hang-spin, rank: 1}                 # a hang that is not SIGSTOP (train/hang_faults.py)
      - {at_step: 70, kind: freeze, rank: 3}                    # stuck in the kernel (cgroup freezer): state D
      - {at_step: 74, kind: bad-batch}                          # a batch that trains to NaN anywhere: judged data
      - {at_step: 80, kind: bit-flip, rank: 2, rate: 1.0}       # rank 2's host flips matmul bits: silent corruption

A fault fires once, when every rank of the running attempt has reported `at_step`; a rollback that takes the job
back before a fault's step only delays it (it fires when the job gets there again), and one that took the job back
past a fault already fired does not play it twice. The report lists the faults that never fired. Signals go through the
coordinator (so they need the run's token) to the rank's node agent; nothing from the schedule reaches a shell.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ground import kill
from ground.typedconfig import ConfigError, from_mapping, read_yaml
from healer.detect.hang import DEFAULT_PHASE_FLOORS
from testbed import freezer
from testbed.layout import FREEZER_ROOT
from wire import phase_now

log = logging.getLogger(__name__)
HANG_KINDS = {"hang-spin": "spin", "hang-data": "data", "hang-collective": "collective", "hang-syscall": "syscall"}
"""Hangs the rank itself plays (train/hang_faults.py), set when the job starts like a nan fault."""
START_KINDS = ("nan", "bad-batch", "bit-flip", *HANG_KINDS)
"""Faults the trainer plays itself, set by a training override when the job starts."""
KINDS = ("kill", "stop", "slow", "slow-job", "corrupt-checkpoint", "nan", "bad-batch", "bit-flip", "break-node",
         "freeze", *HANG_KINDS)


@dataclass(kw_only=True, slots=True)
class Fault:
    at_step: int
    """Fire once every rank of the running attempt has reported this step."""
    kind: str
    """kill (SIGKILL), stop (SIGSTOP), slow (SIGSTOP/SIGCONT duty cycle), slow-job (every rank of the attempt
    through the same duty cycle, stopped and continued together: the whole job slower and no rank standing out, as
    under a power cap or thermal throttling on every GPU; `rank` is not used), corrupt-checkpoint (truncate the
    newest checkpoint's largest file, then SIGKILL `rank` so that the job must resume from an older one), nan
    (the batch of step `at_step` is poisoned: the trainer sets its weights to NaN after training on it, see
    TrainConfig.inject_nan_at_sample; set when the job starts, so it must be the only nan fault), break-node
    (the local disk of `rank`'s node fails: its scratch directory, the ranks' TMPDIR, is replaced by a file,
    and `rank` dies with SIGKILL as a process losing its disk would; the node then fails its diagnostics),
    hang-spin, hang-data, hang-collective, hang-syscall (`rank` hangs as it reaches `at_step`, once per run:
    spinning in compute, blocked in data loading, waiting in a collective no peer enters, blocked in a read(2);
    set when the job starts, TrainConfig.inject_hangs), bad-batch (the first sample of step `at_step`'s batch trains
    to NaN on whichever ranks compute it: TrainConfig.inject_bad_sample, judged data by the re-runs; set when the job
    starts, at most one), bit-flip (from `at_step` on, the forward passes of the ranks on `rank`'s host flip a bit
    of a matmul output at `rate`: TrainConfig.inject_matmul_flips, silent data corruption; set when the job starts),
    freeze (`rank` is frozen by the cgroup v1 freezer: state D,
    and SIGKILL waits; as a rank stuck in a driver or on a dead mount; root, and hosts on this machine, only; not
    while the rank is in a save or a restore, as its phase file says: it waits for the rank to leave it; it is
    thawed, and so dies, when the run ends)."""
    rank: int = 0
    """The global rank it hits."""
    duty: float = 0.5
    """slow, slow-job: the share of each 200 ms period the rank spends stopped."""
    for_: timedelta = timedelta(seconds=30)
    """slow, slow-job: how long (YAML key `for`)."""
    rate: float = 1.0
    """bit-flip: the chance that a forward pass of the host's ranks flips a bit."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.at_step < 0 or self.rank < 0:
            raise ValueError("at_step and rank must be >= 0")
        if not 0 < self.duty < 1:
            raise ValueError(f"duty must be in (0, 1), got {self.duty}")
        if self.for_ <= timedelta(0):
            raise ValueError(f"for must be > 0, got {self.for_}")
        if not 0 < self.rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {self.rate}")


@dataclass(kw_only=True, slots=True)
class Schedule:
    faults: list[Fault] = field(default_factory=list)
    """Faults in the order they fire."""

    def __post_init__(self) -> None:
        for kind in ("nan", "bad-batch"):
            if sum(f.kind == kind for f in self.faults) > 1:
                raise ValueError(f"at most one {kind} fault (it is set when the job starts)")
        steps = [f.at_step for f in self.faults]
        if steps != sorted(steps):
            raise ValueError(f"faults must be in at_step order, got {steps}")

    def check_ranks(self, world_size: int, source: str | Path) -> None:
        """ConfigError naming `source`, the fault and its `rank` when a fault hits a rank the job does not have
        (known only once the job's layout is: a schedule is written for one job and may be played on another)."""
        for i, f in enumerate(self.faults):
            # NOTE: a nan or bad-batch fault poisons a batch: its `rank` (0 unless given) names no process.
            if f.kind not in ("nan", "bad-batch") and f.rank >= world_size:
                raise ConfigError(f"{source}: faults[{i}].rank: {f.rank} is not a rank of a {world_size}-rank job "
                                  f"(ranks 0-{world_size - 1})")

    def start_overrides(self, global_batch: int, node_of_rank: Callable[[int], str] | None = None
                        ) -> tuple[str, ...]:
        """Training overrides the schedule needs from the start (the poisoned batch of a nan or bad-batch fault,
        the hang a rank plays, the host whose matmuls flip bits: `node_of_rank(rank)` names it)."""
        nan = tuple(f"inject_nan_at_sample={f.at_step * global_batch}" for f in self.faults if f.kind == "nan")
        bad = tuple(f"inject_bad_sample={f.at_step * global_batch}" for f in self.faults if f.kind == "bad-batch")
        hangs = [f"{{mode: {HANG_KINDS[f.kind]}, at_step: {f.at_step}, rank: {f.rank}}}"
                 for f in self.faults if f.kind in HANG_KINDS]
        flipping = [f for f in self.faults if f.kind == "bit-flip"]
        if flipping and node_of_rank is None:
            raise ValueError("bit-flip faults need the job's hosts (node_of_rank)")
        flips = [f"{{node: {node_of_rank(f.rank)}, from_step: {f.at_step}, rate: {f.rate}}}"  # type: ignore[misc]
                 for f in flipping]
        return (nan + bad + ((f"inject_hangs=[{', '.join(hangs)}]",) if hangs else ())
                + ((f"inject_matmul_flips=[{', '.join(flips)}]",) if flips else ()))


def load_schedule(path: str | Path) -> Schedule:
    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with `faults:`")
    raw = data.get("faults") or []
    if set(data) - {"faults"}:
        # NOTE: key=str: YAML keys may be numbers beside text, which do not sort together (found by tests/fuzz).
        raise ConfigError(f"{path}: unknown key(s) {sorted(set(data) - {'faults'}, key=str)}; valid keys: faults")
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: faults must be a list")
    faults = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"{path}: faults[{i}]: expected a mapping")
        item = type(item)({("for_" if k == "for" else k): v for k, v in item.items()})  # `for` is a keyword
        faults.append(from_mapping(Fault, item, f"{path}: faults[{i}]"))
    try:
        return Schedule(faults=faults)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def corrupt_newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """Truncate the largest data file of the newest complete checkpoint to half; returns it (None: none yet)."""
    steps = sorted((p for p in ckpt_dir.glob("step-*") if (p / "manifest.json").exists()), reverse=True)
    if not steps:
        return None
    victim = max((p for p in steps[0].iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return victim


def break_scratch(scratch: Path) -> Path:
    """Replace a node's scratch directory by a plain file: every write under it now fails (ENOTDIR)."""
    if scratch.is_dir():
        shutil.rmtree(scratch)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    scratch.write_text("megaheal chaos: this node's local disk failed (break-node)\n")
    return scratch


class Chaos:
    """Plays a schedule against a job: call `tick(lowest_step)` from the healing loop."""

    def __init__(self, schedule: Schedule, kill: Any, ckpt_dir: Path, scratch_of: Any = None,
                 world_size: int | None = None) -> None:
        """`kill(rank, sig) -> pid`: the remediator's signal_rank (through the rank's agent); `scratch_of(rank) -> Path`:
        the scratch directory of the node `rank` runs on (needed by break-node faults; given only where the hosts
        are this machine, which freeze faults need too); `world_size`: the job's ranks (needed by slow-job faults)."""
        if scratch_of is None and any(f.kind in ("break-node", "freeze") for f in schedule.faults):
            raise ValueError("break-node and freeze faults need the job's hosts on this machine (scratch_of)")
        if world_size is None and any(f.kind == "slow-job" for f in schedule.faults):
            raise ValueError("slow-job faults need the job's world size")
        self._world_size = world_size
        self.pending = list(schedule.faults)
        self.fired: list[dict[str, Any]] = []
        self._kill, self._ckpt_dir, self._scratch_of = kill, ckpt_dir, scratch_of
        self._frozen = FREEZER_ROOT / f"megaheal-chaos-{os.getpid()}"

    def tick(self, lowest_step: int | None) -> None:
        if not self.pending or lowest_step is None or lowest_step < _due(self.pending[0]):
            return
        fault = self.pending.pop(0)
        entry: dict[str, Any] = {"kind": fault.kind, "rank": fault.rank, "at_step": fault.at_step, "at": time.time()}
        if fault.kind == "nan":
            entry["note"] = "the poisoned batch was set at start (inject_nan_at_sample)"
        elif fault.kind == "bad-batch":
            entry["note"] = "the bad sample was set at start (inject_bad_sample)"
        elif fault.kind == "bit-flip":
            entry["note"] = "the host's flips were set at start (inject_matmul_flips)"
        elif fault.kind in HANG_KINDS:
            entry["note"] = "the rank plays the hang itself, set at start (inject_hangs)"
        elif fault.kind == "corrupt-checkpoint":
            victim = corrupt_newest_checkpoint(self._ckpt_dir)
            entry["corrupted"] = str(victim) if victim else None
            self._kill(fault.rank, signal.SIGKILL)
        elif fault.kind == "break-node":
            entry["broken"] = str(break_scratch(self._scratch_of(fault.rank)))
            entry["pid"] = self._kill(fault.rank, signal.SIGKILL)
        elif fault.kind == "freeze":
            pid = self._kill(fault.rank, signal.SIGCONT)  # resolves the pid (SIGCONT to a running rank is a no-op)
            group = freezer.freeze(self._frozen, [pid], f"rank-{fault.rank}")
            phase = self._phase_of(fault.rank, pid)  # NOTE: read frozen, so it cannot change under the read
            if phase in DEFAULT_PHASE_FLOORS:
                # NOTE: frozen inside a save (or a restore) the rank looks like one writing to a slow store, which the
                # hang detector rightly waits out for that phase's minutes: the fault is a rank stuck in a step. The
                # heartbeats that say the step come up to a second late, and a few steps on the rank can be in a save
                # (one in a run's tests was throttled, ~11 s): it is thawed at once and frozen at a later tick.
                freezer.thaw(group)
                self.pending.insert(0, fault)
                log.info("chaos: rank %d is in %s: its freeze waits for it to leave", fault.rank, phase)
                return
            entry["pid"] = pid
        elif fault.kind in ("kill", "stop"):
            entry["pid"] = self._kill(fault.rank, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        elif fault.kind == "slow-job":
            assert self._world_size is not None
            pids = [self._kill(rank, signal.SIGCONT) for rank in range(self._world_size)]  # (resolves the pids)
            threading.Thread(target=duty_cycle_together, args=(pids, fault.duty, fault.for_.total_seconds()),
                             name="megaheal-chaos-slow-job", daemon=True).start()
            entry["pids"] = pids
        else:
            pid = self._kill(fault.rank, signal.SIGCONT)  # resolves the pid (SIGCONT to a running rank is a no-op)
            threading.Thread(target=duty_cycle, args=(pid, fault.duty, fault.for_.total_seconds()),
                             name="megaheal-chaos-slow", daemon=True).start()
            entry["pid"] = pid
        log.warning("chaos: %s", entry)
        self.fired.append(entry)

    def _phase_of(self, rank: int, pid: int) -> str | None:
        """The phase rank `rank` (process `pid`) says it is in (wire/phase_now.py: the file its node agent set it
        on the host's scratch disk); None when it keeps none."""
        found = sorted((self._scratch_of(rank) / "megaheal-phase").glob(f"*/{pid}.phase"),
                       key=lambda p: p.stat().st_mtime)
        now = phase_now.read(found[-1]) if found else None
        return now.phase if now is not None else None

    def summary(self) -> dict[str, Any]:
        """What the report says of the schedule: the faults that fired (with when and on what) and those that did
        not (the job ended, or never came back to their step, first)."""
        return {"fired": list(self.fired),
                "not_fired": [{"kind": f.kind, "rank": f.rank, "at_step": f.at_step} for f in self.pending]}

    def close(self) -> None:
        """Thaw what it froze (a frozen rank's pending SIGKILL lands then) and remove its freezer groups."""
        if self._frozen.exists():
            freezer.remove_all(self._frozen)


def _due(fault: Fault) -> int:
    """The lowest step at which `fault` is played. A hang-* fault is the rank's own doing in step `at_step`, which
    then never finishes: it is noted once every rank finished the step before."""
    return max(0, fault.at_step - 1) if fault.kind in HANG_KINDS else fault.at_step


def duty_cycle(pid: int, duty: float, seconds: float, period: float = 0.2) -> None:
    """Slow `pid` down for `seconds`: stopped for `duty` of every `period` (a straggler that is really there).
    It ends with the rank: once the pid no longer names the process it started with, nothing more is sent."""
    duty_cycle_together([pid], duty, seconds, period)


def duty_cycle_together(pids: list[int], duty: float, seconds: float, period: float = 0.2,
                        stop: threading.Event | None = None) -> None:
    """duty_cycle for every one of `pids` at once: stopped together, continued together (within the microseconds of
    a loop of kill(2)), so that none stands out. It ends with the first of them to go (the attempt ended), or once
    `stop` is set."""
    found = [kill.identify(pid, None) for pid in pids]
    targets = [t for t in found if t is not None]
    end = time.monotonic() + seconds
    while targets and len(targets) == len(found) and time.monotonic() < end and not (stop and stop.is_set()):
        stopped = [kill.send(t, signal.SIGSTOP) for t in targets]  # NOTE: every one, before asking if all were
        if not all(stopped):
            break  # a rank is gone (restarted): the slowdown ends with its attempt
        time.sleep(period * duty)
        continued = [kill.send(t, signal.SIGCONT) for t in targets]
        if not all(continued):
            break
        time.sleep(period * (1 - duty))
    for target in targets:
        kill.send(target, signal.SIGCONT)  # none left stopped, whatever ended it
