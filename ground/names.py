"""The one rule for the names of jobs and nodes, wherever they enter: the CLI, training configs, the sidecar's
`--node`, the rank datagrams and the heartbeat batches (wire/telemetry.py's `Name` is this pattern).

A name is 1 to 253 ASCII characters: letters, digits and `. _ : @ -`, starting with a letter or a digit, with no
`..` in it. It must fit everywhere a name goes: Prometheus labels, torchrun's rendezvous id (`JOB-ATTEMPT`), log
lines, the healer's database columns, Alertmanager labels, and the directories named after it (an agent's attempt
and phase directories, a run's `nodes/NODE/`): no `/` and no `..`, so that no name reaches outside its parent
(`a/../../../etc` was once accepted as a job), and paths are made from names by `name_path` alone. Spaces and
non-ASCII letters are refused: a job that its own ranks cannot report under (their datagrams are validated against
this rule) would run unwatched.

The standard library only: the ranks import it through the wire schema.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

MAX_LENGTH = 253
# NOTE: \Z, not $: `$` also matches before a trailing newline, so "job\n" would pass. msgspec applies the pattern
# with re.search, hence the anchors.
NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}\Z"
RULE = "letters, digits and . _ : @ - (ASCII), starting with a letter or digit, no '..', at most 253 characters"
_NAME = re.compile(NAME_PATTERN)
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._:@-]+")
_DOTS = re.compile(r"\.{2,}")
_PART = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._:@-]{0,254}\Z")
"""A path component made from names (`JOB-attempt-003`): a name's characters, up to the 255 of a file name."""


def is_name(value: object) -> bool:
    """Whether `value` is a valid job or node name."""
    return isinstance(value, str) and _NAME.match(value) is not None


def check_name(value: object, what: str) -> str:
    """`value` when it is a valid name; ValueError naming `what` (e.g. "job", "node") and the rule otherwise.
    The message starts with `what`, so that a typed config points at the key's line."""
    if not is_name(value):
        raise ValueError(f"{what} must be a name of {RULE}; got {value!r}")
    return value  # type: ignore[return-value]


def derive_name(text: str) -> str:
    """A valid name made from free text (a run directory's name): every run of other characters becomes "-",
    leading punctuation goes, and the result is cut to 253 characters. Text with nothing usable in it (only
    non-ASCII letters, say) gives "run-" and a short hash of it, so that two such directories stay apart."""
    name = _DOTS.sub(".", _NOT_ALLOWED.sub("-", text)).lstrip("._:@-")[:MAX_LENGTH]
    if not name:
        name = "run-" + hashlib.blake2b(text.encode(errors="surrogateescape"), digest_size=4).hexdigest()
    return name


def name_path(parent: Path, *parts: str) -> Path:
    """`parent` / each of `parts`, where each part is a name or made of names (`f"{job}-attempt-{n:03d}"`): the one
    way megaheal makes a path from a name. ValueError for a part that is not one: nothing made here leaves `parent`."""
    for part in parts:
        if not isinstance(part, str) or _PART.match(part) is None:
            raise ValueError(f"{part!r} cannot name a directory under {parent}: expected {RULE} (255 at most here)")
    return parent.joinpath(*parts)
