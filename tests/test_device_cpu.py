"""The device backends' CPU-checkable parts: absent runtimes, kernel geometry, IPC export parsing.

The copy kernel itself is checked here only where Triton is installed
(compiled for the H200's sm_90 without a GPU, and run by Triton's CPU
interpreter on host tensors); CI has no Triton and skips those. Everything
that needs a device is in ``tests/gpu/``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from aio_datadist import LLMDataDist, LLMException, LLMRole, LLMStatusCode, _core
from aio_datadist.devices import kernels
from aio_datadist.devices.ipc import ExportInvalid
from aio_datadist.devices.peer_cache import PeerDeviceCache
from aio_datadist.testing import runtime_of

S = LLMStatusCode
HAVE_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None


# ---- NPU without torch_npu ---------------------------------------------------------------------


def test_npu_backend_imports_without_torch_npu():
    from aio_datadist.devices import npu

    assert npu.NpuBackend.kind == "npu"


@pytest.mark.skipif(HAVE_TORCH_NPU, reason="torch_npu is installed here")
def test_load_torch_npu_says_what_to_install():
    from aio_datadist.devices.npu import load_torch_npu

    with pytest.raises(LLMException) as info:
        load_torch_npu()
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert "torch_npu is not installed" in str(info.value)


@pytest.mark.skipif(HAVE_TORCH_NPU, reason="torch_npu is installed here")
@pytest.mark.asyncio
async def test_init_with_npu_device_type_fails_clearly():
    before = _core.live_objects()
    dd = LLMDataDist(LLMRole.PROMPT, 3)
    with pytest.raises(LLMException) as info:
        await dd.init({"aio.DeviceType": "npu", "llm.DeviceId": "0"})
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    assert "'aio.DeviceType' is 'npu'" in str(info.value)
    await dd.finalize()
    assert _core.live_objects() == before


@pytest.mark.asyncio
async def test_host_default_still_has_no_device_backend():
    async with LLMDataDist(LLMRole.PROMPT, 4) as dd:
        await dd.init({"aio.DeviceType": "cpu"})
        assert runtime_of(dd).devices is None
        assert runtime_of(dd).device == torch.device("cpu")


# ---- the backend factory -----------------------------------------------------------------------


def test_factory_loads_a_backend_module_only_when_that_kind_is_opened():
    """``devices.open_backend`` imports ``cuda``/``npu`` by name on first use; an unknown kind names the option."""
    script = textwrap.dedent("""
        import sys
        from aio_datadist import LLMException, LLMStatusCode as S, _core
        import aio_datadist.runtime
        from aio_datadist.devices import auto_device, open_backend, select_device
        loaded = lambda: sorted(m for m in ("aio_datadist.devices.cuda", "aio_datadist.devices.npu")
                                if m in sys.modules)
        assert loaded() == [], loaded()
        q = _core.CompletionQueue()
        assert select_device("cpu", 0, q) is None
        assert loaded() == [], loaded()
        auto = auto_device()  # 'cpu' in CI; 'cuda' where torch sees a CUDA device
        if auto == "cpu":
            assert select_device("auto", None, q) is None
            assert loaded() == [], loaded()
        else:
            backend = select_device("auto", None, q)
            assert backend.kind == auto, (backend.kind, auto)
            backend.close()
            assert loaded() == [f"aio_datadist.devices.{auto}"], loaded()
        try:
            open_backend("tpu", 0, q)
        except LLMException as exc:
            assert exc.status_code == S.LLM_PARAM_INVALID and "'aio.DeviceType'" in str(exc), exc
        else:
            raise AssertionError("an unknown kind opened")
        try:
            open_backend("npu", 0, q)
        except LLMException as exc:
            assert exc.status_code == S.LLM_FEATURE_NOT_ENABLED, exc
        assert loaded() == sorted({"aio_datadist.devices.npu", f"aio_datadist.devices.{auto}"} - {
            "aio_datadist.devices.cpu"}), loaded()
        q.close()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


# ---- kernel geometry ---------------------------------------------------------------------------


