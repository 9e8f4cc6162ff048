"""The StreamNotifier against stand-in driver libraries (``tests/fakes/*.c``, built here with cc).

The CUDA and Ascend notifiers differ from the host backend's only in their
symbol tables and stream calls; these stand-ins implement those few calls
with counters, so the defects found by reading the never-run device code are
tested on a CPU: one ACL report thread per process that does not spin with
nothing subscribed, the ACL context set on the calling thread, subscriptions
pruned; CUDA graph capture refused; the retained primary context released.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import shutil
import threading
import time
from collections.abc import Iterator

import fakes
import pytest

from aio_datadist import _core

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the stand-ins")


def _build(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[str, ctypes.CDLL]:
    out = fakes.build(tmp_path_factory, name)
    return out, ctypes.CDLL(out)


@pytest.fixture(scope="module")
def acl(tmp_path_factory):
    return _build(tmp_path_factory, "fake_ascendcl")


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    return _build(tmp_path_factory, "fake_cuda")


def counter(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_int.in_dll(lib, name).value


def drain_until(queue: _core.CompletionQueue, count: int, timeout: float = 5.0) -> list[tuple[int, int, int]]:
    got: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += queue.drain()
        time.sleep(0.005)
    return got


def test_acl_notifiers_share_one_report_thread_which_sleeps_with_nothing_subscribed(acl):
    path, lib = acl
    queue = _core.CompletionQueue()
    first = _core.StreamNotifier(queue, "npu", 0, path)
    second = _core.StreamNotifier(queue, "npu", 0, path)
    reporter = _core._acl_reporter(_core.acl_driver(path))
    try:
        # Both use stream 0x10: ACL allows one report thread per stream, so they must share it.
        first.notify(1, 0x10, 11)
        second.notify(2, 0x10, 22)
        errors: list[BaseException] = []

        def elsewhere() -> None:  # a thread that never set an ACL context itself
            try:
                second.notify(3, 0x20, 33)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(5)
        assert not errors
        assert sorted(drain_until(queue, 3)) == [(1, 0, 11), (2, 0, 22), (3, 0, 33)]
        assert counter(lib, "fake_report_threads") == 1
        assert counter(lib, "fake_subscribes") == 2  # 0x10 once for both notifiers, 0x20 once
        assert counter(lib, "fake_without_context") == 0
        second.release_stream(0x20)  # pruned: that stream is going away
        assert counter(lib, "fake_unsubscribes") == 1 and second.subscribed == [0x10]
    finally:
        first.close()
        second.close()
    assert lib.fake_subscribed() == 0  # the last notifier using 0x10 let it go
    time.sleep(0.25)  # let a report call in flight return
    rounds = reporter.rounds
    time.sleep(0.5)
    assert reporter.rounds == rounds  # nothing subscribed: it sleeps, it does not call (or spin on) the runtime
    queue.close()


def test_cuda_notify_refuses_a_stream_under_graph_capture_and_posts_nothing(cuda):
    path, _ = cuda
    queue = _core.CompletionQueue()
    notifier = _core.StreamNotifier(queue, "cuda", 0, path)
    try:
        notifier.notify(1, 0x5, 7)
        assert queue.drain() == [(1, 0, 7)]
        with pytest.raises(OSError) as info:
            notifier.notify(2, 0xCA, 7)
        assert info.value.errno == errno.EBUSY and "CUDA graph" in str(info.value)
        assert notifier.pending() == 0 and queue.drain() == []
        notifier.notify(2, 0x5, 8)  # the token was never armed: it is free
        assert queue.drain() == [(2, 0, 8)]
    finally:
        notifier.close()
        queue.close()


def test_cuda_primary_context_is_retained_once_per_notifier_and_released_at_close(cuda):
    path, lib = cuda
    driver = _core.cuda_driver(path)
    queue = _core.CompletionQueue()
    retains, releases = counter(lib, "fake_retains"), counter(lib, "fake_releases")
    one = _core.StreamNotifier(queue, "cuda", 0, path)
    two = _core.StreamNotifier(queue, "cuda", 0, path)
    assert driver.retained(0) == 2 and counter(lib, "fake_retains") == retains + 1
    one.close()
    assert driver.retained(0) == 1 and counter(lib, "fake_releases") == releases
    two.close()
    assert driver.retained(0) == 0 and counter(lib, "fake_releases") == releases + 1
    two.close()  # idempotent: nothing released twice
    assert counter(lib, "fake_releases") == releases + 1
    with pytest.raises(OSError) as info:
        _core.StreamNotifier(queue, "cuda", 3, path)
    assert info.value.errno == errno.ENODEV and driver.retained(3) == 0
    queue.close()


def test_mapped_host_pointer_and_host_addressability_come_from_the_driver(cuda):
    path, _ = cuda
    driver = _core.cuda_driver(path)
    assert driver.can_map_host(0) is False  # this stand-in device cannot use host pointers directly
    assert driver.host_device_pointer(0, 0x7000) == 0x7000 + (1 << 32)
    assert driver.retained(0) == 0  # the lookup's own retain was given back


# ---- the CUDA event watcher ---------------------------------------------------------------------


class _FakeDevice:
    """The stand-in's device progress and held host functions, for the watcher tests."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.lib.fake_run_host_funcs.restype = ctypes.c_int

    def set(self, name: str, value: int) -> None:
        ctypes.c_int.in_dll(self.lib, name).value = value

    def enqueued(self) -> int:
        return ctypes.c_long.in_dll(self.lib, "fake_enqueued").value

    def finish_through(self, seq: int) -> None:
        ctypes.c_long.in_dll(self.lib, "fake_device_done").value = seq

    def run_host_funcs(self) -> int:
        return self.lib.fake_run_host_funcs()


