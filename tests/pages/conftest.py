"""Headless Chromium for the browser tests: Debian's /usr/bin/chromium (scripts/install-system-deps.sh installs it),
driven by Playwright. Playwright's own browser download cannot reach its servers from these machines and is never
used. Where the browser is missing the tests are skipped saying why; in CI, which installs it, that is a failure."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("MEGAHEAL_CHROMIUM", "/usr/bin/chromium")
# NOTE: these keep Chromium off the network (these machines have none): without them it dials Google's update,
# sync and safe-browsing hosts at start and logs each refusal.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-extensions"]
SHOTS: list[Path] = []


def _unavailable() -> str | None:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) and shutil.which(CHROMIUM) is None:
        return f"no Chromium at {CHROMIUM}: run scripts/install-system-deps.sh as root (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing: pip install -e '.[dev]'"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    why = _unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests cannot run in CI: {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go (the pytest tmp dir; the path is printed at the end of the run)."""
    path = tmp_path_factory.mktemp("screenshots")
    SHOTS.append(path)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for path in SHOTS:
        names = sorted(p.name for p in path.glob("*.png"))
        if names:
            terminalreporter.write_line(f"browser screenshots ({len(names)}): {path} ({', '.join(names)})")
