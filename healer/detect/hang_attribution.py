"""Which rank holds a hung job, from what every rank was doing when the hang was called (healer/agent/rank_evidence.py:
kernel state, the phase it is in and its Python stack) and where each rank sits in the mesh.

A hung job is a chain of waits: most ranks wait in a collective for a peer that is somewhere else. Each rank is read
as waiting in a collective of a known group (the data-parallel gather or reduce: its dp group; a pipeline send or
receive: its pipeline peers; the per-step all-reduce of the loss: everyone), waiting in a collective of a group that
cannot be told, or not in a collective at all (computing, loading data, in a system call). A rank in a known group's
collective is held up by the members of that group that are not in the same collective. The culprit is a rank that
holds others up and is held up by nobody it can be shown to wait for: the rank not in any collective, or the one
waiting in a collective none of its peers entered. Before that: ranks stuck in the kernel (state D) or stopped (T),
and ranks still in an earlier step than the others, are named as such.

Where every rank's flight recorder answered (exporters/flight_recorder.py), the waits are read from it instead of from
stacks and phases: for each process group, the last collective each rank enqueued and those still in flight. A rank in
collective #N of a group is held up by the members that have not enqueued #N; a rank in a point-to-point operation by
the members of its group that are in none. That is what NCCL's flight recorder analysis does, and it also tells the
group of a collective no stack names (a checkpoint's, the hang injector's own). Gloo's recorder keeps no
point-to-point operation: a rank in none that its stack shows waiting in a pipeline receive is read as the stacks
read it.

When the chain has no single end (two candidates, or a cycle of known waits), the answer says so and names every
candidate rather than guess one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COLLECTIVE_PHASES = {"dp_gather": "dp", "dp_reduce": "dp", "global_scalars": "world"}
"""Phases that are a collective, and the group each runs over."""
INNER_FRAMES = 12
"""Frames from the innermost looked at for the collective a rank waits in (deeper ones are the caller's: a frame of
the training loop far down every stack says nothing of where the rank is blocked)."""


@dataclass(frozen=True, slots=True)
class Wait:
    op: str | None
    """The collective it waits in (None: not in one)."""
    group: str | None
    """"dp", "pp", "world", "dp+pp", or None when the group cannot be told."""


@dataclass(slots=True)
class Attribution:
    suspects: list[int]
    how: str
    ambiguous: bool = False
    waits: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Per rank: what it waits in, and the ranks shown to hold it up."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """The ranks grouped by where they are (phase, collective, innermost frame), largest group first."""

    def to_payload(self) -> dict[str, Any]:
        return {"suspect_ranks": self.suspects, "how": self.how, "ambiguous": self.ambiguous,
                "waits": {str(r): w for r, w in sorted(self.waits.items())}, "groups": self.groups}


def wait_of(rank: dict[str, Any]) -> Wait:
    """Where one rank's evidence says it waits."""
    phase = (rank.get("phase") or {}).get("phase")
    if phase in COLLECTIVE_PHASES:
        return Wait(op=phase, group=COLLECTIVE_PHASES[phase])
    stack: list[str] = rank.get("stack") or []
    inner = stack[:INNER_FRAMES]
    if any("pipelining" in f for f in inner):
        return Wait(op="pipeline p2p", group="pp")
    c10d = next((f for f in inner if "distributed_c10d" in f), None)
    if c10d is not None:
        op = c10d.split(" ", 1)[0]
        if phase == "grad_norm_clip":
            return Wait(op=f"{op} (gradient norm)", group="dp+pp")
        return Wait(op=op, group=None)
    return Wait(op=None, group=None)


def members(group: str, rank: int, mesh: dict[int, dict[str, int]]) -> set[int]:
    """The ranks of `rank`'s `group` (from each rank's pp/dp/tp coordinates)."""
    me = mesh.get(rank)
    if group == "world" or me is None:
        return set(mesh)
    out: set[int] = set()
    for g in group.split("+"):
        fixed = {"dp": ("pp", "tp"), "pp": ("dp", "tp")}[g]
        out |= {r for r, c in mesh.items() if all(c.get(k, 0) == me.get(k, 0) for k in fixed)}
    return out


