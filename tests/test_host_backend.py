"""The host backend (``aio.DeviceType=host``): device caches in host memory, moved only through
ordered native copy queues and completed by the core's StreamNotifier, so every device path runs on CI."""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import select
import threading
import types

import pytest
import torch

from aio_datadist import CacheDesc, DataType, LLMDataDist, LLMException, LLMRole, LLMStatusCode, Placement, _core
from aio_datadist.testing import runtime_of

S = LLMStatusCode


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _q(*values: int) -> array.array:
    return array.array("Q", values)


def test_host_stream_runs_copies_in_order_after_the_streams_it_waits_for():
    queue = _core.CompletionQueue()
    notifier = _core.StreamNotifier(queue, "host")
    compute, copy = _core.HostStream(), _core.HostStream()
    try:
        src, mid, dst = bytearray(b"a" * 64), bytearray(64), bytearray(64)
        gate = compute.gate()
        compute.enqueue_copies(_q(_addr(mid)), _q(_addr(src)), _q(64))
        copy.wait_stream(compute)
        copy.enqueue_copies(_q(_addr(dst)), _q(_addr(mid)), _q(64))
        notifier.notify(5, copy.handle, 64)
        assert not copy.synchronize(0.2)  # held behind the gate on the other stream
        assert queue.drain() == [] and bytes(dst) == bytes(64)
        gate.open()
        assert copy.synchronize(5)
        assert bytes(dst) == b"a" * 64
        # the notifier's thread posts the completion after the stream ran it: wait on the queue's fd
        assert select.select([queue.fileno()], [], [], 5)[0]
        assert queue.drain() == [(5, 0, 64)]
        with pytest.raises(OSError, match="no open host stream"):
            notifier.notify(6, 12345, 0)
    finally:
        notifier.close()
        compute.close()
        copy.close()
        queue.close()


def test_closing_a_host_stream_releases_its_gates_and_refuses_more_work():
    stream = _core.HostStream()
    stream.gate()
    stream.close()
    with pytest.raises(OSError, match="closed"):
        stream.enqueue_copies(_q(0), _q(0), _q(0))


async def _host_dd(cluster: int = 1) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.MIX, cluster)
    await dd.init({"aio.DeviceType": "host"})
    return dd


def _desc(placement: Placement, rows: int = 8, width: int = 33) -> CacheDesc:
    return CacheDesc(num_tensors=3, shape=[rows, width], data_type=DataType.DT_FLOAT16, placement=placement)


@contextlib.asynccontextmanager
async def _device_cache():
    """An endpoint on the host backend with one device cache: ``rt``, ``backend``, ``dev`` and ``hold(after_s)``,
    which holds the stream (opened after ``after_s`` seconds, and in any case before the endpoint is finalized)."""
    dd = await _host_dd()
    rt = runtime_of(dd)
    gates = []

    def hold(after_s: float):
        gate = rt.devices.stream.gate()
        gates.append(gate)
        threading.Timer(after_s, gate.open).start()
        return gate

    try:
        dev = dd.kv_cache_manager.allocate_blocks_cache(_desc(Placement.DEVICE))
        yield types.SimpleNamespace(rt=rt, backend=rt.devices, dev=dev, hold=hold)
    finally:
        for gate in gates:
            gate.open()
        await dd.finalize()


@pytest.mark.asyncio
async def test_host_backend_device_caches_swap_and_copy_byte_exact():
    before = _core.live_objects()
    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        assert rt.devices is not None and rt.devices.kind == "host"
        mgr = dd.kv_cache_manager
        dev = mgr.allocate_blocks_cache(_desc(Placement.DEVICE))
        host = mgr.allocate_blocks_cache(_desc(Placement.HOST))
        assert dev.on_device and not host.on_device
        gen = torch.Generator().manual_seed(3)
        for t in host.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                                    generator=gen))
        await mgr.swap_blocks(host, dev, {0: 7, 3: 1, 5: 5})
        for h, d in zip(host.tensors, dev.tensors, strict=True):
            assert torch.equal(d[7].view(torch.uint8), h[0].view(torch.uint8))
            assert torch.equal(d[1].view(torch.uint8), h[3].view(torch.uint8))
        await mgr.copy_blocks(dev, {7: [2, 3], 1: [6]})
        for d in dev.tensors:
            assert torch.equal(d[2].view(torch.uint8), d[7].view(torch.uint8))
            assert torch.equal(d[6].view(torch.uint8), d[1].view(torch.uint8))
        back = mgr.allocate_blocks_cache(_desc(Placement.HOST))
        await mgr.swap_blocks(dev, back, {2: 0, 6: 1})
        for h, b in zip(host.tensors, back.tensors, strict=True):
            assert torch.equal(b[0].view(torch.uint8), h[0].view(torch.uint8))
            assert torch.equal(b[1].view(torch.uint8), h[3].view(torch.uint8))
        assert rt.completions.pending_count() == 0
    finally:
        await dd.finalize()
    assert _core.live_objects() == before


