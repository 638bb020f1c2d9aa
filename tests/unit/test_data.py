"""Unit tests of train/data.py: sources, the resumable stream and the prefetch loader."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from train.data import (
    ByteTextTokens,
    DataConfig,
    PrefetchLoader,
    SyntheticTokens,
    TokenStream,
    build_source,
)

pytestmark = pytest.mark.unit

VOCAB = 128
SEQ = 16


def _stream(source=None, *, global_batch=4, dp_rank=0, dp_degree=1, start_sample=0) -> TokenStream:
    return TokenStream(
        source or SyntheticTokens(VOCAB, seed=7),
        seq_len=SEQ,
        global_batch=global_batch,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        start_sample=start_sample,
    )


class _FailingSource:
    """Serves good samples until `fail_at`, then raises like a broken disk would."""

    def __init__(self, fail_at: int) -> None:
        self._inner = SyntheticTokens(VOCAB, seed=1)
        self._fail_at = fail_at

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def sample(self, index: int, seq_len: int) -> torch.Tensor:
        if index >= self._fail_at:
            raise OSError(f"disk gone at sample {index}")
        return self._inner.sample(index, seq_len)


def test_it_gives_the_same_samples_for_the_same_seed():
    a, b = SyntheticTokens(VOCAB, seed=3), SyntheticTokens(VOCAB, seed=3)
    for i in (0, 1, 17, 10**12):
        assert torch.equal(a.sample(i, SEQ), b.sample(i, SEQ))


def test_a_different_seed_gives_different_samples():
    a, b = SyntheticTokens(VOCAB, seed=3), SyntheticTokens(VOCAB, seed=4)
    assert not torch.equal(a.sample(0, 64), b.sample(0, 64))


def test_different_indices_give_different_samples():
    src = SyntheticTokens(VOCAB, seed=3)
    assert not torch.equal(src.sample(0, 64), src.sample(1, 64))


def test_synthetic_samples_are_int64_in_vocab_with_seq_len_plus_one_tokens():
    sample = SyntheticTokens(VOCAB, seed=3).sample(5, SEQ)
    assert sample.dtype == torch.int64
    assert sample.shape == (SEQ + 1,)
    assert 0 <= int(sample.min()) and int(sample.max()) < VOCAB


def test_synthetic_tokens_are_learnable():
    src = SyntheticTokens(256, seed=11)
    pairs: Counter[tuple[int, int]] = Counter()
    for i in range(40):
        toks = src.sample(i, 512).tolist()
        pairs.update(zip(toks[:-1], toks[1:]))
    prev_counts: Counter[int] = Counter()
    for (prev, _), n in pairs.items():
        prev_counts[prev] += n
    total = sum(pairs.values())
    # H(next | current) from bigram counts; uniform noise would give log(256).
    cond_entropy = -sum(n / total * math.log(n / prev_counts[p]) for (p, _), n in pairs.items())
    assert cond_entropy < 0.4 * math.log(256)


def test_synthetic_sources_cover_most_of_the_vocabulary():
    src = SyntheticTokens(VOCAB, seed=11)
    seen = set(torch.cat([src.sample(i, 64) for i in range(50)]).tolist())
    assert len(seen) > 0.9 * VOCAB


def test_it_splits_each_global_batch_across_dp_ranks_without_overlap():
    source = SyntheticTokens(VOCAB, seed=5)
    whole = _stream(source, global_batch=4)
    ranks = [_stream(source, global_batch=4, dp_rank=r, dp_degree=2) for r in range(2)]
    for _ in range(3):
        inputs, targets = whole.next_batch()
        parts = [s.next_batch() for s in ranks]
        assert torch.equal(inputs, torch.cat([p[0] for p in parts]))
        assert torch.equal(targets, torch.cat([p[1] for p in parts]))
        assert not torch.equal(parts[0][0], parts[1][0])
    assert whole.position == ranks[0].position == ranks[1].position == 12


def test_batches_are_shifted_inputs_and_targets_of_local_batch_by_seq_len():
    inputs, targets = _stream(global_batch=6, dp_degree=3).next_batch()
    assert inputs.shape == targets.shape == (2, SEQ)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_it_resumes_at_the_saved_position():
    original = _stream()
    for _ in range(3):
        original.next_batch()
    state = original.state_dict()
    assert state == {"sample_index": 12}
    resumed = _stream()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], original.next_batch()[0])


def test_it_can_seek_backwards():
    stream = _stream()
    first = stream.next_batch()[0]
    stream.next_batch()
    stream.load_state_dict({"sample_index": 0})
    assert torch.equal(stream.next_batch()[0], first)


def test_start_sample_skips_whole_steps():
    skipped = _stream(start_sample=8)
    stepped = _stream()
    stepped.next_batch()
    stepped.next_batch()
    assert torch.equal(skipped.next_batch()[0], stepped.next_batch()[0])


def test_prefetch_loader_yields_the_same_batches_as_the_stream():
    plain = _stream()
    expected = [plain.next_batch() for _ in range(5)]
    with PrefetchLoader(_stream(), depth=2) as loader:
        for want in expected:
            got = loader.next()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prefetch_loader_reports_consumer_position_not_prefetched_position():
    stream = _stream()
    with PrefetchLoader(stream, depth=3) as loader:
        loader.next()
        loader.next()
        # Give the thread time to fill the queue so its stream runs ahead.
        deadline = time.monotonic() + 2.0
        while stream.position < 5 * 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.position > 2 * 4
        assert loader.position == 2 * 4
        state = loader.state_dict()
        continued = loader.next()
    resumed = _stream()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()[0], continued[0])


def test_prefetch_loader_can_be_repositioned():
    with PrefetchLoader(_stream(), depth=2) as loader:
        first = loader.next()
        loader.next()
        loader.load_state_dict({"sample_index": 0})
        assert loader.position == 0
        assert torch.equal(loader.next()[0], first[0])
        assert loader.position == 4


def test_prefetch_loader_reraises_producer_errors():
    # Samples 0..7 are fine: two good steps, then the third fails.
    with PrefetchLoader(_stream(_FailingSource(fail_at=8)), depth=2) as loader:
        loader.next()
        loader.next()
        with pytest.raises(RuntimeError, match="data loader failed") as info:
            loader.next()
        assert isinstance(info.value.__cause__, OSError)
        assert loader.position == 8
        # The failure sticks rather than hanging on an empty queue.
        with pytest.raises(RuntimeError, match="data loader failed"):
            loader.next()


def test_prefetch_loader_close_stops_the_thread_promptly():
    loader = PrefetchLoader(_stream(), depth=1)
    loader.next()
    time.sleep(0.05)  # let the producer block on the full queue
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 1.0
    assert not any(t.name == "data-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        loader.next()
    loader.close()  # idempotent


def test_text_source_reads_real_bytes_from_files(tmp_path: Path):
    first, second = b"hello world, ", b"second file body!"
    (tmp_path / "a.txt").write_bytes(first)
    (tmp_path / "b.txt").write_bytes(second)
    src = ByteTextTokens([str(tmp_path / "*.txt")], seed=0)
    corpus = first + second
    assert src.fingerprint() == {"files": 2, "total_bytes": len(corpus)}
    assert src.vocab_size == 256
    # A read straddling the file boundary returns the concatenation's bytes.
    assert src.read(len(first) - 4, 10) == corpus[len(first) - 4 : len(first) + 6]
    for i in range(20):
        sample = src.sample(i, 8)
        assert sample.dtype == torch.int64 and sample.shape == (9,)
        assert bytes(sample.tolist()) in corpus


def test_text_source_samples_can_span_the_file_boundary(tmp_path: Path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"defg")
    src = ByteTextTokens([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], seed=0)
    # seq_len+1 == 6 of 7 bytes: every sample necessarily crosses a.txt -> b.txt.
    assert {bytes(src.sample(i, 5).tolist()) for i in range(20)} <= {b"abcdef", b"bcdefg"}


def test_text_source_file_order_is_sorted_and_deduplicated(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    for name in ("b.txt", "a.txt", "sub/c.txt"):
        (tmp_path / name).write_text(name)
    src = ByteTextTokens(
        [str(tmp_path / "b.txt"), str(tmp_path / "**" / "*.txt"), str(tmp_path / "a.txt")], seed=0
    )
    assert [Path(f).relative_to(tmp_path.resolve()).as_posix() for f in src.files] == [
        "a.txt",
        "b.txt",
        "sub/c.txt",
    ]


def test_text_source_rejects_a_corpus_shorter_than_a_sample(tmp_path: Path):
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    src = ByteTextTokens([str(tmp_path / "tiny.txt")], seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        src.sample(0, 8)


def test_default_text_corpus_is_the_stdlib():
    src = build_source(DataConfig(source="text"), vocab_size=256)
    info = src.fingerprint()
    assert info["files"] > 100
    assert info["total_bytes"] > 1_000_000
    assert all(f.endswith(".py") and "site-packages" not in f for f in src.files)
    assert torch.equal(src.sample(3, 32), src.sample(3, 32))


def test_build_source_returns_synthetic_tokens_with_the_model_vocab():
    src = build_source(DataConfig(), vocab_size=VOCAB)
    assert isinstance(src, SyntheticTokens) and src.vocab_size == VOCAB


def test_unknown_source_is_rejected_with_the_valid_choices():
    with pytest.raises(ValueError, match="synthetic.*text"):
        DataConfig(source="parquet")


def test_glob_matching_nothing_is_rejected_naming_the_pattern(tmp_path: Path):
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(ValueError, match=re.escape(pattern)):
        ByteTextTokens([pattern], seed=0)


def test_indivisible_global_batch_is_rejected():
    with pytest.raises(ValueError, match="divisible"):
        _stream(global_batch=5, dp_degree=2)


def test_text_source_needs_a_vocab_of_at_least_256():
    with pytest.raises(ValueError, match="model.vocab_size"):
        build_source(DataConfig(source="text"), vocab_size=128)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [({"prefetch": 0}, "prefetch"), ({"seed": -1}, "seed"), ({"paths": "a.txt"}, "paths")],
)
def test_bad_config_fields_are_rejected_by_name(kwargs, field_name):
    with pytest.raises(ValueError, match=f"data.{field_name}"):
        DataConfig(**kwargs)


def test_bad_dp_rank_is_rejected():
    with pytest.raises(ValueError, match="dp_rank"):
        _stream(dp_rank=2, dp_degree=2)
