"""The telemetry wire schema: one set of typed structs (msgspec) for both ends of both hops.

    rank ──(datagram, schema v2, MessagePack)──▶ sidecar ──(heartbeat batch, schema 1, JSON)──▶ healer
    exporters/client.py        exporters/receiver.py, heartbeat.py          healer/observe/heartbeats.py

The sender builds these structs and encodes them; the receiver decodes the bytes into the same structs,
validating as it goes, and a value that does not fit is a SchemaError naming its field. Fields a newer
sender adds are ignored (forward compatibility); a schema version this code does not know is refused.

Rank datagram, one per record (`v` changes whenever a field changes meaning or a required one is added):

    {"kind": "hello" | "step" | "event", "v": 2, "job": str, "rank": int, "pid": int, "dropped": int, "body": {...}}

- `dropped` is how many records this rank's client could not send so far: the sidecar cannot see
  datagrams that never reached it, so the client reports its own losses on every later one.
- hello body: HelloBody; step body: StepBody (the trainer's per-step record, the keys the sidecar reads;
  the JSON lines stay the full account); event body: EventBody.
- v2 is MessagePack where v1 was JSON: a NaN loss is exactly what the healer must see, and JSON has no NaN
  (Python's json wrote a non-standard `NaN` that no strict decoder reads); MessagePack carries NaN and
  infinities as they are, so the record is decoded and validated in one step.

Heartbeat batch (JSON, schema 1, unchanged on the wire): HeartbeatBatch, one per node per interval, with a
RankEntry per rank and a GpuEntry per GPU. JSON has no NaN: a non-finite loss or grad norm is null there,
and the entry's `nonfinite` says which it was, e.g. {"loss": "nan"}.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from ground.names import NAME_PATTERN

# NOTE: SchemaError is re-exported: receivers catch it from here, beside the decoders that raise it.
from wire.errors import SchemaError as SchemaError
from wire.errors import explain, json_syntax_error

RECORD_SCHEMA: Final = 2
HEARTBEAT_SCHEMA: Final = 1
# NOTE: far below the AF_UNIX datagram limit (~200 KiB by default); a step record is ~400 bytes.
MAX_DATAGRAM_BYTES = 16 * 1024
MAX_PHASES = 16
MAX_RANKS_PER_BATCH = 4096
# The trainer's phases in the order one step runs them (see train/trainer.py).
# (ft_quorum and ft_reduce: a replica group's, train/ft/: the step's quorum, and the average over the groups)
PHASE_ORDER = ("ft_quorum", "data_wait", "dp_gather", "forward_backward", "pp_wait", "dp_reduce", "ft_reduce",
               "grad_norm_clip", "optimizer", "checkpoint")

# ---- field types -------------------------------------------------------------------------------------------
# NOTE: msgspec has no "finite" constraint; the largest float as both bounds refuses NaN and the infinities.
# NOTE: every struct keeps msgspec's default forbid_unknown_fields=False: that is what lets a newer sender add fields.

# NOTE: integers bounded to 64 bits: the healer packs them into int64 columns (healer/observe/rank_columns.py), where
# a larger one raised struct.error half-way through a batch (a 500, and the batch half stored).
Count = Annotated[int, Meta(ge=0, le=2**63 - 1, description="an integer >= 0 and below 2^63")]
Int64 = Annotated[int, Meta(ge=-(2**63) + 1, le=2**63 - 1, description="an integer of 64 bits")]
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max, description="a finite number")]
Flag = Annotated[bool, Meta(description="true or false")]
Number = Annotated[float, Meta(description="a number (NaN and infinities allowed)")]
# NOTE: the one name rule of jobs and nodes (ground/names.py), here as the decoders check it.
Name = Annotated[str, Meta(pattern=NAME_PATTERN, description="a name (letters, digits, . _ : @ / -, at most 253)")]
Mesh = Annotated[dict[str, Count], Meta(description='an object of coordinates, e.g. {"pp": 0, "dp": 1, "tp": 0}')]
ProcState = Annotated[str, Meta(min_length=1, max_length=1, description="the kernel's one-letter state")]
Phases = Annotated[dict[str, Finite], Meta(max_length=MAX_PHASES,
                                           description=f"an object of at most {MAX_PHASES} phases, in seconds")]


# ---- rank datagrams ----------------------------------------------------------------------------------------

class HelloBody(Struct, frozen=True, kw_only=True):
    """Where the rank sits, sent once at start (and again after the sidecar comes back)."""

    local_rank: Count
    node: str
    """The rank's hostname."""
    world_size: Count
    mesh: Mesh


