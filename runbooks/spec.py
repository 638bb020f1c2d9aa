"""Runbook files: YAML -> typed, fully validated `Runbook` before any step runs.

    name: collectives-quick
    description: ...
    scope: host                          # host: on each suspect host; job: once across the job's hosts
    steps:
      - name: collectives
        check: collective_bandwidth      # a registered check
        timeout: 60s                     # the step is stopped and reported as error past this
        parallel: false                  # consecutive parallel steps run at the same time
        params: {sizes: [65536]}         # the check's typed Config

Unknown keys anywhere (runbook, step, or a check's params) are errors naming the file and key.
Shipped runbooks live in runbooks/library/<name>.yaml and are found by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ground.typedconfig import ConfigError, Override, from_mapping, load_yaml
from runbooks.registry import CheckRegistry, default_registry

LIBRARY = Path(__file__).resolve().parent / "library"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
SCOPES = ("host", "job")
MAX_STEP_TIMEOUT = timedelta(minutes=30)


@dataclass(kw_only=True, slots=True)
class Step:
    """One named step: a registered check, its parameters and its timeout."""

    name: str
    """Unique within the runbook; `--set NAME.PARAM=VALUE` addresses its params."""
    check: str
    """The registered check this step calls."""
    timeout: timedelta
    """Past this the step's process group is stopped and the step reported as error."""
    parallel: bool = False
    """Run at the same time as the neighbouring steps that also set parallel."""
    # NOTE: typed Any because typedconfig only types dataclasses, lists and scalars; the loader
    # validates params against the check's own Config, which is where their types live.
    params: Any = field(default_factory=dict)
    """The check's parameters (a mapping), validated into `config` when the runbook is loaded."""
    config: Any = field(default=None, init=False, repr=False)
    """The check's typed Config, built from params by the loader."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"step name {self.name!r} must be lower-case letters, digits, '-' or '_'")
        if not isinstance(self.params, dict):
            raise ValueError(f"params of step {self.name!r} must be a mapping, got {self.params!r}")
        if not timedelta(0) < self.timeout <= MAX_STEP_TIMEOUT:
            raise ValueError(f"timeout of step {self.name!r} must be in (0, 30m], got {self.timeout}")


@dataclass(kw_only=True, slots=True)
class Runbook:
    """A named list of steps run in order (or in parallel batches) into one verdict."""

    name: str
    """The runbook's name, as `megaheal diagnose NAME` takes it."""
    description: str = ""
    """What it is for and when the healer runs it."""
    scope: str = "host"
    """Where the healer runs it for an incident. host: on each suspect host, through that host's agent (node-health:
    the host's own GPUs, disks, clock). job: once, from the healer's machine, across the job's current hosts, beside
    the training that goes on (network-triage: its pairwise step spans hosts, so no one host can run it)."""
    steps: list[Step] = field(default_factory=list)
    """The steps, in order."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must be lower-case letters, digits, '-' or '_'")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {self.scope!r}")
        if not self.steps:
            raise ValueError("steps must list at least one step")
        names = [s.name for s in self.steps]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"step names must be unique, repeated: {', '.join(duplicates)}")

    def batches(self) -> list[list[Step]]:
        """Steps grouped as they run: each run of consecutive parallel steps together, others alone."""
        out: list[list[Step]] = []
        for step in self.steps:
            if step.parallel and out and out[-1][0].parallel:
                out[-1].append(step)
            else:
                out.append([step])
        return out


def shipped_runbooks() -> list[str]:
    return sorted(p.stem for p in LIBRARY.glob("*.yaml"))


def find_runbook(name_or_path: str) -> Path:
    """A shipped runbook by name, or a runbook file by path."""
    if _NAME.match(name_or_path) and (LIBRARY / f"{name_or_path}.yaml").is_file():
        return LIBRARY / f"{name_or_path}.yaml"
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise ConfigError(
        f"no runbook {name_or_path!r}: shipped runbooks are {', '.join(shipped_runbooks())}, "
        "or give the path of a .yaml file"
    )


def load_runbook(
    name_or_path: str, overrides: list[str] | None = None, registry: CheckRegistry | None = None
) -> Runbook:
    """Load, validate and type a runbook; `overrides` are "STEP.PARAM=VALUE" strings."""
    registry = registry or default_registry()
    path = find_runbook(name_or_path)
    data = load_yaml(path)
    _apply_overrides(data, overrides or [], path)
    where = str(path)
    runbook = from_mapping(Runbook, data, where)
    for i, step in enumerate(runbook.steps):
        step_where = f"{where}: steps[{i}] ({step.name})"
        try:
            registry.target(step.check)
        except KeyError as exc:
            raise ConfigError(f"{step_where}.check: {exc.args[0]}") from None
        step.config = registry.config(step.check, step.params, f"{step_where}.params")
    return runbook


def _apply_overrides(data: dict[str, Any], overrides: list[str], path: Path) -> None:
    """Set `params.PARAM` of the step named STEP for each "STEP.PARAM=VALUE" (VALUE typed by the check's Config
    field: text for a string, YAML for the rest; see ground.typedconfig.Override)."""
    steps = data.get("steps") if isinstance(data.get("steps"), list) else []
    by_name = {s.get("name"): s for s in steps if isinstance(s, dict)}
    for item in overrides:
        key, sep, raw = item.partition("=")
        step_name, dot, param = key.partition(".")
        if not sep or not dot or not param:
            raise ConfigError(f"--set {item!r}: expected STEP.PARAM=VALUE, e.g. host.checkpoint_dir=/ckpt")
        if step_name not in by_name:
            raise ConfigError(
                f"--set {item!r}: {path} has no step {step_name!r}; steps: " f"{', '.join(str(n) for n in by_name)}"
            )
        value = Override(item, raw)
        params = by_name[step_name].setdefault("params", {})
        if not isinstance(params, dict):
            raise ConfigError(f"{path}: steps ({step_name}).params must be a mapping")
        params[param] = value
