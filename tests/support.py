"""Small helpers every test tier uses: a free loopback port, and polling with a deadline."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 0.1) -> Any:
    """Poll `probe` until it returns something truthy and return that; fail naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def service_ready(url: str, proc: subprocess.Popen[bytes], name: str, path: str = "/-/ready") -> bool:
    """Whether a service we started (Prometheus, Alertmanager: /-/ready; the healer: /readyz) answers `path`; fails
    at once if it exited."""
    if proc.poll() is not None:
        raise AssertionError(f"{name} exited with {proc.returncode}")
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