class _RefusingNotifier:
    """The backend's notifier, with notify refused as a driver would (EIO, or EBUSY under graph capture)."""

    def __init__(self, real: _core.StreamNotifier, err: int) -> None:
        self.real = real
        self.err = err

    def notify(self, token: int, stream: int, aux: int = 0) -> None:
        raise OSError(self.err, "refused by the test")

    def __getattr__(self, name: str):
        return getattr(self.real, name)


@pytest.mark.asyncio
@pytest.mark.parametrize("fail", ["enqueue", "notify"])
async def test_a_failed_submission_keeps_its_memory_until_the_stream_drained(fail, monkeypatch):
    """After some copies were enqueued, a failing enqueue or notify must not free what they touch (here the
    stream stays stuck past the failure's wait for it)."""
    import gc
    import weakref

    from aio_datadist import _completion
    from aio_datadist.devices.copies import DeviceCopy, cache_side

    monkeypatch.setattr(_completion, "FAILED_DRAIN_S", 0.05)
    before = _core.live_objects()
    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        backend = rt.devices
        mgr = dd.kv_cache_manager
        dev = mgr.allocate_blocks_cache(_desc(Placement.DEVICE))
        gate = backend.stream.gate()  # the stream cannot get past the copies enqueued before the failure
        staging_buf = torch.zeros(4096, dtype=torch.uint8)
        buf_ref = weakref.ref(staging_buf)
        src = cache_side(dev, [0], 0, 66)
        dst = cache_side(dev, [1], 0, 66)
        jobs = [DeviceCopy(backend, dst, src, 66, "batch", keepalive=staging_buf)]
        real_enqueue = backend.memcpy_batch
        if fail == "enqueue":
            calls = []

            def second_call_fails(*args):
                calls.append(1)
                if len(calls) > 1:
                    raise RuntimeError("driver refused the second batch")
                return real_enqueue(*args)

            backend.memcpy_batch = second_call_fails

            def enqueue_twice():
                from aio_datadist.devices.copies import enqueue_rows

                enqueue_rows(backend, dst, src, 66, "batch", jobs[0].keep)
                enqueue_rows(backend, dst, src, 66, "batch", jobs[0].keep)

            def submit(token):
                backend.enqueue_and_notify(token, enqueue_twice, 0, jobs[0], "test copy")
        else:
            backend.notifier = _RefusingNotifier(backend.notifier, 5)
            submit = jobs[0].submit
        with pytest.raises(LLMException) as info:
            await rt.completions.start(submit, jobs[0].cancel, timeout_ms=1000, what="test copy", keepalive=jobs[0])
        assert info.value.status_code == S.LLM_FAILED
        del info  # its traceback's frames hold the copy too
        if fail == "notify":
            backend.notifier = backend.notifier.real
        jobs.clear()
        del staging_buf, submit
        gc.collect()
        assert backend.held == 1 and buf_ref() is not None  # still held: the stream has not drained
        # finalize waits for that stream to drain (0.8 s from now) without blocking the loop
        import time

        threading.Timer(0.8, gate.open).start()
        finalizing = asyncio.ensure_future(dd.finalize())
        longest, last = 0.0, time.monotonic()
        while not finalizing.done():
            await asyncio.sleep(0.005)
            longest, last = max(longest, time.monotonic() - last), time.monotonic()
        await finalizing
        assert longest < 0.4, f"finalize blocked the loop {longest:.2f} s on the failed submission's stream"
    finally:
        gate.open()
        await dd.finalize()
    assert buf_ref() is None  # released once close drained the stream
    assert _core.live_objects() == before


