"""Upload the generated dashboards to a Grafana through its HTTP API (grafana-client, the optional extra
`megaheal[grafana]`, imported only here: it brings urllib3-future, kept out of the core install).

    megaheal dashboards push --url https://grafana.example.com [--token-file FILE | $GRAFANA_TOKEN]

Dashboards go into one folder (created when missing) and replace the versions there (overwrite): the
JSON in dashboards/ is the source of truth, as with file provisioning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class PushError(Exception):
    """The push cannot go on: missing extra, bad settings, or Grafana refused."""


@dataclass(kw_only=True, slots=True)
class PushConfig:
    url: str
    """Base URL of Grafana, e.g. https://grafana.example.com."""
    token: str
    """Service-account token (Editor on the folder). Never logged."""
    folder_uid: str = "megaheal"
    """Folder the dashboards go into; created when missing."""
    folder_title: str = "megaheal"
    """Title of the folder when it is created."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"url must be an http(s) URL, got {self.url!r}")
        if not self.token.strip():
            raise ValueError("token is empty: give --token-file, or set GRAFANA_TOKEN")
        if not self.folder_uid or len(self.folder_uid) > 40:
            raise ValueError(f"folder_uid must be 1-40 characters, got {self.folder_uid!r}")


def connect(cfg: PushConfig) -> Any:
    try:
        from grafana_client import GrafanaApi
    except ImportError as exc:
        raise PushError("pushing needs the optional extra: pip install 'megaheal[grafana]'") from exc
    return GrafanaApi.from_url(cfg.url, credential=cfg.token)


class _NeverRaised(Exception):
    pass


def _client_error() -> type[BaseException]:
    """grafana-client's error for refused requests (an exception nothing raises when the extra is absent)."""
    try:
        from grafana_client.client import GrafanaException
    except ImportError:
        return _NeverRaised
    return GrafanaException  # type: ignore[no-any-return]


def ensure_folder(api: Any, cfg: PushConfig) -> bool:
    """Create the folder unless Grafana has it; True when it was created."""
    if any(folder.get("uid") == cfg.folder_uid for folder in api.folder.get_all_folders()):
        return False
    api.folder.create_folder(cfg.folder_title, uid=cfg.folder_uid)
    return True


def push(cfg: PushConfig, boards: dict[str, dict[str, Any]], api: Any = None) -> list[str]:
    """Upload `boards` (name -> dashboard JSON); returns the URLs Grafana gives them."""
    api = api if api is not None else connect(cfg)
    try:
        ensure_folder(api, cfg)
        urls = []
        for name, board in boards.items():
            # NOTE: no numeric id: Grafana matches on uid, and an id from another instance would be refused.
            body = {k: v for k, v in board.items() if k != "id"}
            answer = api.dashboard.update_dashboard({"dashboard": body, "folderUid": cfg.folder_uid,
                                                     "overwrite": True, "message": f"megaheal dashboards push ({name})"})
            urls.append(cfg.url.rstrip("/") + str(answer.get("url", f"/d/{body['uid']}")))
        return urls
    except (_client_error(), OSError) as exc:
        raise PushError(f"Grafana at {cfg.url} refused the push: {exc}") from exc
