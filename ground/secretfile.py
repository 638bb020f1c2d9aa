"""Secrets kept in files: bearer tokens and passwords, read with checks and written durably, and a process that
keeps what it holds out of other processes' reach.

Why files and not environment variables: a process's environment is readable at /proc/PID/environ by every
process of the same uid, and on a training node the ranks run under the sidecar's uid. A file is read once at
start; `forbid_inspection` then makes the process non-dumpable, which closes /proc/PID/environ, /proc/PID/mem and
/proc/PID/root (the way into a container's mounted secrets) to every process without CAP_SYS_PTRACE.

Rules for a file named by the operator (`read_secret`): a regular file (a symlink to one is fine: Kubernetes
mounts secrets that way) that nobody but its owner can write, since whoever can write it chooses the secret.
Readable by others is allowed there, because docker compose mounts a host file into containers that run as
other users, and the directory holding it is what keeps it private on the host. A file the healer writes
itself (`read_secret(private=True)`) must be owned by this process's user and have no group or other access.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import os
import re
import secrets
import stat
from pathlib import Path

log = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
# NOTE: a token travels in an HTTP header (Alertmanager, the sidecar): printable ASCII without spaces only.
_TOKEN = re.compile(r"[\x21-\x7e]+")
_PR_SET_DUMPABLE = 4


class SecretError(ValueError):
    """A secret file or value that must not be used; the message names it and says what to do."""


def check_token(token: str, source: str) -> str:
    """`token` if it is a usable bearer token (at least 16 printable ASCII characters, no spaces); else SecretError
    naming `source` (a file or a variable). The value itself never appears in the message."""
    if len(token) < MIN_TOKEN_CHARS:
        raise SecretError(f"{source}: the token has {len(token)} characters, at least {MIN_TOKEN_CHARS} are needed "
                          "(make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if not _TOKEN.fullmatch(token):
        raise SecretError(f"{source}: the token may hold printable ASCII characters only, without spaces")
    return token


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` as a bearer token: the scheme's name in any case (RFC 9110:
    "bearer" is "Bearer"), the token compared in constant time (so it cannot be guessed byte by byte from response
    times)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(errors="replace"), token.encode())


def read_secret(path: str | Path, what: str, private: bool = False) -> str:
    """The content of secret file `path` without surrounding whitespace, after checking who can change it (see the
    module docstring). `what` says what the secret is for, in messages. Raises SecretError."""
    # NOTE: a private file (one the run wrote itself, replace_private) is never a link: one there was put by someone else.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | (os.O_NOFOLLOW if private else 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise SecretError(f"{path}: cannot read the {what}: {exc.strerror}") from exc
    try:
        # NOTE: checked on the open descriptor, so what is checked is what is read (no swap in between).
        info = os.fstat(fd)
        _check(Path(path), info, what, private)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(64 * 1024)
    finally:
        os.close(fd)
    try:
        return raw.decode().strip()
    except UnicodeDecodeError as exc:
        raise SecretError(f"{path}: the {what} is not UTF-8 text") from exc


def _check(path: Path, info: os.stat_result, what: str, private: bool) -> None:
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"{path}: the {what} must be a regular file")
    if mode & 0o022:
        raise SecretError(f"{path}: the {what} file is writable by {_who(mode & 0o022)} (mode {mode:04o}), who could "
                          f"replace it: chmod go-w {path}")
    if private and info.st_uid != os.geteuid():
        raise SecretError(f"{path}: the {what} file belongs to uid {info.st_uid}, not to this user ({os.geteuid()}); "
                          "delete it to have a new one generated")
    if private and mode & 0o077:
        raise SecretError(f"{path}: the {what} file is open to {_who(mode & 0o077)} (mode {mode:04o}): chmod 600 "
                          f"{path}, or delete it to have a new one generated")


def _who(bits: int) -> str:
    return " and ".join(name for name, mask in (("its group", 0o070), ("other users", 0o007)) if bits & mask)


def write_private(path: Path, text: str) -> bool:
    """Create `path` holding `text`, mode 0600, durably: a temporary file written and fsynced, then linked into
    place (which never replaces an existing file) and the directory fsynced, so a crash or a full disk leaves
    either no file or the whole one, never an empty one. False when `path` already existed (another process
    created it first: read theirs)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        _fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def replace_private(path: Path, text: str) -> None:
    """Put `text` at `path`, mode 0600, replacing whatever is there (a symlink is replaced, not followed), durably:
    a new file written and fsynced under another name, renamed over `path`, the directory fsynced. For a file the
    run writes and reads back with read_secret(private=True) (its token, its agents' URLs): its mode and place are
    never an existing file's or link's."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def forbid_inspection() -> bool:
    """Make this process non-dumpable (prctl PR_SET_DUMPABLE 0): other processes of the same uid can no longer
    read its environment, memory or root directory through /proc (only root, with CAP_SYS_PTRACE, can). The
    setting does not pass through exec, so programs this process starts are unaffected. False where the kernel
    refuses (not Linux): logged, not fatal."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
            return True
        reason = os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        reason = str(exc)
    log.warning("cannot make this process non-dumpable (%s): same-uid processes can read it through /proc", reason)
    return False
