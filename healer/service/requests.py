"""What a request carries, read and checked before anything acts on it: the body (bounded, strict JSON), the path
and query parameters, a person's name and note. Whatever does not fit is a `Refused` with a 4xx and the field it
concerns, never an exception that would become a 500.

Why so strict about numbers: `str.isdigit()` is true for "²" and other Unicode digits that `int()` refuses, and
`int()` itself refuses more than 4,300 digits; both used to reach the client as a 500. JSON goes through msgspec,
which has no such limits to trip over: integers beyond 64 bits, NaN and Infinity are refused as invalid JSON
values, and nesting deep enough to exhaust the stack is caught and refused as well.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import msgspec
from starlette.datastructures import QueryParams
from starlette.requests import Request

from healer.decide.states import IncidentState
from wire.errors import json_syntax_error

_DIGITS = re.compile(r"[0-9]{1,19}")  # NOTE: a str pattern's [0-9] is ASCII only, unlike \d and isdigit()
MAX_NAME = 128
"""A person's name (`by`): the actor `person:NAME` must fit the 200 characters of the events' actor column."""
MAX_NOTE = 4000
INCIDENT_QUERY = ("state", "limit", "offset")


class Refused(Exception):
    """A request answered with `status` and {"error": message, "field": field}."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.field = status, field


def shown(value: str, limit: int = 40) -> str:
    """`value` quoted for a message, cut short: an error must not echo 5,000 digits back."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


def parse_int(value: str, field: str, low: int, high: int) -> int:
    if not _DIGITS.fullmatch(value) or not low <= int(value) <= high:
        raise Refused(400, f"expected an integer in [{low}, {high}], got {shown(value)}", field)
    return int(value)


async def read_body(request: Request, max_body: int) -> bytes:
    """The whole body, refused with 413 past `max_body` bytes (whether or not Content-Length says so)."""
    length = request.headers.get("content-length")
    if length is not None and (not _DIGITS.fullmatch(length.strip()) or int(length) > max_body):
        raise Refused(413, f"body larger than {max_body} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise Refused(413, f"body larger than {max_body} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def not_empty(raw: bytes) -> bytes:
    if not raw.strip():
        raise Refused(400, "empty body: expected JSON", "body")
    return raw


def decode_json(raw: bytes) -> Any:
    """`raw` as JSON (RFC 8259: no NaN, no Infinity), or Refused(400) saying where it is wrong."""
    not_empty(raw)
    try:
        return msgspec.json.decode(raw)
    except msgspec.ValidationError as exc:
        # NOTE: decoding into Any, msgspec refuses only numbers out of range (1e999, integers beyond 64 bits), and
        # its path then does not name object keys ("$[...]"): the field is the body.
        raise Refused(400, f"a number out of range (integers must fit in 64 bits): {str(exc).split(' - ')[0]}",
                      "body") from exc
    except msgspec.DecodeError as exc:
        raise Refused(400, json_syntax_error(raw, exc).reason, "body") from exc
    except RecursionError:
        raise Refused(400, "JSON nested too deeply", "body") from None


def incident_query(params: QueryParams) -> tuple[list[IncidentState], int, int]:
    """GET /v1/incidents' parameters: any number of `state`, at most one `limit` and `offset`; nothing else."""
    for name in params:
        if name not in INCIDENT_QUERY:
            raise Refused(400, f"unknown query parameter {shown(name)}; known: {', '.join(INCIDENT_QUERY)}",
                          name[:100] or "query")
    for name in ("limit", "offset"):
        if len(params.getlist(name)) > 1:
            raise Refused(400, "given more than once", name)
    states = []
    for value in params.getlist("state"):
        try:
            states.append(IncidentState(value))
        except ValueError:
            raise Refused(400, f"unknown state {shown(value)}; states: {', '.join(s.value for s in IncidentState)}",
                          "state") from None
    limit = parse_int(params.get("limit", "100"), "limit", 1, 1000)
    offset = parse_int(params.get("offset", "0"), "offset", 0, 10**9)
    return states, limit, offset


def person_fields(body: Any) -> tuple[str, str]:
    """`by` and `note` of an ack or resolve ({} when the request had no body)."""
    if not isinstance(body, dict):
        raise Refused(400, "expected a JSON object", "body")
    return check_person(body.get("by", "operator"), body.get("note", ""))


_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""The marks and overrides that reorder text as it is shown: a note with them can read other than it was written."""


def check_person(by: Any, note: Any) -> tuple[str, str]:
    """Who acts on an incident and their note, as the API and the pages' form take them: a name of printable
    characters, and a note without control characters (but tab and newline) or direction overrides."""
    if not isinstance(by, str) or not 0 < len(by) <= MAX_NAME or not by.isprintable():
        raise Refused(400, f"expected a name of 1-{MAX_NAME} printable characters", "by")
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        raise Refused(400, f"expected a string of at most {MAX_NOTE} characters", "note")
    if any((unicodedata.category(c) == "Cc" and c not in "\t\n\r") or c in _BIDI for c in note):
        raise Refused(400, "control characters (other than tab and newline) and direction marks are not allowed",
                      "note")
    return by, note
