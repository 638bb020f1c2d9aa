"""`megaheal incidents list | show | ack | resolve`: on-call's view of a healer's incidents, through its HTTP API
(healer/service/api.py), as amtool is Alertmanager's. Mounted on `megaheal` by megaheal/cli.py.

    megaheal incidents list [--state escalated] [-o json]          GET  /v1/incidents
    megaheal incidents show 12                                     GET  /v1/incidents/12
    megaheal incidents ack 12 --note "looking at n7"               POST /v1/incidents/12/ack      (token)
    megaheal incidents resolve 12 --note "replaced the NIC"        POST /v1/incidents/12/resolve  (token)

The healer is `--healer-url` (a `megaheal healer`, http://127.0.0.1:8470 by default). A `megaheal run` job's healer
serves over the run's TLS: `--run-dir RUN` then trusts the run's CA (RUN/launcher/tls/ca.pem) and nothing else, checks
that the server's certificate is the healer's, and acts with the run's token. Reading needs no token; acting takes
the first of: `--token-file`, the run's token (with `--run-dir`), MEGAHEAL_TOKEN, the token a local healer generated
in the state directory.

Exit status: 0 done, 1 the healer refused or could not be reached (its words printed), 2 a bad option.
"""

from __future__ import annotations

import getpass
import http.client
import json
import os
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="On-call: list, show, acknowledge and resolve a healer's incidents (through its HTTP API).")

DEFAULT_URL = "http://127.0.0.1:8470"
TOKEN_ENV = "MEGAHEAL_TOKEN"
MAX_RESPONSE = 32 << 20
"""The longest answer read (a page of 1000 incidents with their evidence fits many times over)."""
STATES = ("open", "diagnosing", "remediating", "escalated", "acknowledged", "resolved")
"""healer.decide.states.IncidentState's values; the healer refuses any other (tests check the two agree)."""
OUTPUTS = ("table", "json")

UrlOption = Annotated[str, typer.Option("--healer-url", help="the healer's base URL (a `megaheal run` job's: "
                                        "https://HOST:PORT with --run-dir)")]
RunOption = Annotated[Optional[str], typer.Option("--run-dir", help="a `megaheal run` job's run directory: verify "
                                                  "its healer with the run's ca.pem and act with the run's token "
                                                  "[default: none]")]
TokenOption = Annotated[Optional[str], typer.Option("--token-file", help="file holding the healer's bearer token, "
                                                    "to ack and resolve [default: the run's token with --run-dir, "
                                                    "else MEGAHEAL_TOKEN, else $XDG_STATE_HOME/megaheal/token]")]
OutputOption = Annotated[str, typer.Option("-o", "--output", help="table or json (the API's answer as it is)")]
TimeoutOption = Annotated[float, typer.Option("--timeout", help="seconds to wait for the healer")]


class Refusal(Exception):
    """The healer could not be reached or refused the request; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Healer:
    """Where the healer is and how to reach it: plain HTTP(S), or the run's TLS (`peer`)."""

    url: str
    timeout_s: float
    peer: Any = None
    """ground.tls.PeerTls: the run's CA and the healer's identity; None: the system's trust, or plain HTTP."""

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None) -> Any:
        """The JSON answer of one request; Refusal naming the status and the healer's reason otherwise."""
        headers = {"Accept": "application/json"}
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:
            headers["Content-Type"] = "application/json"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        url = self.url + path
        try:
            status, raw = self._send(method, url, data, headers)
        except OSError as exc:
            raise Refusal(f"cannot reach the healer at {self.url}: {exc}") from exc
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            raise Refusal(f"{method} {url}: {status}, not a JSON answer: {raw[:200]!r}") from None
        if status >= 400:
            why = answer.get("error") if isinstance(answer, dict) else None
            field = answer.get("field") if isinstance(answer, dict) else None
            raise Refusal(f"{method} {url}: {status}: {why or raw[:200]!r}" + (f" (field {field})" if field else ""))
        return answer

    def _send(self, method: str, url: str, data: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        # NOTE: http.client, not urllib: a redirect is never followed (it would carry the token elsewhere).
        if self.peer is not None:
            from ground.tls import https

            return https(method, url, data, headers, self.timeout_s, self.peer, MAX_RESPONSE)
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port or 443, timeout=self.timeout_s,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=self.timeout_s)
        try:
            conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read(MAX_RESPONSE)
        except http.client.HTTPException as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()


