"""The healer's own configuration (`megaheal healer --config FILE`), with defaults that run on a fresh machine:
loopback on port 8470, SQLite under the state directory, the shipped rules in configs/rules/.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

from ground.secretfile import SecretError, check_token, read_secret, write_private
from ground.typedconfig import ConfigError, from_mapping, load_yaml
from healer.decide.rules import DEFAULT_RULES
from healer.oncall.alertmanager import check_runbook_base

TOKEN_ENV = "MEGAHEAL_TOKEN"
_LISTEN = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")


def _state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "megaheal"


def split_listen(listen: str) -> tuple[str, int]:
    match = _LISTEN.match(listen)
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"listen must be HOST:PORT (e.g. 127.0.0.1:8470), got {listen!r}")
    return match["host"].strip("[]"), int(match["port"])


def _http_url(value: str, name: str) -> None:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"{name} must be an http(s) URL, got {value!r}")


@dataclass(kw_only=True, slots=True)
class HealerConfig:
    listen: str = "127.0.0.1:8470"
    """HOST:PORT of the API. Loopback by default: put a TLS proxy in front to expose it."""
    db: str | None = None
    """Database URL: sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB. Default: SQLite in the state dir."""
    db_password_file: str | None = None
    """File holding the PostgreSQL password (never in the URL or the environment, where same-uid processes can
    read it through /proc)."""
    db_timeout: timedelta = timedelta(seconds=10)
    """Longest a PostgreSQL statement or lock wait may take, and how long the readiness probe waits for the
    database: a hung database makes /readyz fail instead of holding the API's workers."""
    token_file: str | None = None
    """File holding the bearer token of mutating endpoints. `megaheal healer --token-file` wins over it, and it over
    MEGAHEAL_TOKEN; with none of them, one is generated into the state directory (mode 0600) and its path logged."""
    rules: list[str] = field(default_factory=lambda: [str(DEFAULT_RULES)])
    """Rule files or directories (*.yaml)."""
    prometheus_url: str | None = None
    """Prometheus for promql rules (required when any rule is a promql rule)."""
    alertmanager_urls: list[str] = field(default_factory=list)
    """Alertmanagers that get the incidents (all of an HA cluster, like Prometheus does)."""
    webhook_urls: list[str] = field(default_factory=list)
    """Generic webhooks that get every incident change as JSON."""
    webhook_token_file: str | None = None
    """Bearer token sent to the webhooks, if they need one."""
    grafana_url: str | None = None
    """Grafana for incident annotations (needs the optional extra megaheal[grafana])."""
    grafana_token_file: str | None = None
    """Service-account token for Grafana."""
    public_url: str | None = None
    """Base URL of this healer as people reach it (alerts link to its incident pages). Default: http://LISTEN."""
    runbook_base: str | None = None
    """Absolute URL of megaheal's docs/ folder as on-call opens it (https://github.com/ORG/megaheal/blob/TAG/docs);
    incident alerts link BASE/operations.md#the-incident-page. Unset: the repository path. Same value as
    Prometheus's external label runbook_base."""
    run_roots: list[str] = field(default_factory=list)
    """Directories holding jobs' run directories, each named after its job (as `megaheal run` names them; e.g. the
    shared filesystem's runs/): the pages draw heat maps, loss plots and the ledger from the records there."""
    instance: str | None = None
    """Name of this healer in incident events (which replica acted). Default: HOSTNAME:PID."""
    detect_interval: timedelta = timedelta(seconds=1)
    """How often the detectors run over the heartbeat stream."""
    promql_interval: timedelta = timedelta(seconds=15)
    """How often promql rules are evaluated."""
    respond_interval: timedelta = timedelta(seconds=1)
    """How often due incidents are acted on (deadlines included)."""
    notify_interval: timedelta = timedelta(seconds=1)
    """How often queued notifications are delivered."""
    alertmanager_resend: timedelta = timedelta(seconds=30)
    """Active incidents are re-posted to Alertmanager this often."""
    probe_interval: timedelta = timedelta(seconds=5)
    """How often the database is checked (readiness; a database that comes back is picked up)."""
    retention: timedelta = timedelta(days=90)
    """Resolved incidents older than this are deleted (with their events)."""
    diagnosis: str = "off"
    """local: run rules' runbooks on this machine (one-machine deployments); off: skip diagnosis."""
    diagnosis_workers: int = 2
    """Runbooks run at the same time at most."""
    max_body_bytes: int = 1 << 20
    """Requests with a larger body are refused with 413."""
    max_connections: int = 1000
    """Open HTTP connections at most (uvicorn's limit_concurrency: beyond it, 503 at once). A sidecar opens one per
    batch and closes it; keep-alive clients (Alertmanager, Prometheus, a proxy) hold theirs while idle."""

    def __post_init__(self) -> None:
        split_listen(self.listen)
        for name in ("prometheus_url", "grafana_url", "public_url"):
            if getattr(self, name) is not None:
                _http_url(getattr(self, name), name)
        for url in self.alertmanager_urls + self.webhook_urls:
            _http_url(url, "alertmanager_urls/webhook_urls")
        if self.runbook_base is not None:
            check_runbook_base(self.runbook_base)
        if self.diagnosis not in ("local", "off"):
            raise ValueError(f"diagnosis must be local or off, got {self.diagnosis!r}")
        if self.diagnosis_workers < 1:
            raise ValueError(f"diagnosis_workers must be >= 1, got {self.diagnosis_workers}")
        if not 8 <= self.max_connections <= 65536:
            raise ValueError(f"max_connections must be in [8, 65536], got {self.max_connections}")
        if not timedelta(milliseconds=100) <= self.db_timeout <= timedelta(minutes=10):
            raise ValueError(f"db_timeout must be in [100ms, 10m], got {self.db_timeout}")
        if not 1024 <= self.max_body_bytes <= 64 << 20:
            raise ValueError(f"max_body_bytes must be in [1 KiB, 64 MiB], got {self.max_body_bytes}")
        for name in ("detect_interval", "promql_interval", "respond_interval", "notify_interval",
                     "alertmanager_resend", "probe_interval", "retention"):
            if getattr(self, name) < timedelta(milliseconds=100):
                raise ValueError(f"{name} must be at least 100ms, got {getattr(self, name)}")

    @property
    def base_url(self) -> str:
        return self.public_url or f"http://{self.listen}"