@contextlib.contextmanager
def watching(path: str, poll_us: int) -> Iterator[tuple[_core.CompletionQueue, _core.StreamNotifier]]:
    """A queue and a CUDA notifier with the event watcher on the stand-in driver; the notifier must drain."""
    queue = _core.CompletionQueue()
    notifier = _core.StreamNotifier(queue, "cuda", 0, path, poll_us=poll_us)
    try:
        yield queue, notifier
    finally:
        assert notifier.close(1.0)
        queue.close()


def _wait_counts(notifier: _core.StreamNotifier, expired: int) -> tuple[int, int]:
    deadline = time.monotonic() + 5
    while notifier.watch_counts[1] < expired and time.monotonic() < deadline:
        time.sleep(0.002)
    return notifier.watch_counts


@pytest.fixture
def device(cuda):
    dev = _FakeDevice(cuda[1])
    dev.set("fake_defer_host_funcs", 1)
    dev.finish_through(0)
    yield dev
    dev.set("fake_defer_host_funcs", 0)
    dev.set("fake_query_error", 0)
    dev.set("fake_no_events", 0)
    ctypes.c_long.in_dll(dev.lib, "fake_done_also").value = -1
    dev.run_host_funcs()
    dev.finish_through(1 << 62)


def test_cuda_watcher_posts_a_record_once_the_event_completes_before_its_host_function(cuda, device):
    path, lib = cuda
    events, destroys = counter(lib, "fake_events"), counter(lib, "fake_event_destroys")
    with watching(path, 5_000_000) as (queue, notifier):
        assert notifier.watching
        for token in (1, 2, 3):
            notifier.notify(token, 0x5, token * 10)
        assert counter(lib, "fake_events") == events + 3 and notifier.pending() == 3
        time.sleep(0.05)
        assert queue.drain() == []  # the device is not there yet
        first = device.enqueued() - 2
        device.finish_through(first + 1)  # past the first two
        assert drain_until(queue, 2) == [(1, 0, 10), (2, 0, 20)]
        time.sleep(0.05)
        assert queue.drain() == []
        device.finish_through(first + 2)
        assert drain_until(queue, 1) == [(3, 0, 30)]
        assert notifier.watch_counts == (3, 0)
        assert notifier.pending() == 0 and notifier.cancel(1) is False  # posted: their tokens are free again
        notifier.notify(1, 0x5, 11)  # token 1 again, while the first one's host function is still held
        assert device.run_host_funcs() == 4  # three late ones post nothing, nor touch the new token 1
        assert queue.drain() == [(1, 0, 11)] and notifier.pending() == 0
        assert counter(lib, "fake_event_destroys") == destroys + 3


