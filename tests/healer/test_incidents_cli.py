"""`megaheal incidents list | show | ack | resolve` against a real healer API on a socket (issue 35): a table or the
API's JSON, acting with the token from the flag, the environment or a run, and a `megaheal run` job's healer reached
over the run's TLS, trusted only when its certificate is the run's healer's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ground.secretfile import replace_private
from healer.engine.engine import Healer
from healer.incidents.db import ensure_schema
from healer.launchers.run_authority import RunAuthority
from healer.launchers.run_token import write_token
from healer.runner.reports import ReportServer
from healer.service.api import create_app
from healer.service.health import Readiness
from megaheal.cli import app
from tests.healer.helpers import make_healer
from tests.healer.services import TOKEN, webhook
from wire.run_paths import RunPaths

pytestmark = pytest.mark.services
RULES = "- name: xid\n  when: {alert: GpuXid}\n"
FIRING = webhook([{"status": "firing", "labels": {"alertname": "GpuXid", "node": "n7", "job": "llama"}}])


def _serve(healer: Healer, token: str, tls: Any = None) -> ReportServer:
    readiness = Readiness(lambda: ensure_schema(healer.store.engine))
    readiness.probe()
    server = ReportServer(create_app(healer, readiness, token), tls=tls)
    server.start()
    return server


def _cli(*args: str, **env: str) -> Any:
    return CliRunner().invoke(app, ["incidents", *args], env=env or None, terminal_width=200)


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Healer]]:
    monkeypatch.delenv("MEGAHEAL_TOKEN", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # no generated token of this machine's healer
    healer = make_healer(tmp_path, RULES)
    healer.handle_alertmanager(FIRING)
    server = _serve(healer, TOKEN)
    yield server.url, healer
    server.stop()


def test_list_and_show_as_a_table_and_as_json(service: tuple[str, Healer]) -> None:
    url, _ = service
    table = _cli("list", "--healer-url", url)
    assert table.exit_code == 0, table.output
    header, row = table.output.splitlines()
    assert header.split() == ["ID", "STATE", "SEVERITY", "KIND", "JOB", "SUSPECTS", "OPENED", "SUMMARY"]
    assert row.split()[:2] == ["1", "open"] and "llama" in row and "n7" in row
    listed = json.loads(_cli("list", "--healer-url", url, "-o", "json", "--state", "open").output)
    assert [i["id"] for i in listed["incidents"]] == [1]
    assert _cli("list", "--healer-url", url, "--state", "resolved").output.strip() == "no incidents"
    shown = _cli("show", "1", "--healer-url", url)
    assert shown.exit_code == 0 and "state:" in shown.output and "n7" in shown.output
    assert json.loads(_cli("show", "1", "--healer-url", url, "-o", "json").output)["events"][0]["to"] == "open"
    missing = _cli("show", "9", "--healer-url", url)
    assert missing.exit_code == 1 and f"GET {url}/v1/incidents/9: 404: " in missing.output
    assert "no incident 9" in missing.output


def test_ack_and_resolve_act_with_the_token_file_first_then_the_environment(service: tuple[str, Healer],
                                                                           tmp_path: Path) -> None:
    url, healer = service
    refused = _cli("ack", "1", "--healer-url", url)
    assert refused.exit_code == 2
    assert "acting on an incident needs the healer's token: give --token-file" in refused.output
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    acked = _cli("ack", "1", "--healer-url", url, "--by", "ann", "--note", "looking at n7",
                 "--token-file", str(token_file), MEGAHEAL_TOKEN="wrong-token-0123456789")
    assert acked.exit_code == 0, acked.output  # the file wins over the environment
    assert acked.output.strip() == "incident 1: acknowledged (by person:ann)"
    by_env = _cli("resolve", "1", "--healer-url", url, "--note", "replaced the NIC", MEGAHEAL_TOKEN=TOKEN)
    assert by_env.exit_code == 0 and by_env.output.strip().startswith("incident 1: resolved")
    again = _cli("resolve", "1", "--healer-url", url, MEGAHEAL_TOKEN=TOKEN)
    assert again.exit_code == 1 and "409:" in again.output and "from resolved to resolved" in again.output
    events = healer.store.get(1)["events"]
    assert [e["to"] for e in events] == ["open", "acknowledged", "resolved"]
    assert events[2]["evidence"]["note"] == "replaced the NIC"
    unreachable = _cli("list", "--healer-url", "http://127.0.0.1:9")
    assert unreachable.exit_code == 1 and "cannot reach the healer at http://127.0.0.1:9" in unreachable.output


@pytest.fixture
def run_healer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, RunAuthority, Healer]]:
    """A `megaheal run` job's healer as the runner serves it: the run's TLS, the run's token."""
    monkeypatch.delenv("MEGAHEAL_TOKEN", raising=False)
    run = RunPaths(tmp_path / "run")
    run.launcher.mkdir(parents=True)
    write_token(run.token)
    authority = RunAuthority.of_run(run.launcher)
    healer = make_healer(tmp_path, RULES)
    healer.handle_alertmanager(FIRING)
    yield run.path, authority, healer


