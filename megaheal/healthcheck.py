"""`megaheal-healthcheck URL`: exit 0 when URL answers 2xx within the timeout, 1 otherwise (a container health check).

A console script of its own, not `python -c "..."`: a check given as one argument with spaces in it was split at the
spaces by podman's Docker-compatible API (podman 4.3, the compose files' health checks created through it), and
Python then saw `-c import`. Only the standard library: it runs every few seconds and must start fast."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].startswith(("http://", "https://")):
        print("usage: megaheal-healthcheck http://HOST:PORT/PATH", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(args[0], timeout=TIMEOUT_S) as response:
            status = response.status
    except (urllib.error.URLError, OSError) as e:
        print(f"megaheal-healthcheck: {args[0]}: {e}", file=sys.stderr)
        return 1
    return 0 if 200 <= status < 300 else 1


if __name__ == "__main__":
    sys.exit(main())
