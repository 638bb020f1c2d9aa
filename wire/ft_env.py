"""The environment of a rank that trains as one replica group of several (train/ft/): set by whoever starts the
group (the node agent under `megaheal run`, a test, a user's own script), read by the rank. The contract is here so
that both sides spell it alike.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

GROUP = "MEGAHEAL_FT_GROUP"
"""The replica group's index, 0 to ft.groups - 1: a replacement group takes the index of the one it replaces."""
LIGHTHOUSE = "MEGAHEAL_FT_LIGHTHOUSE"
"""The Lighthouse's URL, http://HOST:PORT: where the groups agree on each step's quorum."""
KEY_FILE = "MEGAHEAL_FT_KEY_FILE"
"""A private file (0600) holding the run's key, which authenticates a live state transfer between groups
(train/ft/transport.py): the path, never the key (an environment is readable through /proc)."""
AT_LEAST = "MEGAHEAL_FT_AT_LEAST"
"""The step the job's groups have reached when this one starts (wire/orders.ReplicaStart.at_least); unset: 0."""
ADDRESS = "MEGAHEAL_FT_ADDRESS"
"""The address this host trains on: where its live state is served to a joining group, and the name its manager
gives the Lighthouse. Unset: 127.0.0.1 (every group on this machine)."""

_URL = re.compile(r"http://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(\d{1,5})")
_ADDRESS = re.compile(r"[0-9a-fA-F:.]+|[A-Za-z0-9.-]+")


@dataclass(frozen=True, slots=True)
class FtEnv:
    group: int
    lighthouse: str
    key_file: Path
    address: str
    at_least: int = 0


def read(environ: Mapping[str, str], groups: int) -> FtEnv:
    """This rank's group, Lighthouse, key file and address; ValueError naming the variable that is missing or
    wrong."""
    missing = [name for name in (GROUP, LIGHTHOUSE, KEY_FILE) if not environ.get(name)]
    if missing:
        raise ValueError(f"ft.enabled needs {', '.join(missing)} in the environment (wire/ft_env.py)")
    text = environ[GROUP]
    if not text.isdigit() or int(text) >= groups:
        raise ValueError(f"{GROUP}={text!r}: expected a group index from 0 to ft.groups - 1 = {groups - 1}")
    lighthouse = environ[LIGHTHOUSE]
    match = _URL.fullmatch(lighthouse)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{LIGHTHOUSE}={lighthouse!r}: expected http://HOST:PORT")
    address = environ.get(ADDRESS) or "127.0.0.1"
    if _ADDRESS.fullmatch(address) is None:
        raise ValueError(f"{ADDRESS}={address!r}: expected a host name or an IP address")
    at_least = environ.get(AT_LEAST) or "0"
    if not at_least.isdigit():
        raise ValueError(f"{AT_LEAST}={at_least!r}: expected a step, an integer >= 0")
    return FtEnv(group=int(text), lighthouse=lighthouse, key_file=Path(environ[KEY_FILE]), address=address,
                 at_least=int(at_least))


def ft_key(token: str, job: str) -> bytes:
    """The key the replica groups of `job` authenticate a live state transfer with: derived from the run's token, so
    every node agent computes it alike and no one without the token can (the healer itself never needs it)."""
    return hmac.new(token.encode(), b"megaheal replica groups key\0" + job.encode(), hashlib.sha256).digest()
