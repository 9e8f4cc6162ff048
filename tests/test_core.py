"""The native core on its own: completion queue, copy engine, socket engine, segment builders.

These tests use the core the way the asyncio layer does, but synchronously:
submit, wait for the queue's eventfd with ``select``, drain, check the records.
"""

from __future__ import annotations

import array
import ast
import inspect
import os
import pathlib
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist import _core

MIB = 1 << 20
WAIT_S = 10.0


# ---- helpers -------------------------------------------------------------------


def wait_records(queue: _core.CompletionQueue, tokens, timeout: float = WAIT_S) -> dict[int, tuple[int, int]]:
    """Drain ``queue`` until a record for every token arrived; ``{token: (status, aux)}``."""
    want = set(tokens)
    got: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + timeout
    while not want <= got.keys():
        left = deadline - time.monotonic()
        assert left > 0, f"no record for tokens {sorted(want - got.keys())}"
        select.select([queue.fileno()], [], [], left)
        for token, status, aux in queue.drain():
            assert token not in got, f"token {token} reported twice"
            got[token] = (status, aux)
    return got


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def addr(buf: np.ndarray, offset: int = 0) -> int:
    return buf.ctypes.data + offset


def u64(values) -> array.array:
    return array.array("Q", values)


@pytest.fixture
def queue():
    q = _core.CompletionQueue()
    yield q
    q.close()


@pytest.fixture
def copier(queue):
    engine = _core.HostCopyEngine(queue, threads=2)
    yield engine
    engine.close()


@pytest.fixture
def one_thread_copier(queue):
    engine = _core.HostCopyEngine(queue, threads=1)
    yield engine
    engine.close()


@pytest.fixture
def sockets(queue):
    engine = _core.SocketEngine(queue)
    yield engine
    engine.close()


# ---- CompletionQueue -------------------------------------------------------------


def test_queue_drains_posted_records_in_order(queue):
    assert not readable(queue.fileno())
    queue.post(1)
    queue.post(2, _core.CANCELLED)
    queue.post(3, -5, 77)
    assert readable(queue.fileno())
    assert queue.drain() == [(1, 0, 0), (2, _core.CANCELLED, 0), (3, -5, 77)]
    assert queue.drain() == []
    assert not readable(queue.fileno())


