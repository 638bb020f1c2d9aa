"""The run's own token: what the healer and its node agents share, and what anything that can restart or kill the
job must present. One file in the run directory (wire/run_paths.py), written here, read back here by the healer, a
healer that takes the run over, and the launchers."""

from __future__ import annotations

import secrets
from pathlib import Path

from ground.secretfile import check_token, read_secret, replace_private

__all__ = ["read_token", "write_token"]


def write_token(path: Path, token: str | None = None) -> str:
    """The job's token in a file only its owner can read (agents read it; it never goes into an environment): a new
    file of mode 0600 put in place, whatever was there (a link is replaced, not followed)."""
    token = token or secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_private(path, token + "\n")
    return token


def read_token(path: Path) -> str:
    """The job's token as write_token left it: still this user's regular file, open to no one else (SecretError,
    a ValueError, naming what is wrong otherwise)."""
    return check_token(read_secret(path, "run token", private=True), str(path))
