"""The Triton copy kernel, byte-exact against torch over many block patterns.

Run by ``tools/check_triton.sh`` under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, host tensors, no GPU) in a pip target of its own, so
the default CI environment stays without the 280 MB triton wheel. On a GPU
machine with Triton the same cases run on the device (``-m gpu``).

Patterns: every element width (1..8 bytes) and base misalignment 0..15,
masked tails (rows that are not a whole number of loop steps or chunks),
rows longer than one program's chunk, different source and destination
strides and offsets, several tensors at unrelated addresses, and in-place
fan-out (one source block copied to several blocks of the same tensor).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from aio_datadist.devices import kernels

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not HAVE_TRITON, reason="needs Triton (tools/check_triton.sh installs it)"),
    pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                       reason="needs TRITON_INTERPRET=1, or a CUDA device and AIO_DATADIST_TEST_CUDA=1"),
]


def _table(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _buffer(nbytes: int, misalign: int, seed: int) -> torch.Tensor:
    """``nbytes`` of random bytes starting ``misalign`` bytes past a 256-byte boundary."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes + 512,), dtype=torch.uint8, generator=gen).to(DEVICE)
    start = (-raw.data_ptr()) % 256 + misalign
    return raw[start:start + nbytes]


def _run(dst: list[torch.Tensor], src: list[torch.Tensor], dst_rows: list[int], src_rows: list[int], *,
         dst_stride: int, src_stride: int, dst_offset: int, src_offset: int, nbytes: int) -> None:
    db, sb = [t.data_ptr() for t in dst], [t.data_ptr() for t in src]
    geo = kernels.geometry(nbytes, *db, *sb, dst_stride, src_stride, dst_offset, src_offset)
    kernels.launch_copy_rows(_table(db), _table(sb), _table(dst_rows), _table(src_rows), dst_stride=dst_stride,
                             src_stride=src_stride, dst_offset=dst_offset, src_offset=src_offset, geo=geo,
                             num_tensors=len(dst))
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _expect(dst: list[torch.Tensor], src: list[torch.Tensor], dst_rows: list[int], src_rows: list[int], *,
            dst_stride: int, src_stride: int, dst_offset: int, src_offset: int, nbytes: int) -> list[torch.Tensor]:
    out = [d.clone() for d in dst]
    for o, s in zip(out, src, strict=True):
        for dr, sr in zip(dst_rows, src_rows, strict=True):
            d0, s0 = dr * dst_stride + dst_offset, sr * src_stride + src_offset
            o[d0:d0 + nbytes] = s[s0:s0 + nbytes]
    return out


CASES = [
    # (nbytes, dst_stride, src_stride, dst_offset, src_offset, dst misalign, src misalign)
    (16, 16, 16, 0, 0, 0, 0),             # one aligned 16-byte unit
    (4096, 4096, 4096, 0, 0, 0, 0),       # half a loop step, even rows
    (8192, 8192, 8192, 0, 0, 0, 0),       # exactly one step: no masks
    (8200, 8208, 8200, 0, 0, 0, 0),       # one step and a masked tail of 8 bytes
    (70000, 70016, 70000, 0, 0, 0, 0),    # more than one program's chunk, masked last chunk
    (131072, 131072, 131072, 0, 0, 0, 0),  # two whole chunks
    (1000, 1024, 1000, 8, 0, 0, 0),       # offsets inside rows, 8-byte units
    (998, 1000, 1002, 2, 4, 0, 0),        # 2-byte units
    (333, 400, 350, 1, 7, 0, 0),          # 1-byte units, odd everything
    (512, 512, 512, 0, 0, 4, 0),          # destination only 4-byte aligned
    (512, 512, 512, 0, 0, 0, 1),          # source only 1-byte aligned
    (24, 40, 56, 8, 16, 8, 8),            # 8-byte units, small rows
    (9000, 9000, 12000, 0, 3000, 3, 5),   # misaligned, long, different strides
]


@pytest.mark.parametrize("case", CASES, ids=[f"n{c[0]}-ds{c[1]}-ss{c[2]}-do{c[3]}-so{c[4]}-m{c[5]}{c[6]}"
                                             for c in CASES])
def test_rows_between_tensors_match_torch(case):
    nbytes, ds, ss, do, so, dm, sm = case
    tensors, rows = 3, 6
    dst = [_buffer(ds * rows, dm + t, 10 + t) for t in range(tensors)]  # unrelated, differently aligned
    src = [_buffer(ss * rows, sm + t, 20 + t) for t in range(tensors)]
    dst_rows, src_rows = [5, 0, 3, 2], [1, 4, 4, 0]  # a source row read twice
    kw = dict(dst_stride=ds, src_stride=ss, dst_offset=do, src_offset=so, nbytes=nbytes)
    want = _expect(dst, src, dst_rows, src_rows, **kw)
    _run(dst, src, dst_rows, src_rows, **kw)
    for got, exp in zip(dst, want, strict=True):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("nbytes", [64, 1000, 8192, 20000])
def test_in_place_fan_out_within_one_tensor(nbytes):
    """copy_blocks' shape: one source block to several blocks of the same tensor, rows untouched elsewhere."""
    rows, stride = 8, nbytes
    caches = [_buffer(rows * stride, 0, 30 + t) for t in range(2)]
    before = [c.clone() for c in caches]
    dst_rows, src_rows = [2, 5, 7], [1, 1, 1]
    _run(caches, caches, dst_rows, src_rows, dst_stride=stride, src_stride=stride, dst_offset=0, src_offset=0,
         nbytes=nbytes)
    for c, b in zip(caches, before, strict=True):
        view, old = c.view(rows, stride), b.view(rows, stride)
        for r in range(rows):
            want = old[1] if r in dst_rows else old[r]
            assert torch.equal(view[r], want), r


def test_masked_tail_never_writes_past_the_row():
    nbytes, stride = 8195, 8208  # a tail of 3 bytes in 1-byte units; the gap bytes must stay
    dst = [_buffer(stride * 2, 0, 40)]
    src = [_buffer(stride * 2, 0, 41)]
    before = dst[0].clone()
    _run(dst, src, [0], [1], dst_stride=stride, src_stride=stride, dst_offset=0, src_offset=0, nbytes=nbytes)
    assert torch.equal(dst[0][:nbytes], src[0][stride:stride + nbytes])
    assert torch.equal(dst[0][nbytes:], before[nbytes:])
