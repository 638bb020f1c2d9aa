"""The import layering (tests/layering.py): the repository keeps it, and the check catches a forbidden import."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.layering import PACKAGES, violations

pytestmark = pytest.mark.unit


def test_no_package_imports_what_its_layer_forbids() -> None:
    found = violations(REPO)
    assert not found, "\n".join(found)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for top in PACKAGES:
        (root / top).mkdir()
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f'"""A module."""\n\nimport os\n{text}')
    return root


@pytest.mark.parametrize(("module", "text", "line", "names"), [
    ("ground/names.py", "from healer.incidents import store\n", 4, "ground.names imports healer.incidents.store"),
    ("wire/orders.py", "import train.config\n", 4, "wire.orders imports train.config"),
    ("healer/agent/node.py", "from healer.launchers.coordinator import Coordinator\n", 4,
     "healer.agent.node imports healer.launchers.coordinator.Coordinator"),
    ("healer/engine/engine.py", "\n\ndef tick() -> None:\n    from healer.runner import loop\n", 7,
     "healer.engine.engine imports healer.runner.loop"),
    ("healer/decide/policy.py", "from ..launchers import coordinator\n", 4,
     "healer.decide.policy imports healer.launchers.coordinator"),
    ("healer/detect/crash.py", "from healer.engine import respond\n", 4, "healer.detect.crash imports healer.engine.respond"),
    ("exporters/sidecar.py", "from healer import agent\n", 4, "exporters.sidecar imports healer.agent"),
    ("healer/agent/node.py", "from exporters.sidecar import Sidecar\n", 4,
     "healer.agent.node imports exporters.sidecar.Sidecar"),
    ("healer/runner/loop.py", "import megaheal.cli\n", 4, "healer.runner.loop imports megaheal.cli"),
])
def test_a_forbidden_import_is_named_with_its_line_wherever_it_is(tmp_path: Path, module: str, text: str,
                                                                  line: int, names: str) -> None:
    (found,) = violations(_tree(tmp_path, {module: text}))
    assert found.startswith(f"{module}:{line}: {names} ("), found


def test_what_a_layer_may_import_is_not_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "healer/agent/node.py": "from ground import procfs\nfrom wire import orders\nfrom . import host\n",
        "healer/engine/engine.py": "from healer.incidents import store\nfrom ..detect import crash\nimport numpy\n",
        "wire/orders.py": "from ground.names import check_name\n",
        "megaheal/cli.py": "from healer.runner import loop\n",
    })
    assert violations(root) == []
