"""megaheal as a user installs it: the wheel built from this checkout, installed into a fresh virtual environment that
cannot see the checkout, answers `megaheal --version` and heals a `megaheal run` on nothing but the defaults it ships
(the demo job's config, the default rules, the healer's migrations); and the node install (sidecar, relay, agent,
rank API, the CLI itself) imports nothing that the core dependencies do not bring (no torch, no database stack).

Where the fresh environment's third-party packages come from: a `.pth` file naming this test's own environment's
site-packages. NOTE: not an install of the dependencies: torch alone is close to a gigabyte and these machines reach
no index but local ones; the wheel, its package data and its console script are what is under test. A plain path in a
`.pth` file only extends sys.path: the `.pth` files inside that folder are not run, so the editable install of the
checkout there (its finder) stays off, and the fresh environment's own site-packages comes first on sys.path, so
every megaheal package is the wheel's (the test checks where each one is imported from). The wheel is built from a
copy of only what pyproject.toml names, with this environment's setuptools (no download), so the checkout is left
untouched and a file missing from the package data fails here, not on a user's machine.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tomllib
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from healer.incidents.db import head_revision
from tests.conftest import REPO, job_env
from wire.run_paths import RunPaths

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
NODE_MODULES = ("megaheal.cli", "megaheal.rank", "exporters.sidecar", "exporters.receiver", "exporters.relay",
                "exporters.relay_service", "healer.agent.node", "healer.agent.api", "healer.compose_agent")
"""What a node runs: `megaheal sidecar`, `megaheal relay`, `megaheal agent`, and the rank API a training script
imports (beside the torch it brings itself)."""

# Run by the Python under test: imports NODE_MODULES (argv[1]) and prints the top-level modules that brought in,
# less the standard library's and the modules that are not imported from anywhere (a C extension's cython_runtime);
# what its site start-up loaded before does not count.
_IMPORTED = """
import importlib, sys
before = set(sys.modules)
for module in sys.argv[1].split(","):
    importlib.import_module(module)
tops = {m.partition(".")[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)
print("\\n".join(sorted(m for m in tops if getattr(sys.modules.get(m), "__spec__", None) is not None)))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_closure() -> set[str]:
    """The distributions a plain `pip install megaheal` brings: pyproject's dependencies and theirs, all the way."""
    seen: set[str] = set()
    todo = [Requirement(req) for req in PYPROJECT["project"]["dependencies"]]
    while todo:
        req = todo.pop()
        if _normal(req.name) in seen:
            continue
        seen.add(_normal(req.name))
        for line in requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras or {""}):
                todo.append(sub)
    return seen


def node_imports_outside_the_core(python: Path | str, cwd: Path, env: dict[str, str]) -> list[str]:
    """`module (distribution)` for each module NODE_MODULES import that no core dependency provides."""
    done = subprocess.run([str(python), "-c", _IMPORTED, ",".join(NODE_MODULES)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first_party = {pattern.rstrip("*") for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    owners, core = packages_distributions(), core_closure()
    return [f"{module} ({', '.join(owners.get(module, ['no distribution']))})" for module in done.stdout.split()
            if module not in first_party and not module.startswith("_")
            and not any(_normal(owner) in core for owner in owners.get(module, []))]


@pytest.mark.unit
def test_the_node_install_imports_nothing_outside_the_core_dependencies() -> None:
    assert node_imports_outside_the_core(sys.executable, REPO, job_env()) == []


# ---- the wheel in a fresh environment --------------------------------------------------------------------------

def build_wheel(out: Path) -> Path:
    """The wheel of a copy of what pyproject.toml names: its packages, the configs/ they link to, and its files."""
    src = out / "src"
    src.mkdir(parents=True)
    tops = [pattern.rstrip("*") for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in (*tops, "configs"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"], *PYPROJECT["project"]["license-files"]):
        shutil.copy2(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "--wheel-dir", str(out / "dist"), str(src)], check=True, timeout=180)
    (wheel,) = (out / "dist").glob("megaheal-*.whl")
    return wheel


def fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtual environment with `wheel` installed, its dependencies seen through a .pth file (see above)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = dict.fromkeys((sysconfig.get_path("purelib"), sysconfig.get_path("platlib")))
    (site / "dependencies-of-the-test.pth").write_text("".join(f"{path}\n" for path in ours))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=180)
    return python


def user_env(venv: Path) -> dict[str, str]:
    """A user's shell with the fresh environment active: nothing points at the checkout."""
    env = {k: v for k, v in job_env().items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_the_wheel_installed_alone_runs_a_healed_job_on_its_shipped_defaults(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "build")
    venv = tmp_path / "venv"
    python = fresh_venv(venv, wheel)
    home = tmp_path / "home"  # where the user runs megaheal: an empty folder, no configs/ in sight
    home.mkdir()
    env = user_env(venv)

    where = subprocess.run([str(python), "-c", "import importlib; print('\\n'.join(importlib.import_module(m).__file__ "
                            "for m in ('ground', 'wire', 'megaheal', 'train', 'healer', 'migrations', 'runbooks')))"],
                           cwd=home, env=env, check=True, capture_output=True, text=True).stdout.split()
    site = venv.resolve()
    assert all(Path(f).resolve().is_relative_to(site) for f in where), f"imported from outside the wheel: {where}"

    version = subprocess.run([str(venv / "bin" / "megaheal"), "--version"], cwd=home, env=env, capture_output=True,
                             text=True, timeout=60)
    assert (version.returncode, version.stdout.strip()) == (0, f"megaheal {PYPROJECT['project']['version']}")

    # NOTE: 3 of the record's 54 days: the shipped config is what is under test here (the whole record took 70-90 s
    # of this test; tests/sim runs the simulator itself).
    simulated = subprocess.run([str(venv / "bin" / "megaheal"), "simulate", "--set", "days=3", "--out",
                                str(tmp_path / "sim")], cwd=home, env=env, capture_output=True, text=True, timeout=120)
    assert simulated.returncode == 0, simulated.stderr  # on the shipped cluster config (configs/sim/)
    assert (tmp_path / "sim" / "simulation.json").is_file()

    assert node_imports_outside_the_core(python, home, env) == []

    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        code = subprocess.run([str(venv / "bin" / "megaheal"), "run", "--run-dir", str(run_dir), "--set", "steps=4",
                               "--metrics-port", "-1", "--timeout-min", "5"], cwd=home, env=env | {"COLUMNS": "160"},
                              stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=360).returncode
    assert code == 0, log.read_text()[-4000:]
    paths = RunPaths(run_dir)
    assert paths.report.is_file(), log.read_text()[-4000:]
    # The shipped demo config, copied into the run for its hosts (it lies outside the user's folder), and the
    # healer's schema made by the wheel's migrations.
    assert (paths.launcher / "config.yaml").read_text() == (REPO / "configs" / "demo.yaml").read_text()
    with sqlite3.connect(paths.database) as db:
        (migrated,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
    assert migrated == head_revision()
