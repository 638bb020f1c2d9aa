"""The composition root of a node agent: the agent (healer/agent/node.py) with what it holds of the node side, the
host's sidecar and the forwarder of its batches (exporters/). `megaheal agent` and a launcher that runs agents in its
own process both build one here, so the agent's package itself imports only the wire and the ground."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exporters.dcgm_scrape import DcgmScrape
from exporters.heartbeat import HeartbeatForwarder
from exporters.sidecar import AUTO, Sidecar
from ground.tls import TlsFiles
from healer.agent.node import NodeAgent
from wire.telemetry import HeartbeatBatch

AGENT_BUFFER_BATCHES = 2
"""Batches an agent keeps while the healer does not answer: each carries the whole of the current attempt, so the
newest says all, and a healer that comes back is sent that, not minutes of backlog."""


def node_agent(cfg: NodeAgent.Config, nvml: Any = AUTO, dcgm: DcgmScrape.Config | None = None) -> NodeAgent:
    """An agent for `cfg`, not started. `nvml`: the sidecar's GPU source (AUTO: NVML where it loads; None: none);
    `dcgm`: read the GPUs from this dcgm-exporter instead (NVML is then not opened)."""
    sidecar = Sidecar(Sidecar.Config(node=cfg.node, socket_path=cfg.socket_path, metrics_addr=cfg.metrics_addr,
                                     dcgm=dcgm),
                      nvml=nvml)

    tls = TlsFiles(cfg.tls_dir).client() if cfg.tls_dir is not None else None

    def forwarder(healer_url: str, build: Callable[[int, float], HeartbeatBatch]) -> HeartbeatForwarder:
        return HeartbeatForwarder(healer_url, build, cfg.heartbeat_interval_s, AGENT_BUFFER_BATCHES, token=cfg.token,
                                  relay_url=cfg.relay_url, tls=tls)

    return NodeAgent(cfg, sidecar, forwarder)