def test_queue_collects_records_from_many_threads(queue):
    def post(first: int) -> None:
        for token in range(first, first + 500):
            queue.post(token, 0, token)

    threads = [threading.Thread(target=post, args=(1 + 500 * i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = wait_records(queue, range(1, 2001))
    assert all(got[token] == (0, token) for token in got)


def test_queue_close_is_idempotent_and_counted():
    before = _core.live_objects()["CompletionQueue"]
    q = _core.CompletionQueue()
    assert _core.live_objects()["CompletionQueue"] == before + 1
    q.post(1)
    q.close()
    q.close()
    assert q.closed
    assert _core.live_objects()["CompletionQueue"] == before
    for call in (q.fileno, q.drain, lambda: q.post(2)):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_status_constants_are_negative_errnos():
    import errno

    assert _core.OK == 0
    assert _core.CANCELLED == -errno.ECANCELED
    assert _core.CONNECTION_LOST == -errno.ECONNRESET


# ---- HostCopyEngine ----------------------------------------------------------------


@st.composite
def copy_lists(draw):
    """Random non-overlapping destination ranges, each paired with any source range."""
    size = 1 << 16
    lengths = draw(st.lists(st.integers(0, 3000), min_size=0, max_size=20))
    gaps = draw(st.lists(st.integers(0, 200), min_size=len(lengths), max_size=len(lengths)))
    order = draw(st.permutations(range(len(lengths))))
    dst_offsets = [0] * len(lengths)
    pos = 0
    for i in order:
        pos += gaps[i]
        dst_offsets[i] = pos
        pos += lengths[i]
    src_offsets = [draw(st.integers(0, size - n)) for n in lengths]
    return size, list(zip(dst_offsets, src_offsets, lengths))


@settings(max_examples=40, deadline=None)
@given(case=copy_lists(), threads=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_copy_engine_matches_numpy(case, threads, seed):
    size, segs = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = rng.integers(0, 256, size + 4096, dtype=np.uint8)
    expected = dst.copy()
    for d, s, n in segs:
        expected[d:d + n] = src[s:s + n]
    q = _core.CompletionQueue()
    engine = _core.HostCopyEngine(q, threads=threads)
    try:
        triples = u64(v for d, s, n in segs for v in (addr(dst, d), addr(src, s), n))
        total = engine.submit(7, triples)
        assert total == sum(n for _, _, n in segs)
        assert wait_records(q, [7]) == {7: (_core.OK, total)}
        assert engine.pending() == 0
    finally:
        engine.close()
        q.close()
    assert np.array_equal(dst, expected)


def test_copy_engine_splits_large_jobs_over_threads(queue):
    engine = _core.HostCopyEngine(queue, threads=3, split_bytes=1 * MIB)
    try:
        rng = np.random.default_rng(1)
        src = rng.integers(0, 256, 24 * MIB, dtype=np.uint8)
        dst = np.zeros(32 * MIB, dtype=np.uint8)
        # Big runs (cut into 1 MiB chunks), adjacent runs (coalesced) and small pieces.
        segs = [(0, 0, 5 * MIB), (5 * MIB, 5 * MIB, 3 * MIB), (9 * MIB, 12 * MIB, 7 * MIB + 13),
                (20 * MIB, 1, 100), (21 * MIB, 3, 4 * MIB)]
        triples = u64(v for d, s, n in segs for v in (addr(dst, d), addr(src, s), n))
        total = engine.submit(1, triples)
        assert wait_records(queue, [1]) == {1: (_core.OK, total)}
        expected = np.zeros_like(dst)
        for d, s, n in segs:
            expected[d:d + n] = src[s:s + n]
        assert np.array_equal(dst, expected)
    finally:
        engine.close()


def test_copy_engine_completes_an_empty_job(copier, queue):
    assert copier.submit(5, u64([])) == 0
    assert copier.submit(6, u64([1, 2, 0])) == 0  # zero-length segments are dropped
    assert wait_records(queue, [5, 6]) == {5: (_core.OK, 0), 6: (_core.OK, 0)}


def test_copy_engine_rejects_bad_submissions(one_thread_copier, queue):
    src = np.ones(64 * MIB, dtype=np.uint8)
    dst = np.zeros(64 * MIB, dtype=np.uint8)
    with pytest.raises(ValueError, match="triples"):
        one_thread_copier.submit(1, u64([1, 2]))
    with pytest.raises(TypeError):
        one_thread_copier.submit(1, None)
    one_thread_copier.submit(2, u64([addr(dst), addr(src), dst.nbytes]))
    with pytest.raises(ValueError, match="already in use"):
        one_thread_copier.submit(2, u64([addr(dst), addr(src), 10]))
    wait_records(queue, [2])
    assert one_thread_copier.pending() == 0


@pytest.mark.parametrize("threads", [0, 65, -1])
def test_copy_engine_rejects_thread_counts_without_leaking(queue, threads):
    before = _core.live_objects()
    with pytest.raises(ValueError, match="threads"):
        _core.HostCopyEngine(queue, threads=threads)
    assert _core.live_objects() == before


def test_failed_construction_touches_nothing(queue):
    """Regression: a half-built engine closed fd 0 and skewed the live counts."""
    stdin_before = os.fstat(0) if _fd_open(0) else None
    before = _core.live_objects()
    closed = _core.CompletionQueue()
    closed.close()
    for make in (lambda: _core.SocketEngine(closed), lambda: _core.HostCopyEngine(closed)):
        with pytest.raises(ValueError, match="closed"):
            make()
    for make in (lambda: _core.SocketEngine(None), lambda: _core.HostCopyEngine(None)):
        with pytest.raises(TypeError):
            make()
    assert _core.live_objects() == before
    if stdin_before is not None:
        assert os.fstat(0).st_ino == stdin_before.st_ino


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_cancel_queued_copy_then_next_copy_succeeds(one_thread_copier, queue):
    big_src = np.ones(64 * MIB, dtype=np.uint8)
    big_dst = np.zeros(64 * MIB, dtype=np.uint8)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.full(4096, 0xAB, dtype=np.uint8)
    one_thread_copier.submit(1, u64([addr(big_dst), addr(big_src), big_dst.nbytes]))
    one_thread_copier.submit(2, u64([addr(dst), addr(src), 4096]))  # queued behind job 1
    assert one_thread_copier.cancel(2) is True
    assert one_thread_copier.cancel(2) in (True, False)  # idempotent
    assert one_thread_copier.cancel(999) is False
    got = wait_records(queue, [1, 2])
    assert got[1] == (_core.OK, big_dst.nbytes)
    assert got[2] == (_core.CANCELLED, 0)
    assert (dst == 0xAB).all(), "a cancelled queued copy wrote its destination"
    assert one_thread_copier.cancel(2) is False
    one_thread_copier.submit(3, u64([addr(dst), addr(src), 4096]))
    assert wait_records(queue, [3]) == {3: (_core.OK, 4096)}
    assert np.array_equal(dst, src)
    assert one_thread_copier.pending() == 0


def test_cancel_running_copy_stops_at_next_segment(one_thread_copier, queue):
    src = np.ones(256 * MIB, dtype=np.uint8)
    dst = np.zeros(256 * MIB, dtype=np.uint8)
    seg = 4 * MIB
    # Non-adjacent destinations, so the 64 segments are not coalesced into one.
    triples = u64(v for i in range(32) for v in (addr(dst, 2 * i * seg), addr(src, i * seg), seg))
    one_thread_copier.submit(1, triples)
    one_thread_copier.cancel(1)
    assert wait_records(queue, [1]) == {1: (_core.CANCELLED, 0)}
    assert not dst[2 * 31 * seg:].any(), "the last segment was copied after cancel"
    assert one_thread_copier.pending() == 0


def test_wait_returns_once_no_thread_copies_the_job_any_more(one_thread_copier, queue):
    """``wait`` blocks without the GIL until the job left the copy threads (or its timeout): after ``cancel``
    then ``wait``, nothing of the job is written any more, before its record was even drained."""
    src = np.ones(256 * MIB, dtype=np.uint8)
    dst = np.zeros(256 * MIB, dtype=np.uint8)
    one_thread_copier.submit(1, u64([addr(dst), addr(src), dst.nbytes]))
    deadline = time.monotonic() + 5
    while not dst[0] and time.monotonic() < deadline:
        pass
    assert one_thread_copier.wait(1, 0.0) is False  # still copying
    one_thread_copier.cancel(1)
    assert one_thread_copier.wait(1, 1.0) is True
    snapshot = dst.copy()
    time.sleep(0.1)
    assert np.array_equal(dst, snapshot), "the job wrote after wait returned"
    assert wait_records(queue, [1]) == {1: (_core.CANCELLED, 0)}
    assert one_thread_copier.wait(1, 0.0) is True  # a job that is over, or a token never used
    assert one_thread_copier.wait(999, 0.0) is True
    small_src, small_dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    one_thread_copier.submit(2, u64([addr(small_dst), addr(small_src), 4096]))
    assert one_thread_copier.wait(2, 5.0) is True  # a job that ends by itself
    assert np.array_equal(small_dst, small_src)
    assert wait_records(queue, [2]) == {2: (_core.OK, 4096)}


def test_close_cancels_queued_copies(queue):
    engine = _core.HostCopyEngine(queue, threads=1)
    big_src = np.ones(64 * MIB, dtype=np.uint8)
    big_dst = np.zeros(64 * MIB, dtype=np.uint8)
    small = np.zeros(16, dtype=np.uint8)
    engine.submit(1, u64([addr(big_dst), addr(big_src), big_dst.nbytes]))
    for token in (2, 3, 4):
        engine.submit(token, u64([addr(small), addr(big_src), 16]))
    engine.close()
    engine.close()
    got = wait_records(queue, [1, 2, 3, 4])
    assert got[1][0] in (_core.OK, _core.CANCELLED)
    assert all(got[t] == (_core.CANCELLED, 0) for t in (2, 3, 4))
    assert not small.any()
    assert engine.pending() == 0
    with pytest.raises(ValueError, match="closed"):
        engine.submit(5, u64([]))
    assert engine.cancel(2) is False


# ---- SocketEngine ------------------------------------------------------------------


def test_socket_engine_moves_scatter_gather_lists(sockets, queue, socket_pair):
    a, b = socket_pair
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 8 * MIB, dtype=np.uint8)
    dst = np.zeros(8 * MIB + 100, dtype=np.uint8)
    # Send three pieces of src; receive them into two pieces of dst.
    send = u64([addr(src, 0), 3 * MIB, addr(src, 3 * MIB), 1 * MIB, addr(src, 5 * MIB), 2 * MIB])
    recv = u64([addr(dst, 100), 2 * MIB, addr(dst, 2 * MIB + 100), 4 * MIB])
    assert sockets.submit_recv(1, b.fileno(), recv) == 6 * MIB
    assert sockets.submit_send(2, a.fileno(), send) == 6 * MIB
    assert wait_records(queue, [1, 2]) == {1: (_core.OK, 6 * MIB), 2: (_core.OK, 6 * MIB)}
    expected = np.concatenate([src[:4 * MIB], src[5 * MIB:7 * MIB]])
    assert np.array_equal(dst[100:100 + 6 * MIB], expected)
    assert not dst[:100].any() and not dst[100 + 6 * MIB:].any()
    assert sockets.pending() == 0
    sockets.detach(a.fileno())
    sockets.detach(b.fileno())


def test_socket_engine_cancel_waiting_receive_keeps_socket_usable(sockets, queue, socket_pair):
    a, b = socket_pair
    buf = np.zeros(1024, dtype=np.uint8)
    sockets.submit_recv(1, b.fileno(), u64([addr(buf), 1024]))
    assert sockets.cancel(1) is True
    assert wait_records(queue, [1]) == {1: (_core.CANCELLED, 0)}
    assert sockets.cancel(1) is False
    payload = np.arange(1024, dtype=np.uint16).astype(np.uint8)
    sockets.submit_recv(2, b.fileno(), u64([addr(buf), 1024]))
    sockets.submit_send(3, a.fileno(), u64([addr(payload), 1024]))
    assert wait_records(queue, [2, 3]) == {2: (_core.OK, 1024), 3: (_core.OK, 1024)}
    assert np.array_equal(buf, payload)
    sockets.detach(a.fileno())
    sockets.detach(b.fileno())


def test_socket_engine_reports_a_closed_peer(sockets, queue, socket_pair):
    a, b = socket_pair
    buf = np.zeros(64, dtype=np.uint8)
    sockets.submit_recv(1, b.fileno(), u64([addr(buf), 64]))
    a.send(b"x" * 10)
    a.shutdown(socket.SHUT_WR)
    assert wait_records(queue, [1]) == {1: (_core.CONNECTION_LOST, 10)}
    sockets.detach(b.fileno())


def test_socket_engine_detach_and_close_cancel_queued_jobs(queue, socket_pair):
    a, b = socket_pair
    engine = _core.SocketEngine(queue)
    buf = np.zeros(64, dtype=np.uint8)
    engine.submit_recv(1, b.fileno(), u64([addr(buf), 64]))
    engine.submit_recv(2, b.fileno(), u64([addr(buf), 64]))
    engine.detach(b.fileno())
    assert wait_records(queue, [1, 2]) == {1: (_core.CANCELLED, 0), 2: (_core.CANCELLED, 0)}
    engine.submit_recv(3, a.fileno(), u64([addr(buf), 64]))
    engine.close()
    engine.close()
    assert wait_records(queue, [3]) == {3: (_core.CANCELLED, 0)}
    assert engine.pending() == 0
    assert not buf.any()
    with pytest.raises(ValueError, match="closed"):
        engine.submit_send(4, a.fileno(), u64([addr(buf), 1]))
    assert engine.cancel(3) is False
    engine.detach(a.fileno())  # a no-op once closed


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(10)
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the peer closed"
        out += chunk
    return bytes(out)


def _answer(status: int, total: int) -> bytes:
    """An answer header as ``wire.ANSWER`` lays it out (magic, status, request id 7, total)."""
    return b"AIOA" + struct.pack("<IQQ", status, 7, total)


def test_gated_receive_takes_the_header_then_the_payload(sockets, queue, socket_pair):
    a, b = socket_pair
    header, payload = np.zeros(_core.GATE_BYTES, np.uint8), np.zeros(4096, np.uint8)
    sockets.submit_recv_gated(1, b.fileno(), u64([addr(header), _core.GATE_BYTES, addr(payload), 4096]), 7)
    a.sendall(_answer(0, 4096) + bytes(range(256)) * 16)
    assert wait_records(queue, [1]) == {1: (_core.OK, _core.GATE_BYTES + 4096)}
    assert header.tobytes() == _answer(0, 4096) and payload.tobytes() == bytes(range(256)) * 16
    sockets.detach(b.fileno())


@pytest.mark.parametrize("magic, status, req_id, total", [
    (b"AIOA", 1, 7, 12), (b"AIOA", 0x50110005, 7, 0),  # refusals
    (b"AIOA", 0, 7, 4095), (b"AIOA", 0, 7, 4097), (b"AIOA", 0, 7, 1 << 63),  # another size
    (b"AIOA", 0, 9, 4096), (b"AIOB", 0, 7, 4096), (b"\0\0\0\0", 0, 0, 0),  # another request, not an answer
])
def test_gated_receive_stops_after_a_refusal_or_another_answer(sockets, queue, socket_pair, magic, status, req_id,
                                                                total):
    """A refusal, an offer of another size, an answer to another request or no answer at all: the job
    ends after the header and nothing behind it is read: the payload stays untouched and the next bytes
    wait on the socket."""
    a, b = socket_pair
    header, payload = np.zeros(_core.GATE_BYTES, np.uint8), np.zeros(4096, np.uint8)
    behind = b"refused: no such key" + b"\xee" * 4096  # sent with the header: the peer lies or explains
    a.sendall(magic + struct.pack("<IQQ", status, req_id, total) + behind)
    sockets.submit_recv_gated(1, b.fileno(), u64([addr(header), _core.GATE_BYTES, addr(payload), 4096]), 7)
    assert wait_records(queue, [1]) == {1: (_core.OK, _core.GATE_BYTES)}
    assert not payload.any()
    b.setblocking(True)
    assert recv_exactly(b, len(behind)) == behind  # the stream is in step after the header
    sockets.detach(b.fileno())


def test_gated_receive_needs_its_header_first(sockets, socket_pair):
    _, b = socket_pair
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="header"):
        sockets.submit_recv_gated(1, b.fileno(), u64([addr(buf), 64]), 7)
    with pytest.raises(ValueError, match="header"):
        sockets.submit_recv_gated(1, b.fileno(), u64([]), 7)
    assert sockets.pending() == 0


def test_loop_job_moves_what_the_socket_takes_each_step(socket_pair):
    """A LoopJob steps until over: 0 while the socket is full or empty, 1 once every byte moved."""
    a, b = socket_pair
    src = np.random.default_rng(5).integers(0, 256, 8 * MIB, dtype=np.uint8)
    dst = np.zeros(8 * MIB, dtype=np.uint8)
    send = _core.LoopJob(a.fileno(), True, u64([addr(src, 4 * MIB), 4 * MIB, addr(src), 4 * MIB]))
    recv = _core.LoopJob(b.fileno(), False, u64([addr(dst), 8 * MIB]))
    assert send.sending and not recv.sending and send.total == recv.total == 8 * MIB
    assert recv.step() == 0 and recv.moved == 0  # nothing sent yet
    for _ in range(100_000):
        sent, got = send.step(), recv.step()
        if sent == 1 and got == 1:
            break
        assert sent in (0, 1) and got in (0, 1)
    assert send.moved == recv.moved == 8 * MIB
    assert np.array_equal(dst, np.concatenate([src[4 * MIB:], src[:4 * MIB]]))


def test_loop_job_gate_and_errors(socket_pair):
    a, b = socket_pair
    header, payload = np.zeros(_core.GATE_BYTES, np.uint8), np.zeros(64, np.uint8)
    job = _core.LoopJob(b.fileno(), False, u64([addr(header), _core.GATE_BYTES, addr(payload), 64]), 7, True)
    a.send(_answer(0, 64)[:10])
    assert job.step() == 0 and job.moved == 10  # part of the header: nothing past it
    a.send(_answer(0, 64)[10:] + b"x" * 64)
    assert job.step() == 1 and payload.tobytes() == b"x" * 64
    refused = _core.LoopJob(b.fileno(), False, u64([addr(header), _core.GATE_BYTES, addr(payload), 64]), 8, True)
    a.send(_answer(0, 64) + b"y" * 64)  # an answer to request 7, not 8
    assert refused.step() == 1 and refused.moved == _core.GATE_BYTES and payload.tobytes() == b"x" * 64
    a.close()
    lost = _core.LoopJob(b.fileno(), False, u64([addr(payload), 64]))
    assert lost.step() == 1 and lost.moved == 64  # the 64 bytes still queued
    assert _core.LoopJob(b.fileno(), False, u64([addr(payload), 64])).step() == _core.CONNECTION_LOST
    with pytest.raises(ValueError, match="header"):
        _core.LoopJob(b.fileno(), False, u64([addr(payload), 64]), 1, True)
    with pytest.raises(ValueError, match="gated"):
        _core.LoopJob(b.fileno(), True, u64([addr(header), _core.GATE_BYTES]), 1, True)
    with pytest.raises(ValueError, match="pairs"):
        _core.LoopJob(b.fileno(), False, u64([addr(payload)]))


def test_a_waiting_loop_receive_sets_the_low_water_mark_and_puts_it_back(socket_pair):
    """A receive that waits for the rest of its bytes (its header checked, if gated) asks the kernel to
    signal only once all of them are there (SO_RCVLOWAT), and its end, or ``release``, puts the default back."""
    a, b = socket_pair

    def lowat() -> int:
        return b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

    header, payload = np.zeros(_core.GATE_BYTES, np.uint8), np.zeros(4096, np.uint8)
    job = _core.LoopJob(b.fileno(), False, u64([addr(header), _core.GATE_BYTES, addr(payload), 4096]), 7, True,
                        lowat_max=1 << 20)
    assert job.step() == 0 and lowat() == 1  # the header is not checked yet: a refusal's short text must wake us
    a.send(_answer(0, 4096) + b"x" * 1000)
    assert job.step() == 0 and job.moved == _core.GATE_BYTES + 1000 and lowat() == 3096
    a.send(b"x" * 3096)
    assert job.step() == 1 and lowat() == 1 and payload.tobytes() == b"x" * 4096
    capped = _core.LoopJob(b.fileno(), False, u64([addr(payload), 4096]), lowat_max=1000)
    assert capped.step() == 0 and lowat() == 1000  # at most lowat_max
    a.send(b"z" * 4096)
    assert capped.step() == 1 and lowat() == 1
    unset = _core.LoopJob(b.fileno(), False, u64([addr(payload), 4096]))
    assert unset.step() == 0 and lowat() == 1  # without lowat_max: the socket's default
    unset.release()
    plain = _core.LoopJob(b.fileno(), False, u64([addr(payload), 4096]), lowat_max=1 << 20)
    a.send(b"y" * 96)
    assert plain.step() == 0 and lowat() == 4000
    plain.release()
    assert lowat() == 1
    plain.release()  # a no-op once put back
    assert plain.step() == 0 and lowat() == 4000
    a.close()
    assert plain.step() == _core.CONNECTION_LOST and lowat() == 1


def test_socket_engine_rejects_bad_submissions(sockets, queue, socket_pair):
    a, _ = socket_pair
    buf = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError, match="pairs"):
        sockets.submit_send(1, a.fileno(), u64([addr(buf)]))
    with pytest.raises(ValueError, match="fd"):
        sockets.submit_send(1, -1, u64([addr(buf), 8]))
    with pytest.raises(TypeError):
        sockets.submit_recv(1, a.fileno(), None)
    sockets.submit_recv(1, a.fileno(), u64([addr(buf), 8]))
    with pytest.raises(ValueError, match="already in use"):
        sockets.submit_recv(1, a.fileno(), u64([addr(buf), 8]))
    sockets.detach(a.fileno())
    wait_records(queue, [1])
    assert sockets.submit_send(2, a.fileno(), u64([])) == 0
    assert wait_records(queue, [2]) == {2: (_core.OK, 0)}
    sockets.detach(a.fileno())


# ---- segment builders ----------------------------------------------------------------


def _reference_segments(bases, indices, stride, offset, nbytes):
    out: list[int] = []
    for base in bases:
        for index in indices:
            a = base + index * stride + offset
            if out and out[-2] + out[-1] == a:
                out[-1] += nbytes
            else:
                out += [a, nbytes]
    return out


def _reference_triples(dst_bases, dst_idx, dst_stride, dst_off, src_bases, src_idx, src_stride, src_off, nbytes):
    out: list[int] = []
    for db, sb in zip(dst_bases, src_bases):
        for di, si in zip(dst_idx, src_idx):
            d, s = db + di * dst_stride + dst_off, sb + si * src_stride + src_off
            if out and out[-3] + out[-1] == d and out[-2] + out[-1] == s:
                out[-1] += nbytes
            else:
                out += [d, s, nbytes]
    return out


_blocks = st.lists(st.integers(0, 15), max_size=12)


@settings(max_examples=60, deadline=None)
@given(num_tensors=st.integers(0, 4), src=_blocks, data=st.data(),
       stride_blocks=st.integers(1, 3), offset=st.integers(0, 64), nbytes=st.integers(1, 64))
def test_segment_builders_match_reference(num_tensors, src, data, stride_blocks, offset, nbytes):
    stride = 64 * stride_blocks + offset  # nbytes + offset may reach a whole stride: runs coalesce
    dst = data.draw(st.lists(st.integers(0, 15), min_size=len(src), max_size=len(src)))
    # Tensors either back to back (tensor runs coalesce too) or far apart.
    tensor_bytes = 16 * stride
    gap = data.draw(st.sampled_from([0, 4096]))
    bases = [4096 + t * (tensor_bytes + gap) for t in range(num_tensors)]
    dst_bases = [1 << 30 | b for b in bases]
    got = _core.segments(u64(bases), array.array("q", src), stride, offset, nbytes)
    assert got.typecode == "Q"
    assert list(got) == _reference_segments(bases, src, stride, offset, nbytes)
    got = _core.copy_segments(u64(dst_bases), array.array("q", dst), stride, offset,
                              u64(bases), array.array("q", src), stride, offset, nbytes)
    assert list(got) == _reference_triples(dst_bases, dst, stride, offset, bases, src, stride, offset, nbytes)


def test_segment_builders_coalesce_runs():
    blocks = array.array("q", [4, 5, 6, 9])
    assert list(_core.segments(u64([1000]), blocks, 10, 0, 10)) == [1040, 30, 1090, 10]
    got = _core.copy_segments(u64([0]), array.array("q", [0, 1, 2, 3]), 10, 0,
                              u64([1000]), blocks, 10, 0, 10)
    assert list(got) == [0, 1040, 30, 30, 1090, 10]


def test_copy_segments_rejects_mismatched_counts():
    with pytest.raises(ValueError, match="counts differ"):
        _core.copy_segments(u64([0]), array.array("q", [0, 1]), 1, 0, u64([0]), array.array("q", [0]), 1, 0, 1)
    with pytest.raises(ValueError, match="counts differ"):
        _core.copy_segments(u64([0, 8]), array.array("q", [0]), 1, 0, u64([0]), array.array("q", [0]), 1, 0, 1)


# ---- the stub file ---------------------------------------------------------------------


def test_stub_declares_what_the_core_exports():
    stub = pathlib.Path(_core.__file__).with_name("_core.pyi")
    tree = ast.parse(stub.read_text())
    declared: dict[str, set[str] | None] = {}
    functions: list[tuple[object, ast.FunctionDef]] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            declared[node.name] = {n.name for n in methods}
            cls = getattr(_core, node.name)
            functions += [(getattr(cls, n.name), n) for n in methods
                          if n.name != "__init__" and not n.decorator_list]
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = None
            functions.append((getattr(_core, node.name), node))
        elif isinstance(node, ast.AnnAssign):
            declared[node.target.id] = None
    exported = {name for name in vars(_core) if not name.startswith("_")}
    assert set(declared) == exported
    for name, members in declared.items():
        if members is not None:
            public = {m for m in dir(getattr(_core, name)) if not m.startswith("_")}
            assert members - {"__init__"} == public, name
    for obj, node in functions:
        stub_params = [a.arg for a in node.args.args]
        assert stub_params == list(inspect.signature(obj).parameters), node.name


def _pairs_reference(info, rows):
    """What copy_blocks accepts, written plainly: (srcs, dsts) or None."""
    if type(info) is not dict:
        return None
    srcs, dsts = [], []
    for s, ds in info.items():
        if type(s) is not int or type(ds) not in (list, tuple) or not ds or not 0 <= s < rows:
            return None
        for d in ds:
            if type(d) is not int or not 0 <= d < rows:
                return None
            srcs.append(s)
            dsts.append(d)
    if len(set(dsts)) != len(dsts) or set(dsts) & set(srcs):
        return None
    return srcs, dsts


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(-2, 40), st.lists(st.integers(-2, 40), max_size=4), max_size=12),
       st.integers(1, 40))
