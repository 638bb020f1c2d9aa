"""Building an in-process healer (real store on SQLite, real rules, real detectors) for the engine and API tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from healer.decide.rules import load_rule_set
from healer.engine.engine import Healer
from healer.incidents import db
from healer.incidents.metrics import HealerMetrics
from healer.incidents.store import IncidentStore
from healer.observe.heartbeats import HeartbeatTable
from healer.oncall.sinks import Sink, Sinks
from healer.ports import Diagnoser, Remediator

RUNBOOKS = Path(__file__).resolve().parent / "runbooks"


class ManualClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_healer(tmp_path: Path, rules: str, clock: ManualClock | None = None, diagnoser: Diagnoser | None = None,
                sinks: list[Sink] | None = None, db_url: str | None = None, remediator: Remediator | None = None
                ) -> Healer:
    from datetime import datetime, timezone

    clock = clock or ManualClock()
    (tmp_path / "rules.yaml").write_text(rules)
    engine = db.make_engine(db_url or f"sqlite:///{tmp_path / 'healer.db'}")
    db.ensure_schema(engine)
    store = IncidentStore(engine, "test-healer", clock=lambda: datetime.fromtimestamp(clock.now, timezone.utc))
    metrics = HealerMetrics()
    table = HeartbeatTable(clock=clock)
    healer = Healer(store=store, rules=load_rule_set([tmp_path / "rules.yaml"]), table=table,
                    sinks=Sinks(sinks or []), metrics=metrics, diagnoser=diagnoser, remediator=remediator, clock=clock)
    metrics.track(lambda: len(table), store.open_counts)
    healer.start()
    return healer


def batch(node: str, ranks: list[int], job: str = "job", age: float = 0.2, seq: int = 0) -> dict[str, Any]:
    """A heartbeat batch as exporters/heartbeat.py sends it (the fields the healer reads, and some it ignores)."""
    return {"schema": 1, "node": node, "seq": seq, "sent_at": 1.0, "nvml": "absent", "gpus": [],
            "ranks": [{"job": job, "rank": r, "pid": 1000 + r, "local_rank": r % 8, "world_size": 64, "mesh": {},
                       "alive": True, "last_seen_age_s": age, "dropped": 0, "events": {}, "last_event": None,
                       "step": 10, "step_seconds": 0.5, "phases": {"forward_backward": 0.4}, "loss": 2.5}
                      for r in ranks]}


class Receiver:
    """A real HTTP endpoint on loopback that records what is POSTed to it (a webhook's other end)."""

    def __init__(self, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                length = int(self.headers.get("content-length", "0"))
                outer.bodies.append(json.loads(self.rfile.read(length)))
                outer.headers.append(dict(self.headers))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
