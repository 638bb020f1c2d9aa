"""Detector names -> classes, imported on first use (so a rule file can be checked without loading every
detector's dependencies). An unknown name is an error that lists the known ones; registering a name twice
is an error too.
"""

from __future__ import annotations

import importlib
import threading

from healer.detect.base import Detector

_BUILTIN: dict[str, str] = {
    "heartbeat_stale": "healer.detect.heartbeat_stale:HeartbeatStale",
    "crash": "healer.detect.crash:Crash",
    "hang": "healer.detect.hang:Hang",
    "straggler": "healer.detect.straggler:Straggler",
    "nonfinite": "healer.detect.nonfinite:NonFinite",
    "loss_spike": "healer.detect.loss_spike:LossSpike",
    "gpu_fault": "healer.detect.gpu_fault:GpuFault",
    "collective_slowdown": "healer.detect.collective_slowdown:CollectiveSlowdown",
    "job_slowdown": "healer.detect.job_slowdown:JobSlowdown",
    "host_lost": "healer.detect.host_lost:HostLost",
    "healer_blind": "healer.detect.blind:HealerBlind",
    "sdc": "healer.detect.sdc:Sdc",
    "rerun": "healer.detect.sdc:RerunNotice",
}


class DetectorRegistry:
    def __init__(self, paths: dict[str, str] | None = None) -> None:
        self._paths = dict(_BUILTIN if paths is None else paths)
        self._loaded: dict[str, type[Detector]] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self._paths)

    def register(self, name: str, path: str) -> None:
        """Add `name` -> "module:Class"; raises ValueError when the name is taken."""
        if name in self._paths:
            raise ValueError(f"detector {name!r} is already registered ({self._paths[name]})")
        self._paths[name] = path

    def resolve(self, name: str) -> type[Detector]:
        """The class of detector `name`; KeyError naming the known detectors when there is none."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name not in self._paths:
                raise KeyError(f"unknown detector {name!r}; known detectors: {', '.join(self.names())}")
            module_name, _, attr = self._paths[name].partition(":")
            cls = getattr(importlib.import_module(module_name), attr)
            if not (isinstance(cls, type) and issubclass(cls, Detector)):
                raise TypeError(f"{self._paths[name]} is not a Detector")
            self._loaded[name] = cls
            return cls


_default = DetectorRegistry()


def default_registry() -> DetectorRegistry:
    return _default