STUCK_IN_KERNEL = "process stuck in the kernel"
"""How a rank held by the kernel (state D) is told: its host is left out (healer.decide.plans.choose: `stuck`)."""


def attribute(ranks: list[dict[str, Any]], mesh: dict[int, dict[str, int]]) -> Attribution:
    """`ranks`: one evidence payload per rank (rank, state, wchan, phase, stack); `mesh`: rank -> {pp, dp, tp}."""
    by_rank = {r["rank"]: r for r in ranks if isinstance(r.get("rank"), int)}
    groups = _groups(by_rank)
    for states, how in ((("D",), f"{STUCK_IN_KERNEL} (state D)"), (("T", "t"), "process stopped (state T)")):
        stuck = sorted(r for r, ev in by_rank.items() if ev.get("state") in states)
        if stuck:
            return Attribution(stuck, how, groups=groups)
    gone = sorted(r for r, ev in by_rank.items() if ev.get("state") is None)
    if gone:
        return Attribution(gone, "its process is gone", groups=groups)
    steps = {r: (ev.get("phase") or {}).get("step") for r, ev in by_rank.items()}
    known = {r: s for r, s in steps.items() if isinstance(s, int)}
    if len(set(known.values())) > 1:
        low = min(known.values())
        behind = sorted(r for r, s in known.items() if s == low)
        return Attribution(behind, f"still in step {low} while the others are past it", groups=groups)
    recorded = _recorder_attribution(by_rank, mesh, groups)
    if recorded is not None:
        return recorded
    waits = {r: wait_of(ev) for r, ev in by_rank.items()}
    # First, only the waits whose group is known count; where that leaves no end (every peer waits in a collective
    # whose group cannot be told: a checkpoint's), such a wait is taken as one on every rank.
    for unknown_is_world in (False, True):
        held = _held(waits, mesh, unknown_is_world)
        holding = {r for hs in held.values() for r in hs}
        ends = sorted(r for r in holding if not held[r])
        if ends:
            break
    detail = {r: {"op": w.op, "group": w.group, "held_up_by": sorted(held[r])} for r, w in waits.items()}
    if len(ends) == 1:
        (end,) = ends
        w = waits[end]
        how = ("not in any collective while its peers wait for it" if w.op is None else
               f"waits in {w.op}, a collective none of its peers entered, while they wait for it")
        return Attribution(ends, how, waits=detail, groups=groups)
    if ends:
        return Attribution(ends, "several ranks hold the others up: named them all", ambiguous=True, waits=detail,
                           groups=groups)
    return Attribution(sorted(by_rank), "the waits form no chain with one end: every rank named", ambiguous=True,
                       waits=detail, groups=groups)