def healer_of(url: str, run_dir: str | None, timeout_s: float) -> Healer:
    """The healer to ask; ValueError naming the option that is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
        raise ValueError(f"--healer-url must be http(s)://HOST:PORT, got {url!r}")
    if not 0 < timeout_s <= 600:
        raise ValueError(f"--timeout must be in (0, 600] seconds, got {timeout_s}")
    url = url.rstrip("/")
    if run_dir is None:
        return Healer(url, timeout_s)
    from ground.secretfile import SecretError, read_secret
    from ground.tls import PeerTls
    from healer.launchers.run_authority import RunAuthority
    from wire.run_paths import RunPaths

    if url == DEFAULT_URL:
        # NOTE: the runner leaves its endpoint's address in the run directory (its port is chosen at start).
        where = RunPaths(Path(run_dir)).healer_url
        try:
            url = read_secret(where, "the run's healer URL", private=True).rstrip("/")
        except (OSError, SecretError) as exc:
            raise ValueError(f"--run-dir: {where}: {exc}; give the healer's address as --healer-url") from exc
    if not url.startswith("https://"):
        raise ValueError(f"--run-dir: a `megaheal run` job's healer serves https only; give its address as "
                         f"--healer-url https://HOST:PORT, got {url!r}")

    ca = RunAuthority(RunPaths(Path(run_dir)).launcher / "tls").ca_cert
    if not ca.is_file():
        raise ValueError(f"--run-dir: {ca} is missing: is {run_dir} the run directory of a `megaheal run` job?")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    # NOTE: the healer's certificate names `urn:megaheal:healer:healer`, not a host: the chain is verified against
    # the run's CA in the handshake, and the name by PeerTls right after (ground/tls.py's NOTE).
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cafile=ca)
    return Healer(url, timeout_s, PeerTls(context, "healer"))


def acting_token(token_file: str | None, run_dir: str | None) -> str:
    """The bearer token to act with: `--token-file`, the run's token, MEGAHEAL_TOKEN, or a local healer's generated
    one, the first that is there. ValueError (SecretError) naming the source that is unusable, or saying where to
    put one."""
    from ground.secretfile import check_token, read_secret

    if token_file is not None:
        return check_token(read_secret(token_file, "healer token"), token_file)
    if run_dir is not None:
        from healer.launchers.run_token import read_token
        from wire.run_paths import RunPaths

        return read_token(RunPaths(Path(run_dir)).token)
    if TOKEN_ENV in os.environ:
        return check_token(os.environ[TOKEN_ENV].strip(), TOKEN_ENV)
    generated = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "megaheal" / "token"
    if generated.is_file():
        return check_token(read_secret(generated, "generated API token", private=True), str(generated))
    raise ValueError(f"acting on an incident needs the healer's token: give --token-file FILE, set {TOKEN_ENV}, "
                     f"or --run-dir for a `megaheal run` job (no generated token at {generated} either)")


# ---- output -----------------------------------------------------------------------------------------------------


def table(header: tuple[str, ...], rows: Sequence[Sequence[Any]], last_max: int = 80) -> str:
    """Columns aligned with two spaces between them; the last (free text) cut at `last_max` characters."""
    rows = [tuple(map(str, r[:-1])) + (_cut(str(r[-1]), last_max),) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())  # a note's newlines would break the table's lines
    return text if len(text) <= n else text[:n - 1] + "…"


def _suspects(incident: dict[str, Any]) -> str:
    """The suspects as `rank 3 (n2)`, `n7`, `n7 gpu 2` (healer/detect/suspects.py's Suspect, as JSON)."""
    words = []
    for s in incident.get("suspects") or []:
        if not isinstance(s, dict):
            words.append(str(s))
            continue
        node, rank, gpu = s.get("node"), s.get("rank"), s.get("gpu")
        word = f"rank {rank}" + (f" ({node})" if node else "") if rank is not None else str(node)
        words.append(word + (f" gpu {gpu}" if gpu is not None else ""))
    return ", ".join(words) or incident.get("node") or "-"


def list_table(incidents: list[dict[str, Any]]) -> str:
    if not incidents:
        return "no incidents"
    rows = [(str(i["id"]), i["state"], i.get("severity") or "-", i["kind"], i.get("job") or "-", _suspects(i),
             i.get("opened_at") or "-", i.get("summary") or "") for i in incidents]
    return table(("ID", "STATE", "SEVERITY", "KIND", "JOB", "SUSPECTS", "OPENED", "SUMMARY"), rows)


def show_text(incident: dict[str, Any]) -> str:
    fields = ("id", "state", "kind", "rule", "severity", "page", "job", "node", "owner", "acknowledged_by",
              "occurrences", "opened_at", "state_since", "last_seen_at", "resolved_at", "summary")
    width = max(map(len, fields)) + 1
    lines = [f"{(name + ':').ljust(width)} {incident.get(name) if incident.get(name) is not None else '-'}"
             for name in fields]
    lines.append(f"{'suspects:'.ljust(width)} {_suspects(incident)}")
    events = incident.get("events") or []
    if events:
        lines += ["", table(("AT", "EVENT", "FROM", "TO", "BY"), [(e.get("at") or "-", e.get("kind") or "-",
                                                                    e.get("from") or "-", e.get("to") or "-",
                                                                    e.get("actor") or "-") for e in events])]
    runs = incident.get("runbook_runs") or []
    if runs:
        lines += ["", table(("RUNBOOK", "NODES", "VERDICT", "STARTED", "SUMMARY"),
                            [(r.get("runbook") or "-", ",".join(r.get("nodes") or []) or "-", r.get("verdict") or "-",
                              r.get("started_at") or "-", r.get("summary") or "") for r in runs])]
    return "\n".join(lines)


# ---- commands ---------------------------------------------------------------------------------------------------


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _shaped(answer: Any, key: str, url: str) -> dict[str, Any]:
    """`answer` when it is a healer's (a JSON object with `key`); Refusal otherwise (something else at that URL)."""
    if not isinstance(answer, dict) or key not in answer:
        raise Refusal(f"{url} answered, but not as a megaheal healer does (no {key!r} in its answer): "
                      "is it the healer?")
    return answer


def _check_output(output: str) -> None:
    if output not in OUTPUTS:
        raise ValueError(f"-o/--output must be one of {', '.join(OUTPUTS)}, got {output!r}")


def _id(incident_id: int) -> int:
    if not 1 <= incident_id < 2**62:
        raise ValueError(f"INCIDENT_ID must be a positive incident number, got {incident_id}")
    return incident_id


@app.command("list")
def list_(
    states: Annotated[Optional[list[str]], typer.Option("--state", help=f"only incidents in this state (repeatable): {', '.join(STATES)} [default: every state]")] = None,
    limit: Annotated[int, typer.Option("--limit", help="incidents at most, newest first (1-1000)")] = 100,
    offset: Annotated[int, typer.Option("--offset", help="skip this many of the newest first")] = 0,
    healer_url: UrlOption = DEFAULT_URL, run_dir: RunOption = None, output: OutputOption = "table",
    timeout: TimeoutOption = 10.0,
) -> None:
    """List incidents, newest first."""
    try:
        _check_output(output)
        for state in states or []:
            if state not in STATES:
                raise ValueError(f"--state: unknown state {state!r}; states: {', '.join(STATES)}")
        if not 1 <= limit <= 1000 or offset < 0:
            raise ValueError(f"--limit must be in 1-1000 and --offset >= 0, got {limit} and {offset}")
        healer = healer_of(healer_url, run_dir, timeout)
    except ValueError as exc:
        raise _fail(str(exc), 2) from exc
    query = urllib.parse.urlencode([*(("state", s) for s in states or []), ("limit", limit), ("offset", offset)])
    try:
        answer = _shaped(healer.call("GET", f"/v1/incidents?{query}"), "incidents", healer.url)
    except Refusal as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(answer, indent=2) if output == "json" else list_table(answer["incidents"]))


