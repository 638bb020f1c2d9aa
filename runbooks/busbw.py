"""nccl-tests' bandwidth arithmetic: algorithm bandwidth and bus bandwidth of a collective.

algbw = S / t, with S the bytes of one operation as nccl-tests counts them (the whole array for
all_gather, reduce_scatter and all_to_all). busbw = algbw x a factor that makes the number
comparable with the hardware's link bandwidth whatever the rank count n:
all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; sendrecv 1.
(Source: nccl-tests doc/PERFORMANCE.md.)
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv")
ELEMENT_BYTES = 4  # the tests move float32 tensors


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for `collective` among `n` ranks."""
    if n < 2:
        raise ValueError(f"a collective bandwidth test needs at least 2 ranks, got {n}")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "sendrecv":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


def algbw(size_bytes: int, seconds: float) -> float:
    """Bytes per second of one operation of `size_bytes` taking `seconds`."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return size_bytes / seconds


def busbw(collective: str, n: int, size_bytes: int, seconds: float) -> float:
    """Bus bandwidth in bytes per second."""
    return algbw(size_bytes, seconds) * bus_factor(collective, n)


def check_size(size_bytes: int, n: int) -> None:
    """Every collective splits its array into n float32 chunks: the size must allow that."""
    if size_bytes <= 0 or size_bytes % (ELEMENT_BYTES * n):
        raise ValueError(
            f"message size {size_bytes} must be a positive multiple of {ELEMENT_BYTES} x ranks "
            f"({ELEMENT_BYTES * n} bytes for {n} ranks)"
        )


def fit_size(size_bytes: int, n: int) -> int:
    """`size_bytes` rounded down to a multiple of n float32 chunks, as nccl-tests rounds its counts: a runbook's sizes
    are written before anyone knows how many hosts it will be run across (3 hosts: multiples of 12 bytes)."""
    return size_bytes - size_bytes % (ELEMENT_BYTES * n)
