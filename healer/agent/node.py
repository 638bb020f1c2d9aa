"""`megaheal agent`: the node agent of one host. The sidecar grown into an agent: it still takes the ranks' records
over its datagram socket and serves /metrics, and it also runs and watches the host's part of each attempt
(healer/agent/host.py), reports all of it to the healer in its heartbeat batches, and carries out the healer's
orders (wire/orders.py) through its HTTP API (healer/agent/api.py).

An agent that loses the healer keeps its ranks running, keeps its batches (bounded, the oldest dropped and counted)
and sends them when the healer answers again. It never decides for the job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from ground import procfs
from ground.names import name_path
from ground.tls import TlsFiles
from healer.agent import rank_evidence
from healer.agent.confine import check_start
from healer.agent.host import HostAttempt
from healer.agent.order_book import OrderBook
from healer.agent.rank_start import HostPlaces, free_port, rank_environment, replica_environment, torchrun_argv
from healer.agent.runbook_order import run_runbook_order
from healer.agent.warm_host import WarmHostAttempt, WarmWorkers
from wire.orders import (
    Adopted,
    AdoptOrder,
    Evidence,
    EvidenceOrder,
    Order,
    Reporting,
    ReportOrder,
    Result,
    RunbookOrder,
    RunbookRun,
    ShutdownOrder,
    ShuttingDown,
    Signalled,
    SignalOrder,
    Started,
    StartOrder,
    StopOrder,
    Stopped,
    Workers,
    WorkersOrder,
)
from wire.telemetry import HeartbeatBatch
from wire.warm_plan import WorkerStart

log = logging.getLogger(__name__)


class Telemetry(Protocol):
    """The host's telemetry the agent holds: the sidecar (exporters/sidecar.py) that takes the ranks' records and
    serves /metrics. NOTE: handed in by the agent's composer (healer/compose_agent.py), so that this package stands
    on the wire alone: the agent needs only the batch it builds, not how it is collected."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def heartbeat_batch(self, seq: int, sent_at: float) -> HeartbeatBatch: ...


class Forwarder(Protocol):
    """What posts the agent's batches to the healer (exporters/heartbeat.py's HeartbeatForwarder)."""

    last_taken_at: float | None
    """When the healer last took a batch (monotonic clock); None: never."""

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def nudge(self) -> None: ...

    def retarget(self, healer_url: str) -> None: ...


MakeForwarder = Callable[[str, Callable[[int, float], HeartbeatBatch]], Forwarder]
"""(healer URL, the batch builder) -> a forwarder not yet started, posting there at the agent's interval."""