@pytest.mark.asyncio
async def test_a_failed_submission_behind_a_stuck_stream_fails_past_its_bound_with_an_error_logged(monkeypatch,
                                                                                                   caplog):
    """The stream stays held past ``FAILED_DRAIN_S``: the failure reaches the caller at that bound, and the
    stuck device is logged as an ERROR (its copies may still land after the call returned)."""
    import logging
    import time

    from aio_datadist import _completion

    monkeypatch.setattr(_completion, "FAILED_DRAIN_S", 0.1)
    caplog.set_level(logging.ERROR, logger="aio_datadist")
    async with _device_cache() as bench:
        backend = bench.backend
        job = _row_copy(backend, bench.dev)
        bench.hold(1.0)
        backend.notifier = _RefusingNotifier(backend.notifier, 5)
        started = time.monotonic()
        with pytest.raises(LLMException):
            await bench.rt.completions.start(job.submit, job.cancel, timeout_ms=None, what="copy", keepalive=job)
        took = time.monotonic() - started
        backend.notifier = backend.notifier.real
    assert 0.1 <= took < 0.8, took
    said = [r for r in caplog.records if r.levelno == logging.ERROR and "did not end within" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.asyncio
@pytest.mark.parametrize("fail", ["enqueue", "notify"])
async def test_a_failed_submission_fails_its_caller_only_once_its_copies_are_done(fail):
    """The copies a submission enqueued before it failed land before the failure reaches the caller, whose call
    returns with it: no byte of it after that. The stream is held for 0.2 s past the failure."""
    from aio_datadist.devices.copies import DeviceCopy, cache_side, enqueue_rows

    async with _device_cache() as bench:
        backend, dev = bench.backend, bench.dev
        dev.tensors[0][0].view(torch.uint8).fill_(7)
        dev.tensors[0][1].view(torch.uint8).zero_()
        src, dst = cache_side(dev, [0], 0, 66), cache_side(dev, [1], 0, 66)
        job = DeviceCopy(backend, dst, src, 66, "batch", keepalive=None)
        bench.hold(0.2)
        if fail == "enqueue":
            def enqueue_then_fail() -> None:
                enqueue_rows(backend, dst, src, 66, "batch", job.keep)
                raise RuntimeError("driver refused the second batch")

            def submit(token: int) -> None:
                backend.enqueue_and_notify(token, enqueue_then_fail, 0, job, "test copy")
        else:
            backend.notifier = _RefusingNotifier(backend.notifier, 5)
            submit = job.submit
        with pytest.raises(LLMException):
            await bench.rt.completions.start(submit, job.cancel, timeout_ms=1000, what="test copy", keepalive=job)
        landed = dev.tensors[0][1].view(torch.uint8)[:66].clone()
        if fail == "notify":
            backend.notifier = backend.notifier.real
        assert bool((landed == 7).all()), landed
        assert backend.held == 0  # the stream drained: what the copies touched is let go now, not at close


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["fence", "copy"])
async def test_a_failed_submission_does_not_block_the_loop(what):
    """Behind earlier work held on the stream for 0.5 s: a refused fence (nothing of its own queued) fails at
    once, a failed copy submission once the stream drained; the loop runs on meanwhile (it was blocked up to
    1 s on each, waiting for the whole stream)."""
    import time

    async with _device_cache() as bench:
        backend = bench.backend
        job = _row_copy(backend, bench.dev)
        bench.hold(0.5)
        longest, stop = 0.0, False

        async def ticker() -> None:
            nonlocal longest
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.005)
                now = time.monotonic()
                longest, last = max(longest, now - last), now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        backend.notifier = _RefusingNotifier(backend.notifier, 5)
        started = time.monotonic()
        with pytest.raises(LLMException):
            if what == "fence":
                await bench.rt.completions.start(backend.fence, backend.cancel, timeout_ms=None, what="fence")
            else:
                await bench.rt.completions.start(job.submit, job.cancel, timeout_ms=None, what="copy", keepalive=job)
        took = time.monotonic() - started
        backend.notifier = backend.notifier.real
        stop = True
        await tick
        assert longest < 0.2, f"the loop stood still {longest:.2f} s"
        assert took < 0.2 if what == "fence" else took > 0.3, took  # a copy's failure waits for the copy


def _row_copy(backend, dev):
    """A device copy of 66 bytes of row 0 of ``dev`` into row 1."""
    from aio_datadist.devices.copies import DeviceCopy, cache_side

    return DeviceCopy(backend, cache_side(dev, [1], 0, 66), cache_side(dev, [0], 0, 66), 66, "batch", keepalive=None)