def test_block_pairs_agrees_with_the_plain_check(info, rows):
    got = _core.block_pairs(info, rows)
    want = _pairs_reference(info, rows)
    if want is None:
        assert got is None
    else:
        assert got is not None and (got[0].tolist(), got[1].tolist()) == want
        assert got[0].typecode == got[1].typecode == "q"


@pytest.mark.parametrize("info", [
    {1: [2], 3: [2]},                 # a destination twice
    {1: [2, 2]},                      # a destination twice in one list
    {1: [2], 2: [3]},                 # a destination that is a source (named after it)
    {2: [3], 1: [2]},                 # ... and before it
    {1: [True]}, {True: [2]},         # bools are not block numbers
    {1: [np.int64(2)]},               # numpy integers take the full check
    {1: [2 ** 70]}, {-(2 ** 70): [2]},  # too large for int64: no OverflowError
    {1: []}, {1: 2}, {1: "23"}, {1: range(2, 3)},
    {1: [10]}, {10: [1]}, {-1: [2]}, {1: [-1]},
])
def test_block_pairs_leaves_everything_else_to_the_full_check(info):
    assert _core.block_pairs(info, 10) is None


def test_block_pairs_takes_only_a_dict():
    from collections import OrderedDict
    from types import MappingProxyType

    assert _core.block_pairs(MappingProxyType({1: [2]}), 10) is None
    assert _core.block_pairs([(1, [2])], 10) is None
    assert _core.block_pairs(OrderedDict({1: [2]}), 10) is None  # a subclass: its items() may be anything
    assert _core.block_pairs({1: (2, 3), 4: [5]}, 10) is not None


def test_input_pending_peeks_without_taking_a_record_or_its_fd():
    """``input_pending`` (a same-host pull's look at the share socket before it reads records): False only while
    nothing is queued; a queued record and the fd it carries are still there for the read that follows."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        assert not _core.input_pending(b.fileno())
        socket.send_fds(a, [b"record"], [r])
        assert _core.input_pending(b.fileno()) and _core.input_pending(b.fileno())
        data, fds, _flags, _addr = socket.recv_fds(b, 64, 1)
        assert data == b"record" and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the fd that came with it: the pipe
        os.close(fds[0])
        assert not _core.input_pending(b.fileno())
        a.close()
        assert _core.input_pending(b.fileno())  # the end: a read says so
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)
    assert _core.input_pending(b.fileno())  # a closed socket (-1): a read fails and says so
