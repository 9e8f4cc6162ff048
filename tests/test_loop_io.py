"""Loop-driven socket jobs (``LoopIo``): timeouts counted from the start, no byte after the end."""

from __future__ import annotations

import array
import asyncio
import socket
import time

import numpy as np
import pytest

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist._core import LoopJob
from aio_datadist.link_channels import LOOP_LOWAT_MAX
from aio_datadist.loop_io import LoopIo

MIB = 1 << 20


def pairs(buf: np.ndarray) -> array.array:
    return array.array("Q", (buf.ctypes.data, buf.nbytes))


def start(sock: socket.socket, buf: np.ndarray, *, send: bool, timeout_ms: int | None) -> LoopIo:
    return LoopIo(sock.fileno(), LoopJob(sock.fileno(), send, pairs(buf)), what="test job", keepalive=buf,
                  timeout_ms=timeout_ms, settled=None)


@pytest.mark.asyncio
async def test_a_job_the_socket_takes_at_once_ends_in_its_first_step_without_a_timer(socket_pair):
    a, b = socket_pair
    src = np.full(1000, 7, np.uint8)
    io = start(a, src, send=True, timeout_ms=50)
    assert io.future.done() and io.future.result() == 1000
    assert io._timer is None  # nothing left to time
    assert b.recv(2000) == src.tobytes()
    await asyncio.sleep(0.1)  # and nothing fires later


@pytest.mark.asyncio
async def test_a_stuck_send_times_out_counted_from_its_start_and_sends_nothing_after(socket_pair):
    a, b = socket_pair
    src = np.ones(64 * MIB, np.uint8)  # far more than the socket pair's buffers
    t0 = time.monotonic()
    io = start(a, src, send=True, timeout_ms=300)
    assert not io.future.done()
    with pytest.raises(LLMException) as err:
        await io.future
    took = time.monotonic() - t0
    assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT and "test job timed out after 300 ms" in str(err.value)
    assert 0.25 <= took < 5.0
    moved = io._job.moved
    assert 0 < moved < src.nbytes
    got = 0
    for _ in range(10_000):  # drain the peer's end: exactly what was sent before the timeout
        try:
            chunk = b.recv(1 << 20)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            try:
                chunk = b.recv(1 << 20)
            except BlockingIOError:
                break
        got += len(chunk)
    assert got == moved


@pytest.mark.asyncio
async def test_a_receive_that_keeps_getting_bytes_still_times_out_counted_from_its_start(socket_pair):
    """The timeout bounds the whole job, not the wait between two steps: a peer that trickles bytes does not keep
    a job past it (a timer set again on each step passed every other test here: found by audit, 2026-12-07)."""
    a, b = socket_pair
    dst = np.zeros(MIB, np.uint8)
    t0 = time.monotonic()
    io = start(b, dst, send=False, timeout_ms=300)
    for _ in range(40):  # a trickle of 2 s at most, 100 bytes every 50 ms
        if io.future.done():
            break
        a.send(b"\x01" * 100)
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    assert io.future.done() and 0 < io._job.moved < dst.nbytes, "a job still making progress outlived its timeout"
    with pytest.raises(LLMException) as err:
        await io.future
    assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT and took < 1.5


@pytest.mark.asyncio
async def test_a_receive_whose_peer_closed_mid_way_fails_and_is_no_short_success(socket_pair):
    """The LoopJob's report of a closed peer reaches the caller as a failure, never as the bytes it got."""
    a, b = socket_pair
    dst = np.zeros(4096, np.uint8)
    a.send(b"\x01" * 1000)
    io = start(b, dst, send=False, timeout_ms=5000)
    assert not io.future.done() and io._job.moved == 1000
    a.close()
    with pytest.raises(LLMException) as err:
        await io.future
    assert err.value.status_code == LLMStatusCode.LLM_LINK_FAILED, err.value


