"""The wire schema of rank records: what a training rank sends its node's sidecar, one datagram each.

Every datagram is one UTF-8 JSON object, the envelope:

    {"v": 1, "kind": "hello" | "step" | "event", "job": str, "rank": int, "pid": int,
     "dropped": int, "body": {...}}

- `dropped` is how many records this rank's client could not send so far: the sidecar cannot see
  datagrams that never reached it, so the client reports its own losses on every later one.
- hello body: {"local_rank", "node", "world_size", "mesh": {"pp", "dp", "tp"}}.
- step body: the trainer's per-step record as it is (see `Trainer._record`): `step`, `time`,
  `loss`, `grad_norm`, `step_seconds`, `tokens_per_second`, `mfu`, `phases` are required; other keys
  travel along untouched (they stay in the JSON lines, which remain the full account).
- event body: {"name": "checkpoint_saved" | "exception" | ..., "time": float, "fields": {...}}.

`v` changes whenever a field changes meaning or a required one is added; a sidecar rejects (and
counts) versions it does not know rather than misreading them. NaN and infinities are allowed:
a NaN loss is exactly what the healer must see.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
KINDS = ("hello", "step", "event")
# NOTE: far below the AF_UNIX datagram limit (~200 KiB by default); a step record is ~700 bytes.
MAX_DATAGRAM_BYTES = 16 * 1024
MAX_JOB_CHARS = 128
# Required numeric fields of a step body (loss and grad_norm may be NaN; the others must be finite).
STEP_FLOATS = ("loss", "grad_norm", "step_seconds", "tokens_per_second", "mfu", "time")
MAX_PHASES = 16
# The trainer's phases in the order one step runs them (see train/trainer.py).
PHASE_ORDER = ("data_wait", "dp_gather", "forward_backward", "dp_reduce", "grad_norm_clip", "optimizer",
               "checkpoint")


class SchemaError(ValueError):
    """A datagram that is not a valid record of a known schema version; the message says why."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a record: the job, the global rank, its process, and its client's drop count so far."""

    job: str
    rank: int
    pid: int
    dropped: int


@dataclass(frozen=True, slots=True)
class Hello:
    origin: Origin
    local_rank: int
    node: str
    world_size: int
    mesh: dict[str, int]


@dataclass(frozen=True, slots=True)
class StepRecord:
    origin: Origin
    step: int
    time: float
    loss: float
    grad_norm: float
    step_seconds: float
    tokens_per_second: float
    mfu: float
    phases: dict[str, float]
    dp_reduce_enter_ns: int | None = None
    max_rss_mib: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """The record's other keys (local_rank, world_size, mesh, node, lr, ...), as sent."""


@dataclass(frozen=True, slots=True)
class Event:
    origin: Origin
    name: str
    time: float
    fields: dict[str, Any]


Message = Hello | StepRecord | Event


def ordered_phases(phases: dict[str, float]) -> list[str]:
    """Phases in the order the trainer runs them; unknown ones (a later trainer's) after, by name."""
    return [p for p in PHASE_ORDER if p in phases] + sorted(p for p in phases if p not in PHASE_ORDER)


def encode(kind: str, origin: Origin, body: dict[str, Any]) -> bytes:
    """One datagram. Raises TypeError/ValueError if `body` is not JSON-serialisable."""
    envelope = {"v": SCHEMA_VERSION, "kind": kind, "job": origin.job, "rank": origin.rank,
                "pid": origin.pid, "dropped": origin.dropped, "body": body}
    return json.dumps(envelope, separators=(",", ":")).encode()


def decode(data: bytes) -> Message:
    """Parse and validate one datagram; raises SchemaError naming the first problem."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise SchemaError("envelope: expected an object")
    if obj.get("v") != SCHEMA_VERSION:
        raise SchemaError(f"v: unknown schema version {obj.get('v')!r} (this sidecar reads {SCHEMA_VERSION})")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise SchemaError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    job = obj.get("job")
    if not isinstance(job, str) or not job or len(job) > MAX_JOB_CHARS or not job.isprintable():
        raise SchemaError(f"job: expected a printable string of 1-{MAX_JOB_CHARS} characters")
    origin = Origin(job=job, rank=_int(obj, "rank"), pid=_int(obj, "pid"), dropped=_int(obj, "dropped"))
    body = obj.get("body")
    if not isinstance(body, dict):
        raise SchemaError("body: expected an object")
    if kind == "hello":
        return _hello(origin, body)
    if kind == "step":
        return _step(origin, body)
    return _event(origin, body)


def _hello(origin: Origin, body: dict[str, Any]) -> Hello:
    node = body.get("node")
    if not isinstance(node, str):
        raise SchemaError("body.node: expected a string")
    return Hello(origin=origin, local_rank=_int(body, "local_rank", "body."), node=node,
                 world_size=_int(body, "world_size", "body."), mesh=_mesh(body.get("mesh")))


def _step(origin: Origin, body: dict[str, Any]) -> StepRecord:
    values = {}
    for name in STEP_FLOATS:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(f"body.{name}: expected a number, got {value!r}")
        if name not in ("loss", "grad_norm") and not math.isfinite(value):
            raise SchemaError(f"body.{name}: expected a finite number, got {value!r}")
        values[name] = float(value)
    phases = body.get("phases")
    if not isinstance(phases, dict) or len(phases) > MAX_PHASES:
        raise SchemaError(f"body.phases: expected an object of at most {MAX_PHASES} phases")
    for name, seconds in phases.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            raise SchemaError(f"body.phases.{name}: expected a finite number, got {seconds!r}")
    enter = body.get("dp_reduce_enter_ns")
    if enter is not None and (isinstance(enter, bool) or not isinstance(enter, int)):
        raise SchemaError(f"body.dp_reduce_enter_ns: expected an integer or null, got {enter!r}")
    rss = body.get("max_rss_mib")
    if rss is not None and (isinstance(rss, bool) or not isinstance(rss, (int, float))):
        raise SchemaError(f"body.max_rss_mib: expected a number or null, got {rss!r}")
    known = {*STEP_FLOATS, "step", "phases", "dp_reduce_enter_ns", "max_rss_mib"}
    return StepRecord(origin=origin, step=_int(body, "step", "body."), phases={k: float(v) for k, v in phases.items()},
                      dp_reduce_enter_ns=enter, max_rss_mib=None if rss is None else float(rss),
                      extra={k: v for k, v in body.items() if k not in known}, **values)


def _event(origin: Origin, body: dict[str, Any]) -> Event:
    name, when, fields = body.get("name"), body.get("time"), body.get("fields", {})
    if not isinstance(name, str) or not name or len(name) > 64:
        raise SchemaError("body.name: expected an event name of 1-64 characters")
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise SchemaError(f"body.time: expected a number, got {when!r}")
    if not isinstance(fields, dict):
        raise SchemaError("body.fields: expected an object")
    return Event(origin=origin, name=name, time=float(when), fields=fields)


def _int(obj: dict[str, Any], key: str, where: str = "") -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{where}{key}: expected a non-negative integer, got {value!r}")
    return value


def _mesh(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()
    ):
        raise SchemaError('body.mesh: expected an object of integer coordinates, e.g. {"pp": 0, "dp": 1, "tp": 0}')
    return dict(value)