@pytest.mark.parametrize(("nbytes", "values", "unit", "align", "chunks", "even"), [
    (32768, (0, 1 << 20, 32768), 8, 16, 1, True),          # the 32 KiB blocks: 16-byte accesses
    (32768, (0, 8), 8, 8, 1, True),                        # an 8-byte aligned offset: 8-byte accesses
    (4 << 20, (0,), 8, 16, 64, True),                      # a 4 MiB row: 64 programs of 64 KiB
    (1000, (0,), 8, 8, 1, False),                          # a short row: masked
    (6, (2,), 2, 2, 1, False),
    (3, (0,), 1, 1, 1, False),
    (65536 + 4096, (0,), 8, 16, 2, False),                 # a tail chunk: masked
])
def test_geometry_picks_the_widest_safe_access(nbytes, values, unit, align, chunks, even):
    geo = kernels.geometry(nbytes, *values)
    assert (geo.unit, geo.align, geo.chunks_per_row, geo.even) == (unit, align, chunks, even)
    assert geo.row_units * geo.unit == nbytes
    assert geo.chunk_units * geo.unit <= kernels.CHUNK_BYTES
    assert geo.chunks_per_row * geo.chunk_units >= geo.row_units > (geo.chunks_per_row - 1) * geo.chunk_units
    if geo.chunk_units > geo.block:
        assert geo.chunk_units % geo.block == 0


@pytest.mark.parametrize(("dst_bases", "src_bases", "dst_offset", "src_offset", "align"), [
    ((0x10000, 0x30000), (0x20000, 0x40000), 0, 0, 16),
    ((0x10000, 0x30000), (0x20000, 0x40000), 8, 0, 8),     # an offset into the destination rows
    ((0x10000, 0x30000), (0x20000, 0x40000), 0, 2, 2),     # one into the source rows
    ((0x10004, 0x30000), (0x20000, 0x40000), 0, 0, 4),     # one base of several
    ((0x10000, 0x30000), (0x20000, 0x40001), 0, 0, 1),
])
def test_a_kernel_copy_aligns_on_every_base_and_offset_it_addresses(monkeypatch, dst_bases, src_bases, dst_offset,
                                                                    src_offset, align):
    """``enqueue_rows`` builds the launch geometry from what the kernel addresses: a base or an offset left out
    gives wider accesses than the addresses allow (which the interpreter does not fault on)."""
    from aio_datadist.devices.backend import DeviceBackend
    from aio_datadist.devices.copies import Side, enqueue_rows

    launched = []
    monkeypatch.setattr(kernels, "launch_copy_rows", lambda *args, geo, **kw: launched.append(geo))
    backend = DeviceBackend.__new__(DeviceBackend)
    backend._alignments = {}
    backend.table = lambda values, cache=False: torch.tensor(list(values), dtype=torch.int64)
    cpu = torch.device("cpu")
    dst = Side(dst_bases, 32768, (1, 2), dst_offset, cpu, lambda: ())
    src = Side(src_bases, 32768, (0, 3), src_offset, cpu, lambda: ())
    enqueue_rows(backend, dst, src, 4096, "kernel", [])
    assert [geo.align for geo in launched] == [align]


def test_geometry_rejects_empty_rows():
    with pytest.raises(ValueError):
        kernels.geometry(0)


@pytest.mark.skipif(HAVE_TRITON, reason="Triton is installed here")
@pytest.mark.skipif(HAVE_TRITON, reason="Triton is installed here")
def test_kernels_module_imports_and_reports_no_triton():
    assert kernels.available() is False


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (not in CI)")
def test_kernel_compiles_for_sm90_with_16_byte_accesses():
    """Compiled here without a GPU: the aligned case must use 16-byte vector loads and stores."""
    triton, tl, kernel = kernels._triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = ["dst_bases", "src_bases", "dst_rows", "src_rows", "n_rows", "dst_stride", "src_stride",
             "dst_offset", "src_offset", "row_units", "chunks_per_row"]
    types = ["*i64"] * 4 + ["i32", "i64", "i64", "i64", "i64", "i32", "i32"]
    signature = dict(zip(names, types)) | {k: "constexpr" for k in ("ELEM", "ALIGN", "CHUNK", "BLOCK", "EVEN")}
    geo = kernels.geometry(32768, 0, 32768)
    # What the JIT specializes at launch: pointers and the multiples of 16 among the integers.
    values = dict(n_rows=512, dst_stride=32768, src_stride=32768, dst_offset=0, src_offset=0,
                  row_units=geo.row_units, chunks_per_row=geo.chunks_per_row)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if i < 4 or (values[n] % 16 == 0 and values[n])}
    src = ASTSource(kernel, signature=signature, attrs=attrs,
                    constexprs={"ELEM": tl.int64, "ALIGN": geo.align, "CHUNK": geo.chunk_units,
                                "BLOCK": geo.block, "EVEN": geo.even})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernels.NUM_WARPS}).asm["ptx"]
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
    assert "ld.global.v2.b64" in accesses and "st.global.v2.b64" in accesses
    assert not any(a.startswith("st.global") and "v2" not in a for a in accesses)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (not in CI)")
