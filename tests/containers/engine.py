"""podman for the container tier: the engine with the project's settings, its Docker-compatible API for compose v1,
and the health-check timer that systemd would otherwise be.

podman runs a container's health check only when a systemd timer calls `podman healthcheck run`; these hosts have no
systemd, so every check would stay "starting" and `depends_on: {condition: service_healthy}` would wait forever.
HealthTimer is that timer: each check runs every `interval` from its container's start, as Docker runs it, and the
result (healthy, unhealthy after `retries` failures past `start_period`) is podman's own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import stop_process, wait_for

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO / "deploy" / "podman" / "containers.conf"
PROJECT_LABEL = "com.docker.compose.project"


def env() -> dict[str, str]:
    return dict(os.environ) | {"CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], env=env(), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done


def podman_json(*args: str) -> Any:
    return json.loads(podman(*args).stdout or "[]")


@contextmanager
def api_socket(path: Path) -> Iterator[str]:
    """podman's Docker-compatible API on a unix socket for as long as the block runs; yields its DOCKER_HOST."""
    log = (path.parent / "podman-service.log").open("w")
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{path}"], env=env(),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("podman's API socket", lambda: path.exists() or proc.poll() is not None, timeout_s=20)
        if proc.poll() is not None:
            raise AssertionError(f"podman system service exited {proc.returncode}: see {log.name}")
        yield f"unix://{path}"
    finally:
        stop_process(proc)
        log.close()


@dataclass
class _Check:
    interval_s: float
    next_at: float


class HealthTimer:
    """Runs the health check of every container of one compose project on its own interval, in a thread."""

    POLL_S = 0.5

    def __init__(self, project: str) -> None:
        self.project = project
        self._checks: dict[str, _Check] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"health-timer-{project}", daemon=True)

    def __enter__(self) -> HealthTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                self._tick()
            except (AssertionError, subprocess.TimeoutExpired, json.JSONDecodeError):
                continue  # a container removed between listing and checking: the next tick sees the new set

    def _tick(self) -> None:
        running = podman_json("ps", "--filter", f"label={PROJECT_LABEL}={self.project}", "--format", "json")
        now = time.time()
        for c in running:
            key = f"{c['Id']}@{c['StartedAt']}"  # a container restarted in place starts its checks over
            if key not in self._checks:
                (info,) = podman_json("inspect", "--type", "container", c["Id"])
                health = info["Config"].get("Healthcheck")
                interval_s = ((health or {}).get("Interval") or 30_000_000_000) / 1e9
                # Docker runs the first check one interval after the start (start_period only forgives failures).
                self._checks[key] = _Check(interval_s if health else 0.0, float(c["StartedAt"]) + interval_s)
            check = self._checks[key]
            if check.interval_s and now >= check.next_at:
                check.next_at = now + check.interval_s
                podman("healthcheck", "run", c["Id"], timeout=check.interval_s + 30, check=False)


CGROUP_ROOT = Path("/sys/fs/cgroup")


def remove_podman_cgroups() -> list[str]:
    """Remove the cgroups podman and its builds leave with the cgroupfs manager (libpod_parent, buildah-*), in every
    hierarchy, deepest first; a frozen one is thawed first. One that still holds a process stays (rmdir refuses a
    busy cgroup). Returns the ones that stayed."""
    left = []
    tops = [d for d in CGROUP_ROOT.glob("*/*") if d.is_dir() and (d.name == "libpod_parent" or d.name.startswith("buildah-"))]
    tops += [d for d in CGROUP_ROOT.glob("*") if d.is_dir() and (d.name == "libpod_parent" or d.name.startswith("buildah-"))]
    for top in tops:
        for d in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            state = d / "freezer.state"
            try:
                if state.exists() and state.read_text().strip() != "THAWED":
                    state.write_text("THAWED")
                d.rmdir()
            except OSError:
                left.append(str(d))
    return left


def skip_reason() -> str | None:
    """Why the tier cannot run on this machine, or None. As root every tool must be there (make test installs them):
    a missing one fails the tier rather than skipping it."""
    if os.geteuid() != 0:
        return "the container tier needs root (debootstrap, podman with runc and cgroupfs)"
    return None


def require_tools() -> None:
    missing = [t for t in ("podman", "debootstrap", "docker-compose") if not shutil.which(t)]
    assert not missing, f"{', '.join(missing)} not installed: scripts/install-system-deps.sh installs them"