@app.command()
def show(
    incident_id: Annotated[int, typer.Argument(metavar="INCIDENT_ID", help="the incident's number (`list` shows them)", show_default=False)],
    healer_url: UrlOption = DEFAULT_URL, run_dir: RunOption = None, output: OutputOption = "table",
    timeout: TimeoutOption = 10.0,
) -> None:
    """Show one incident with every transition and runbook run."""
    try:
        _check_output(output)
        healer = healer_of(healer_url, run_dir, timeout)
        path = f"/v1/incidents/{_id(incident_id)}"
    except ValueError as exc:
        raise _fail(str(exc), 2) from exc
    try:
        answer = _shaped(healer.call("GET", path), "state", healer.url)
    except Refusal as exc:
        raise _fail(str(exc), 1) from exc
    typer.echo(json.dumps(answer, indent=2) if output == "json" else show_text(answer))


def _act(verb: str, incident_id: int, by: str | None, note: str, healer_url: str, run_dir: str | None,
         token_file: str | None, output: str, timeout: float) -> None:
    try:
        _check_output(output)
        healer = healer_of(healer_url, run_dir, timeout)
        path = f"/v1/incidents/{_id(incident_id)}/{verb}"
        token = acting_token(token_file, run_dir)
    except ValueError as exc:
        raise _fail(str(exc), 2) from exc
    try:
        answer = healer.call("POST", path, {"by": by or getpass.getuser(), "note": note}, token)
    except Refusal as exc:
        raise _fail(str(exc), 1) from exc
    if output == "json":
        typer.echo(json.dumps(answer, indent=2))
    else:
        shown = answer if isinstance(answer, dict) else {}
        typer.echo(f"incident {incident_id}: {shown.get('state', verb)}"
                   + (f" (by {shown['acknowledged_by']})" if shown.get("acknowledged_by") else ""))