class StepBody(Struct, frozen=True, kw_only=True):
    """One finished step (train/trainer.py, Trainer._record; megaheal/rank for any trainer). What a trainer does not
    know it leaves out (None): a user's script may report only its step, or nothing but the progress of its
    collectives (megaheal/rank/progress.py)."""

    step: Count
    time: Finite
    """Unix time at which the step ended."""
    step_seconds: Finite
    loss: Number | None = None
    """May be NaN or infinite: that is what the nonfinite detector looks for."""
    grad_norm: Number | None = None
    tokens_per_second: Finite | None = None
    mfu: Finite | None = None
    phases: Phases = {}
    dp_reduce_enter_ns: Int64 | None = None
    """CLOCK_MONOTONIC at which the rank entered the step's dp reduce (comparable within a node)."""
    max_rss_mib: Finite | None = None
    attempt: Count | None = None
    """Which of the job's attempts the step belongs to (MEGAHEAL_ATTEMPT when it was sent): a warm worker keeps its
    process, pid and rank from one attempt to the next, and a step its aborted attempt finished after the next one
    was planned is not the new attempt's."""
    # The rank's identity again, so that a sidecar that missed the hello (restarted) still knows the rank.
    local_rank: Count | None = None
    node: str | None = None
    world_size: Count | None = None
    mesh: Mesh | None = None
    replica_group: Count | None = None
    """Under fault tolerance per replica group (train/ft/): the rank's group."""
    replicas: Count | None = None
    """Under fault tolerance per replica group: the groups that took part in the step (its quorum)."""


class EventBody(Struct, frozen=True, kw_only=True):
    """Something that happened on the rank: checkpoint_saved, exception, finishing, ... with free-form fields."""

    name: Annotated[str, Meta(min_length=1, max_length=64, description="an event name of 1-64 characters")]
    time: Finite
    fields: dict[str, Any] = {}


class _Envelope(Struct, frozen=True, tag_field="kind"):
    """Who sent a record: the job, the global rank, its process, and its client's drop count so far. `kind` (the
    tag) says which body follows."""

    v: Annotated[Literal[2], Meta(description=f"schema version {RECORD_SCHEMA}")]  # NOTE: Literal[RECORD_SCHEMA]
    job: Name
    rank: Count
    pid: Count
    dropped: Count


class Hello(_Envelope, frozen=True, tag="hello"):
    body: HelloBody


class StepRecord(_Envelope, frozen=True, tag="step"):
    body: StepBody


class Event(_Envelope, frozen=True, tag="event"):
    body: EventBody


Message = Hello | StepRecord | Event
_RECORD_TYPE = Annotated[Message, Meta(description="a rank record (a MessagePack map)")]


# ---- heartbeat batches -------------------------------------------------------------------------------------
# NOTE: gc=False: a healer holds ~12,000 of these with no reference cycles; the collector need not scan them.

class RankEntry(Struct, frozen=True, kw_only=True, gc=False):
    """One rank in a heartbeat batch: the sidecar's view of it and its latest step (fields None until it
    reported one)."""

    job: Name
    rank: Count
    alive: Flag
    """Its process exists and is not a zombie."""
    last_seen_age_s: Annotated[float, Meta(ge=0, le=sys.float_info.max, description="a finite number >= 0")]
    """How old the rank's newest record was when the sidecar built the batch."""
    pid: Count | None = None
    local_rank: Count | None = None
    world_size: Count | None = None
    mesh: Mesh = {}
    dropped: Count = 0
    events: dict[str, Count] = {}
    last_event: EventBody | None = None
    step: Count | None = None
    step_time: Finite | None = None
    step_seconds: Finite | None = None
    phases: Phases = {}
    loss: Finite | None = None
    grad_norm: Finite | None = None
    nonfinite: dict[str, str] = {}
    """Which of loss and grad_norm were not finite (and are null here), e.g. {"loss": "nan"}."""
    tokens_per_second: Finite | None = None
    mfu: Finite | None = None
    dp_reduce_enter_ns: Int64 | None = None
    dp_reduce_lag_s: Finite | None = None
    max_rss_mib: Finite | None = None
    attempt: Count | None = None
    """The attempt its step belongs to (StepBody.attempt), when the rank said."""
    proc_state: ProcState | None = None
    """The kernel's state letter of the rank's process as the sidecar read it (R, S, D, T: stopped by a signal,
    t: by a tracer); None when it is gone or the sender did not say. A hang names a stopped rank by it."""


