"""What megaheal's requests carry stays where they were sent: a redirect is an answer, not a place to send the
Authorization header on to; and a bearer token is recognised whatever case its scheme is written in."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exporters.heartbeat import urllib_post
from ground.httpclient import RequestFailed, request_json
from ground.secretfile import bearer_matches

pytestmark = pytest.mark.unit

TOKEN = "a-token-of-enough-characters"


@pytest.fixture
def servers() -> Iterator[tuple[str, list[str | None]]]:
    """A server that redirects every request to a second one, which records the Authorization headers it gets."""
    seen: list[str | None] = []

    class Target(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    target = ThreadingHTTPServer(("127.0.0.1", 0), Target)

    class Redirect(Target):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{target.server_port}/stolen")
            self.end_headers()

        do_POST = do_GET  # noqa: N815

    redirect = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for server in (target, redirect):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{redirect.server_port}/v1/heartbeats", seen
    for server in (target, redirect):
        server.shutdown()
        server.server_close()


def test_a_redirect_is_not_followed_with_the_token(servers: tuple[str, list[str | None]]) -> None:
    url, seen = servers
    with pytest.raises(RequestFailed, match="HTTP 302"):
        request_json("GET", url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert urllib_post(url, b"{}", {"Authorization": f"Bearer {TOKEN}"}, 5.0) == 302  # a sidecar's heartbeat
    assert seen == [], "the redirect's target was asked, with the token"


def test_a_bearer_token_is_recognised_in_any_case_of_its_scheme_and_nothing_else_passes() -> None:
    for header in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer {TOKEN} "):
        assert bearer_matches(header, TOKEN), header
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer{TOKEN}", "Bearer ", "Bearer é"):
        assert not bearer_matches(header, TOKEN), header
