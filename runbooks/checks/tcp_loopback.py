"""TCP loopback throughput and latency of this node's own network stack.

The receiving side runs in a forked process, not a thread, so the two ends do not take turns on
one interpreter lock and the numbers describe the kernel's path rather than Python's scheduling.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass

CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class TcpLoopback:
    throughput_bytes_s: float
    latency_p50_s: float
    latency_p99_s: float


def _serve(listener: socket.socket, total: int, pings: int, msg: int) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        received = 0
        while received < total:
            n = conn.recv_into(view, min(CHUNK, total - received))
            if n == 0:
                return
            received += n
        conn.sendall(b"k")  # the sender stops its clock on this byte: all data has arrived
        small = bytearray(msg)
        for _ in range(pings):
            _recv_exact(conn, small)
            conn.sendall(small)


def _recv_exact(conn: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the loopback connection early")
        got += n


def measure(address: str, total_bytes: int, pings: int, message_bytes: int, timeout_s: float) -> TcpLoopback:
    """Stream `total_bytes` to a local receiver, then time `pings` round trips of `message_bytes`."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(1)
        server = mp.get_context("fork").Process(
            target=_serve, args=(listener, total_bytes, pings, message_bytes), daemon=True
        )
        server.start()
        try:
            return _client(family, listener.getsockname()[:2], total_bytes, pings, message_bytes, timeout_s)
        finally:
            server.join(timeout=2)
            if server.is_alive():
                server.kill()
                server.join()
    finally:
        listener.close()


def _client(family: int, addr: tuple, total: int, pings: int, msg: int, timeout_s: float) -> TcpLoopback:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = memoryview(bytes(CHUNK))
        start = time.perf_counter()
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            sock.sendall(payload[:n])
            sent += n
        ack = bytearray(1)
        _recv_exact(sock, ack)
        throughput = total / (time.perf_counter() - start)
        small, back = bytes(msg), bytearray(msg)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(small)
            _recv_exact(sock, back)
            rtts.append(time.perf_counter() - t0)
    rtts.sort()
    return TcpLoopback(
        throughput_bytes_s=throughput,
        latency_p50_s=statistics.median(rtts),
        latency_p99_s=rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))],
    )
