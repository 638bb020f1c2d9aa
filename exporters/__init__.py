"""Telemetry: the rank client, the node sidecar, the NVML collector, traces and the timeline.

Training ranks import only `exporters.client` (standard library only, so the trainer pays nothing
for Prometheus, OpenTelemetry or NVML). Everything else runs in the node's sidecar process.
"""

from exporters.client import NullRankClient, RankClient

__all__ = ["NullRankClient", "RankClient"]