class GpuEntry(Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One GPU's health in a heartbeat batch (what the gpu_fault detector reads); failed NVML reads are None.

    NOTE: fields at their defaults are left out of the JSON (a healthy GPU is its index and uuid): 16,384 nodes' GPUs
    decoded in full cost the healer as much as all their ranks by column."""

    gpu: Count
    uuid: str | None = None
    last_xid: int | None = None
    xid_counts: dict[str, Count] = {}
    """Xid code (as a string: JSON object keys are) -> events counted."""
    ecc_dbe_volatile: Finite | None = None
    uncorrectable_remapped_rows: Finite | None = None
    row_remap_pending: Finite | None = None
    row_remap_failure: Finite | None = None
    recovery_action: Finite | None = None


MAX_TAIL_LINES = 50
LogLine = Annotated[str, Meta(max_length=2000, description="a log line of at most 2000 characters")]


class RankProcess(Struct, frozen=True, kw_only=True, gc=False):
    """A rank process of the host's part of an attempt, as its node agent sees it in /proc."""

    rank: Count
    local_rank: Count
    pid: Count
    started: Finite
    """When the process started, in seconds after boot: with the pid, its identity (a reused pid is another)."""
    state: ProcState
    cpu_seconds: Finite
    phase: Annotated[str, Meta(min_length=1, max_length=32,
                               description="a phase name of 1-32 characters")] | None = None
    """The phase the rank says it is in now (wire/phase_now.py); None: between two, or it keeps no such file."""
    phase_step: Count | None = None
    phase_for_s: Annotated[float, Meta(ge=0, le=sys.float_info.max, description="a finite number >= 0")] | None = None
    """How long it had been in that phase when its agent looked (by the host's clock: no skew to the healer's)."""


class RankExit(Struct, frozen=True, kw_only=True, gc=False):
    """A rank (or the host's torchrun agent, rank None) that ended, and how."""

    rank: Count | None
    pid: Count
    at: Finite
    """Unix time at which the node agent saw it end."""
    exit_code: int | None = None
    """None when a signal ended it, or when its status could not be read (`vanished`)."""
    signal: Count | None = None
    vanished: Flag = False
    """Reaped by its torchrun agent before its status could be read; the agent's failure report may follow."""
    expected: Flag = False
    """The healer had ordered the attempt stopped: never a crash."""
    log_tail: Annotated[list[LogLine], Meta(max_length=MAX_TAIL_LINES)] = []


class AttemptReport(Struct, frozen=True, kw_only=True, gc=False):
    """The host's part of one attempt of a job, in every batch of its node agent (all of it each time: a batch
    that is lost loses nothing)."""

    job: Name
    attempt: Count
    node_rank: Count
    ranks: list[RankProcess] = []
    exits: list[RankExit] = []
    ended: Flag = False
    """The host's torchrun agent has exited."""
    exit_code: int | None = None
    """Its exit code, once ended."""
    stopping: Flag = False
    """The healer ordered it stopped."""


class HeartbeatBatch(Struct, frozen=True, kw_only=True, gc=False):
    schema: Annotated[Literal[1], Meta(description=f"{HEARTBEAT_SCHEMA}")]  # NOTE: Literal[HEARTBEAT_SCHEMA]
    node: Name
    seq: Count
    sent_at: Finite
    ranks: Annotated[list[RankEntry], Meta(max_length=MAX_RANKS_PER_BATCH,
                                           description=f"a list of at most {MAX_RANKS_PER_BATCH} rank entries")]
    nvml: str | None = None
    """"ok" while the sidecar serves GPU metrics, "absent" without a driver."""
    gpus: list[GpuEntry] = []
    attempt: AttemptReport | None = None
    """The host's part of the job's current attempt, when a node agent (not a bare sidecar) sends the batch."""
    agent_url: str | None = None
    """Where the node agent takes orders (a healer that takes a job over finds its agents here)."""


_BATCH_TYPE = Annotated[HeartbeatBatch, Meta(description="a JSON object")]


class _Versions(Struct):
    """Just the version fields, read after a failed decode to tell an unknown version from a bad record."""

    v: Any = None
    schema: Any = None


# ---- encoding and decoding ---------------------------------------------------------------------------------

_record_decoder = msgspec.msgpack.Decoder(_RECORD_TYPE)
_batch_decoder = msgspec.json.Decoder(_BATCH_TYPE)
encode = msgspec.msgpack.Encoder().encode
"""One datagram from a Hello, StepRecord or Event. Raises TypeError for a value MessagePack cannot carry."""
encode_batch = msgspec.json.Encoder().encode
"""The JSON body of a HeartbeatBatch."""


def known_phases_only(message: Message) -> tuple[Message, int]:
    """`message` with only the trainer's own phases (PHASE_ORDER) in a step record, and how many it left out.

    NOTE: every phase name becomes a Prometheus series and a span name: a sender inventing names each step would
    grow both without bound, so names the trainer does not use are refused, not stored."""
    if not isinstance(message, StepRecord):
        return message, 0
    known = {name: seconds for name, seconds in message.body.phases.items() if name in PHASE_ORDER}
    unknown = len(message.body.phases) - len(known)
    if not unknown:
        return message, 0
    body = msgspec.structs.replace(message.body, phases=known)
    return msgspec.structs.replace(message, body=body), unknown


def ordered_phases(phases: dict[str, float]) -> list[str]:
    """Phases in the order the trainer runs them; unknown ones (a later trainer's) after, by name."""
    return [p for p in PHASE_ORDER if p in phases] + sorted(p for p in phases if p not in PHASE_ORDER)


def build_record(kind: str, job: str, rank: int, pid: int, dropped: int, body: Mapping[str, Any]) -> Message:
    """A sender's record of `kind` ("hello", "step", "event"), validated into its struct; `body` keys the
    schema does not know are left out. Raises msgspec.ValidationError naming the field that does not fit."""
    record = {"kind": kind, "v": RECORD_SCHEMA, "job": job, "rank": rank, "pid": pid, "dropped": dropped,
              "body": dict(body)}
    return msgspec.convert(record, _RECORD_TYPE)  # type: ignore[no-any-return]


def decode(data: bytes) -> Message:
    """Decode and validate one datagram; raises SchemaError naming the first problem."""
    try:
        return _record_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise _record_version_error(data) or (
            explain(exc, _RECORD_TYPE) if isinstance(exc, msgspec.ValidationError) else
            SchemaError("", f"not a MessagePack record: {exc}")) from exc
    except RecursionError as exc:
        # NOTE: msgspec recurses into nested arrays and maps (an event's free-form fields, any field a newer sender
        # adds): 16 KiB of one-byte arrays nest deeper than the interpreter allows (tests/fuzz/test_rank_datagrams.py).
        raise SchemaError("", "nested too deeply to be a rank record") from exc


def decode_batch(data: bytes) -> HeartbeatBatch:
    """Decode and validate a heartbeat batch's JSON body; raises SchemaError naming the first problem."""
    return decode_json(_batch_decoder, _BATCH_TYPE, data)  # type: ignore[no-any-return]


def decode_json(decoder: msgspec.json.Decoder, root: Any, data: bytes,
                versions: tuple[int, ...] = (HEARTBEAT_SCHEMA,)) -> Any:
    """`data` decoded by `decoder` (into the type `root`, whose `schema` is one of `versions`); raises SchemaError
    naming the first problem, or the schema version when it is not one of `versions`."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _batch_version_error(_peek(msgspec.json.decode, data).schema, versions) or explain(exc, root) from exc
    except msgspec.DecodeError as exc:
        raise json_syntax_error(data, exc) from exc
    except RecursionError:
        # NOTE: msgspec recurses into values it skips too (an unknown field holding "[" * 200000).
        raise SchemaError("", "JSON nested too deeply") from None


def convert_batch(obj: Any) -> HeartbeatBatch:
    """A heartbeat batch from an already decoded JSON object (a dict), validated as decode_batch does."""
    try:
        return msgspec.convert(obj, _BATCH_TYPE)
    except msgspec.ValidationError as exc:
        schema = obj.get("schema") if isinstance(obj, dict) else None
        raise _batch_version_error(schema, (HEARTBEAT_SCHEMA,)) or explain(exc, _BATCH_TYPE) from exc


def _peek(decode_fn: Any, data: bytes) -> _Versions:
    try:
        return decode_fn(data, type=_Versions)  # type: ignore[no-any-return]
    except (msgspec.MsgspecError, RecursionError):
        return _Versions()


def _record_version_error(data: bytes) -> SchemaError | None:
    if data[:1] == b"{":
        return SchemaError("v", f"a JSON datagram (schema v1); this sidecar reads v{RECORD_SCHEMA} (MessagePack): "
                                "run the ranks and the sidecar from the same megaheal")
    v = _peek(msgspec.msgpack.decode, data).v
    if v is None or v == RECORD_SCHEMA:
        return None
    return SchemaError("v", f"unknown schema version {repr(v)[:40]} (this sidecar reads {RECORD_SCHEMA})")


def _batch_version_error(schema: Any, versions: tuple[int, ...]) -> SchemaError | None:
    if schema is None or schema in versions:
        return None
    return SchemaError("schema", f"expected {' or '.join(map(str, versions))}, got {schema!r}")