class _ServingLink:
    """What ``same_host.serve_copy`` needs of a link: it records what would be sent."""

    def __init__(self) -> None:
        self.sent: list = []
        self.serving: dict = {}
        self.local_pushes: dict = {}
        self.ending = False
        self.counters = types.SimpleNamespace(begin=lambda *a: 0, end=lambda *a: None, refused=lambda *a: None)

    def send(self, msg, req_id, **fields) -> None:
        self.sent.append((msg, req_id, fields))


class _InterruptingNotifier(_RefusingNotifier):
    def notify(self, token: int, stream: int, aux: int = 0) -> None:
        raise KeyboardInterrupt


@pytest.mark.asyncio
@pytest.mark.parametrize("stream_busy", [False, True])
async def test_a_device_push_refused_at_submission_is_answered_with_its_own_status(stream_busy):
    """A same-host device push the owner's driver refuses (a notify under graph capture: a param error) is
    answered with that status, also when the failure waits for earlier work on the stream (it read
    ``LLM_FAILED`` then: found by review)."""
    import errno

    from aio_datadist.transport.same_host import serve_copy

    async with _device_cache() as bench:
        backend, dev = bench.backend, bench.dev
        if stream_busy:
            bench.hold(0.3)
        job = _row_copy(backend, dev)
        backend.notifier = _RefusingNotifier(backend.notifier, errno.EBUSY)
        link = _ServingLink()
        try:
            serve_copy(bench.rt, link, 7, types.SimpleNamespace(timeout_ms=1000),
                       types.SimpleNamespace(cache=dev, total=66, landed=[]), job.submit, job.cancel, job, "local")
            async with asyncio.timeout(3):
                while not link.sent:
                    await asyncio.sleep(0.01)
        finally:
            backend.notifier = backend.notifier.real
        ((_, _, fields),) = link.sent
        assert fields["status"] == S.LLM_PARAM_INVALID, fields


@pytest.mark.asyncio
@pytest.mark.parametrize("step", ["enqueue", "notify"])
async def test_a_ctrl_c_in_a_device_submission_reaches_the_caller(step):
    """An interrupt raised while a device copy is submitted (its copies put on the stream, or its notify) goes
    on at once, as before the failed submission's wait for its copies (which took it for a failure of the
    copy, answered to the peer: found by reviews)."""
    from aio_datadist.transport.same_host import serve_copy

    async with _device_cache() as bench:
        backend, dev = bench.backend, bench.dev
        job = _row_copy(backend, dev)
        real = backend.memcpy_batch

        def interrupted(*args):
            real(*args)  # on the stream already
            raise KeyboardInterrupt

        if step == "enqueue":
            backend.memcpy_batch = interrupted
        else:
            backend.notifier = _InterruptingNotifier(backend.notifier, 0)
        link = _ServingLink()
        try:
            with pytest.raises(KeyboardInterrupt):
                serve_copy(bench.rt, link, 7, types.SimpleNamespace(timeout_ms=1000),
                           types.SimpleNamespace(cache=dev, total=66, landed=[]), job.submit, job.cancel, job,
                           "local")
        finally:
            backend.memcpy_batch = real
            if step == "notify":
                backend.notifier = backend.notifier.real
        await asyncio.sleep(0.1)
        assert link.sent == []  # nothing answered to the peer for it


@pytest.mark.asyncio
async def test_a_notify_under_graph_capture_is_a_clear_param_error():
    dd = await _host_dd()
    try:
        backend = runtime_of(dd).devices
        backend.notifier = _RefusingNotifier(backend.notifier, 16)  # EBUSY: what the core says under capture
        with pytest.raises(LLMException) as info:
            backend.notify_on(1, backend.default_stream)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'stream'" in str(info.value)
        backend.notifier = backend.notifier.real
    finally:
        await dd.finalize()


