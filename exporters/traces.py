"""OpenTelemetry traces of training steps: one span per step per rank, a child span per phase.

Names follow OTel's guidance that a span name identifies a class of operation, not an instance: every step span is
`train.step` and every phase span is named by its phase (`forward_backward`, `dp_reduce`, ...); which step, job and
rank it was are attributes (`megaheal.step`, `megaheal.job`, `megaheal.rank`, `megaheal.attempt`, ...). NOTE: OTel's
semantic conventions have no training-step attributes (their gen_ai.* ones are about inference requests), hence
megaheal's own namespace.

Spans are made from step records after the fact, with the record's own times: the step ends at the
record's `time` and lasted `step_seconds`; phases are laid end to end in the order the trainer runs
them (durations exact; positions approximate where phases overlap, e.g. the dp reduce on CUDA).

Every rank's span of step N (on every node) lands in the same trace: the trace id is derived from
(job, step). A trace viewer then shows one step of the whole job, rank under rank: the seed's
dependency view, where the rank that holds everyone up stands out.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import HOST_NAME, SERVICE_NAME, SERVICE_VERSION, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from wire.telemetry import StepRecord, ordered_phases

TRACER_NAME = "megaheal.exporters"
STEP_SPAN = "train.step"
"""The name of every step span (its children are named by their phase)."""
DEFAULT_SERVICE_NAME = "megaheal-sidecar"
log = logging.getLogger(__name__)


def step_trace_id(job: str, step: int) -> int:
    """The 128-bit trace id shared by every rank's span of one step of one job (never 0, which is invalid)."""
    digest = hashlib.blake2b(f"{job}\0{step}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


class _StepIdGenerator(RandomIdGenerator):
    """Random span ids; the trace id of the next root span is chosen by the caller (per thread)."""

    def __init__(self) -> None:
        self._next = threading.local()

    def set_next_trace_id(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", None)
        self._next.trace_id = None
        return trace_id if trace_id is not None else super().generate_trace_id()


OTLP_HTTP_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def otlp_exporter(endpoint: str) -> ReportingExporter:
    """OTLP/HTTP exporter for a collector's base URL (e.g. http://127.0.0.1:4318) or its /v1/traces URL."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    # NOTE: the SDK's exporter logs each retry and each lost batch: with no collector (the compose stack without
    # one, a collector restarting) that is two lines a second. ReportingExporter says it once per outage instead.
    logging.getLogger(OTLP_HTTP_LOGGER).setLevel(logging.CRITICAL)
    return ReportingExporter(OTLPSpanExporter(endpoint=url, timeout=5), url)


class ReportingExporter(SpanExporter):
    """An exporter that counts the batches it could not deliver and logs once when delivery stops and once when it
    comes back, not once per batch."""

    def __init__(self, inner: SpanExporter, where: str) -> None:
        self.inner, self.where = inner, where
        self.failed_batches = 0
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                log.info("traces: %s takes spans again", self.where)
            self._failing = False
        else:
            self.failed_batches += 1
            if not self._failing:
                log.warning("traces: %s does not take spans; dropping them until it does "
                            "(megaheal_sidecar_trace_batches_failed_total counts the batches)", self.where)
            self._failing = True
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def sidecar_resource(node: str) -> Resource:
    """The sidecar's resource: megaheal's defaults (service.name megaheal-sidecar, service.version, host.name the
    sidecar's --node) under whatever OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES say.

    NOTE: `Resource.create(attributes)` lets the attributes given in code win over the environment (the spec's
    order for an application's own settings); ours are defaults, so the SDK's environment detector is merged once
    more on top."""
    defaults: dict[str, str] = {SERVICE_NAME: DEFAULT_SERVICE_NAME, HOST_NAME: node}
    try:
        defaults[SERVICE_VERSION] = importlib.metadata.version("megaheal")
    except importlib.metadata.PackageNotFoundError:
        pass  # run from a source tree that was never installed: no version to claim
    return Resource.create(defaults).merge(OTELResourceDetector().detect())


class StepTracer:
    """Turns step records into spans on its own TracerProvider (never the global one)."""

    def __init__(self, node: str, exporter: SpanExporter, batch: bool = True) -> None:
        self._ids = _StepIdGenerator()
        self.provider = TracerProvider(resource=sidecar_resource(node), id_generator=self._ids)
        # NOTE: the batch processor drops spans when its queue is full instead of blocking the receiver.
        processor = (BatchSpanProcessor(exporter, max_queue_size=8192, schedule_delay_millis=1000)
                     if batch else SimpleSpanProcessor(exporter))
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer(TRACER_NAME)
        self._node = node

    def record(self, message: StepRecord) -> None:
        rec = message.body
        end_ns = int(rec.time * 1e9)
        start_ns = end_ns - int(rec.step_seconds * 1e9)
        attributes: dict[str, str | int | float] = {
            "megaheal.job": message.job, "megaheal.rank": message.rank, "megaheal.step": rec.step,
            "megaheal.node": self._node, "process.pid": message.pid,
        }
        attributes.update({f"megaheal.{k}": v for k, v in (("loss", rec.loss), ("mfu", rec.mfu),
                                                            ("tokens_per_second", rec.tokens_per_second))
                           if v is not None})
        if rec.attempt is not None:
            attributes["megaheal.attempt"] = rec.attempt
        attributes.update({f"megaheal.mesh.{k}": v for k, v in (rec.mesh or {}).items()})
        self._ids.set_next_trace_id(step_trace_id(message.job, rec.step))
        span = self._tracer.start_span(STEP_SPAN, context=Context(), start_time=start_ns, attributes=attributes)
        parent = trace.set_span_in_context(span)
        # NOTE: a phase span repeats the step's identity: a trace query (TraceQL `{name="dp_reduce"}`) filters by
        # the span's own attributes, and a phase span alone must say which rank and step it timed.
        ident = {k: attributes[k] for k in ("megaheal.job", "megaheal.rank", "megaheal.step")}
        t = start_ns
        for phase in ordered_phases(rec.phases):
            duration = int(rec.phases[phase] * 1e9)
            child = self._tracer.start_span(phase, context=parent, start_time=t,
                                            attributes={"megaheal.phase": phase, **ident})
            child.end(end_time=t + duration)
            t += duration
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the exporter's timeout) and stop."""
        self.provider.shutdown()
