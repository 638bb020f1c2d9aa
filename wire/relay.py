"""The relay hop's wire: what a relay posts to the healer's /v1/heartbeats/relayed each interval (exporters/relay.py).

    node ──(HeartbeatBatch, schema 1)──▶ relay ──(RelayColumns, schema 2)──▶ healer
                                         exporters/relay.py                  healer/observe/heartbeats.py

Schema 2, RelayColumns: the group's rank entries by column. Why: decoding each rank's JSON object into a RankEntry
(a struct and four dicts) cost the healer ~5 us a rank, and storing it ~4 us more (bench/healer_ingest.py): more
than one core at 131,072 ranks a second. The relay already decodes every node's batch (to check it), so it writes
the group's entries out as columns instead: one packed little-endian array per field (base64 in the JSON), row i of
each one rank, the nodes' rows one after another in the order of `nodes`. The healer reads each column with one
np.frombuffer, checks it with numpy, writes it into its own columns, and turns a row back into a RankEntry only when
something asks for that rank's whole entry (an incident's evidence).

Nothing is lost: every field of a RankEntry has a column, and Rows.entry(i) gives back the entry the node sent
(tests/exporters/test_relay_wire.py compares them). Fields that only a few ranks carry (the last event, which
values were not finite) are listed by row instead of one value per rank. The healer checks every column as a node's
batch is checked (counts >= 0, numbers finite, ages >= 0, job indices in range, every column as long as the nodes'
ranks) and names the field and row that is not (`rows.step[3]`).

Schema 1, RelayBatch: each node's batch whole, as an earlier relay sent it. The healer still takes it, so that
relays and healer need not be upgraded at once (the healer first: an older healer refuses schema 2, naming it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
import numpy as np
from msgspec import Meta, Struct

from wire.telemetry import (
    HEARTBEAT_SCHEMA,
    MAX_RANKS_PER_BATCH,
    AttemptReport,
    Count,
    EventBody,
    Finite,
    GpuEntry,
    HeartbeatBatch,
    Name,
    RankEntry,
    SchemaError,
    decode_json,
)

MAX_NODES_PER_RELAY = 1024
RELAY_COLUMNS_SCHEMA: Final = 2
MAX_ROWS = MAX_NODES_PER_RELAY * MAX_RANKS_PER_BATCH

Age = Annotated[float, Meta(ge=0, le=sys.float_info.max, description="a finite number >= 0")]
MISSING: Final = -(2**63)
"""In an integer column: the rank has no value (null in its entry)."""
STATE_MISSING: Final = "\x00"
"""In the process states: the rank has none."""

# Each column's kind, by field: "count" (an integer >= 0), "maybe-count" (that, or MISSING), "int" (any, or MISSING),
# "index" (into `jobs`), "age" (a finite number >= 0), "number" (finite, or NaN for null), "flag" (0 or 1).
_KINDS: Final = {"job": "index", "rank": "count", "alive": "flag", "last_seen_age_s": "age", "pid": "maybe-count",
                 "local_rank": "maybe-count", "world_size": "maybe-count", "dropped": "count", "step": "maybe-count",
                 "step_time": "number", "step_seconds": "number", "loss": "number", "grad_norm": "number",
                 "tokens_per_second": "number", "mfu": "number", "dp_reduce_enter_ns": "int",
                 "dp_reduce_lag_s": "number", "max_rss_mib": "number", "attempt": "maybe-count"}
_OPTIONAL: Final = frozenset({"attempt"})
"""Columns a relay of an earlier release does not send (empty): every row's value is missing."""
_GROUPS: Final = {"phases": "number", "mesh": "maybe-count", "events": "maybe-count"}
_DTYPES: Final = {"count": "<i8", "maybe-count": "<i8", "int": "<i8", "index": "<i8", "age": "<f8", "number": "<f8",
                  "flag": "u1"}
_WORDS: Final = {"count": "integers >= 0", "maybe-count": "integers >= 0 (or the missing value)",
                 "int": "integers", "index": "indices into rows.jobs", "age": "finite numbers >= 0",
                 "number": "finite numbers (NaN: null)", "flag": "0 or 1"}
Column = Annotated[bytes, Meta(max_length=8 * MAX_ROWS, description="the column's values, little-endian, in base64")]


