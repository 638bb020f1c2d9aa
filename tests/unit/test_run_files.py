"""The files a run writes for itself and reads back (its token, its agents' URLs): written as new files of mode 0600
whatever was there before (a link replaced, not followed; an older file's mode not kept), and read back only while
they are still this user's regular files that no one else can read or write. Whoever could write them would choose
the token, or where the healer sends it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ground.secretfile import SecretError
from healer.launchers import agent_registry
from healer.launchers.run_token import read_token, write_token
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_token_is_written_as_a_new_private_file_whatever_was_at_its_path(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("left alone\n")
    token_file = tmp_path / "run" / "token"
    token_file.parent.mkdir()
    token_file.symlink_to(elsewhere)  # planted: the write must not go through it
    token = write_token(token_file)
    assert not token_file.is_symlink() and mode(token_file) == 0o600 and elsewhere.read_text() == "left alone\n"
    assert read_token(token_file) == token
    token_file.chmod(0o644)
    write_token(token_file, token)  # an older file's mode is not kept
    assert mode(token_file) == 0o600


@pytest.mark.parametrize("spoil", ["group-readable", "world-writable", "a link", "another user's"])
def test_a_token_file_someone_else_could_have_read_or_written_is_refused(tmp_path: Path, spoil: str) -> None:
    token_file = tmp_path / "token"
    write_token(token_file)
    if spoil == "group-readable":
        token_file.chmod(0o640)
    elif spoil == "world-writable":
        token_file.chmod(0o602)
    elif spoil == "a link":
        real = tmp_path / "real"
        token_file.rename(real)
        token_file.symlink_to(real)
    elif os.geteuid() == 0:
        os.chown(token_file, 65534, 65534)
    else:
        pytest.skip("changing a file's owner needs root")
    with pytest.raises(SecretError, match=str(token_file)):
        read_token(token_file)


def test_the_agents_urls_are_private_and_a_file_others_could_write_is_not_read(tmp_path: Path, caplog) -> None:
    agent_registry.save(tmp_path, {"n1": "http://127.0.0.1:1234"})
    where = RunPaths(tmp_path).agents
    assert mode(where) == 0o600 and agent_registry.load(tmp_path) == {"n1": "http://127.0.0.1:1234"}
    where.chmod(0o666)  # anyone could have pointed n1 elsewhere: the healer would send its token there
    assert agent_registry.load(tmp_path) == {}
    assert "not taken from" in caplog.text and "writable by" in caplog.text
