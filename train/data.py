"""Training data: deterministic, resumable token streams and a prefetching loader.

This module holds:

* ``DataConfig`` -- which source to read and how far ahead to prefetch.
* Two random-access token sources, where sample ``i`` is a pure function of
  ``(seed, i)``:
  ``SyntheticTokens`` (a seeded sparse Markov chain, learnable but free) and
  ``ByteTextTokens`` (real text from files as byte tokens, read lazily).
* ``TokenStream`` -- cuts the global sample sequence into per-step global
  batches and hands each data-parallel rank its contiguous slice.
* ``PrefetchLoader`` -- prepares batches on a background thread while
  reporting the position of what the *consumer* has taken, so checkpoints
  resume exactly.

Because every sample is addressed by its global index, skipping forward is
O(1) and the token stream is identical whatever the data-parallel layout.
"""

from __future__ import annotations

import glob
import os
import queue
import sysconfig
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch

VALID_SOURCES = ("synthetic", "text")
BYTE_VOCAB_SIZE = 256

# Spawn keys separate the independent random streams derived from one seed,
# so the chain's structure never correlates with the per-sample draws.
_CHAIN_KEY = 0
_SAMPLE_KEY = 1

# Successor probabilities of the synthetic Markov chain: skewed so the
# conditional entropy (~1.1 nats) is far below log(vocab) and a model can
# visibly reduce its loss, yet not deterministic.
_SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)

# Directories under the stdlib path that hold third-party packages; they vary
# from machine to machine, so the default corpus leaves them out.
_THIRD_PARTY_DIRS = frozenset({"site-packages", "dist-packages"})

# How long the loader thread and consumer block before re-checking for
# shutdown; short enough that close() returns promptly.
_POLL_S = 0.05
_JOIN_TIMEOUT_S = 5.0


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training tokens come from and how the loader prepares them."""

    source: str = "synthetic"
    """Token source: "synthetic" (seeded Markov chain) or "text" (bytes of files)."""

    paths: list[str] = field(default_factory=list)
    """Files or glob patterns ("**" recurses) for source="text"; empty means the stdlib's *.py files."""

    seed: int = 1234
    """Seed of the sample sequence; sample i depends only on (seed, i). Must be >= 0."""

    prefetch: int = 2
    """Batches prepared ahead by the background loader thread (>= 1)."""

    def __post_init__(self) -> None:
        if self.source not in VALID_SOURCES:
            raise ValueError(
                f"data.source={self.source!r} is unknown; set it to one of {list(VALID_SOURCES)}"
            )
        if not isinstance(self.paths, list) or not all(isinstance(p, str) for p in self.paths):
            raise ValueError(
                f"data.paths={self.paths!r} must be a list of path or glob strings"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed={self.seed!r} must be a non-negative integer")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(
                f"data.prefetch={self.prefetch!r} must be an integer >= 1 (batches prepared ahead)"
            )


class TokenSource(Protocol):
    """A random-access source: sample(i) depends only on the seed and i."""

    @property
    def vocab_size(self) -> int: ...

    def sample(self, index: int, seq_len: int) -> torch.Tensor: ...


def _check_seed(seed: int, owner: str) -> None:
    # SeedSequence only accepts non-negative entropy; fail with a clear message.
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{owner} seed={seed!r} must be a non-negative integer")


def _check_sample_args(index: int, seq_len: int) -> None:
    if index < 0:
        raise ValueError(f"sample index={index} must be >= 0")
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")


def _sample_rng(seed: int, index: int) -> np.random.Generator:
    """The generator for sample `index`: independent of every other index."""
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(_SAMPLE_KEY, index)))
    )


