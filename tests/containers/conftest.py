"""The container tier's fixtures: the images (built once per session by scripts/build-images.sh), the stack of
docker-compose.yml (once per module), and a small training job on the host that writes to the sidecar's socket."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, job_env, kill_job
from tests.containers.engine import (REPO, HealthTimer, api_socket, env, remove_podman_cgroups, require_tools,
                                     skip_reason)
from tests.containers.stack import RANK_UID, SERVICES, Stack
from tests.support import wait_for

BUILD_TIMEOUT_S = 900
RANKS = 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = skip_reason()
    for item in items:
        if "tests/containers/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.containers)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def images() -> Iterator[None]:
    """Build every image the stack runs; afterwards remove the cgroups podman and its builds left behind."""
    require_tools()
    done = subprocess.run([str(REPO / "scripts" / "build-images.sh")], cwd=REPO, capture_output=True, text=True,
                          env=env() | {"PIP": str(Path(sys.executable).parent / "pip")}, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"build-images.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    try:
        yield
    finally:
        left = remove_podman_cgroups()
        if left:
            warnings.warn(f"podman cgroups still hold processes: {', '.join(left)}", stacklevel=1)


@pytest.fixture(scope="module")
def stack(images: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    project = f"mhtest{os.getpid()}"
    with api_socket(tmp_path_factory.mktemp("podman") / "api.sock") as docker_host:
        # The services' logs land in a directory pytest keeps (its last three runs), for a post-mortem.
        st = Stack.prepare(project, docker_host, log_dir=tmp_path_factory.mktemp("container-logs"))
        try:
            with HealthTimer(project):
                st.compose("up", "-d", *SERVICES, timeout=420)
                # compose waits only for what other started services depend on (postgres, the healer); the sidecar,
                # Prometheus and Alertmanager have their first check one interval after their start.
                try:
                    wait_for("every service healthy",
                             lambda: sorted(st.health().values()) == ["healthy"] * len(SERVICES), timeout_s=120)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}: {st.health()}\n{st.logs()}") from None
                st.scrape_sidecar()
                yield st
        finally:
            if st.containers():  # not yet taken down by the last test
                st.save_logs()
            st.compose("down", "-v", "--remove-orphans", timeout=180, check=False)
            shutil.rmtree(st.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def training(stack: Stack) -> Iterator[subprocess.Popen[bytes]]:
    """A 2-rank job on the host, as the sidecar's uid, its records to the sidecar's socket; runs until killed."""
    run_dir = stack.dir / "job"
    run_dir.mkdir()
    os.chown(run_dir, RANK_UID, RANK_UID)
    log = (stack.dir / "job.log").open("wb")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS), "-m", "train",
         "--config", str(CONFIGS / "tiny-dp4.yaml"), "--run-dir", str(run_dir / "run"),
         "--set", f"parallel.dp={RANKS}", "--set", "global_batch=4", "--set", "steps=100000"],
        cwd=REPO, env=job_env() | {"MEGAHEAL_SIDECAR_SOCKET": str(stack.socket_dir / "sidecar.sock"),
                                   "HOME": str(run_dir)},
        user=RANK_UID, group=RANK_UID, extra_groups=[], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            kill_job(job)
        log.close()
