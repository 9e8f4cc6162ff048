"""StreamNotifier on a real CUDA stream: order, no early records, cancellation, close, completions."""

from __future__ import annotations

import asyncio
import select
import time

import pytest
import torch

from aio_datadist import LLMException, LLMStatusCode, _core
from aio_datadist._completion import Completions

S = LLMStatusCode
# torch.cuda._sleep spins this many GPU cycles: about 50 ms at the H200's clocks.
LONG = 100_000_000


@pytest.fixture
def queue():
    q = _core.CompletionQueue()
    yield q
    q.close()


@pytest.fixture(params=[0, 200_000], ids=["host-functions", "event-watcher"])
def notifier(queue, request):
    """Host functions only, and with the event watcher (a 200 ms window: it catches the 50 ms sleeps)."""
    n = _core.StreamNotifier(queue, "cuda", torch.cuda.current_device(), poll_us=request.param)
    assert n.watching == (request.param > 0)
    yield n
    n.close()


def wait_records(queue, count, timeout=10.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {count} records arrived"
        select.select([queue.fileno()], [], [], left)
        got.extend(queue.drain())
    return got


def test_records_follow_stream_order_and_never_come_early(queue, notifier):
    stream = torch.cuda.Stream()
    events = []
    with torch.cuda.stream(stream):
        for token in (1, 2, 3):
            torch.cuda._sleep(LONG)
            done = torch.cuda.Event()
            done.record(stream)
            events.append(done)
            notifier.notify(token, stream.cuda_stream, token * 10)
    assert notifier.pending() == 3
    assert not select.select([queue.fileno()], [], [], 0)[0], "a record came before the stream got there"
    seen = []
    deadline = time.monotonic() + 10
    while len(seen) < 3:
        select.select([queue.fileno()], [], [], max(0.0, deadline - time.monotonic()))
        for token, status, aux in queue.drain():
            # Everything enqueued before this token's notify has finished when its record is read.
            assert events[token - 1].query(), f"record {token} arrived before its stream work finished"
            seen.append((token, status, aux))
        assert time.monotonic() < deadline
    assert seen == [(1, 0, 10), (2, 0, 20), (3, 0, 30)]
    assert notifier.pending() == 0


def test_the_event_watcher_posts_ahead_of_the_host_functions_and_only_once(queue):
    n = _core.StreamNotifier(queue, "cuda", torch.cuda.current_device(), poll_us=200_000)
    try:
        stream = torch.cuda.Stream()
        src = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
        dst = torch.zeros_like(src)
        for token in range(1, 21):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(LONG // 50)  # about 1 ms
                dst.copy_(src + token)
                n.notify(token, stream.cuda_stream, token)
            (got,) = wait_records(queue, 1)
            assert got == (token, 0, token)
            # The record says the copy is done: its bytes are there, read without any wait on the stream.
            assert int(dst[12345].item()) == 12345 + token
        early, expired = n.watch_counts
        assert early >= 15 and expired == 0, (early, expired)  # nearly all ahead of their host functions
        time.sleep(0.05)
        assert queue.drain() == [] and n.pending() == 0  # the host functions posted nothing more
    finally:
        assert n.close()


def test_the_legacy_default_stream_works(queue, notifier):
    torch.cuda._sleep(LONG // 10)
    notifier.notify(7, 0, 1)
    assert wait_records(queue, 1) == [(7, 0, 1)]


def test_cancel_marks_the_token_and_its_record_waits_for_the_stream(queue, notifier):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(LONG)
        done = torch.cuda.Event()
        done.record(stream)
        notifier.notify(1, stream.cuda_stream, 99)
    assert notifier.cancel(1) is True
    assert notifier.cancel(1) is True
    records = wait_records(queue, 1)
    assert records == [(1, _core.CANCELLED, 0)]
    assert done.query()
    assert notifier.cancel(1) is False
    with pytest.raises(ValueError, match="already in use"):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(LONG)
            notifier.notify(2, stream.cuda_stream)
            notifier.notify(2, stream.cuda_stream)
    wait_records(queue, 1)


def test_close_waits_for_every_enqueued_notification(queue):
    n = _core.StreamNotifier(queue, "cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(4 * LONG)
        done = torch.cuda.Event()
        done.record(stream)
        n.notify(5, stream.cuda_stream)
    n.close()
    assert done.query(), "close returned before the device reached the notification"
    assert queue.drain() == [(5, 0, 0)]
    assert n.closed and n.pending() == 0
    with pytest.raises(ValueError, match="closed"):
        n.notify(6, stream.cuda_stream)
    n.close()


def test_a_bad_device_is_refused(queue):
    with pytest.raises(OSError, match="CUDA device"):
        _core.StreamNotifier(queue, "cuda", torch.cuda.device_count() + 3)


@pytest.mark.asyncio
async def test_completions_hold_a_cancelled_token_until_the_device_is_done(queue, notifier):
    comp = Completions(queue)
    try:
        stream = torch.cuda.Stream()
        keep = torch.empty(16, device="cuda")
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2 * LONG)
            fut = comp.start(lambda t: notifier.notify(t, stream.cuda_stream, 5), notifier.cancel,
                             timeout_ms=None, what="device work", keepalive=keep)
        fut.cancel()
        await asyncio.sleep(0)
        assert comp.pending_count() == 1 and notifier.pending() == 1
        for _ in range(500):
            if comp.pending_count() == 0:
                break
            await asyncio.sleep(0.01)
        assert comp.pending_count() == 0 and notifier.pending() == 0
        with torch.cuda.stream(stream):
            ok = comp.start(lambda t: notifier.notify(t, stream.cuda_stream, 5), notifier.cancel,
                            timeout_ms=5000, what="device work")
        assert await ok == 5
        with torch.cuda.stream(stream):
            torch.cuda._sleep(4 * LONG)
            late = comp.start(lambda t: notifier.notify(t, stream.cuda_stream), notifier.cancel,
                              timeout_ms=5, what="device work")
        with pytest.raises(LLMException) as info:
            await late
        assert info.value.status_code == S.LLM_TIMEOUT
        for _ in range(500):
            if comp.pending_count() == 0:
                break
            await asyncio.sleep(0.01)
        assert comp.pending_count() == 0
    finally:
        comp.close()