class NodeAgent:
    @dataclass(kw_only=True, slots=True)
    class Config:
        node: str
        """This host's name (its sidecar's, in every series and batch)."""
        listen: str = "127.0.0.1:0"
        """HOST:PORT of the orders API; loopback unless told otherwise (on a cluster: the host's cluster address)."""
        advertise: str | None = None
        """The address the healer reaches the API at, when not `listen`'s (a wildcard bind, say)."""
        healer_url: str | None = None
        """Where the batches go (the healer's /v1/heartbeats). Unset: none are sent."""
        relay_url: str | None = None
        """This host's node-group relay (`megaheal relay`): the batches go there while it answers."""
        token: str
        """The job's token: every order needs it, and the batches carry it."""
        socket_path: str
        """The ranks' datagram socket (their MEGAHEAL_SIDECAR_SOCKET)."""
        work_dir: Path
        """The agent's own directory (each attempt's logs of this host; its order book and epoch floor, which an agent
        started again in it takes on: healer/agent/order_book.py)."""
        scratch_dir: Path
        """The host's local disk: the ranks' TMPDIR (and what node-health tests)."""
        metrics_addr: str = "127.0.0.1:0"
        heartbeat_interval_s: float = 0.5
        poll_interval_s: float = 0.2
        """How often the host's rank processes are looked at."""
        python: str = field(default_factory=lambda: sys.executable)
        cwd: Path = field(default_factory=Path.cwd)
        """Where torchrun and the runbooks run (the checkout, so `-m train` imports)."""
        extra_env: dict[str, str] = field(default_factory=dict)
        """Added to the environment of every rank and runbook (an agent in the healer's process cannot use its own)."""
        run_dir: Path | None = None
        """The run directory this agent was started for: a start order's run directory, checkpoint to resume from and
        config must be inside it (the config may also be under `cwd`; healer/agent/confine.py). None: not checked
        (an agent started by hand, without --run-dir)."""
        tls_dir: Path | None = None
        """This host's TLS files (ground/tls.py: ca.pem, cert.pem, key.pem, issued by the run's authority): the orders
        API then serves over TLS and takes orders only from the run's healer, and batches go to the healer over TLS
        with this host's certificate, which is what binds them to this host. None: plain HTTP, the token alone."""
        orphan_exit_s: float = 300.0
        """An agent that has heard nothing from its healer (no batch taken, no order) for this long while no rank of
        its runs here exits, saying why: nothing is left for it to keep, and a healer that comes back starts agents
        anew. While ranks run it waits for a take-over however long. 0: it never exits by itself."""

        def __post_init__(self) -> None:
            if len(self.token) < 16:
                raise ValueError("token must be at least 16 characters")
            if not 0 < self.poll_interval_s <= 10 or not 0 < self.heartbeat_interval_s <= 60:
                raise ValueError("poll_interval_s must be in (0, 10] and heartbeat_interval_s in (0, 60]")
            if self.tls_dir is not None:
                TlsFiles(self.tls_dir).check()
                if any(u and not u.startswith("https://") for u in (self.healer_url, self.relay_url)):
                    raise ValueError("with tls_dir, healer_url and relay_url must be https:// URLs (a relay started "
                                     "with --tls-dir)")
            if self.relay_url and not self.healer_url:
                raise ValueError("relay_url needs healer_url (where the batches go while the relay is down)")
            if self.orphan_exit_s < 0:
                raise ValueError(f"orphan_exit_s must be >= 0, got {self.orphan_exit_s}")

    def __init__(self, cfg: Config, sidecar: Telemetry, forwarder: MakeForwarder) -> None:
        """An agent holding `sidecar` (not started yet), sending its batches through forwarders `forwarder` makes
        (healer/compose_agent.py builds both from the config)."""
        self.cfg = cfg
        self.sidecar = sidecar
        self._forwarder = forwarder
        # NOTE: the book and the epoch floor live in the work directory, which a replaced agent is started with
        # again: it answers a retried order as its predecessor did, and refuses the healers it refused.
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        self.orders = OrderBook(self._execute, directory=cfg.work_dir)
        self._places = HostPlaces(node=cfg.node, scratch_dir=cfg.scratch_dir, socket_path=cfg.socket_path,
                                  extra_env=cfg.extra_env)
        self.attempt: HostAttempt | WarmHostAttempt | None = None
        self.warm: WarmWorkers | None = None
        """The job's warm workers on this host, when its attempts run warm (they outlive each attempt)."""
        self._lock = threading.RLock()
        self.url = ""
        # NOTE: every batch carries the whole of the current attempt (its exits included): the forwarder keeps few.
        self.heartbeat = forwarder(cfg.healer_url, self.batch) if cfg.healer_url else None
        self._stop = threading.Event()
        self._shutdown = threading.Event()
        self._poller = threading.Thread(target=self._poll_forever, name="megaheal-agent-poll", daemon=True)
        self.poll_failures = 0
        """Looks at the host's ranks that raised (each logged with its traceback; the loop went on)."""
        self.thread_restarts = 0
        self._heard_at = time.monotonic()
        """When the healer was last heard from (an order came, a batch was taken), on the monotonic clock."""
        self.exit_reason: str | None = None
        self._standalone = False
        self._server: Any = None

    # ---- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> str:
        """Start every part; the orders API's URL."""
        from healer.agent.api import serve

        try:
            self.cfg.scratch_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # NOTE: a host whose local disk failed still gets its agent: it is the agent that lets the healer see
            # the host is sick (preflight and node-health fail it by that disk) rather than a host that never came.
            log.error("the scratch directory %s is unusable: %s", self.cfg.scratch_dir, exc)
        self.cfg.work_dir.mkdir(parents=True, exist_ok=True)
        self.sidecar.start()
        self.orders.start()
        self._server, port = serve(self, self.cfg.listen)
        host = self.cfg.advertise or self.cfg.listen.rpartition(":")[0]
        self.url = f"{'https' if self.cfg.tls_dir else 'http'}://{host}:{port}"
        self._poller.start()
        if self.heartbeat is not None:
            self.heartbeat.start()
        log.info("megaheal agent on %s: orders %s, ranks -> %s, healer %s", self.cfg.node, self.url,
                 self.cfg.socket_path, self.cfg.healer_url or "none")
        return self.url

    def stop(self) -> None:
        """Stop the agent (its ranks are left as they are: the healer decides about them)."""
        self._stop.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.orders.stop()
        if self._server is not None:
            self._server.should_exit = True
        self.sidecar.stop()

    def serve_forever(self) -> None:
        self._standalone = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._shutdown.set())
        url = self.start()
        print(f"megaheal agent {self.cfg.node}: {url}", flush=True)
        try:
            self._shutdown.wait()
        finally:
            self.stop()

    def _poll_forever(self) -> None:
        while not self._wait_for_a_look():
            try:
                self._poll_once()
            except Exception:  # noqa: BLE001 - NOTE: one bad look (a /proc entry or a file gone) is not the end
                # of the agent's eyes: an agent whose poll thread died went on sending batches of ranks it no longer
                # looked at, and the healer saw its job fall silent (tests/agent/test_agent_survives.py).
                self.poll_failures += 1
                log.error("agent %s: a look at the host's ranks failed (%d so far); the next one goes on",
                          self.cfg.node, self.poll_failures, exc_info=True)

    def _wait_for_a_look(self) -> bool:
        """Wait until the next look: the poll interval, or less when a rank of the attempt ends (a crash: its exit
        status is read while it is still a zombie, HostAttempt.wait_for_exit). True when the agent stops."""
        attempt = self.attempt
        try:
            if attempt is not None and not attempt.ended:
                attempt.wait_for_exit(self.cfg.poll_interval_s)
                return self._stop.is_set()
        except Exception:  # noqa: BLE001 - NOTE: as a failed look: the agent goes on looking at its interval
            log.warning("agent %s: waiting for a rank's exit failed; looking at the interval", self.cfg.node,
                        exc_info=True)
        return self._stop.wait(self.cfg.poll_interval_s)

    def _poll_once(self) -> None:
        self._exit_if_orphaned()
        with self._lock:
            attempt = self.attempt
            if attempt is None:
                return
            before = (len(attempt.exits), attempt.ended)
            attempt.poll()
            changed = (len(attempt.exits), attempt.ended) != before
            heartbeat = self.heartbeat
        # NOTE: an exit is what the healer acts on at once (a crash): it goes out now, not at the next interval
        # (half a second on average of every crash's detection).
        if changed and heartbeat is not None:
            heartbeat.nudge()

    def _exit_if_orphaned(self) -> None:
        """Leave when neither the healer nor a rank needs this agent any more (Config.orphan_exit_s)."""
        # NOTE: only an agent of its own process (serve_forever): one inside its healer's process ends with it.
        if not self.cfg.orphan_exit_s or not self._standalone or self._shutdown.is_set():
            return
        if self.heartbeat is not None and self.heartbeat.last_taken_at is not None:
            self._heard_at = max(self._heard_at, self.heartbeat.last_taken_at)
        silent_s = time.monotonic() - self._heard_at
        if silent_s < self.cfg.orphan_exit_s or self._ranks_run_here():
            return
        self.exit_reason = (f"nothing heard from the healer for {silent_s:.0f} s (orphan_exit_s "
                            f"{self.cfg.orphan_exit_s:g}) and no rank runs here")
        log.warning("agent %s exits: %s", self.cfg.node, self.exit_reason)
        if self.warm is not None:
            self.warm.stop(5.0, threading.Event())  # its idle standbys: nobody would ever give them a rank
        self._shutdown.set()

    def _ranks_run_here(self) -> bool:
        """Whether the host's part of an attempt still runs (a rank trains, or torchrun restarts them)."""
        with self._lock:
            return self.attempt is not None and not self.attempt.ended

    def threads(self) -> dict[str, bool]:
        """Whether each of the agent's own loops runs (the API server's thread is its own: it answers, or not)."""
        out = {"poll": self._poller.is_alive(), "orders": self.orders.alive}
        if self.heartbeat is not None:
            out["heartbeat"] = self.heartbeat.alive
        return out

    def _watch_threads(self) -> None:
        """A loop that died anyway (not of an Exception: those are caught in it) is said once and started again: an
        agent that looks at nothing must not look healthy. Called with each batch, so at the heartbeat interval."""
        if self._stop.is_set() or self._poller.is_alive() or not self._poller.ident:
            return
        self.thread_restarts += 1
        log.error("agent %s: its poll thread died; started again (%d restart(s))", self.cfg.node, self.thread_restarts)
        self._poller = threading.Thread(target=self._poll_forever, name="megaheal-agent-poll", daemon=True)
        self._poller.start()

    def health(self) -> dict[str, Any]:
        """/healthz's answer: ok, or degraded with the loops that do not run and how often a look failed."""
        threads = self.threads()
        dead = sorted(name for name, alive in threads.items() if not alive)
        return {"status": "degraded" if dead else "ok", "node": self.cfg.node, "threads": threads,
                "dead_threads": dead, "poll_failures": self.poll_failures, "thread_restarts": self.thread_restarts}

    # ---- what it reports -----------------------------------------------------------------------------

    def batch(self, seq: int, sent_at: float) -> HeartbeatBatch:
        """The sidecar's batch, with the host's part of the current attempt and where to send orders."""
        self._watch_threads()
        with self._lock:
            report = self.attempt.report() if self.attempt is not None else None
        base = self.sidecar.heartbeat_batch(seq, sent_at)
        return msgspec.structs.replace(base, attempt=report, agent_url=self.url or None)

    def state(self) -> dict[str, Any]:
        with self._lock:
            report = self.attempt.report() if self.attempt is not None else None
        return {"node": self.cfg.node, "url": self.url, "pid": os.getpid(),
                "attempt": msgspec.to_builtins(report) if report is not None else None, "health": self.health()}

    # ---- orders --------------------------------------------------------------------------------------

    def submit(self, order: Order) -> tuple[Any, bool]:
        """Queue `order` (OrderBook.submit). A stop with no grace cuts short a stop in progress (a second Ctrl-C):
        orders are carried out one after another, so it takes effect here, before it queues behind that stop."""
        if isinstance(order, StopOrder) and order.grace_s == 0:
            with self._lock:
                attempt = self.attempt
            if attempt is not None and attempt.attempt == order.attempt:
                attempt.hurry.set()
        return self.orders.submit(order)

    def _execute(self, order: Order) -> Result:
        self._heard_at = time.monotonic()  # NOTE: only the healer holds the token an order needs
        if isinstance(order, StartOrder):
            return self._start(order)
        if isinstance(order, StopOrder):
            return self._stop_attempt(order)
        if isinstance(order, ReportOrder):
            if self.heartbeat is None:
                self.heartbeat = self._forwarder(order.healer_url, self.batch)
                self.heartbeat.start()
            else:
                self.heartbeat.retarget(order.healer_url)
            return Reporting(healer_url=order.healer_url)
        if isinstance(order, AdoptOrder):
            return self._adopt(order)
        if isinstance(order, ShutdownOrder):
            threading.Timer(0.2, self._shutdown.set).start()  # after this answer is out
            return ShuttingDown()
        if isinstance(order, EvidenceOrder):
            return self._evidence(order)
        if isinstance(order, WorkersOrder):
            with self._lock:
                assign = self.attempt.assign if isinstance(self.attempt, WarmHostAttempt) else {}
                return Workers(node=self.cfg.node, workers=self.warm.describe(assign) if self.warm else [])
        if isinstance(order, SignalOrder):
            with self._lock:
                if self.attempt is None or self.attempt.attempt != order.attempt:
                    raise LookupError(f"attempt {order.attempt} is not running on {self.cfg.node}")
                return Signalled(pid=self.attempt.signal(order.rank, getattr(signal, order.signal)))
        assert isinstance(order, RunbookOrder)
        return self._runbook(order)

    def _start(self, order: StartOrder) -> Started:
        if self.cfg.run_dir is not None:
            check_start(order, self.cfg.run_dir, self.cfg.cwd)
        if order.warm is not None:
            return self._start_warm(order)
        with self._lock:
            if self.attempt is not None and not self.attempt.ended:
                if self.attempt.attempt == order.attempt:
                    return self._started(order.attempt)
                raise RuntimeError(f"attempt {self.attempt.attempt} still runs on {self.cfg.node}; stop it first")
            self._endpoint = order.rdzv_endpoint or f"{self._rdzv_host()}:{free_port()}"
            argv = torchrun_argv(order, self._endpoint, self.cfg.python, self._attempt_dir(order) / "ranks")
            env = rank_environment(order, self._places, self._phase_dir(order.job, order.attempt))
            if order.replica is not None:
                env |= replica_environment(order, order.replica, self.cfg.token, self._attempt_dir(order),
                                           self._rdzv_host())
            cwd = Path(order.program.cwd) if order.program is not None else self.cfg.cwd
            self.attempt = HostAttempt(job=order.job, attempt=order.attempt, node_rank=order.node_rank, argv=argv,
                                       env=env, cwd=cwd, log_dir=self._attempt_dir(order),
                                       phase_dir=self._phase_dir(order.job, order.attempt),
                                       rank_offset=order.replica.group * order.nproc_per_node
                                       if order.replica is not None else 0)
            self.attempt.start()
            return self._started(order.attempt)

    def _start_warm(self, order: StartOrder) -> Started:
        """A generation of the job's warm pool here: a new pool when `formed_in` names another (a cold formation; what
        an older pool left here is stopped first), else the running pool's workers take their new ranks (a warm
        restart: this replaces the record of the attempt before, whose ranks live on in this one)."""
        spec = order.warm
        assert spec is not None
        with self._lock:
            current = self.attempt
            if current is not None and current.attempt == order.attempt and not current.ended:
                return self._started(order.attempt)
            same_pool = self.warm is not None and self.warm.formed_in == spec.formed_in and \
                self.warm.control == spec.control
        if not same_pool:
            if current is not None and not current.ended:
                raise RuntimeError(f"attempt {current.attempt} still runs on {self.cfg.node}; stop it first")
            if self.warm is not None:
                self.warm.stop(0.0, threading.Event())  # an old pool's standbys: never part of a new one
            phase_dir = self._phase_dir(order.job, spec.formed_in)
            self.warm = WarmWorkers(job=order.job, node=self.cfg.node, formed_in=spec.formed_in, control=spec.control,
                                    python=self.cfg.python,
                                    cwd=Path(order.program.cwd) if order.program is not None else self.cfg.cwd,
                                    env=rank_environment(order, self._places, phase_dir),
                                    log_dir=self._attempt_dir(order) / "warm",
                                    standbys=spec.standbys, token=self.cfg.token, program=order.program,
                                    trainer=WorkerStart(order.config, order.run_dir, tuple(order.overrides))
                                    if order.config is not None else None)
        assert self.warm is not None
        # NOTE: a spare keeps a host's worth of standbys until it takes a host's place, then the job's number.
        self.warm.standbys = spec.standbys
        attempt = WarmHostAttempt(job=order.job, attempt=order.attempt, node_rank=order.node_rank, pool=self.warm,
                                  assign=dict(spec.assign), local_rank=dict(spec.local_rank),
                                  phase_dir=self._phase_dir(order.job, spec.formed_in))
        with self._lock:
            if isinstance(current, WarmHostAttempt):
                current.superseded = True
            attempt.start()
            self.attempt = attempt
            return self._started(order.attempt)

    def _started(self, attempt: int) -> Started:
        """The answer to a start: the rendezvous endpoint, and the torchrun agent's pid and start time (what a healer
        that takes over checks before it signals it); a warm generation has no torchrun agent (None)."""
        assert self.attempt is not None
        if self.attempt.process is None:
            return Started(attempt=attempt)
        pid = self.attempt.process.pid
        return Started(attempt=attempt, rdzv_endpoint=self._endpoint, pid=pid, started=procfs.start_time(pid))

    _endpoint = ""

    def _adopt(self, order: AdoptOrder) -> Adopted:
        """Take on the attempt the agent before us started on this host (it died; the attempt runs on)."""
        with self._lock:
            if self.attempt is not None and self.attempt.attempt == order.attempt and not self.attempt.ended:
                return Adopted(adopted=order.attempt, pid=self.attempt.process.pid if self.attempt.process else None)
            if self.attempt is not None and not self.attempt.ended:
                raise RuntimeError(f"attempt {self.attempt.attempt} runs on {self.cfg.node}; it cannot adopt another")
            found = HostAttempt(job=order.job, attempt=order.attempt, node_rank=order.node_rank, argv=[], env={},
                                cwd=self.cfg.cwd, log_dir=self._attempt_dir(order),
                                phase_dir=self._phase_dir(order.job, order.attempt))
            if not found.adopt(self.cfg.node):
                raise LookupError(f"attempt {order.attempt} of {order.job} does not run on {self.cfg.node}")
            self.attempt = found
            assert found.process is not None
            return Adopted(adopted=order.attempt, pid=found.process.pid)

    def _attempt_dir(self, order: StartOrder | AdoptOrder) -> Path:
        return name_path(self.cfg.work_dir, f"{order.job}-attempt-{order.attempt:03d}")

    def _phase_dir(self, job: str, attempt: int) -> Path:
        """Where the attempt's ranks say which phase they are in (wire/phase_now.py). NOTE: on the host's own
        scratch disk, not under the run directory: that is shared between hosts on a cluster, and a page mapped
        from a network filesystem is written back over the network."""
        return name_path(self.cfg.scratch_dir / "megaheal-phase", f"{job}-attempt-{attempt:03d}").absolute()

    def _evidence(self, order: EvidenceOrder) -> Evidence:
        """What each rank of the attempt here is doing, read from outside (nothing is signalled or stopped)."""
        with self._lock:
            attempt = self.attempt
            if attempt is None or attempt.attempt != order.attempt:
                raise LookupError(f"attempt {order.attempt} is not running on {self.cfg.node}")
            report = attempt.report()
        ranks = {r.pid: r.rank for r in report.ranks}
        found, took = rank_evidence.collect_all(ranks, attempt.phase_dir or self._phase_dir(report.job, report.attempt),
                                                order.timeout_s)
        return Evidence(node=self.cfg.node, ranks=found, took_s=round(took, 3))

    def _rdzv_host(self) -> str:
        host = (self.cfg.advertise or self.cfg.listen).rpartition(":")[0]
        return host if host not in ("", "0.0.0.0", "[::]") else socket.gethostname()

    def _stop_attempt(self, order: StopOrder) -> Stopped:
        with self._lock:
            attempt = self.attempt
        if attempt is None or attempt.attempt != order.attempt:
            return Stopped()
        attempt.stop(order.grace_s)  # NOTE: outside the lock: the poller keeps reporting while it stops
        return Stopped(stopped=attempt.attempt, exit_code=attempt.exit_code)

    def _runbook(self, order: RunbookOrder) -> RunbookRun:
        """The runbook on this host, in the agent's environment with the host's name and scratch disk
        (healer/agent/runbook_order.py)."""
        env = dict(os.environ) | self.cfg.extra_env | {"MEGAHEAL_NODE": self.cfg.node,
                                                        "TMPDIR": str(self.cfg.scratch_dir.absolute())}
        return run_runbook_order(order, python=self.cfg.python, node=self.cfg.node, cwd=self.cfg.cwd, env=env)


def agent_socket_path(node: str, work_dir: Path) -> str:
    """The ranks' socket of the agent of `node` working in `work_dir`: the same for every agent started there (a
    restarted agent hears the ranks of the attempt it takes on, which go on sending to the path they were given), and
    short (AF_UNIX paths hold 107 bytes): a directory of this user's under the host's temp directory, named by a
    digest of the two."""
    digest = hashlib.sha256(f"{node}\0{work_dir.absolute()}".encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"mh-agent-{os.getuid()}-{digest}" / "ranks.sock")