@pytest.mark.asyncio
async def test_a_refused_record_starts_nothing():
    """EventLayerSynchronizer.record(i, stream=s) refused (a stream under graph capture, a stream of another
    kind): LLM_PARAM_INVALID, and layer i is not started by it (its wait times out)."""
    from aio_datadist import EventLayerSynchronizer

    dd = await _host_dd()
    try:
        backend = runtime_of(dd).devices
        with EventLayerSynchronizer(dd, 2, timeout_ms=50) as events:
            backend.notifier = _RefusingNotifier(backend.notifier, 16)  # EBUSY: what the core says under capture
            try:
                with pytest.raises(LLMException) as info:
                    events.record(0, stream=backend.default_stream)
            finally:
                backend.notifier = backend.notifier.real
            assert info.value.status_code == S.LLM_PARAM_INVALID
            with pytest.raises(LLMException) as info:
                events.record(1, stream=object())
            assert info.value.status_code == S.LLM_PARAM_INVALID
            assert [await events.synchronize_layer(i) for i in range(2)] == [False, False]
    finally:
        await dd.finalize()


def test_kernel_side_of_a_pinned_host_cache_uses_the_mapped_device_pointer():
    from aio_datadist.devices.copies import Side, kernel_side

    class Pin:
        address, nbytes, device_address = 0x10000, 0x4000, 0x7F0000010000

    side = Side((0x10000, 0x12000), 64, (0, 1), 0, torch.device("cpu"), lambda: (), on_host=True)
    mapped = kernel_side(side, Pin())
    assert mapped.bases == (0x7F0000010000, 0x7F0000012000) and mapped.rows == side.rows
    Pin.device_address = Pin.address  # a device that uses host pointers directly: unchanged
    assert kernel_side(side, Pin()) is side
    Pin.device_address = 0x7F0000010000
    outside = Side((0x90000,), 64, (0,), 0, torch.device("cpu"), lambda: (), on_host=True)
    with pytest.raises(AssertionError):
        kernel_side(outside, Pin())


def test_auto_picks_cuda_then_npu_then_cpu(monkeypatch):
    import importlib.machinery
    import sys

    from aio_datadist.devices import auto_device

    assert auto_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake = types.ModuleType("torch_npu")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert auto_device() == "npu"
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    assert auto_device() == "cpu"


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("cut", ["timeout", "cancel"])
@pytest.mark.parametrize("op", ["copy_blocks", "swap_out", "swap_in"])
async def test_a_local_device_copy_given_up_on_a_held_stream_lands_nothing_after_it_returned(op, cut):
    """copy_blocks / swap_blocks of a device cache whose copy waits on the held copy stream: a timeout or a
    cancel returns only once the stream reported the copy over, so the destination never changes afterwards."""
    import asyncio

    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        backend = rt.devices
        mgr = dd.kv_cache_manager
        dev = mgr.allocate_blocks_cache(_desc(Placement.DEVICE))
        host = mgr.allocate_blocks_cache(_desc(Placement.HOST))
        for t in dev.tensors:
            for r in range(8):
                t[r].view(torch.uint8).fill_(r + 1)
        for t in host.tensors:
            t.view(torch.uint8).fill_(0xEE)
        dst, row = {"copy_blocks": (dev, 5), "swap_out": (host, 5), "swap_in": (dev, 6)}[op]

        def call(timeout: int):
            if op == "copy_blocks":
                return mgr.copy_blocks(dev, {1: [5]}, timeout=timeout)
            if op == "swap_out":
                return mgr.swap_blocks(dev, host, {1: 5}, timeout=timeout)
            return mgr.swap_blocks(host, dev, {1: 6}, timeout=timeout)

        gate = backend.stream.gate()  # the copy queues up behind this point of the copy stream
        asyncio.get_running_loop().call_later(0.4, gate.open)
        if cut == "timeout":
            with pytest.raises(LLMException) as info:
                await call(100)
            assert info.value.status_code == S.LLM_TIMEOUT
        else:
            task = asyncio.ensure_future(call(5000))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        after = [t[row].view(torch.uint8).clone() for t in dst.tensors]
        assert backend.stream.pending() == 0  # the copy it enqueued is over
        await asyncio.sleep(0.5)  # the gate is open by now: a copy still queued would have run
        for a, t in zip(after, dst.tensors, strict=True):
            assert torch.equal(a, t[row].view(torch.uint8)), "a byte landed after the call returned"
        assert rt.completions.pending_count() == 0
        await mgr.copy_blocks(dev, {2: [7]})  # the stream works afterwards
        assert all(torch.equal(t[7], t[2]) for t in dev.tensors)
    finally:
        await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # (one loop: the copy threads do not care which)
