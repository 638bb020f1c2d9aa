"""Paths of the deployment configs and small readers shared by the tests of tests/deploy."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
ALERTS = PROMETHEUS_DIR / "rules" / "alerts.yml"
RECORDING = PROMETHEUS_DIR / "rules" / "recording.yml"
# promtool's unit tests of the rules: every *_test.yml (alerts_test.yml; ettr_test.yml, evaluated every 5 minutes).
ALERT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*_test.yml"))
ALERTMANAGER_DIR = DEPLOY / "alertmanager"
ALERTMANAGER = ALERTMANAGER_DIR / "alertmanager.yml"
COMPOSE = REPO / "docker-compose.yml"
OPERATIONS = REPO / "docs" / "operations.md"
# Every alert's runbook_url, up to its `#anchor`: under the external label runbook_base, else the repository path.
RUNBOOK_TEMPLATE = ("{{ with $externalLabels.runbook_base }}{{ . }}/operations.md"
                    "{{ else }}docs/operations.md{{ end }}")


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one silently,
    and so does docker-compose v1)."""


def _no_duplicates(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {sorted(map(str, dupes))}", node.start_mark)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=UniqueKeyLoader)


def unit_tests() -> list[dict[str, Any]]:
    """The test groups of every promtool unit test file (ALERT_TESTS), in file order."""
    return [group for path in ALERT_TESTS for group in load_yaml(path)["tests"]]


def rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]


def tool(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a command-line tool from Debian's packages (scripts/install-system-deps.sh installs them)."""
    exe = shutil.which(argv[0])
    assert exe, f"{argv[0]} is missing: run scripts/install-system-deps.sh"
    return subprocess.run([exe, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=60)


def markdown_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to dashes)."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors
