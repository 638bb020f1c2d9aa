"""The explicit registry of checks a runbook step may call, and the interface a check implements.

A check is a class with a `name`, a nested typed `Config` (its parameters, validated when the
runbook is loaded, before anything runs) and `run(config, ctx) -> CheckResult`. The registry maps
names to dotted paths and imports a check only when it is first used, so loading and validating a
runbook does not import torch. Registering a name twice is an error, and so is an unknown name.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ground.typedconfig import ConfigError, from_mapping
from wire.verdict import CheckResult

# RFC 1123 host names: what a node name may be before it labels anything or reaches a check.
NODE_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


@dataclass(kw_only=True, slots=True)
class CheckContext:
    """What the runner tells every check at run time (never taken from an alert without validation)."""

    nodes: tuple[str, ...] = ()
    """Nodes under suspicion (`--nodes`); empty: the check's own default participants."""
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    """This machine's name, for labelling node-local measurements."""
    baselines_path: str | None = None
    """JSON file of stored baselines; None: compare against nothing."""
    calibrate: bool = False
    """Measuring baselines: checks measure but do not compare."""
    timeout_s: float = 60.0
    """The step's timeout; checks size inner timeouts (process groups, commands) to fit inside it."""

    def __post_init__(self) -> None:
        for node in self.nodes:
            if not isinstance(node, str) or not NODE_NAME.match(node):
                raise ValueError(f"nodes: {node!r} is not a valid host name (RFC 1123: letters, digits, '-', '.')")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"nodes: each node may be named once, got {list(self.nodes)}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def to_payload(self) -> dict[str, Any]:
        return {
            "nodes": list(self.nodes),
            "hostname": self.hostname,
            "baselines_path": self.baselines_path,
            "calibrate": self.calibrate,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> CheckContext:
        return cls(
            nodes=tuple(data["nodes"]),
            hostname=data["hostname"],
            baselines_path=data["baselines_path"],
            calibrate=bool(data["calibrate"]),
            timeout_s=float(data["timeout_s"]),
        )


class Check:
    """Base of every check. Subclasses set `name`, nest a `Config` dataclass and implement `run`.

    Dependencies a test wants to replace (an NVML module, torch.cuda, /proc) are constructor
    arguments with real defaults; the step worker constructs checks with no arguments.
    """

    name: ClassVar[str] = ""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """A check without parameters."""

    def validate(self, config: Any, ctx: CheckContext) -> None:
        """Checks that need the run's context (the nodes); raise ValueError. Runs before any step starts."""

    def run(self, config: Any, ctx: CheckContext) -> CheckResult:
        raise NotImplementedError


class CheckRegistry:
    """Check name -> dotted path "module:Class", imported on first use and cached."""

    def __init__(self, targets: Mapping[str, str] | None = None) -> None:
        self._targets: dict[str, str] = {}
        self._loaded: dict[str, type[Check]] = {}
        for name, target in (targets or {}).items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        if name in self._targets:
            raise ValueError(f"check {name!r} is already registered (as {self._targets[name]}); names must be unique")
        if not re.match(r"^[a-z][a-z0-9_]*$", name):
            raise ValueError(f"check name {name!r} must be lower_snake_case")
        if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", target):
            raise ValueError(f"check {name!r}: target {target!r} must be 'package.module:ClassName'")
        self._targets[name] = target

    def names(self) -> list[str]:
        return sorted(self._targets)

    def target(self, name: str) -> str:
        try:
            return self._targets[name]
        except KeyError:
            raise KeyError(f"unknown check {name!r}; registered: {', '.join(self.names())}") from None

    def resolve(self, name: str) -> type[Check]:
        if name not in self._loaded:
            self._loaded[name] = load_target(self.target(name))
        return self._loaded[name]

    def config(self, name: str, params: Mapping[str, Any], where: str) -> Any:
        """The check's typed Config from a step's `params`; every error names `where` and the key."""
        cls = self.resolve(name).Config
        return from_mapping(cls, params, where)


def load_target(target: str) -> type[Check]:
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Check)):
        raise TypeError(f"{target} is not a Check subclass")
    return cls


BUILTIN_CHECKS: dict[str, str] = {
    "collective_bandwidth": "runbooks.checks.collective:CollectiveBandwidthCheck",
    "loopback": "runbooks.checks.loopback:LoopbackCheck",
    "gpu_health": "runbooks.checks.gpu_health:GpuHealthCheck",
    "gpu_compute": "runbooks.checks.gpu_compute:GpuComputeCheck",
    "host": "runbooks.checks.host:HostCheck",
    "dcgm_diag": "runbooks.checks.dcgm_diag:DcgmDiagCheck",
}


def default_registry() -> CheckRegistry:
    """A fresh registry holding the built-in checks (fresh, so tests can add their own safely)."""
    return CheckRegistry(BUILTIN_CHECKS)


__all__ = ["BUILTIN_CHECKS", "Check", "CheckContext", "CheckRegistry", "ConfigError", "default_registry"]
