"""The StreamNotifier against stand-in driver libraries (``tests/fakes/*.c``, built here with cc).

The CUDA and Ascend notifiers differ from the host backend's only in their
symbol tables and stream calls; these stand-ins implement those few calls
with counters, so the defects found by reading the never-run device code are
tested on a CPU: one ACL report thread per process that does not spin with
nothing subscribed, the ACL context set on the calling thread, subscriptions
pruned; CUDA graph capture refused; the retained primary context released.
"""

from __future__ import annotations

import ctypes
import errno
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from aio_datadist import _core

FAKES = Path(__file__).parent / "fakes"
pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the stand-ins")


def _build(tmp_path_factory: pytest.TempPathFactory, name: str) -> tuple[str, ctypes.CDLL]:
    out = tmp_path_factory.mktemp(name) / f"lib{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(FAKES / f"{name}.c")],
                   check=True, timeout=60)
    return str(out), ctypes.CDLL(str(out))


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