def test_a_run_healer_is_reached_over_the_runs_tls_with_the_runs_token(run_healer: Any) -> None:
    run_dir, authority, healer = run_healer
    token = (RunPaths(run_dir).token).read_text().strip()
    server = _serve(healer, token, authority.healer().server(require_peer=False))
    try:
        assert server.url.startswith("https://")
        plain = _cli("list", "--healer-url", server.url.replace("https", "http"), "--run-dir", str(run_dir))
        assert plain.exit_code == 2 and "serves https only" in plain.output
        listed = _cli("list", "--healer-url", server.url, "--run-dir", str(run_dir), "-o", "json")
        assert listed.exit_code == 0, listed.output
        assert [i["id"] for i in json.loads(listed.output)["incidents"]] == [1]
        acked = _cli("ack", "1", "--healer-url", server.url, "--run-dir", str(run_dir))
        assert acked.exit_code == 0, acked.output
        assert healer.store.get(1)["state"] == "acknowledged"
        untrusted = _cli("list", "--healer-url", server.url)  # the system's CAs do not know the run's
        assert untrusted.exit_code == 1 and "cannot reach the healer" in untrusted.output
        # The runner leaves its endpoint's address in the run directory: --run-dir alone finds it.
        missing = _cli("list", "--run-dir", str(run_dir))
        assert missing.exit_code == 2 and "healer.url" in missing.output
        replace_private(RunPaths(run_dir).healer_url, server.url + "\n")
        found = _cli("list", "--run-dir", str(run_dir), "-o", "json")
        assert found.exit_code == 0 and [i["id"] for i in json.loads(found.output)["incidents"]] == [1], found.output
    finally:
        server.stop()


def test_a_server_with_another_certificate_of_the_run_is_not_the_healer(run_healer: Any) -> None:
    run_dir, authority, healer = run_healer
    token = (RunPaths(run_dir).token).read_text().strip()
    impostor = _serve(healer, token, authority.relay("r1").server(require_peer=False))  # the run's CA, not the healer
    try:
        result = _cli("ack", "1", "--healer-url", impostor.url, "--run-dir", str(run_dir))
        assert result.exit_code == 1 and "names relay r1, not a healer" in result.output
        assert healer.store.get(1)["state"] == "open"
    finally:
        impostor.stop()


def test_a_run_directory_without_the_runs_authority_is_an_error(tmp_path: Path) -> None:
    result = _cli("list", "--healer-url", "https://127.0.0.1:9", "--run-dir", str(tmp_path))
    assert result.exit_code == 2
    assert f"--run-dir: {tmp_path}/launcher/tls/ca.pem is missing" in result.output
