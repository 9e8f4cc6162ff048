"""StreamNotifier on a machine without a device driver: its errors, and its host-function logic.

What runs here:

* constructing a notifier where the driver library is missing (or is not a
  driver) fails with OSError(ENODEV) naming what is missing, and the Python
  layer turns that into ``LLM_FEATURE_NOT_ENABLED``;
* the host-function body the drivers call (``_notify_fire``) is run by a
  plain native thread through the test-only ``_core._HostFnLine``, which
  shares the notifier's bookkeeping: order, aux, cancellation, token reuse,
  close, and the ``Completions.start`` contract (a cancelled or timed-out
  token stays held until its record arrives).

The same behaviour on a real CUDA stream is in ``tests/gpu/``.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import errno
import weakref

import pytest

from aio_datadist import LLMDataDist, LLMException, LLMRole, LLMStatusCode, _core
from aio_datadist._completion import Completions
from aio_datadist.devices.streams import open_notifier

S = LLMStatusCode


def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


HAVE_CUDA_DRIVER = _loadable("libcuda.so.1")
HAVE_ACL = _loadable("libascendcl.so")
LIBC = ctypes.util.find_library("c") or "libc.so.6"


@pytest.fixture
def queue():
    q = _core.CompletionQueue()
    yield q
    q.close()


@pytest.fixture
def line(queue):
    ln = _core._HostFnLine(queue)
    yield ln
    ln.close()


# ---- missing drivers -------------------------------------------------------------------------


@pytest.mark.skipif(HAVE_CUDA_DRIVER, reason="an NVIDIA driver is installed here")
def test_cuda_notifier_without_driver_names_libcuda(queue):
    before = _core.live_objects()
    with pytest.raises(OSError) as info:
        _core.StreamNotifier(queue, "cuda")
    assert info.value.errno == errno.ENODEV
    assert "libcuda.so.1 not found" in info.value.strerror
    assert "no NVIDIA driver" in info.value.strerror
    assert _core.live_objects() == before
    with pytest.raises(OSError, match="libcuda.so.1 not found"):
        _core.cuda_driver()


@pytest.mark.skipif(HAVE_ACL, reason="an Ascend CANN runtime is installed here")
def test_npu_notifier_without_cann_names_libascendcl(queue):
    with pytest.raises(OSError) as info:
        _core.StreamNotifier(queue, "npu")
    assert info.value.errno == errno.ENODEV
    assert "libascendcl.so not found" in info.value.strerror


def test_a_library_that_is_not_the_driver_is_refused_by_symbol(queue):
    with pytest.raises(OSError) as info:
        _core.StreamNotifier(queue, "cuda", library=LIBC)
    assert info.value.errno == errno.ENODEV
    assert "has no cuInit" in info.value.strerror
    with pytest.raises(OSError, match="has no aclrtLaunchCallback"):
        _core.StreamNotifier(queue, "npu", library=LIBC)


def test_bad_backend_and_closed_queue_are_refused(queue):
    before = _core.live_objects()
    with pytest.raises(ValueError, match="backend must be 'cuda', 'npu' or 'host'"):
        _core.StreamNotifier(queue, "tpu")
    closed = _core.CompletionQueue()
    closed.close()
    with pytest.raises(ValueError, match="closed"):
        _core.StreamNotifier(closed, "cuda")
    with pytest.raises(TypeError):
        _core.StreamNotifier(None, "cuda")
    assert _core.live_objects() == before


@pytest.mark.skipif(HAVE_CUDA_DRIVER, reason="an NVIDIA driver is installed here")
def test_python_layer_reports_missing_driver_as_feature_not_enabled(queue):
    with pytest.raises(LLMException) as info:
        open_notifier(queue, "cuda", 0)
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert "libcuda.so.1 not found: no NVIDIA driver" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.skipif(HAVE_CUDA_DRIVER, reason="an NVIDIA driver is installed here")
@pytest.mark.asyncio
async def test_init_with_cuda_device_type_fails_clearly_and_leaks_nothing():
    before = _core.live_objects()
    dd = LLMDataDist(LLMRole.DECODER, 7)
    with pytest.raises(LLMException) as info:
        await dd.init({"aio.DeviceType": "cuda"})
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert "'aio.DeviceType' is 'cuda'" in str(info.value) and "libcuda.so.1" in str(info.value)
    assert not dd.kv_cache_manager.is_initialized()
    await dd.finalize()
    assert _core.live_objects() == before


# ---- the host-function body, run by a native thread ----------------------------------------


def test_records_arrive_in_stream_order_with_aux(queue, line):
    for token in range(1, 9):
        line.enqueue(token, token * 100)
    assert line.pending() == 8
    assert line.fire(3) == 3
    assert queue.drain() == [(1, 0, 100), (2, 0, 200), (3, 0, 300)]
    assert line.pending() == 5
    assert line.fire(10) == 5
    assert queue.drain() == [(t, 0, t * 100) for t in range(4, 9)]
    assert line.pending() == 0
    assert line.fire(1) == 0


def test_cancel_marks_the_token_and_its_record_still_arrives(queue, line):
    line.enqueue(1, 10)
    line.enqueue(2, 20)
    assert line.cancel(2) is True
    assert line.cancel(2) is True  # idempotent while pending
    assert queue.drain() == []  # nothing is posted before the stream gets there
    line.fire(2)
    assert queue.drain() == [(1, 0, 10), (2, _core.CANCELLED, 0)]
    assert line.cancel(2) is False  # the record went: nothing is pending any more
    assert line.cancel(99) is False


def test_token_in_use_is_refused_and_free_again_after_its_record(queue, line):
    line.enqueue(5)
    with pytest.raises(ValueError, match="already in use"):
        line.enqueue(5)
    line.fire(1)
    assert queue.drain() == [(5, 0, 0)]
    line.enqueue(5)
    line.fire(1)
    assert queue.drain() == [(5, 0, 0)]


def test_close_lets_every_pending_record_arrive(queue):
    ln = _core._HostFnLine(queue)
    for token in (1, 2, 3):
        ln.enqueue(token)
    ln.cancel(2)
    ln.close()
    ln.close()
    assert queue.drain() == [(1, 0, 0), (2, _core.CANCELLED, 0), (3, 0, 0)]
    assert ln.pending() == 0
    with pytest.raises(ValueError, match="closed"):
        ln.enqueue(4)


def test_records_after_the_queue_closed_are_dropped():
    q = _core.CompletionQueue()
    ln = _core._HostFnLine(q)
    ln.enqueue(1)
    q.close()
    assert ln.fire(1) == 1  # the host function still runs and frees its slot
    assert ln.pending() == 0
    ln.close()


# ---- the Completions contract ---------------------------------------------------------------


class Keep:
    pass


@pytest.fixture
def completions(queue):
    comp = Completions(queue)
    yield comp
    comp.close()


async def _fire_from_native_thread(line: _core._HostFnLine, count: int) -> None:
    """What the driver does when the stream reaches the host functions: run them off the loop."""
    await asyncio.get_running_loop().run_in_executor(None, line.fire, count)


@pytest.mark.asyncio
async def test_completion_resolves_with_aux_when_the_stream_gets_there(completions, line):
    fut = completions.start(lambda t: line.enqueue(t, 4096), line.cancel, timeout_ms=None, what="copy")
    await asyncio.sleep(0)
    assert not fut.done()
    await _fire_from_native_thread(line, 1)
    assert await asyncio.wait_for(fut, 5) == 4096
    assert completions.pending_count() == 0


@pytest.mark.asyncio
async def test_cancelled_wait_holds_token_and_keepalive_until_the_record(completions, line):
    keep = Keep()
    ref = weakref.ref(keep)
    fut = completions.start(lambda t: line.enqueue(t), line.cancel, timeout_ms=None, what="copy", keepalive=keep)
    del keep
    fut.cancel()
    await asyncio.sleep(0)
    assert line.pending() == 1  # the device work cannot be recalled...
    assert completions.pending_count() == 1  # ...so the token and what it keeps alive stay
    assert ref() is not None
    await _fire_from_native_thread(line, 1)
    for _ in range(100):
        if completions.pending_count() == 0:
            break
        await asyncio.sleep(0.01)
    assert completions.pending_count() == 0
    assert ref() is None
    # The next operation on the same line works.
    fut2 = completions.start(lambda t: line.enqueue(t, 1), line.cancel, timeout_ms=None, what="copy")
    await _fire_from_native_thread(line, 1)
    assert await asyncio.wait_for(fut2, 5) == 1


@pytest.mark.asyncio
async def test_timeout_fails_the_wait_and_the_late_record_is_absorbed(completions, line):
    fut = completions.start(lambda t: line.enqueue(t), line.cancel, timeout_ms=20, what="device copy")
    with pytest.raises(LLMException) as info:
        await fut
    assert info.value.status_code == S.LLM_TIMEOUT
    assert completions.pending_count() == 1
    await _fire_from_native_thread(line, 1)
    for _ in range(100):
        if completions.pending_count() == 0:
            break
        await asyncio.sleep(0.01)
    assert completions.pending_count() == 0


@pytest.mark.asyncio
async def test_many_waiters_resolve_in_order_from_one_native_thread(completions, line):
    futs = [completions.start(lambda t, i=i: line.enqueue(t, i), line.cancel, timeout_ms=None, what="copy")
            for i in range(200)]
    done_order: list[int] = []
    for i, f in enumerate(futs):
        f.add_done_callback(lambda _f, i=i: done_order.append(i))
    await _fire_from_native_thread(line, 200)
    assert await asyncio.wait_for(asyncio.gather(*futs), 5) == list(range(200))
    # From Python 3.12 gather of futures already done returns without a pass of the loop: the futures' own
    # callbacks, scheduled when they resolved, run at the next one.
    await asyncio.sleep(0)
    assert done_order == list(range(200))
