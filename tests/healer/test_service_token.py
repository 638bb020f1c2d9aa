"""The API token of a real `megaheal healer`: a token shorter than 16 characters from any source (the generated
file, a token file, MEGAHEAL_TOKEN) stops the start with an error naming the source, and so does a token file
that others could change; a generated token is written whole or not at all."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from ground.secretfile import write_private
from tests.healer.services import MEGAHEAL, free_port, http, wait_for

pytestmark = pytest.mark.services


def _start(tmp_path: Path, *args: str, env_token: str | None = None, port: int | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGAHEAL_TOKEN", "MEGAHEAL_DB")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    if env_token is not None:
        env["MEGAHEAL_TOKEN"] = env_token
    (tmp_path / "rules.yaml").write_text("")
    config = tmp_path / "healer.yaml"
    config.write_text(f"rules: [{tmp_path / 'rules.yaml'}]\ndb: sqlite:///{tmp_path / 'h.db'}\n")
    return subprocess.Popen([MEGAHEAL, "healer", "--config", str(config), "--listen", f"127.0.0.1:{port or free_port()}",
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _refused(proc: subprocess.Popen[str]) -> str:
    """The output of a healer that must refuse to start; fails if it serves instead."""
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the healer started instead of refusing its token:\n{out[-2000:]}") from None
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    return out


def _generated(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "megaheal" / "token"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def test_it_refuses_an_empty_generated_token_file_instead_of_accepting_an_empty_bearer(tmp_path: Path) -> None:
    token = _generated(tmp_path)
    token.touch(mode=0o600)  # what a healer killed between creating and writing it used to leave behind
    out = _refused(_start(tmp_path))
    assert f"{token}: the token has 0 characters, at least 16 are needed" in out


@pytest.mark.parametrize("value", ["", "short-token", "   "])
def test_it_refuses_a_short_or_empty_megaheal_token(tmp_path: Path, value: str) -> None:
    out = _refused(_start(tmp_path, env_token=value))
    assert "MEGAHEAL_TOKEN: the token has" in out and "at least 16" in out


def test_it_refuses_a_short_token_file_and_one_that_others_can_write(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("0123456789\n")
    assert f"{short}: the token has 10 characters" in _refused(_start(tmp_path, "--token-file", str(short)))
    writable = tmp_path / "writable"
    writable.write_text("0123456789abcdef0123\n")
    writable.chmod(0o666)
    out = _refused(_start(tmp_path, "--token-file", str(writable)))
    assert f"{writable}: the API token file is writable by its group and other users (mode 0666)" in out


def test_it_refuses_a_generated_token_file_open_to_others(tmp_path: Path) -> None:
    token = _generated(tmp_path)
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o644)
    assert "open to its group and other users (mode 0644)" in _refused(_start(tmp_path))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_it_refuses_a_generated_token_file_of_another_user(tmp_path: Path) -> None:
    token = _generated(tmp_path)
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o600)
    os.chown(token, 65534, 65534)
    assert "belongs to uid 65534" in _refused(_start(tmp_path))


def test_a_generated_token_is_private_complete_and_the_only_one_accepted(tmp_path: Path) -> None:
    port = free_port()
    proc = _start(tmp_path, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the healer", lambda: _answers(url, proc), 60)
        token_file = tmp_path / "state" / "megaheal" / "token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        assert len(token) >= 32
        beat = {"schema": 1, "node": "n1", "seq": 0, "sent_at": 1, "ranks": []}
        for wrong in ("", " ", token[:-1], token + "x"):
            assert http("POST", f"{url}/v1/heartbeats", beat, token=wrong or None)[0] == 401
        assert http("POST", f"{url}/v1/heartbeats", beat, token=token)[0] == 202
        assert not [p for p in token_file.parent.iterdir() if p.name.startswith(".token")]  # no temp file left
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def _answers(url: str, proc: subprocess.Popen[str]) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the healer exited: {proc.communicate()[0][-2000:]}")
    try:
        return http("GET", f"{url}/healthz", timeout=2)[0] == 200
    except OSError:
        return False


def test_a_second_writer_never_replaces_the_first_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    assert write_private(path, "first-token-0123456789\n")
    assert not write_private(path, "second-token-0123456789\n")  # two healers starting at once: one token
    assert path.read_text() == "first-token-0123456789\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["token"]
