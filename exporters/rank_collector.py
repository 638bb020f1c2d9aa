"""Prometheus collectors of the sidecar: training metrics per rank, and the sidecar's own health.

Series per rank (labels job, node, rank; budget 20, so 12,288 ranks stay under 250k series):

    megaheal_step                                  1
    megaheal_step_seconds{phase}                   7  (phase="total" is the whole step; 6 phases at most)
    megaheal_loss, megaheal_grad_norm              2
    megaheal_tokens_per_second, megaheal_mfu       2
    megaheal_rank_last_seen_seconds                1
    megaheal_rank_up                               1
    megaheal_telemetry_dropped_total               1
    megaheal_dp_reduce_lag_seconds                 1
    megaheal_rank_info{local_rank,pid,pp,dp,tp}    1
    megaheal_rank_events_total{kind}               3  (checkpoint_saved, checkpoint_failed, exception)
                                                  --
                                                  20

The rank's peak RSS and its last event's details travel in heartbeats only (wire/telemetry.py, RankEntry).

Families are built afresh from a RankTable snapshot at every scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.ranks import COUNTED_EVENTS, RankState, RankTable
from wire.telemetry import ordered_phases

SERIES_PER_RANK_BUDGET = 20
MAX_PHASES = 6
LABELS = ["job", "node", "rank"]


def exported_phases(phases: dict[str, float]) -> list[str]:
    """The phases that get a series, in the trainer's order, MAX_PHASES at most (the sidecar keeps only the
    trainer's own phase names: wire/telemetry.py, known_phases_only)."""
    return ordered_phases(phases)[:MAX_PHASES]


class RankCollector(Collector):
    """Training metrics of every rank the sidecar has heard from."""

    def __init__(self, table: RankTable, node: str, registry: CollectorRegistry | None = None) -> None:
        self._table, self._node = table, node
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        ranks = self._table.snapshot()
        yield from self._step_families(ranks)
        yield from self._liveness_families(ranks)

    def _labels(self, s: RankState) -> list[str]:
        # NOTE: the node label is the sidecar's --node (what operators call the machine), not the rank's hostname.
        return [s.job, self._node, str(s.rank)]

    def _step_families(self, ranks: list[RankState]) -> Iterator[Metric]:
        step = GaugeMetricFamily("megaheal_step", "Last completed optimizer step of the rank.", labels=LABELS)
        seconds = GaugeMetricFamily(
            "megaheal_step_seconds", 'Duration of the last step (phase="total") and of each of its phases.',
            labels=[*LABELS, "phase"], unit="seconds")
        scalars = {
            "loss": GaugeMetricFamily("megaheal_loss", "Training loss of the last step (mean over the batch).",
                                      labels=LABELS),
            "grad_norm": GaugeMetricFamily("megaheal_grad_norm", "Global gradient L2 norm of the last step, "
                                           "before clipping.", labels=LABELS),
            "tokens_per_second": GaugeMetricFamily("megaheal_tokens_per_second", "Tokens per second of the whole "
                                                   "job over the last step, as seen by the rank.", labels=LABELS),
            "mfu": GaugeMetricFamily("megaheal_mfu", "Model FLOPs utilisation of the last step (0-1).",
                                     labels=LABELS),
        }
        lag = GaugeMetricFamily(
            "megaheal_dp_reduce_lag_seconds", "How much later the rank entered the data-parallel reduce of its last "
            "step than the earliest rank of the node at that step.", labels=LABELS)
        for s in ranks:
            rec = s.last_step
            if rec is None:
                continue
            labels = self._labels(s)
            step.add_metric(labels, rec.step)
            seconds.add_metric([*labels, "total"], rec.step_seconds)
            for phase in exported_phases(rec.phases):
                seconds.add_metric([*labels, phase], rec.phases[phase])
            for name, family in scalars.items():
                value = getattr(rec, name)
                if value is not None:  # what the rank's trainer does not report has no series
                    family.add_metric(labels, value)
            if s.reduce_lag_seconds is not None:
                lag.add_metric(labels, s.reduce_lag_seconds)
        yield from (step, seconds, *scalars.values(), lag)

    def _liveness_families(self, ranks: list[RankState]) -> Iterator[Metric]:
        seen = GaugeMetricFamily("megaheal_rank_last_seen_seconds", "Seconds since the sidecar last heard from "
                                 "the rank.", labels=LABELS)
        up = GaugeMetricFamily("megaheal_rank_up", "1 while the rank's process is alive (and not a zombie), else 0.",
                               labels=LABELS)
        dropped = CounterMetricFamily("megaheal_telemetry_dropped", "Records the rank's client could not send "
                                      "(sidecar absent or behind), as last reported by the rank.", labels=LABELS)
        info = GaugeMetricFamily("megaheal_rank_info", "Where the rank sits: its process, local rank and mesh "
                                 "coordinates (value 1).", labels=[*LABELS, "local_rank", "pid", "pp", "dp", "tp"])
        events = CounterMetricFamily("megaheal_rank_events", "Events the rank reported, by kind.",
                                     labels=[*LABELS, "kind"])
        for s in ranks:
            labels = self._labels(s)
            seen.add_metric(labels, s.age_seconds)
            up.add_metric(labels, 1.0 if s.alive else 0.0)
            dropped.add_metric(labels, s.dropped)
            coords = [str(s.mesh.get(d, "")) for d in ("pp", "dp", "tp")]
            info.add_metric([*labels, "" if s.local_rank is None else str(s.local_rank), str(s.pid), *coords], 1.0)
            for kind in COUNTED_EVENTS:
                events.add_metric([*labels, kind], s.events.get(kind, 0))
        yield from (seen, up, dropped, info, events)


class SidecarCollector(Collector):
    """The sidecar's own health: what it received, rejected and forwarded, and whether NVML is there."""

    def __init__(self, stats: Callable[[], dict[str, float]], node: str,
                 registry: CollectorRegistry | None = None) -> None:
        self._stats, self._node = stats, node
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        counters = {
            "received": "Datagrams received from ranks.",
            "malformed": "Datagrams rejected as not a record of a known schema version.",
            "rejected_senders": "Datagrams refused for their sender: another user, or a pid other than the one the "
                                "record claims (kernel credentials, SCM_CREDENTIALS).",
            "rejected_phases": "Phase names left out of step records because the trainer has no such phase.",
            "rejected_ranks": "Records refused because the sidecar already tracks its maximum number of ranks.",
            "forgotten_ranks": "Ranks dropped after going silent for the sidecar's forget_after_s.",
            "heartbeats_sent": "Heartbeat batches the healer accepted.",
            "heartbeat_failures": "Heartbeat posts that failed (healer down, slow or refusing).",
            "heartbeats_dropped": "Heartbeat batches dropped from the full retry buffer.",
            "trace_batches_failed": "Step-trace batches the OTLP collector did not take (down, unreachable, refusing).",
        }
        for key, doc in counters.items():
            family = CounterMetricFamily(f"megaheal_sidecar_{key}", doc, labels=["node"])
            family.add_metric([self._node], stats.get(key, 0))
            yield family
        gauges = {
            "ranks": "Ranks the sidecar currently tracks.",
            "heartbeats_buffered": "Heartbeat batches waiting to be sent to the healer.",
            "nvml_up": "1 when the NVML collector is serving GPU metrics, 0 when NVML is absent or failed to start.",
        }
        for key, doc in gauges.items():
            family = GaugeMetricFamily(f"megaheal_sidecar_{key}", doc, labels=["node"])
            family.add_metric([self._node], stats.get(key, 0))
            yield family