def test_kernel_is_byte_exact_under_the_triton_interpreter():
    """The kernel's indexing, run by Triton's CPU interpreter on host tensors (no GPU involved)."""
    script = textwrap.dedent("""
        import torch
        from aio_datadist.devices import kernels
        T, R, row = 3, 10, 32768
        gen = torch.Generator().manual_seed(0)
        src = torch.randint(0, 255, (T, R, row), dtype=torch.uint8, generator=gen)
        dst = torch.zeros_like(src)
        tab = lambda xs: torch.tensor(xs, dtype=torch.int64)
        db = tab([dst[t].data_ptr() for t in range(T)])
        sb = tab([src[t].data_ptr() for t in range(T)])
        drows, srows = tab([1, 4, 7, 8]), tab([0, 3, 9, 2])
        for nbytes, off in [(row, 0), (1000, 8), (6, 2), (3, 5), (20000, 4096)]:
            dst.zero_()
            geo = kernels.geometry(nbytes, *db.tolist(), *sb.tolist(), row, off)
            kernels.launch_copy_rows(db, sb, drows, srows, dst_stride=row, src_stride=row, dst_offset=off,
                                     src_offset=off, geo=geo, num_tensors=T)
            want = torch.zeros_like(src)
            want[:, drows, off:off + nbytes] = src[:, srows, off:off + nbytes]
            assert torch.equal(dst, want), (nbytes, off)
        print("exact")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "exact"


# ---- a peer's device export: its declared geometry is checked against the mapping ---------------


class _Mapping:
    address, nbytes = 1 << 20, 4096

    def view(self, offset, nbytes):
        raise AssertionError("the kernel and batch paths never build views")

    def close(self):
        pass


@pytest.mark.parametrize(("rows", "row_bytes", "tensor_bytes", "offsets", "why"), [
    (4, 256, 1000, (0,), "geometry"),
    (0, 256, 0, (0,), "geometry"),
    (4, 256, 1024, (), "outside"),
    (4, 256, 1024, (3200,), "outside"),
    (4, 256, 1024, (-8,), "outside"),
])
def test_a_peer_export_that_does_not_fit_its_mapping_is_refused(rows, row_bytes, tensor_bytes, offsets, why):
    with pytest.raises(ExportInvalid, match=why):
        PeerDeviceCache(1, _Mapping(), rows, row_bytes, tensor_bytes, offsets, torch.device("cpu"))


def test_rows_and_bytes_outside_a_peer_cache_never_reach_a_copy():
    peer = PeerDeviceCache(1, _Mapping(), 4, 256, 1024, (0, 2048), torch.device("cpu"))
    side = peer.side([3, 0], 16, 32, 1, 1)
    assert side.bases == (_Mapping.address + 2048,) and side.rows == (3, 0) and side.offset == 16
    for rows, offset, nbytes, first, count in [([4], 0, 8, 0, 1), ([-1], 0, 8, 0, 1), ([0], 250, 8, 0, 1),
                                               ([0], 0, 8, 1, 2), ([], 0, 8, 0, 1), ([0], 0, 0, 0, 1)]:
        with pytest.raises(ExportInvalid):
            peer.side(rows, offset, nbytes, first, count)
    peer.close()


def test_the_default_copy_method_follows_what_each_side_is(monkeypatch):
    """Device rows go by the kernel on CUDA; host<->device by the kernel only where the host cache is page-locked
    (the device addresses it), else by a driver batch, else staged; the host backend always batches."""
    from aio_datadist.devices.copies import Side, choose_method

    def side(on_host: bool) -> Side:
        return Side((0,), 16, (0,), 0, torch.device("cpu"), lambda: (), on_host=on_host)

    class Backend:
        def __init__(self, kind: str, batch: bool) -> None:
            self.kind, self.batch_copies = kind, batch

    dev, host = side(False), side(True)
    monkeypatch.setattr(kernels, "available", lambda: True)
    cuda = Backend("cuda", True)
    assert choose_method(cuda, dev, dev) == "kernel"
    assert choose_method(cuda, dev, host, host_pinned=True) == "kernel"
    assert choose_method(cuda, host, dev, host_pinned=True) == "kernel"
    assert choose_method(cuda, dev, host) == "batch"
    assert choose_method(Backend("cuda", False), dev, host) == "staged"
    assert choose_method(Backend("npu", False), dev, host, host_pinned=True) == "staged"
    assert choose_method(Backend("npu", False), dev, dev) == "torch"
    assert choose_method(Backend("host", True), dev, host, host_pinned=True) == "batch"
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert choose_method(cuda, dev, host, host_pinned=True) == "batch"
    assert choose_method(cuda, dev, dev) == "torch"
