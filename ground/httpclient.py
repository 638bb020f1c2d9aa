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
                 timeout_s: float = 5.0) -> Any:
    """Send `body` as JSON (if given) and return the decoded JSON answer (None for an empty one)."""
    data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
    all_headers = {"Accept": "application/json", **(headers or {})}
    if data is not None:
        all_headers["Content-Type"] = "application/json"
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
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestFailed(f"{method} {url}: the answer is not JSON", permanent=True) from exc
