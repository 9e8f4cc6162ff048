"""GPU tests: skipped without CUDA; the driver's own fds are set up once, before the leak checks."""

from __future__ import annotations

import gc
import multiprocessing
import os

import pytest
import torch

from aio_datadist import _core

CUDA = torch.cuda.is_available()
SKIP_REASON = ("needs a CUDA device" if os.environ.get("AIO_DATADIST_TEST_CUDA") == "1" else
               "needs a CUDA device and AIO_DATADIST_TEST_CUDA=1 (without it tests/conftest.py hides the device)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not CUDA:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session", autouse=True)
def cuda_warm():
    """Open the driver (context, streams, pinned memory, the copy kernel) before any fd snapshot."""
    if not CUDA:
        yield
        return
    torch.cuda.init()
    x = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).copy_(x)
    torch.cuda.Stream()
    from aio_datadist.devices import kernels

    if kernels.available():
        t = torch.tensor([x.data_ptr()], dtype=torch.int64, device="cuda")
        r = torch.zeros(1, dtype=torch.int64, device="cuda")
        kernels.launch_copy_rows(t, t, r, r, dst_stride=0, src_stride=0, dst_offset=0, src_offset=0,
                                 geo=kernels.geometry(256, 0), num_tensors=1)
    torch.cuda.synchronize()
    yield


def _open_fds() -> set[str]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{name}->{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            pass
    return fds


# Kept by the event loops (as in tests/conftest.py) and by the NVIDIA driver / torch's IPC bookkeeping.
_NOT_OURS = ("/dev/urandom", "pipe:", "/dev/nvidia", "/dev/shm/torch_")


@pytest.fixture(autouse=True)
def no_leaks():
    """tests/conftest.py's check, less the fds the driver opens lazily."""
    before_fds = _open_fds()
    before_live = _core.live_objects()
    yield
    gc.collect()
    leaked = {fd for fd in _open_fds() - before_fds if not any(s in fd for s in _NOT_OURS)}
    assert _core.live_objects() == before_live, "native objects left open"
    assert not leaked, f"file descriptors left open: {sorted(leaked)}"
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(5)
    assert not children, f"child processes left running: {children}"