class SyntheticTokens:
    """Learnable synthetic text: a seeded, sparse first-order Markov chain.

    Internally the chain walks hidden states ``s_{t+1} = (s_t + d[c_t]) mod V``
    with a few fixed offsets ``d`` chosen with skewed probabilities, and emits
    token ``perm[s_t]``. The random permutation hides the additive structure,
    so each token simply has a handful of likely successors, while the walk
    stays a cumulative sum and can be generated without a Python loop.
    """

    def __init__(self, vocab_size: int, seed: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2 for synthetic tokens")
        _check_seed(seed, "SyntheticTokens")
        self._vocab_size = vocab_size
        self._seed = seed
        chain_rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(_CHAIN_KEY,)))
        )
        n_successors = min(len(_SUCCESSOR_PROBS), vocab_size - 1)
        # Non-zero distinct offsets so every token has n_successors different successors.
        self._offsets = chain_rng.choice(
            np.arange(1, vocab_size, dtype=np.int64), size=n_successors, replace=False
        )
        probs = np.asarray(_SUCCESSOR_PROBS[:n_successors], dtype=np.float64)
        self._cum_probs = np.cumsum(probs / probs.sum())
        self._perm = chain_rng.permutation(vocab_size).astype(np.int64)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def sample(self, index: int, seq_len: int) -> torch.Tensor:
        """Tokens of sample `index`: int64, shape [seq_len + 1]."""
        _check_sample_args(index, seq_len)
        rng = _sample_rng(self._seed, index)
        start = rng.integers(0, self._vocab_size)
        # Inverse-CDF draw of which successor each step takes; side="right" and
        # clipping keep a draw of exactly the last edge inside the table.
        choice = np.searchsorted(self._cum_probs, rng.random(seq_len), side="right")
        choice = np.minimum(choice, len(self._offsets) - 1)
        states = np.empty(seq_len + 1, dtype=np.int64)
        states[0] = start
        states[1:] = start + np.cumsum(self._offsets[choice])
        return torch.from_numpy(self._perm[states % self._vocab_size])


