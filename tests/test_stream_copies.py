"""Host copies from ``_core.stream_copy_min`` bytes on write with streaming stores (``_stream_copy.pxd``): every
byte lands where its triple says and none elsewhere, whatever the sizes and alignments, on the loop's thread
(``copy_now``) and on the copy threads (``HostCopyEngine``)."""

from __future__ import annotations

import array
import os
import random

import pytest
import torch

from aio_datadist import _core
from aio_datadist.transport import same_host

SPAN = 1 << 20
#: Sizes around the streaming copy's own edges: under 256 bytes past the first line it is one memcpy; a body
#: of whole 64-byte lines, then a tail.
EDGES = (0, 1, 63, 64, 65, 255, 256, 257, 319, 320, 321, 4095, 4096, 32768, 70001)


@pytest.fixture
def streaming():
    """Every copy streams while the test runs."""
    old = _core.set_stream_copy_min(0)
    yield
    _core.set_stream_copy_min(old)


def _random_list(rng: random.Random, src: torch.Tensor, dst: torch.Tensor) -> tuple[array.array, torch.Tensor]:
    """Triples copying pieces of ``src`` to disjoint places of ``dst`` at any alignment; what ``dst`` must hold
    after (zero where no piece lands)."""
    triples, want = array.array("Q"), torch.zeros_like(dst)
    at = rng.randint(0, 70)
    for _ in range(rng.randint(1, 6)):
        n = rng.choice((*EDGES, rng.randint(0, 200_000)))
        if at + n > SPAN:
            break
        s = rng.randint(0, SPAN - n)
        triples.extend((dst.data_ptr() + at, src.data_ptr() + s, n))
        want[at:at + n] = src[s:s + n]
        at += n + rng.randint(0, 130)
    return triples, want


def test_a_streaming_copy_now_is_exact_at_every_size_and_alignment(streaming):
    rng = random.Random(19)
    src = torch.randint(0, 256, (SPAN,), dtype=torch.uint8)
    before = _core.streamed_lists()
    for trial in range(150):
        dst = torch.zeros(SPAN, dtype=torch.uint8)
        triples, want = _random_list(rng, src, dst)
        assert _core.copy_now(triples) == sum(triples[2::3])
        assert torch.equal(dst, want), f"trial {trial}: {list(triples)}"
    assert _core.streamed_lists() == before + 150


def test_copy_now_streams_from_the_threshold_on():
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    old = _core.set_stream_copy_min(2 << 20)
    try:
        for nbytes, streams in (((2 << 20) - 1, False), (2 << 20, True), (3 << 20, True)):
            dst.zero_()
            before = _core.streamed_lists()
            half = nbytes // 2  # two triples: the threshold counts the list's bytes in all
            _core.copy_now(array.array("Q", [dst.data_ptr(), src.data_ptr(), half,
                                             dst.data_ptr() + half + 7, src.data_ptr() + half, nbytes - half]))
            assert _core.streamed_lists() == before + streams
            assert torch.equal(dst[:half], src[:half])
            assert torch.equal(dst[half + 7:nbytes + 7], src[half:nbytes])
            assert not dst[half:half + 7].any() and not dst[nbytes + 7:].any()
    finally:
        _core.set_stream_copy_min(old)


@pytest.mark.parametrize("threshold", [0, 2 ** 64 - 1], ids=["streaming", "memcpy"])
def test_an_engine_job_is_exact_split_over_threads_streaming_or_not(threshold):
    """A 9 MiB job at odd offsets, split into chunks over two threads (and each chunk into 1 MiB steps)."""
    old = _core.set_stream_copy_min(threshold)
    queue = _core.CompletionQueue()
    engine = _core.HostCopyEngine(queue, threads=2, split_bytes=1 << 20)
    try:
        src = torch.randint(0, 256, (10 << 20,), dtype=torch.uint8)
        dst = torch.zeros(10 << 20, dtype=torch.uint8)
        pieces = ((3, 17, (4 << 20) + 5), ((4 << 20) + 70, (5 << 20) + 1, (5 << 20) - 9))
        triples = array.array("Q")
        want = torch.zeros_like(dst)
        for d, s, n in pieces:
            triples.extend((dst.data_ptr() + d, src.data_ptr() + s, n))
            want[d:d + n] = src[s:s + n]
        assert engine.submit(7, triples) == sum(n for _, _, n in pieces)
        assert engine.streamed_jobs == (threshold == 0)
        assert engine.wait(7, 30.0)
        assert torch.equal(dst, want)
    finally:
        engine.close()
        queue.close()
        _core.set_stream_copy_min(old)


def test_the_threshold_is_checked_and_defaults_to_2_mib():
    if not os.environ.get("AIO_DATADIST_STREAM_COPY_MIN", "").strip():
        assert same_host.STREAM_COPY_MIN == 2 << 20
    current = _core.stream_copy_min()
    assert current == same_host.STREAM_COPY_MIN
    for bad in (-1, 2 ** 64, True, 1.5, "1", None):
        with pytest.raises(ValueError, match="streaming copy threshold"):
            _core.set_stream_copy_min(bad)
    assert _core.stream_copy_min() == current
    assert _core.set_stream_copy_min(2 ** 64 - 1) == current  # off, for comparisons
    assert _core.set_stream_copy_min(current) == 2 ** 64 - 1
