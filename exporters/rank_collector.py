"""Prometheus collectors of the sidecar: training metrics per rank, and the sidecar's own health.

Series per rank (labels job, node, rank; budget 22, so 12,288 ranks stay under 275k series):

    megaheal_step                                  1
    megaheal_step_seconds{phase}                   7  (phase="total" is the whole step; 6 phases at most)
    megaheal_rank_compute_seconds_sum, _count      2  (every step's forward/backward + optimizer)
    megaheal_loss, megaheal_grad_norm              2
    megaheal_tokens_per_second, megaheal_mfu       2
    megaheal_rank_last_seen_seconds                1
    megaheal_rank_up                               1
    megaheal_telemetry_dropped_total               1
    megaheal_dp_reduce_lag_seconds                 1
    megaheal_rank_info{local_rank,pid,pp,dp,tp}    1
    megaheal_rank_events_total{kind}               3  (checkpoint_saved, checkpoint_failed, exception)
                                                  --
                                                  22

Series per job on the node (labels job, node), over every step of every rank there: megaheal_step_duration_seconds,
a histogram (18 series: 16 buckets, sum and count), and megaheal_step_phase_seconds_total{phase} (8 phases at most):
26 series a node, 40k for 1,536 nodes.

Last value and running totals. megaheal_step_seconds is each rank's last step: a scrape every 15 s sees one step in
many, so averaging it over time is a sample, not a mean. It stays for what a last value is good for: what a rank
did just now, and the phase breakdown of the step it is stuck after. Exact means come from the totals, which count
every step record the sidecar receives: rate(X_sum[5m]) / rate(X_count[5m]) is the mean over those 5 minutes.
- The step duration is a per-node histogram, not a per-rank one: in a synchronous job every rank's step takes the
  same time (the fast ones wait in the collectives), so per-rank buckets would repeat one distribution 8 times a
  node for 18 series a rank. The histogram gives the job's quantiles (histogram_quantile over sum by (job, le)).
- What differs between ranks is their own work: the compute phases (COMPUTE_PHASES), summed per rank
  (megaheal_rank_compute_seconds, a summary without quantiles). Its mean names the straggler.
- Phases are summed per node (cheap), enough for an exact breakdown of where the job's step time goes.

The rank's peak RSS and its last event's details travel in heartbeats only (wire/telemetry.py, RankEntry).

Families are built afresh from a RankTable snapshot at every scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from exporters.ranks import COUNTED_EVENTS, RankState, RankTable, StepHistogram
from wire.telemetry import ordered_phases

SERIES_PER_RANK_BUDGET = 22
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
        ranks, histograms = self._table.metrics_snapshot()
        yield from self._step_families(ranks)
        yield from self._total_families(ranks, histograms)
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

    def _total_families(self, ranks: list[RankState], histograms: dict[str, StepHistogram]) -> Iterator[Metric]:
        duration = HistogramMetricFamily(
            "megaheal_step_duration_seconds", "Duration of every step of every rank of the job on this node (all "
            "step records received, not only the last).", labels=["job", "node"], unit="seconds")
        phases = CounterMetricFamily(
            "megaheal_step_phase_seconds", "Seconds spent in each phase over every step of every rank of the job on "
            "this node: divided by megaheal_step_duration_seconds_count, the mean per step.",
            labels=["job", "node", "phase"], unit="seconds")
        for job, histogram in histograms.items():
            duration.add_metric([job, self._node], histogram.cumulative(), histogram.sum)
            for phase in ordered_phases(histogram.phase_seconds):
                phases.add_metric([job, self._node, phase], histogram.phase_seconds[phase])
        compute = SummaryMetricFamily(
            "megaheal_rank_compute_seconds", "The rank's compute (forward/backward and optimizer phases) of every "
            "step it reported with phases: rate(_sum) / rate(_count) is its mean per step.", labels=LABELS,
            unit="seconds")
        for s in ranks:
            if s.totals.compute_steps:
                compute.add_metric(self._labels(s), s.totals.compute_steps, s.totals.compute_seconds)
        yield from (duration, phases, compute)

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
            "nvml_up": "GPU readings present (NVML or dcgm-exporter).",
        }
        for key, doc in gauges.items():
            gauge = GaugeMetricFamily(f"megaheal_sidecar_{key}", doc, labels=["node"])
            gauge.add_metric([self._node], stats.get(key, 0))
            yield gauge