def _has_glob_magic(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _resolve_pattern(pattern: str) -> list[str]:
    """Regular files named by one path or glob pattern; ValueError if none."""
    expanded = os.path.expanduser(pattern)
    if _has_glob_magic(expanded):
        matches = glob.glob(expanded, recursive=True)
    else:
        matches = [expanded] if os.path.exists(expanded) else []
    files = [m for m in matches if os.path.isfile(m)]
    if not files:
        if os.path.isdir(expanded):
            raise ValueError(
                f"data.paths entry {pattern!r} is a directory; use a glob such as "
                f"{os.path.join(pattern, '**', '*.txt')!r} to pick its files"
            )
        raise ValueError(
            f"data.paths entry {pattern!r} matches no regular files; fix the path or pattern"
        )
    return files


def _stdlib_python_files() -> list[str]:
    """All *.py files of the standard library, without third-party packages."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending into site-packages,
        # whose contents differ between machines and would change the corpus.
        dirnames[:] = [d for d in dirnames if d not in _THIRD_PARTY_DIRS]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return found


def _corpus_files(paths: list[str]) -> list[str]:
    """The corpus's files: deduplicated by real path, sorted, non-empty."""
    raw = _stdlib_python_files() if not paths else [
        f for pattern in paths for f in _resolve_pattern(pattern)
    ]
    # Sorting absolute real paths makes the order independent of the order
    # patterns were listed in and of the file system's directory order.
    unique = sorted({os.path.realpath(f) for f in raw})
    # Empty files contribute no bytes; dropping them keeps the offset table strict.
    return [f for f in unique if os.path.isfile(f) and os.path.getsize(f) > 0]


class ByteTextTokens:
    """Real text as byte-level tokens (token = byte value, vocab 256).

    The corpus is the virtual concatenation of its files in sorted order. Only
    the file list and cumulative sizes live in memory; each sample reads just
    its own bytes, so every rank can hold a large corpus cheaply.
    """

    def __init__(self, paths: list[str], seed: int) -> None:
        _check_seed(seed, "ByteTextTokens")
        self._seed = seed
        self._files = _corpus_files(list(paths))
        if not self._files:
            where = paths if paths else "the standard library"
            raise ValueError(f"text corpus from {where!r} has no non-empty files")
        sizes = np.array([os.path.getsize(f) for f in self._files], dtype=np.int64)
        self._sizes = sizes
        # _ends[k] = offset one past file k's last byte in the concatenation.
        self._ends = np.cumsum(sizes)
        self._total = int(self._ends[-1])

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    @property
    def files(self) -> list[str]:
        return list(self._files)

    @property
    def total_bytes(self) -> int:
        return self._total

    def fingerprint(self) -> dict[str, int]:
        """A compact description of the corpus for run logs."""
        return {"files": len(self._files), "total_bytes": self._total}

    def sample(self, index: int, seq_len: int) -> torch.Tensor:
        """Bytes of sample `index` as tokens: int64, shape [seq_len + 1]."""
        _check_sample_args(index, seq_len)
        length = seq_len + 1
        if self._total < length:
            raise ValueError(
                f"text corpus has {self._total} bytes, fewer than seq_len+1={length}; "
                "add more files to data.paths or lower the sequence length"
            )
        rng = _sample_rng(self._seed, index)
        # Offsets span [0, total - length] inclusive so every sample fits.
        offset = int(rng.integers(0, self._total - length + 1))
        data = self.read(offset, length)
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes of the concatenated corpus starting at `offset`."""
        if offset < 0 or length < 0 or offset + length > self._total:
            raise ValueError(
                f"read of {length} bytes at offset {offset} exceeds the corpus of {self._total} bytes"
            )
        chunks: list[bytes] = []
        file_idx = int(np.searchsorted(self._ends, offset, side="right"))
        while length > 0:
            file_start = int(self._ends[file_idx] - self._sizes[file_idx])
            within = offset - file_start
            take = min(length, int(self._sizes[file_idx]) - within)
            chunks.append(self._read_file(file_idx, within, take))
            offset += take
            length -= take
            file_idx += 1
        return b"".join(chunks)

    def _read_file(self, file_idx: int, within: int, take: int) -> bytes:
        path = self._files[file_idx]
        with open(path, "rb") as fh:
            fh.seek(within)
            data = fh.read(take)
        # A short read means the file shrank after indexing; silently padding
        # would shift every later sample, so stop loudly instead.
        if len(data) != take:
            raise RuntimeError(
                f"corpus file {path!r} changed size since it was indexed; "
                "keep training data immutable during a run"
            )
        return data


def build_source(cfg: DataConfig, vocab_size: int) -> TokenSource:
    """The token source `cfg` asks for, checked against the model's vocabulary."""
    if cfg.source == "synthetic":
        return SyntheticTokens(vocab_size, cfg.seed)
    if cfg.source == "text":
        if vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"data.source='text' emits byte tokens 0..255 but model.vocab_size={vocab_size}; "
                f"raise model.vocab_size to at least {BYTE_VOCAB_SIZE}"
            )
        return ByteTextTokens(cfg.paths, cfg.seed)
    raise ValueError(
        f"data.source={cfg.source!r} is unknown; set it to one of {list(VALID_SOURCES)}"
    )


class TokenStream:
    """Per-rank batches of a global, step-ordered sample sequence.

    Step k consumes global samples [start + k*G, start + (k+1)*G); dp rank r
    takes the contiguous slice [r*G/dp, (r+1)*G/dp) of it. The position is
    counted in global samples, so it is the same on every rank and remains
    valid if the job resumes with a different data-parallel degree.
    """

    def __init__(
        self,
        source: TokenSource,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_degree: int,
        start_sample: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1")
        if dp_degree < 1:
            raise ValueError(f"dp_degree={dp_degree} must be >= 1")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_degree={dp_degree})")
        if global_batch % dp_degree != 0:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by dp_degree={dp_degree}; "
                "choose a global batch that is a multiple of the data-parallel degree"
            )
        self._check_position(start_sample)
        self._source = source
        self._seq_len = seq_len
        self._global_batch = global_batch
        self._local_batch = global_batch // dp_degree
        self._rank_offset = dp_rank * self._local_batch
        self._position = start_sample

    @staticmethod
    def _check_position(sample_index: Any) -> None:
        if not isinstance(sample_index, int) or sample_index < 0:
            raise ValueError(f"sample_index={sample_index!r} must be a non-negative integer")

    @property
    def position(self) -> int:
        """Global index of the next step's first sample (same on all dp ranks)."""
        return self._position

    @property
    def local_batch(self) -> int:
        return self._local_batch

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 [local_batch, seq_len]; advances one step."""
        first = self._position + self._rank_offset
        tokens = torch.stack(
            [self._source.sample(first + j, self._seq_len) for j in range(self._local_batch)]
        )
        # Advance only after every sample was produced, so a failed read
        # leaves the position on the step that still needs to be taken.
        self._position += self._global_batch
        # Contiguous copies so callers can .view() them and the big tensor is freed.
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position (forward or back); O(1) for any distance."""
        if "sample_index" not in state:
            raise ValueError(
                f"data state {state!r} lacks 'sample_index'; pass a TokenStream.state_dict()"
            )
        self._check_position(state["sample_index"])
        self._position = state["sample_index"]