ByOption = Annotated[Optional[str], typer.Option("--by", help="who acts, as the incident's history records it [default: your login name]")]
NoteOption = Annotated[str, typer.Option("--note", help="why, kept in the incident's history")]
IdArgument = Annotated[int, typer.Argument(metavar="INCIDENT_ID", help="the incident's number (`list` shows them)", show_default=False)]


@app.command()
def ack(incident_id: IdArgument, by: ByOption = None, note: NoteOption = "", healer_url: UrlOption = DEFAULT_URL,
        run_dir: RunOption = None, token_file: TokenOption = None, output: OutputOption = "table",
        timeout: TimeoutOption = 10.0) -> None:
    """Acknowledge an incident: a person owns it, and the healer stops acting on it."""
    _act("ack", incident_id, by, note, healer_url, run_dir, token_file, output, timeout)


@app.command()
def resolve(incident_id: IdArgument, by: ByOption = None, note: NoteOption = "", healer_url: UrlOption = DEFAULT_URL,
            run_dir: RunOption = None, token_file: TokenOption = None, output: OutputOption = "table",
            timeout: TimeoutOption = 10.0) -> None:
    """Resolve an incident: its condition is fixed."""
    _act("resolve", incident_id, by, note, healer_url, run_dir, token_file, output, timeout)