class SlowFirstStep:
    """A ``LoopJob`` whose first step takes 100 ms (a large first copy on a busy host)."""

    def __init__(self, job: LoopJob) -> None:
        self.job, self.steps = job, 0

    def step(self) -> int:
        self.steps += 1
        if self.steps == 1:
            time.sleep(0.1)
        return self.job.step()

    def __getattr__(self, name):
        return getattr(self.job, name)


@pytest.mark.asyncio
async def test_the_timer_counts_from_before_the_first_step(socket_pair):
    """A first step that takes long counts against the timeout: the timer is due at the job's start plus the
    timeout (one counted from after the first step passed the tests above; audit, 2026-12-07)."""
    _, b = socket_pair
    dst = np.zeros(4096, np.uint8)
    t0 = asyncio.get_running_loop().time()
    io = LoopIo(b.fileno(), SlowFirstStep(LoopJob(b.fileno(), False, pairs(dst))), what="test job", keepalive=dst,
                timeout_ms=300, settled=None)
    assert not io.future.done() and io._timer is not None
    # due 0.3 s after the start (0.4 s counted from after the 0.1 s first step): 80 ms of slack for a loaded host
    assert io._timer.when() - t0 < 0.38, "the timeout was counted from after the first step"
    io.stop(LLMException("stopped", status_code=LLMStatusCode.LLM_FAILED))
    with pytest.raises(LLMException):
        await io.future


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", ["timeout", "cancel"])
async def test_a_cut_receive_writes_nothing_once_it_is_over(socket_pair, cut):
    a, b = socket_pair
    dst = np.zeros(4 * MIB, np.uint8)
    a.send(b"\x01" * 1000)
    io = start(b, dst, send=False, timeout_ms=200 if cut == "timeout" else None)
    assert not io.future.done() and io._job.moved == 1000
    if cut == "timeout":
        with pytest.raises(LLMException) as err:
            await io.future
        assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
    else:
        await asyncio.sleep(0.05)
        io.future.cancel()
    before = dst.copy()
    sent = 0
    for _ in range(1000):  # the rest arrives after the end, until the socket's buffer is full
        try:
            sent += a.send(b"\x02" * MIB)
        except BlockingIOError:
            break
        await asyncio.sleep(0)
    assert sent > 0
    await asyncio.sleep(0.1)  # loop turns in which a job still watching would read
    assert np.array_equal(dst, before) and int(dst[:1000].sum()) == 1000 and not dst[1000:].any()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["timeout", "stop", "cancel"])
async def test_a_stopped_loop_receive_puts_the_low_water_mark_back(how):
    """Row 94 as ``LoopIo`` uses it: a receive waiting for the rest of its bytes sets the socket's ``SO_RCVLOWAT``
    (the kernel wakes it once they are there), and one stopped (its timeout, ``stop``, its future cancelled) puts
    the default back as it ends. Only ``LoopJob.release`` itself was tested: removing its call from ``LoopIo``
    passed every named test (found by audit, 2026-12-06)."""
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        buf = np.zeros(4096, np.uint8)
        job = LoopJob(b.fileno(), False, array.array("Q", (buf.ctypes.data, buf.nbytes)), lowat_max=LOOP_LOWAT_MAX)
        io = LoopIo(b.fileno(), job, what="test receive", keepalive=buf,
                    timeout_ms=100 if how == "timeout" else None, settled=None)
        a.send(b"x" * 96)
        await asyncio.sleep(0.05)
        assert not io.future.done() and _lowat(b) == 4000  # waiting for the rest
        if how == "stop":
            io.stop(LLMException("stopped", status_code=LLMStatusCode.LLM_FAILED))
        elif how == "cancel":
            io.future.cancel()
            await asyncio.sleep(0)
        with pytest.raises((LLMException, asyncio.CancelledError)):
            await io.future
        assert _lowat(b) == 1, "the stopped receive left SO_RCVLOWAT on the socket"
    finally:
        a.close()
        b.close()


def _lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