async def test_a_staged_swap_given_up_waits_for_its_host_copy():
    """The staged swap (NPU; CUDA drivers without batch copies) copies between the chunk buffers and the
    host cache on the copy threads. Given up, that copy is stopped and waited for before the call returns:
    before, it was cancelled but not waited for, and up to 1 MiB per copy thread could still land in the
    caller's host cache after ``LLM_TIMEOUT`` (its record arrived after the return in 2 runs of 10)."""
    import asyncio

    from aio_datadist.devices import ops

    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        mgr = dd.kv_cache_manager
        rows, width = 16, 1024 * 1024  # 4 tensors x 16 rows x 2 MiB: 128 MiB each way
        dev = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.DEVICE))
        host = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.HOST))
        for t in dev.tensors:
            t.fill_(1.0)
        for timeout in (3, 5, 8, 10, 12, 15, 20, 25, 30, 40):
            for t in host.tensors:
                t.zero_()
            try:
                await ops.copy_rows(rt, host, list(range(rows)), dev, list(range(rows)), 0, width * 2, timeout,
                                    "swap_blocks", method="staged")
            except LLMException as exc:
                assert exc.status_code == S.LLM_TIMEOUT
            assert rt.completions.pending_count() == 0, f"a copy still ran after the return ({timeout} ms)"
            after = [t.clone() for t in host.tensors]
            await asyncio.sleep(0.05)
            assert all(torch.equal(a, t) for a, t in zip(after, host.tensors, strict=True)), timeout
    finally:
        await dd.finalize()


@pytest.mark.asyncio
async def test_a_staged_swap_given_up_returns_only_once_its_host_copy_is_over():
    """As above, with the race made wide: the copy threads take their time to stop (``cancel`` does not cut the
    running job), so a swap that only cancelled its host copy would return while the copy still writes."""
    from aio_datadist.devices import ops

    class _SlowToStop:
        def __init__(self, real: _core.HostCopyEngine) -> None:
            self.real = real

        def submit(self, token: int, triples) -> None:
            return self.real.submit(token, triples)

        def cancel(self, token: int) -> bool:
            return False  # the job runs to its end: a slow stop

    dd = await _host_dd()
    rt = runtime_of(dd)
    real = rt.copier
    try:
        mgr = dd.kv_cache_manager
        rows, width = 16, 1024 * 1024
        dev = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.DEVICE))
        host = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.HOST))
        rt.copier = _SlowToStop(real)
        given_up = {"out": 0, "in": 0}
        for timeout, (dst, src, way) in zip((3, 8, 15, 3, 8, 15), [(host, dev, "out")] * 3 + [(dev, host, "in")] * 3):
            try:
                await ops.copy_rows(rt, dst, list(range(rows)), src, list(range(rows)), 0, width * 2, timeout,
                                    "swap_blocks", method="staged")
            except LLMException as exc:
                assert exc.status_code == S.LLM_TIMEOUT
                given_up[way] += 1
            # (a swap whose copies all ended before its loop noticed the time, on a loaded host, is done: its case
            # is the others')
            assert real.pending() == 0, f"a host copy still ran after the return ({timeout} ms)"
        assert given_up["out"] and given_up["in"], given_up
    finally:
        rt.copier = real
        await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["out", "in"])
async def test_staged_swaps_given_up_with_their_errors_kept_leave_the_pool_its_buffers(direction):
    """A caller that keeps the LLM_TIMEOUT of a staged swap (a list of errors, gather(return_exceptions=True))
    must not keep the staging buffer its host copy used: a retired buffer counts against the pool until it goes,
    so a few such errors would leave every later staged transfer of the endpoint waiting for a buffer."""
    import asyncio
    import gc

    from aio_datadist.devices import ops

    dd = await _host_dd()
    try:
        rt = runtime_of(dd)
        mgr = dd.kv_cache_manager
        rows, width = 16, 1024 * 1024  # 4 tensors x 16 rows x 2 MiB
        dev = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.DEVICE))
        host = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.HOST))
        for t in dev.tensors:
            t.fill_(1.0)
        for t in host.tensors:
            t.fill_(1.0)
        pool = rt.staging.pool
        kept = []
        dst, src = (host, dev) if direction == "out" else (dev, host)
        for timeout in (3, 5, 8, 10, 12, 15, 20, 3, 5, 8, 10, 12):
            try:
                await ops.copy_rows(rt, dst, list(range(rows)), src, list(range(rows)), 0, width * 2, timeout,
                                    "swap_blocks", method="staged")
            except LLMException as exc:
                assert exc.status_code == S.LLM_TIMEOUT
                kept.append(exc)
        assert kept, "no swap timed out"
        gc.collect()
        await asyncio.sleep(0.1)
        retired = pool.live - pool.idle
        assert retired == 0, f"{retired} of {pool.buffers} staging buffers kept by {len(kept)} errors the caller holds"
        for t in dst.tensors:
            t.zero_()
        await ops.copy_rows(rt, dst, list(range(rows)), src, list(range(rows)), 0, width * 2, 3000,
                            "swap_blocks", method="staged")
        assert all(torch.equal(t, d) for t, d in zip(host.tensors, dev.tensors, strict=True))
    finally:
        await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize("delay_ms", [0, 6])
