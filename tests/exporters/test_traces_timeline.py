"""Step spans (captured with the SDK's InMemorySpanExporter) and the Chrome/Perfetto timeline of a run."""

from __future__ import annotations

import http.server
import importlib.metadata
import json
import logging
import threading

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from typer.testing import CliRunner

from exporters.timeline import build_trace, read_rank_files
from exporters.traces import OTLP_HTTP_LOGGER, STEP_SPAN, StepTracer, otlp_exporter, step_trace_id
from megaheal.cli import app
from tests.exporters.helpers import PHASES, step_record
from wire.telemetry import PHASE_ORDER, build_record, decode, encode

pytestmark = pytest.mark.unit
# The phases of a step of megaheal's trainer without replica groups, in the order a step runs them.
STEP_PHASES = tuple(p for p in PHASE_ORDER if p in PHASES)


def test_each_step_is_a_span_with_a_child_per_phase_shared_across_ranks() -> None:
    exporter = InMemorySpanExporter()
    tracer = StepTracer("node-1", exporter, batch=False)
    for rank in range(2):
        rec = step_record(5, rank=rank, time=1_700_000_000.0)
        tracer.record(decode(encode(build_record("step", "job-a", rank, 100 + rank, 0, rec))))
    tracer.shutdown()
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name == STEP_SPAN]
    assert len(steps) == 2 and len(spans) == 2 * (1 + len(STEP_PHASES))
    assert {s.context.trace_id for s in steps} == {step_trace_id("job-a", 5)}, "one trace per step of the job"
    for step in steps:
        children = sorted((s for s in spans if s.parent and s.parent.span_id == step.context.span_id),
                          key=lambda s: s.start_time)
        assert [c.name for c in children] == list(STEP_PHASES)
        assert step.end_time == 1_700_000_000 * 10**9
        assert step.end_time - step.start_time == int(step_record(0)["step_seconds"] * 1e9)
        assert children[0].start_time == step.start_time
        reduce = children[STEP_PHASES.index("dp_reduce")]
        assert reduce.end_time - reduce.start_time == int(0.05 * 1e9), "dp_reduce lasts what it lasted"
        assert step.attributes["megaheal.rank"] in (0, 1) and step.attributes["megaheal.mesh.dp"] in (0, 1)
        assert step.resource.attributes["host.name"] == "node-1"


def record_spans(*records: dict, job: str = "job-a") -> list:
    exporter = InMemorySpanExporter()
    tracer = StepTracer("node-1", exporter, batch=False)
    for rec in records:
        tracer.record(decode(encode(build_record("step", job, rec["rank"], 100, 0, rec))))
    tracer.shutdown()
    return list(exporter.get_finished_spans())


def test_span_names_are_one_per_kind_of_operation_and_the_step_is_an_attribute() -> None:
    spans = record_spans(*(step_record(s, rank=r, attempt=2) for s in (7, 8, 9) for r in (0, 1)))
    assert {s.name for s in spans} == {STEP_SPAN, *STEP_PHASES}, "no name carries a step, rank or job"
    steps = [s for s in spans if s.name == STEP_SPAN]
    assert sorted((s.attributes["megaheal.step"], s.attributes["megaheal.rank"]) for s in steps) == \
        [(7, 0), (7, 1), (8, 0), (8, 1), (9, 0), (9, 1)]
    assert {(s.attributes["megaheal.job"], s.attributes["megaheal.attempt"]) for s in steps} == {("job-a", 2)}
    for phase in (s for s in spans if s.name != STEP_SPAN):
        parent = next(s for s in steps if s.context.span_id == phase.parent.span_id)
        assert phase.attributes["megaheal.phase"] == phase.name
        assert {k: phase.attributes[k] for k in ("megaheal.job", "megaheal.rank", "megaheal.step")} == \
            {k: parent.attributes[k] for k in ("megaheal.job", "megaheal.rank", "megaheal.step")}


def test_a_step_sent_without_its_attempt_has_no_attempt_attribute() -> None:
    step = next(s for s in record_spans(step_record(3)) if s.name == STEP_SPAN)
    assert "megaheal.attempt" not in step.attributes


def test_the_resource_is_megaheals_default_under_the_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    default = record_spans(step_record(1))[0].resource.attributes
    assert (default["service.name"], default["host.name"]) == ("megaheal-sidecar", "node-1")
    assert default["service.version"] == importlib.metadata.version("megaheal")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "x")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,host.name=gpu-17.example")
    spans = record_spans(step_record(1))
    assert {s.resource.attributes["service.name"] for s in spans} == {"x"}
    assert {s.resource.attributes["deployment.environment"] for s in spans} == {"prod"}
    assert {s.resource.attributes["host.name"] for s in spans} == {"gpu-17.example"}, "the environment wins"
    assert {s.resource.attributes["service.version"] for s in spans} == {default["service.version"]}
    # OTEL_RESOURCE_ATTRIBUTES alone may name the service too (OTEL_SERVICE_NAME wins when both do).
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes")
    assert record_spans(step_record(1))[0].resource.attributes["service.name"] == "from-attributes"


