"""Outbound HTTP (Prometheus queries, Alertmanager, webhooks) on the standard library, with a timeout always.

Failures become RequestFailed: permanent for a 4xx other than 408/429 (retrying cannot help), transient
for everything else (5xx, timeouts, refused connections). A redirect is never followed (`open_url`): urllib would
send the request's Authorization header on to wherever the answer points.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ground.tls import PeerTls, https

MAX_RESPONSE = 16 << 20


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Answers a 3xx as what it is (an HTTPError), instead of asking the new place with the same headers."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        return None


open_url = urllib.request.build_opener(_NoRedirects).open
"""urllib.request.urlopen without redirects: for every request megaheal sends, a token in it or not."""


class RequestFailed(Exception):
    """A request that got no usable answer; `permanent`: asking again cannot help (a 4xx other than 408/429)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


def request_json(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
                 timeout_s: float = 5.0, tls: PeerTls | None = None) -> Any:
    """Send `body` as JSON (if given) and return the decoded JSON answer (None for an empty one). With `tls`, over
    mutual TLS to the peer it names (ground/tls.py)."""
    data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
    all_headers = {"Accept": "application/json", **(headers or {})}
    if data is not None:
        all_headers["Content-Type"] = "application/json"
    if tls is not None:
        return _tls_json(method, url, data, all_headers, timeout_s, tls)
    req = urllib.request.Request(url, data=data, headers=all_headers, method=method)
    try:
        with open_url(req, timeout=timeout_s) as response:  # noqa: S310 - URL from the operator
            raw = response.read(MAX_RESPONSE)
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode(errors="replace").strip()
        permanent = 400 <= exc.code < 500 and exc.code not in (408, 429)
        raise RequestFailed(f"{method} {url}: HTTP {exc.code}: {detail[:500]}", permanent=permanent) from exc
    except (OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RequestFailed(f"{method} {url}: {reason}") from exc
    return _decoded(method, url, raw)


def _tls_json(method: str, url: str, data: bytes | None, headers: dict[str, str], timeout_s: float,
              tls: PeerTls) -> Any:
    try:
        status, raw = https(method, url, data, headers, timeout_s, tls, MAX_RESPONSE)
    except (OSError, TimeoutError) as exc:
        # NOTE: a peer that is not who was asked for (PeerRefused) is as good as no answer: the host is not reached.
        raise RequestFailed(f"{method} {url}: {exc}") from exc
    if status >= 300:  # a 3xx is an answer as it is: never followed
        detail = raw[:2000].decode(errors="replace").strip()
        permanent = 400 <= status < 500 and status not in (408, 429)
        raise RequestFailed(f"{method} {url}: HTTP {status}: {detail[:500]}", permanent=permanent)
    return _decoded(method, url, raw)


def _decoded(method: str, url: str, raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestFailed(f"{method} {url}: the answer is not JSON", permanent=True) from exc