def test_cuda_watcher_posts_in_order_and_leaves_a_slow_notification_to_its_host_function(cuda, device):
    path, lib = cuda
    destroys = counter(lib, "fake_event_destroys")
    with watching(path, 20_000) as (queue, notifier):  # a 20 ms window
        notifier.notify(1, 0x5, 1)
        notifier.notify(2, 0x6, 2)  # another stream, which gets there at once: its record waits behind the first
        ctypes.c_long.in_dll(lib, "fake_done_also").value = device.enqueued()
        time.sleep(0.005)
        assert queue.drain() == []
        assert _wait_counts(notifier, 2) == (0, 2)
        assert queue.drain() == [] and counter(lib, "fake_event_destroys") == destroys + 2
        assert device.run_host_funcs() == 2  # the host functions post both, in order
        assert queue.drain() == [(1, 0, 1), (2, 0, 2)] and notifier.pending() == 0


def test_cuda_watcher_posts_a_cancelled_notification_as_cancelled(cuda, device):
    path, _ = cuda
    with watching(path, 5_000_000) as (queue, notifier):
        notifier.notify(4, 0x5, 99)
        assert notifier.cancel(4)
        device.finish_through(device.enqueued())
        assert drain_until(queue, 1) == [(4, -errno.ECANCELED, 0)]
        device.run_host_funcs()
        time.sleep(0.02)
        assert queue.drain() == []


def test_cuda_watcher_gives_up_on_a_query_error_and_without_events_the_host_function_alone_posts(cuda, device):
    path, lib = cuda
    with watching(path, 5_000_000) as (queue, notifier):
        device.set("fake_query_error", 1)
        notifier.notify(1, 0x5, 1)
        assert _wait_counts(notifier, 1) == (0, 1) and queue.drain() == []
        device.set("fake_query_error", 0)
        device.set("fake_no_events", 1)  # the driver refuses an event: nothing is watched
        events = counter(lib, "fake_events")
        notifier.notify(2, 0x5, 2)
        assert counter(lib, "fake_events") == events and notifier.watch_counts == (0, 1)
        assert device.run_host_funcs() == 2
        assert queue.drain() == [(1, 0, 1), (2, 0, 2)]


def test_cuda_watcher_is_off_at_zero_and_refuses_a_negative_window(cuda):
    path, _ = cuda
    queue = _core.CompletionQueue()
    notifier = _core.StreamNotifier(queue, "cuda", 0, path)
    assert not notifier.watching and notifier.watch_counts == (0, 0)
    notifier.close()
    with pytest.raises(ValueError, match="poll_us must be >= 0"):
        _core.StreamNotifier(queue, "cuda", 0, path, poll_us=-1)
    host = _core.StreamNotifier(queue, "host", 0, None, poll_us=1000)  # CUDA only
    assert not host.watching
    host.close()
    queue.close()


def test_closing_a_watching_notifier_stops_its_thread_and_frees_what_it_watched(cuda, device):
    """Close while the watcher holds notifications whose host functions ran (the device not there by its
    events' reckoning) and while one's host function is still held: the drain times out for that one (its
    bookkeeping is left for the late host function), the watcher stops, every event is destroyed, and the
    late host function still posts."""
    path, lib = cuda
    queue = _core.CompletionQueue()
    destroys, events = counter(lib, "fake_event_destroys"), counter(lib, "fake_events")
    notifier = _core.StreamNotifier(queue, "cuda", 0, path, poll_us=60_000_000)
    notifier.notify(1, 0x5, 1)
    assert device.run_host_funcs() == 1
    assert drain_until(queue, 1) == [(1, 0, 1)]  # the host function posted; the watcher still polls
    notifier.notify(2, 0x5, 2)
    with pytest.warns(ResourceWarning, match="has not reached"):
        assert notifier.close(0.05) is False
    assert counter(lib, "fake_event_destroys") - destroys == counter(lib, "fake_events") - events == 2
    assert queue.drain() == []
    assert device.run_host_funcs() == 1
    assert queue.drain() == [(2, 0, 2)]
    queue.close()