async def test_finalize_during_a_staged_swap_ends_it_and_lands_nothing_after(direction, delay_ms):
    """finalize at any point of a staged swap: both end within bounds, and nothing lands after the swap ended."""
    import asyncio

    from aio_datadist.devices import ops

    dd = await _host_dd()
    rt = runtime_of(dd)
    mgr = dd.kv_cache_manager
    rows, width = 16, 1024 * 1024
    dev = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.DEVICE))
    host = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.HOST))
    src_t, dst_t = ([t for t in dev.tensors], [t for t in host.tensors]) if direction == "out" else \
        ([t for t in host.tensors], [t for t in dev.tensors])
    for t in src_t:
        t.fill_(1.0)
    for t in dst_t:
        t.zero_()
    dst, src = (host, dev) if direction == "out" else (dev, host)
    swap = asyncio.ensure_future(ops.copy_rows(rt, dst, list(range(rows)), src, list(range(rows)), 0, width * 2,
                                               10_000, "swap_blocks", method="staged"))
    await asyncio.sleep(delay_ms / 1000)
    fin = asyncio.ensure_future(dd.finalize())
    done, _ = await asyncio.wait([swap, fin], timeout=5)
    assert swap in done, "the swap hangs across finalize"
    after = [t.clone() for t in dst_t]
    assert fin in done or (await asyncio.wait([fin], timeout=5))[0], "finalize hangs"
    with contextlib.suppress(LLMException, asyncio.CancelledError):
        swap.result()
    await asyncio.sleep(0.2)
    assert all(torch.equal(a, t) for a, t in zip(after, dst_t, strict=True)), "bytes landed after the swap ended"


@pytest.mark.asyncio
@pytest.mark.parametrize("direction", ["out", "in"])
async def test_finalize_during_a_staged_swap_on_a_healthy_device_abandons_nothing(direction):
    """finalize while a staged swap runs on a device that is not stuck: quiesce sees the stream idle between two
    chunks, the swap enqueues its next gather or scatter before the close, and the close then took the device
    for stuck (``close(0.0)`` while busy): every cache of the endpoint kept for the life of the process
    (``runtime.ABANDONED``), an ERROR logged, the backend's streams left open."""
    import asyncio

    from aio_datadist import runtime as runtime_mod
    from aio_datadist.devices import ops
    from aio_datadist.devices.staging import DeviceStaging

    abandoned = len(runtime_mod.ABANDONED)
    for i in range(10):
        dd = await _host_dd()
        rt = runtime_of(dd)
        rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=256 * 1024, buffers=4)
        mgr = dd.kv_cache_manager
        rows, width = 16, 256 * 1024  # 4 tensors x 16 rows x 512 KiB: 128 chunks of 256 KiB
        dev = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.DEVICE))
        host = mgr.allocate_blocks_cache(CacheDesc(4, [rows, width], DataType.DT_FLOAT16, Placement.HOST))
        dst, src = (host, dev) if direction == "out" else (dev, host)
        swap = asyncio.ensure_future(ops.copy_rows(rt, dst, list(range(rows)), src, list(range(rows)), 0,
                                                   width * 2, 10_000, "swap_blocks", method="staged"))
        await asyncio.sleep(0.001 * (1 + i % 5))
        await asyncio.wait_for(dd.finalize(), 10)
        with contextlib.suppress(LLMException, asyncio.CancelledError):
            await asyncio.wait_for(swap, 5)
        assert len(runtime_mod.ABANDONED) == abandoned, f"iteration {i}: a healthy device's caches abandoned"