class RowExtras(Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """The fields of one row that only a few ranks carry."""

    row: Count
    last_event: EventBody | None = None
    nonfinite: dict[str, str] = {}


class RankRows(Struct, frozen=True, kw_only=True, gc=False):
    """Every rank entry of a relay batch by column: one packed array per RankEntry field (see RankEntry for what each
    means), 8-byte little-endian integers (MISSING: null) or floats (NaN: null), `alive` one byte a row.

    NOTE: binary, not JSON numbers: the healer reads each column with one np.frombuffer, where parsing 20 JSON numbers
    a rank cost ~1 us of its ~2.5 us (and turning the lists into arrays most of the rest of its ingest)."""

    jobs: Annotated[list[Name], Meta(description="a list of job names")]
    job: Column
    rank: Column
    alive: Column
    last_seen_age_s: Column
    pid: Column
    local_rank: Column
    world_size: Column
    dropped: Column
    step: Column
    step_time: Column
    step_seconds: Column
    loss: Column
    grad_norm: Column
    tokens_per_second: Column
    mfu: Column
    dp_reduce_enter_ns: Column
    dp_reduce_lag_s: Column
    max_rss_mib: Column
    attempt: Column = b""
    proc_state: Annotated[str, Meta(max_length=MAX_ROWS, description="one process state letter a row (NUL: none)")]
    phases: Annotated[dict[str, Column], Meta(max_length=64, description="an object of columns")] = {}
    mesh: Annotated[dict[str, Column], Meta(max_length=64, description="an object of columns")] = {}
    events: Annotated[dict[str, Column], Meta(max_length=64, description="an object of columns")] = {}
    """Event name -> how many of it each rank counted (MISSING: the rank has no such count)."""
    extras: list[RowExtras] = []


class Rows:
    """A relay batch's rows, checked: each column a numpy array (read-only, over the decoded bytes). What the healer
    keeps of a relayed rank, and what RankBeat reads its fields from."""

    __slots__ = ("n", "jobs", "columns", "groups", "proc_state", "extras")

    def __init__(self, rows: RankRows, n: int) -> None:
        self.n, self.jobs = n, rows.jobs
        self.columns = {name: np.full(n, MISSING, dtype=np.int64) if name in _OPTIONAL and not getattr(rows, name)
                        else _array(f"rows.{name}", getattr(rows, name), kind, n, len(rows.jobs))
                        for name, kind in _KINDS.items()}
        self.groups = {group: {key: _array(f"rows.{group}.{key}", column, kind, n, 0)
                               for key, column in getattr(rows, group).items()} for group, kind in _GROUPS.items()}
        if len(rows.proc_state) != n:
            raise SchemaError("rows.proc_state", f"has {len(rows.proc_state)} states; the nodes have {n} ranks")
        self.proc_state = rows.proc_state
        self.extras: dict[int, RowExtras] = {}
        for k, extra in enumerate(rows.extras):
            if extra.row >= n or extra.row in self.extras:
                raise SchemaError(f"rows.extras[{k}].row", f"{extra.row} is past the last row or listed twice")
            self.extras[extra.row] = extra

    def __len__(self) -> int:
        return self.n

    def job(self, i: int) -> str:
        return self.jobs[int(self.columns["job"][i])]

    def value(self, name: str, i: int) -> Any:
        """Field `name` of row i as its RankEntry holds it (a Python value; None where the rank had none)."""
        if name == "proc_state":
            state = self.proc_state[i]
            return None if state == STATE_MISSING else state
        return _python(self.columns[name][i], _KINDS[name])

    def entry(self, i: int) -> RankEntry:
        """Row i as the RankEntry its node sent (for evidence, not for every rank: ~10 us)."""
        extra = self.extras.get(i)
        values: dict[str, Any] = {name: self.value(name, i) for name in _KINDS if name != "job"}
        groups: dict[str, Any] = {group: {key: v for key, column in self.groups[group].items()
                          if (v := _python(column[i], kind)) is not None} for group, kind in _GROUPS.items()}
        return RankEntry(job=self.job(i), proc_state=self.value("proc_state", i),
                         last_event=extra.last_event if extra else None,
                         nonfinite=dict(extra.nonfinite) if extra else {}, **values, **groups)


def _python(value: Any, kind: str) -> Any:
    if kind == "flag":
        return bool(value)
    if _DTYPES[kind] == "<f8":
        return None if value != value else float(value)  # NOTE: NaN != NaN
    return None if value == MISSING else int(value)


def _array(field: str, data: bytes, kind: str, n: int, jobs: int) -> np.ndarray:
    """The column `data` as an array of n values of `kind`; SchemaError (naming `field`) when it is not one."""
    dtype = np.dtype(_DTYPES[kind])
    if len(data) != n * dtype.itemsize:
        raise SchemaError(field, f"has {len(data)} bytes; the nodes' {n} ranks need {n * dtype.itemsize}")
    values = np.frombuffer(data, dtype=dtype)
    if kind == "flag":
        bad = values > 1
    elif kind == "age":
        bad = ~np.isfinite(values) | (values < 0)
    elif kind == "number":
        bad = np.isinf(values)
    elif kind == "index":
        bad = (values < 0) | (values >= jobs)
    elif kind == "count":
        bad = values < 0
    elif kind == "maybe-count":
        bad = (values < 0) & (values != MISSING)
    else:
        bad = np.zeros(n, dtype=bool)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise SchemaError(f"{field}[{at}]", f"expected {_WORDS[kind]}, got {values[at].item()!r}")
    return values


class RelayedNodeHead(Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One node of a relay batch: its batch's own fields, and how many rows of `rows` are its ranks."""

    node: Name
    seq: Count
    sent_at: Finite
    age_s: Age
    """How long ago the relay received the batch, by the relay's clock."""
    ranks: Annotated[int, Meta(ge=0, le=MAX_RANKS_PER_BATCH,
                               description=f"an integer in [0, {MAX_RANKS_PER_BATCH}]")]
    nvml: str | None = None
    gpus: list[GpuEntry] = []
    attempt: AttemptReport | None = None
    agent_url: str | None = None


class _RelayHeader(Struct, frozen=True, kw_only=True, gc=False, tag_field="schema"):
    """What a relay's batch of either schema starts with (`schema`, its tag, says which follows)."""

    relay: Name
    seq: Count
    sent_at: Finite


class RelayColumns(_RelayHeader, tag=RELAY_COLUMNS_SCHEMA):
    """A relay's batch, schema 2: its nodes' own fields, and all their ranks by column."""

    nodes: Annotated[list[RelayedNodeHead], Meta(max_length=MAX_NODES_PER_RELAY,
                                                 description=f"a list of at most {MAX_NODES_PER_RELAY} nodes")]
    rows: RankRows


@dataclass(frozen=True, slots=True)
class Relayed:
    """A RelayColumns as the healer takes it: its rows checked against its nodes (Rows)."""

    relay: str
    seq: int
    sent_at: float
    nodes: list[RelayedNodeHead]
    rows: Rows


class NodeColumns:
    """One node's batch as a relay keeps it: its ranks already as columns. Made when the batch comes, so that a value
    no column can hold (an integer past 64 bits) is refused to its node, not to the whole group's batch later."""

    __slots__ = ("batch", "jobs", "columns", "groups", "proc_state", "extras")

    def __init__(self, batch: HeartbeatBatch) -> None:
        ranks = batch.ranks
        self.batch = batch
        self.jobs = [e.job for e in ranks]
        self.columns = {name: _pack([getattr(e, name) for e in ranks], kind, name)
                        for name, kind in _KINDS.items() if name != "job"}
        self.groups = {group: {key: _pack([getattr(e, group).get(key) for e in ranks], kind, f"{group}.{key}")
                               for key in sorted({k for e in ranks for k in getattr(e, group)})}
                       for group, kind in _GROUPS.items()}
        self.proc_state = "".join(STATE_MISSING if e.proc_state is None else e.proc_state for e in ranks)
        self.extras = [RowExtras(row=i, last_event=e.last_event, nonfinite=e.nonfinite)
                       for i, e in enumerate(ranks) if e.last_event is not None or e.nonfinite]


def _pack(values: list[Any], kind: str, field: str) -> np.ndarray:
    if _DTYPES[kind] == "<f8":
        return np.array(values, dtype=np.float64)  # NOTE: None becomes NaN
    if kind == "flag":
        return np.array(values, dtype=np.uint8)
    for i, v in enumerate(values):
        if v is not None and not MISSING < v < 2**63:
            raise SchemaError(f"ranks[{i}].{field}", f"{v} does not fit a 64-bit integer")
    return np.array([MISSING if v is None else v for v in values], dtype=np.int64)


def columns_of(relay: str, seq: int, sent_at: float,
               nodes: list[tuple[float, NodeColumns | HeartbeatBatch]]) -> RelayColumns:
    """The relay batch of `nodes`, each (age_s, its latest batch), in that order."""
    held = [(age_s, node if isinstance(node, NodeColumns) else NodeColumns(node)) for age_s, node in nodes]
    job_ids: dict[str, int] = {}
    heads: list[RelayedNodeHead] = []
    jobs: list[int] = []
    states: list[str] = []
    extras: list[RowExtras] = []
    n = 0
    for age_s, node in held:
        b = node.batch
        heads.append(RelayedNodeHead(node=b.node, seq=b.seq, sent_at=b.sent_at, age_s=age_s, ranks=len(node.jobs),
                                     nvml=b.nvml, gpus=b.gpus, attempt=b.attempt, agent_url=b.agent_url))
        jobs.extend(job_ids.setdefault(job, len(job_ids)) for job in node.jobs)
        states.append(node.proc_state)
        extras.extend(msgspec.structs.replace(x, row=x.row + n) for x in node.extras)
        n += len(node.jobs)

    def joined(parts: list[np.ndarray]) -> bytes:
        return np.concatenate(parts).tobytes() if parts else b""

    columns = {name: joined([node.columns[name] for _, node in held]) for name in _KINDS if name != "job"}
    groups: dict[str, dict[str, bytes]] = {}
    for group, kind in _GROUPS.items():
        missing = np.nan if _DTYPES[kind] == "<f8" else MISSING
        keys = sorted({key for _, node in held for key in node.groups[group]})
        groups[group] = {key: joined([node.groups[group].get(key, np.full(len(node.jobs), missing,
                                                                          dtype=_DTYPES[kind]))
                                      for _, node in held]) for key in keys}
    return RelayColumns(relay=relay, seq=seq, sent_at=sent_at, nodes=heads, rows=RankRows(
        jobs=list(job_ids), job=np.array(jobs, dtype=np.int64).tobytes(), proc_state="".join(states), extras=extras,
        **columns, **groups))  # type: ignore[arg-type]


# ---- schema 1 ----------------------------------------------------------------------------------------------

class RelayedNode(Struct, frozen=True, kw_only=True, gc=False):
    """One node's latest batch as a relay holds it, and how long ago the relay received it (by the relay's own
    clock, so the healer's staleness needs no clock agreement between hosts)."""

    age_s: Age
    batch: HeartbeatBatch


class RelayBatch(_RelayHeader, tag=HEARTBEAT_SCHEMA):
    """A relay's batch, schema 1: the latest heartbeat batch of each node of its group, whole."""

    nodes: Annotated[list[RelayedNode], Meta(max_length=MAX_NODES_PER_RELAY,
                                             description=f"a list of at most {MAX_NODES_PER_RELAY} nodes")]


_RELAY_TYPE = Annotated[RelayColumns | RelayBatch, Meta(description="a JSON object")]
_relay_decoder = msgspec.json.Decoder(_RELAY_TYPE)
encode_relay = msgspec.json.Encoder().encode
"""The JSON body of a RelayColumns."""


def decode_relay_batch(data: bytes) -> Relayed | RelayBatch:
    """Decode and validate a relay's batch of either schema; raises SchemaError naming the first problem, e.g.
    `rows.step[3]` or `nodes[3].batch.ranks[0].step`."""
    decoded: Any = decode_json(_relay_decoder, _RELAY_TYPE, data, versions=(HEARTBEAT_SCHEMA, RELAY_COLUMNS_SCHEMA))
    if isinstance(decoded, RelayBatch):
        return decoded
    rows = Rows(decoded.rows, sum(head.ranks for head in decoded.nodes))
    return Relayed(relay=decoded.relay, seq=decoded.seq, sent_at=decoded.sent_at, nodes=decoded.nodes, rows=rows)
