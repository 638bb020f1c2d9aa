"""`loopback`: the node's own network path. TCP loopback throughput and latency always; RDMA
`ib_write_bw` loopback on each RDMA device where perftest and a device exist, otherwise reported
as skipped with the reason. A node that cannot move data to itself cannot serve a training job.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import timedelta

from runbooks.baselines import BaselineStore, below_baseline
from runbooks.checks import rdma_loopback, tcp_loopback
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Measurement, Status, Suspect, worst

MiB = 1 << 20


class LoopbackCheck(Check):
    name = "loopback"

    @dataclass(kw_only=True, slots=True)
    class Config:
        address: str = "127.0.0.1"
        """Local IP address to test through (a NIC's own address tests its IP stack path)."""
        tcp_mib: int = 256
        """MiB streamed for the TCP throughput test."""
        pings: int = 200
        """Round trips for the TCP latency test."""
        ping_bytes: int = 64
        """Bytes per latency round trip."""
        max_latency: timedelta = timedelta(milliseconds=2)
        """Degraded when the median round trip exceeds this (loopback is normally tens of microseconds)."""
        min_tcp_gbit_s: float | None = None
        """Fail below this TCP throughput; None: compare only with the stored baseline."""
        rdma: bool = True
        """Run ib_write_bw loopback on RDMA devices where present."""
        rdma_duration: timedelta = timedelta(seconds=2)
        """Length of each ib_write_bw run."""
        min_rdma_gbit_s: float | None = None
        """Fail a device below this RDMA bandwidth; None: compare only with the stored baseline."""
        baseline_fraction: float = 0.9
        """Fail below this fraction of a stored baseline."""

        def __post_init__(self) -> None:
            try:
                ipaddress.ip_address(self.address)
            except ValueError:
                raise ValueError(f"address must be an IP address, got {self.address!r}") from None
            if not 1 <= self.tcp_mib <= 16384:
                raise ValueError(f"tcp_mib must be in [1, 16384], got {self.tcp_mib}")
            if not 1 <= self.pings <= 100_000 or not 1 <= self.ping_bytes <= MiB:
                raise ValueError(
                    f"pings must be in [1, 100000] and ping_bytes in [1, 1 MiB], got {self.pings}, {self.ping_bytes}"
                )
            if self.max_latency <= timedelta(0):
                raise ValueError(f"max_latency must be > 0, got {self.max_latency}")
            if not timedelta(seconds=1) <= self.rdma_duration <= timedelta(seconds=60):
                raise ValueError(f"rdma_duration must be in [1s, 60s], got {self.rdma_duration}")
            if not 0 < self.baseline_fraction <= 1:
                raise ValueError(f"baseline_fraction must be in (0, 1], got {self.baseline_fraction}")

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        store = BaselineStore(None if ctx.calibrate else ctx.baselines_path)
        parts = [self._tcp(config, ctx, store)]
        if config.rdma:
            parts.append(self._rdma(config, ctx, store))
        status = worst([p.status for p in parts])
        summary = "; ".join(p.summary for p in parts)
        return CheckResult(
            status=status,
            summary=summary,
            suspects=tuple(s for p in parts for s in p.suspects),
            measurements=tuple(m for p in parts for m in p.measurements),
            details={k: v for p in parts for k, v in p.details.items()},
        )

    def _tcp(self, config: Config, ctx: CheckContext, store: BaselineStore) -> CheckResult:
        try:
            r = tcp_loopback.measure(
                config.address,
                config.tcp_mib * MiB,
                config.pings,
                config.ping_bytes,
                timeout_s=max(1.0, ctx.timeout_s / 2),
            )
        except OSError as exc:
            return CheckResult(
                status=Status.FAIL,
                summary=f"TCP loopback via {config.address} failed: {exc}",
                suspects=(Suspect(kind="host", name=ctx.hostname, reason=f"TCP loopback failed: {exc}"),),
            )
        labels = {"address": config.address, "node": ctx.hostname}
        key = f"loopback/tcp/{config.address}/throughput"
        gbit = Measurement(
            name="tcp_throughput",
            value=r.throughput_bytes_s * 8 / 1e9,
            unit="Gbit/s",
            labels=labels,
            baseline=store.get(key),
            key=key,
        )
        p50 = Measurement(name="tcp_latency_p50", value=r.latency_p50_s, unit="s", labels=labels)
        p99 = Measurement(name="tcp_latency_p99", value=r.latency_p99_s, unit="s", labels=labels)
        text = f"TCP loopback {gbit.value:.2f} Gbit/s, RTT p50 {p50.value * 1e6:.0f} us"
        status, problem = Status.PASS, ""
        if config.min_tcp_gbit_s is not None and gbit.value < config.min_tcp_gbit_s:
            status, problem = Status.FAIL, f" < {config.min_tcp_gbit_s:g} Gbit/s"
        elif below_baseline(gbit.value, gbit.baseline, config.baseline_fraction):
            status, problem = Status.FAIL, f" < {config.baseline_fraction:g} x baseline {gbit.baseline:.2f} Gbit/s"
        elif p50.value > config.max_latency.total_seconds():
            status, problem = Status.DEGRADED, f"; RTT above {config.max_latency.total_seconds() * 1e3:g} ms"
        suspects = () if status is Status.PASS else (Suspect(kind="host", name=ctx.hostname, reason=text + problem),)
        return CheckResult(status=status, summary=text + problem, suspects=suspects, measurements=(gbit, p50, p99))

    def _rdma(self, config: Config, ctx: CheckContext, store: BaselineStore) -> CheckResult:
        devices = rdma_loopback.available_devices()
        reason = rdma_loopback.skip_reason(devices)
        if reason:
            return CheckResult(
                status=Status.SKIPPED, summary=f"RDMA loopback skipped: {reason}", details={"rdma": {"skipped": reason}}
            )
        budget = timedelta(seconds=config.rdma_duration.total_seconds() + 15)
        measurements, problems = [], []
        for device in devices:
            r = rdma_loopback.loopback(device, config.rdma_duration, budget)
            if r.gbit_s is None:
                problems.append(
                    Suspect(kind="host", name=f"{ctx.hostname}/{device}", reason=f"ib_write_bw failed: {r.error}")
                )
                continue
            key = f"loopback/rdma/{device}/bw"
            m = Measurement(
                name="rdma_write_bw",
                value=r.gbit_s,
                unit="Gbit/s",
                labels={"device": device, "node": ctx.hostname},
                baseline=store.get(key),
                key=key,
            )
            measurements.append(m)
            floor = config.min_rdma_gbit_s
            if (floor is not None and m.value < floor) or below_baseline(m.value, m.baseline, config.baseline_fraction):
                problems.append(
                    Suspect(
                        kind="host",
                        name=f"{ctx.hostname}/{device}",
                        reason=f"RDMA loopback {m.value:.1f} Gbit/s below its floor or baseline",
                    )
                )
        text = ", ".join(f"{m.labels['device']} {m.value:.1f} Gbit/s" for m in measurements)
        if problems:
            return CheckResult(
                status=Status.FAIL,
                summary="RDMA loopback: " + "; ".join(s.reason for s in problems),
                suspects=tuple(problems),
                measurements=tuple(measurements),
            )
        return CheckResult(status=Status.PASS, summary=f"RDMA loopback {text}", measurements=tuple(measurements))