def _recorder_attribution(by_rank: dict[int, dict[str, Any]], mesh: dict[int, dict[str, int]],
                          groups: list[dict[str, Any]]) -> Attribution | None:
    """The chain of waits as the flight recorders tell it; None unless every rank answered. A rank in no recorded
    operation may still wait in one the recorder does not keep (gloo's point-to-point sends and receives, a
    pipeline's): its stack says so, and its mesh group, as in the stack-only reading."""
    recs = {r: (ev.get("collectives") or {}).get("groups") for r, ev in by_rank.items()}
    if not recs or not all(isinstance(g, dict) for g in recs.values()):
        return None
    enqueued = {r: {g: int(v.get("last_enqueued", -1)) for g, v in gs.items()} for r, gs in recs.items()}
    completed = {r: {g: int(v.get("last_completed", -1)) for g, v in gs.items()} for r, gs in recs.items()}
    group_ranks: dict[str, set[int]] = {}
    for gs in recs.values():
        for g, v in gs.items():
            group_ranks.setdefault(g, set()).update(x for x in v.get("ranks") or [] if isinstance(x, int))
    flights: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for r, gs in recs.items():
        # A collective is in flight while its number is past the last completed; a point-to-point operation while the
        # recorder has not retired it.
        flights[r] = [(g, f) for g, v in gs.items() for f in v.get("in_flight") or []
                      if isinstance(f, dict) and (f.get("p2p") or int(f.get("seq", -1)) > completed[r].get(g, -1))]
    stacked = {r: wait_of(ev) for r, ev in by_rank.items()}
    held: dict[int, set[int]] = {}
    for r in recs:
        held[r] = set()
        if not flights[r] and stacked[r].op is not None and stacked[r].group is not None:
            held[r] = {p for p in members(stacked[r].group, r, mesh) & set(recs) - {r} if stacked[p] != stacked[r]}
        for g, f in flights[r]:
            peers = (group_ranks.get(g) or set(recs)) & set(recs) - {r}
            if f.get("p2p"):
                held[r] |= {p for p in peers if not any(h == g and x.get("p2p") for h, x in flights[p])}
            else:
                held[r] |= {p for p in peers if enqueued[p].get(g, -1) < int(f.get("seq", -1))}
    detail = {r: {"op": ", ".join(f"{f.get('op')} #{f.get('seq')} of group {g}" for g, f in flights[r])
                        or stacked[r].op,
                  "group": ",".join(sorted({g for g, _ in flights[r]})) or stacked[r].group,
                  "held_up_by": sorted(held[r])}
              for r in recs}
    holding = {r for hs in held.values() for r in hs}
    ends = sorted(r for r in holding if not held[r])
    if len(ends) == 1 and not flights[ends[0]] and stacked[ends[0]].op is None:
        return Attribution(ends, "not in any collective while its peers wait for it (flight recorder)", waits=detail,
                           groups=groups)
    if len(ends) == 1:
        return Attribution(ends, "holds its peers up (flight recorder)", waits=detail, groups=groups)
    if not ends:
        # A cycle: some rank waits in a collective that none of the other members of its group entered. In a pair
        # that is as true of the peer left waiting (its partner never came): the odd one out is the rank alone in the
        # collective of the most members, ByteRobust's minority.
        alone: dict[int, tuple[int, str, dict[str, Any]]] = {}
        for r, fs in flights.items():
            for g, f in fs:
                peers = (group_ranks.get(g) or set(recs)) & set(recs) - {r}
                if not f.get("p2p") and peers and all(enqueued[p].get(g, -1) < int(f.get("seq", -1)) for p in peers):
                    alone[r] = max(alone.get(r, (0, g, f)), (len(peers), g, f), key=lambda x: x[0])
        most = max((n for n, _, _ in alone.values()), default=0)
        odd = sorted(r for r, (n, _, _) in alone.items() if n == most)
        if len(odd) == 1:
            _, g, f = alone[odd[0]]
            return Attribution(odd, f"waits in {f.get('op')}, a collective none of its peers entered, while they wait "
                                    f"for it (flight recorder: #{f.get('seq')} of group {g})", waits=detail,
                               groups=groups)
        ends = odd or sorted(recs)
    return Attribution(ends, "the flight recorders show no single rank holding the others up: named them all",
                       ambiguous=True, waits=detail, groups=groups)


def _held(waits: dict[int, Wait], mesh: dict[int, dict[str, int]], unknown_is_world: bool) -> dict[int, set[int]]:
    """Per rank, the ranks shown to hold it up: those of the group it waits on that are not in the same collective."""
    held: dict[int, set[int]] = {}
    for r, w in waits.items():
        group = w.group or ("world" if unknown_is_world and w.op is not None else None)
        if w.op is None or group is None:
            held[r] = set()  # not shown to wait for anyone
            continue
        peers = members(group, r, mesh) & set(waits)
        held[r] = {p for p in peers if p != r and waits[p] != w}
    return held


def _groups(by_rank: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks grouped by phase, kernel state and innermost frame: what ByteRobust-style stack grouping shows."""
    out: dict[tuple[str, str, str], list[int]] = {}
    for r, ev in sorted(by_rank.items()):
        stack = ev.get("stack") or []
        key = ((ev.get("phase") or {}).get("phase") or "-", ev.get("state") or "gone", stack[0] if stack else "-")
        out.setdefault(key, []).append(r)
    rows = [{"phase": k[0], "state": k[1], "frame": k[2], "ranks": v, "size": len(v)} for k, v in out.items()]
    return sorted(rows, key=lambda g: (-g["size"], g["ranks"]))