def test_cuda_watcher_posts_nothing_ahead_of_a_notification_it_gave_up(cuda, device):
    """Found by review: once the watcher gave a notification up to its host function, a later one on the
    same stream was posted early, ahead of it."""
    path, _ = cuda
    with watching(path, 20_000) as (queue, notifier):
        try:
            notifier.notify(1, 0x5, 1)
            assert _wait_counts(notifier, 1) == (0, 1)  # its window ended: the host function will post it
            notifier.notify(2, 0x5, 2)
            device.finish_through(device.enqueued())  # both are done on the device
            time.sleep(0.05)
            assert queue.drain() == []  # 2 waits behind 1
            assert device.run_host_funcs() == 2
            assert queue.drain() == [(1, 0, 1), (2, 0, 2)]
            notifier.notify(3, 0x5, 3)  # nothing is behind any more: the watcher posts early again
            device.finish_through(device.enqueued())
            assert drain_until(queue, 1) == [(3, 0, 3)]
            assert notifier.watch_counts[0] == 1
        finally:
            device.run_host_funcs()


def test_cuda_watcher_posts_nothing_ahead_of_an_unwatched_notification(cuda, device):
    """Found by review: a notification the driver gave no event (so the watcher never saw it) was overtaken
    by the next watched one."""
    path, _ = cuda
    with watching(path, 5_000_000) as (queue, notifier):
        notifier.notify(3, 0x5, 3)
        device.set("fake_no_events", 1)
        notifier.notify(4, 0x5, 4)
        device.set("fake_no_events", 0)
        notifier.notify(5, 0x5, 5)
        device.set("fake_no_events", 1)
        notifier.notify(6, 0x6, 6)  # left behind too, after 5: 5 still waits for 4, the oldest one behind
        device.set("fake_no_events", 0)
        device.finish_through(device.enqueued())
        assert drain_until(queue, 1) == [(3, 0, 3)]
        time.sleep(0.05)
        assert queue.drain() == []  # 5 waits behind 4
        assert device.run_host_funcs() == 4
        assert queue.drain() == [(4, 0, 4), (5, 0, 5), (6, 0, 6)]


def test_closing_a_notifier_while_another_thread_notifies_waits_for_that_call(cuda):
    """Found by review: close() from the loop while a thread was inside notify() (its host function already
    run, the launch not yet returned) freed the watcher that notify() then handed its event to: a crash."""
    path, lib = cuda
    queue = _core.CompletionQueue()
    destroys, events = counter(lib, "fake_event_destroys"), counter(lib, "fake_events")
    ctypes.c_int.in_dll(lib, "fake_launch_delay_us").value = 200_000
    notifier = _core.StreamNotifier(queue, "cuda", 0, path, poll_us=5_000_000)
    errors: list[BaseException] = []

    def notify() -> None:
        try:
            notifier.notify(1, 0x5, 1)
        except BaseException as exc:
            errors.append(exc)

    try:
        thread = threading.Thread(target=notify)
        thread.start()
        time.sleep(0.05)  # inside the launch: the host function ran, the watcher has no item yet
        started = time.monotonic()
        assert notifier.close(5.0)
        assert time.monotonic() - started > 0.05  # it waited for the notify call
        thread.join(5)
        assert not thread.is_alive() and errors == []
        assert queue.drain() == [(1, 0, 1)]
        assert counter(lib, "fake_event_destroys") - destroys == counter(lib, "fake_events") - events == 1
    finally:
        ctypes.c_int.in_dll(lib, "fake_launch_delay_us").value = 0
        queue.close()