def write_run(run_dir, layout: dict[int, dict[str, int]], steps: int = 3) -> None:
    (run_dir / "ranks").mkdir(parents=True)
    for rank, mesh in layout.items():
        lines = [json.dumps(step_record(s, rank=rank, mesh=mesh, time=1000.0 + s)) for s in range(steps)]
        (run_dir / "ranks" / f"{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_timeline_has_a_track_per_rank_in_mesh_order(tmp_path) -> None:
    # Ranks as torch lays out (pp, dp, tp) = (2, 1, 2): tp innermost.
    layout = {0: {"pp": 0, "dp": 0, "tp": 0}, 1: {"pp": 0, "dp": 0, "tp": 1},
              2: {"pp": 1, "dp": 0, "tp": 0}, 3: {"pp": 1, "dp": 0, "tp": 1}}
    write_run(tmp_path, layout)
    with (tmp_path / "ranks" / "3.jsonl").open("a") as f:
        f.write('{"step": 3, "time": 10')  # a rank killed mid-write
    result = CliRunner().invoke(app, ["timeline", str(tmp_path), "-o", str(tmp_path / "trace.json")])
    assert result.exit_code == 0, result.output
    assert "4 ranks" in result.output and "1 unreadable lines skipped" in result.output
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= e.keys()
    assert {e["tid"] for e in slices} == {0, 1, 2, 3}
    assert {(e["pid"], e["tid"]) for e in slices} == {(1, 0), (1, 1), (2, 2), (2, 3)}, "a process per pp stage"
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    assert sorted(order, key=order.get) == [0, 1, 2, 3]
    step1 = next(e for e in slices if e["tid"] == 2 and e["name"] == "step 1")
    phases = [e for e in slices if e["tid"] == 2 and e["cat"] == "phase" and e["args"]["step"] == 1]
    assert [p["name"] for p in phases] == list(STEP_PHASES)
    assert all(step1["ts"] <= p["ts"] and p["ts"] + p["dur"] <= step1["ts"] + step1["dur"] + 1 for p in phases)
    assert step1["ts"] == 1e6, "times are relative to the first step's start; steps end 1 s apart"


def test_the_mesh_order_is_not_the_rank_order(tmp_path) -> None:
    # A layout where rank numbers and (pp, dp, tp) order differ: the tracks follow the mesh.
    layout = {0: {"pp": 1, "dp": 0, "tp": 0}, 1: {"pp": 0, "dp": 1, "tp": 0}, 2: {"pp": 0, "dp": 0, "tp": 0}}
    write_run(tmp_path, layout, steps=2)
    ranks, skipped = read_rank_files(tmp_path)
    assert [r.rank for r in ranks] == [2, 1, 0] and skipped == 0
    trace = build_trace(ranks, first_step=1, last_step=1)
    steps = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == {"step 1"}


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that refuses (400: not retried) or takes (200) each batch, as the test says."""
    status = 400
    batches = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).batches += 1
        self.send_response(type(self).status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_an_unreachable_collector_is_logged_once_per_outage_and_counted_per_batch(
        caplog: pytest.LogCaptureFixture) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        exporter = otlp_exporter(f"http://127.0.0.1:{server.server_address[1]}")
        tracer = StepTracer("node-1", exporter, batch=False)
        record = decode(encode(build_record("step", "job-a", 0, 100, 0, step_record(1))))
        with caplog.at_level(logging.INFO, logger="exporters.traces"):
            for _ in range(3):
                tracer.record(record)
            _Collector.status = 200
            tracer.record(record)
        tracer.shutdown()
    finally:
        server.shutdown()
    # One batch per span (simple processor): the step and its phases, four times; the first three refused.
    per_step = 1 + len(STEP_PHASES)
    assert _Collector.batches == 4 * per_step and exporter.failed_batches == 3 * per_step
    said = [r.getMessage() for r in caplog.records if r.name == "exporters.traces"]
    assert len(said) == 2 and "does not take spans" in said[0] and "takes spans again" in said[1], said
    assert not [r for r in caplog.records if r.name == OTLP_HTTP_LOGGER], "the SDK's own per-batch lines are quiet"