def load_config(path: str | None) -> HealerConfig:
    if path is None:
        return HealerConfig()
    return from_mapping(HealerConfig, load_yaml(path), path)


def read_token(token_file: str | None) -> tuple[str, str]:
    """The API token and where it came from: the token file (`--token-file`, else the config's `token_file`: the
    caller puts the flag's in `token_file`), MEGAHEAL_TOKEN, or a generated one, the first that is set; as every
    megaheal command takes a token, the more explicit source wins. A token shorter than 16 characters from any of
    them, and a token file others could change, stop the start (ConfigError)."""
    try:
        if token_file:
            return check_token(read_secret(token_file, "API token"), token_file), token_file
        if TOKEN_ENV in os.environ:
            # NOTE: set but empty is an error too: `MEGAHEAL_TOKEN=` (a compose variable left unset) must not
            # quietly fall back to another token than the one the operator meant.
            return check_token(os.environ[TOKEN_ENV].strip(), TOKEN_ENV), TOKEN_ENV
        return _generated_token()
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc


def _generated_token() -> tuple[str, str]:
    """The token in the state directory, generated on first use. It is written whole or not at all
    (`write_private`), so an empty file was made by someone else, and is refused like any short token."""
    import secrets

    path = _state_dir() / "token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n")  # False: another healer made it first; use theirs
    return check_token(read_secret(path, "generated API token", private=True), str(path)), str(path)


def read_db_password(path: str | None) -> str | None:
    """The database password from `db_password_file` (None without one); ConfigError when it is unusable."""
    if path is None:
        return None
    try:
        password = read_secret(path, "database password")
    except SecretError as exc:
        raise ConfigError(str(exc)) from exc
    if not password:
        raise ConfigError(f"{path}: the database password file is empty")
    return password
