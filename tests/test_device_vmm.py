"""CUDA device cache exports against the stand-in libcuda (``tests/fakes/fake_cuda.c``, built here with cc).

``devices/cuda_vmm.py`` is the part of CUDA device IPC that differs from the
host backend: the driver's VMM calls. The stand-in keeps "device memory" in
memfds and turns the access flags it is given into page protections, so the
call sequence, the read-only import in another process, every fallback
reason and the undo of every half-done step are checked on a CPU. The real
driver path runs in ``tests/gpu/test_gpu_ipc.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import signal
from multiprocessing import reduction

import fakes
import pytest
from peers import process_context

from aio_datadist.devices.cuda_vmm import PROT_READ, PROT_READWRITE, VmmDriver
from aio_datadist.devices.ipc import IpcUnavailable

pytestmark = [pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the stand-in"),
              pytest.mark.usefixtures("fork_server")]
KNOBS = {"fake_device_count": 1, "fake_vmm": 1, "fake_posix_fd": 1, "fake_peer_access": 1, "fake_import_error": 0,
         "fake_access_error": 0, "fake_create_error": 0, "fake_last_access_flags": -1}
COUNTERS = ("fake_creates", "fake_mem_releases", "fake_exports", "fake_imports", "fake_reserves", "fake_frees",
            "fake_maps", "fake_unmaps", "fake_access_calls")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return fakes.build(tmp_path_factory, "fake_cuda")


@pytest.fixture
def cuda(built):
    lib = ctypes.CDLL(built)
    for name, value in KNOBS.items():
        ctypes.c_int.in_dll(lib, name).value = value
    for name in COUNTERS:
        ctypes.c_int.in_dll(lib, name).value = 0
    return built, lib


def get(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.c_int.in_dll(lib, name).value


def set_(lib: ctypes.CDLL, name: str, value: int) -> None:
    ctypes.c_int.in_dll(lib, name).value = value


def balanced(lib: ctypes.CDLL) -> None:
    """Every reservation freed, every mapping undone, every handle released."""
    assert get(lib, "fake_reserves") == get(lib, "fake_frees")
    assert get(lib, "fake_maps") == get(lib, "fake_unmaps")
    assert get(lib, "fake_creates") + get(lib, "fake_imports") == get(lib, "fake_mem_releases")


def _importer(conn, path: str, identity: bytes, nbytes: int, write: bool) -> None:
    """A same-host peer in its own process: map the export it is handed, read it, report the access it asked."""
    import os

    fd = reduction.recv_handle(conn)
    mapping = VmmDriver(path).import_fd(0, identity, fd, nbytes)
    os.close(fd)
    lib = ctypes.CDLL(path)
    conn.send((ctypes.string_at(mapping.address, 64), get(lib, "fake_last_access_flags")))
    if write:
        ctypes.memset(mapping.address, 0, 1)  # a read-only import: this faults
    conn.send("wrote")


def run_importer(path: str, fd: int, identity: bytes, nbytes: int, write: bool) -> tuple[list, int]:
    ctx = process_context()
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_importer, args=(theirs, path, identity, nbytes, write))
    proc.start()
    theirs.close()
    got = []
    try:
        reduction.send_handle(mine, fd, proc.pid)
        while mine.poll(20):
            try:
                got.append(mine.recv())
            except EOFError:
                break
    finally:
        proc.join(20)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        mine.close()
    return got, proc.exitcode


def test_an_export_is_mapped_read_only_by_a_peer_in_another_process(cuda):
    path, lib = cuda
    driver = VmmDriver(path)
    assert driver.unavailable(0) is None
    alloc = driver.allocate(0, 100_000)
    assert alloc.nbytes == 131072  # rounded up to the driver's granularity
    assert (get(lib, "fake_last_access_flags"), get(lib, "fake_last_access_device")) == (PROT_READWRITE, 0)
    pattern = bytes(range(64))
    ctypes.memmove(alloc.address, pattern, 64)  # the owner writes its own cache
    identity = driver.identity(0)
    got, code = run_importer(path, alloc.fd, identity, alloc.nbytes, write=False)
    assert got == [(pattern, PROT_READ), "wrote"] and code == 0
    got, code = run_importer(path, alloc.fd, identity, alloc.nbytes, write=True)
    assert got == [(pattern, PROT_READ)] and code == -signal.SIGSEGV  # the peer's write never lands
    assert ctypes.string_at(alloc.address, 64) == pattern
    alloc.release()
    assert get(lib, "fake_exports") == 1
    balanced(lib)


@pytest.mark.parametrize(("knob", "value", "why"), [
    ("fake_vmm", 0, "has no virtual memory management"),
    ("fake_posix_fd", 0, "cannot export memory as POSIX file descriptors"),
])
def test_a_device_without_exportable_memory_says_why(cuda, knob, value, why):
    path, lib = cuda
    set_(lib, knob, value)
    driver = VmmDriver(path)
    assert why in driver.unavailable(0)
    with pytest.raises(IpcUnavailable, match=why):
        driver.import_fd(0, driver.identity(0), 0, 65536)
    balanced(lib)


def test_a_driver_without_the_vmm_calls_says_which_are_missing():
    driver = VmmDriver("libc.so.6")
    assert "libc.so.6 has no cuInit" in driver.unavailable(0) and "cuMemCreate" in driver.unavailable(0)


def test_imports_that_fail_undo_every_step_and_never_grant_write_access(cuda):
    path, lib = cuda
    driver = VmmDriver(path)
    alloc = driver.allocate(0, 65536)
    identity = driver.identity(0)
    cases = [
        ("fake_import_error", 801, "cuMemImportFromShareableHandle failed: CUDA_ERROR_FAKE"),  # a VM refusing
        ("fake_access_error", 801, "cuMemSetAccess failed"),  # read-only access refused: no retry read-write
    ]
    for knob, value, why in cases:
        set_(lib, knob, value)
        set_(lib, "fake_last_access_flags", -1)
        calls = get(lib, "fake_access_calls")
        with pytest.raises(IpcUnavailable, match=why):
            driver.import_fd(0, identity, alloc.fd, alloc.nbytes)
        assert get(lib, "fake_last_access_flags") == -1
        assert get(lib, "fake_access_calls") - calls == (knob == "fake_access_error")  # asked once: no retry
        set_(lib, knob, 0)
    # A peer that declares more than its export holds: the mapping is refused, nothing stays mapped.
    with pytest.raises(IpcUnavailable, match="cuMemMap failed"):
        driver.import_fd(0, identity, alloc.fd, alloc.nbytes * 2)
    alloc.release()
    balanced(lib)


def test_failed_steps_give_back_the_mapping_budget_and_the_exported_fd(cuda):
    """A refused import gives back what it took of the peers' mapping budget, and an export whose mapping fails
    closes the fd it exported: ``balanced`` counts neither (skipping either undo passed every test here: found by
    audit, 2026-12-07)."""
    import os

    from aio_datadist.devices import host

    path, lib = cuda
    driver = VmmDriver(path)
    alloc = driver.allocate(0, 65536)
    budget, fds = (host._peer_mapped, host._peer_mappings), len(os.listdir("/proc/self/fd"))
    for knob in ("fake_import_error", "fake_access_error"):
        set_(lib, knob, 801)
        with pytest.raises(IpcUnavailable):
            driver.import_fd(0, driver.identity(0), alloc.fd, alloc.nbytes)
        with pytest.raises(OSError, match="cuMemSetAccess failed") if knob == "fake_access_error" else \
                contextlib.nullcontext():
            driver.allocate(0, 65536).release()  # read-write access refused: the export is undone
        set_(lib, knob, 0)
    with pytest.raises(IpcUnavailable, match="cuMemMap failed"):
        driver.import_fd(0, driver.identity(0), alloc.fd, alloc.nbytes * 2)
    assert (host._peer_mapped, host._peer_mappings) == budget, "a failed import kept its share of the budget"
    assert len(os.listdir("/proc/self/fd")) == fds, "a failed export left its fd open"
    alloc.release()
    balanced(lib)


def test_a_peer_gpu_that_is_not_visible_or_not_peer_accessible_is_named(cuda):
    path, lib = cuda
    set_(lib, "fake_device_count", 2)
    driver = VmmDriver(path)
    alloc = driver.allocate(1, 65536)  # the peer's cache on GPU 1
    assert get(lib, "fake_last_create_device") == 1  # made there, and read-write for GPU 1 alone
    assert (get(lib, "fake_last_access_flags"), get(lib, "fake_last_access_device")) == (PROT_READWRITE, 1)
    with pytest.raises(IpcUnavailable, match="is not visible in this process"):
        driver.import_fd(0, b"another-gpu-uuid", alloc.fd, alloc.nbytes)
    set_(lib, "fake_peer_access", 0)
    with pytest.raises(IpcUnavailable, match="no P2P access from CUDA device 0 to device 1"):
        driver.import_fd(0, driver.identity(1), alloc.fd, alloc.nbytes)
    set_(lib, "fake_peer_access", 1)
    mapping = driver.import_fd(0, driver.identity(1), alloc.fd, alloc.nbytes)  # P2P: read access for GPU 0
    assert (get(lib, "fake_last_access_flags"), get(lib, "fake_last_access_device")) == (PROT_READ, 0)
    del mapping
    alloc.release()
    balanced(lib)