@dataclass(frozen=True, slots=True)
class _Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    position_after: int


@dataclass(frozen=True, slots=True)
class _Failure:
    error: BaseException
    position: int


class PrefetchLoader:
    """Prepares batches of a TokenStream on a daemon thread, `depth` ahead.

    The stream is owned by the thread while it runs; the loader's own
    position tracks what the consumer has taken, which is what a checkpoint
    must record (the prefetched-but-unused batches are simply redone).
    """

    def __init__(self, stream: TokenStream, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth={depth} must be >= 1; raise data.prefetch")
        self._stream = stream
        self._depth = depth
        self._position = stream.position
        self._failure: _Failure | None = None
        self._closed = False
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue[_Batch | _Failure] = queue.Queue(maxsize=self._depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(self._queue, self._stop), name="data-prefetch", daemon=True
        )
        self._thread.start()

    def _produce(self, out: queue.Queue[_Batch | _Failure], stop: threading.Event) -> None:
        while not stop.is_set():
            position = self._stream.position
            try:
                inputs, targets = self._stream.next_batch()
            # Deliberately broad: the error is not swallowed but handed to the
            # consumer, which re-raises it; otherwise training would hang on
            # an empty queue after the thread died.
            except Exception as exc:  # noqa: BLE001
                self._put(out, stop, _Failure(exc, position))
                return
            self._put(out, stop, _Batch(inputs, targets, self._stream.position))

    @staticmethod
    def _put(out: queue.Queue[_Batch | _Failure], stop: threading.Event, item: _Batch | _Failure) -> None:
        # A timed put re-checks the stop flag, so close() never waits on a
        # full queue that nobody will drain.
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_JOIN_TIMEOUT_S)

    @property
    def position(self) -> int:
        """Global index of the first sample of the next batch `next()` returns."""
        return self._position

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restart prefetching from a saved position, discarding prepared batches."""
        if self._closed:
            raise RuntimeError("data loader is closed; create a new PrefetchLoader")
        self._halt()
        if self._thread.is_alive():
            raise RuntimeError(
                f"data loader thread did not stop within {_JOIN_TIMEOUT_S}s; cannot reposition it"
            )
        self._stream.load_state_dict(state)
        self._position = self._stream.position
        self._failure = None
        self._start()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) batch; re-raises a producer failure."""
        if self._closed:
            raise RuntimeError("data loader is closed; create a new PrefetchLoader")
        if self._failure is None:
            item = self._get()
            if isinstance(item, _Batch):
                self._position = item.position_after
                return item.inputs, item.targets
            self._failure = item
        raise RuntimeError(
            f"data loader failed while preparing the batch at sample {self._failure.position}"
        ) from self._failure.error

    def _get(self) -> _Batch | _Failure:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                # Re-check the queue after seeing the thread dead: it may have
                # put its last item between our timeout and the liveness check.
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(
                        "data loader thread stopped without producing a batch"
                    ) from None

    def close(self) -> None:
        """Stop the background thread; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._halt()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
