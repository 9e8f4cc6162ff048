"""Small same-host copies run on the loop's thread (``same_host.INLINE_COPY_MAX``) while the copy threads
have no job; large ones, and any while the threads have work, on the threads. The bytes are exact."""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, Placement, _core
from aio_datadist.transport import same_host
from peers import DECODER_ID, PROMPT_ID, fill, linked_pair

pytestmark = pytest.mark.usefixtures("fork_server")

SMALL = CacheDesc(4, (16, 64, 1024), DataType.DT_UINT8, Placement.HOST)  # 64 KiB blocks, 1 MiB a tensor
BIG = CacheDesc(2, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 1 MiB blocks, 64 MiB a tensor
LOCAL = {"transport": "local"}


class CountingCopier:
    """The runtime's copy engine, counting the jobs handed to it."""

    def __init__(self, inner) -> None:
        self.inner, self.jobs = inner, 0

    def submit(self, token, triples):
        self.jobs += 1
        return self.inner.submit(token, triples)

    def cancel(self, token):
        return self.inner.cancel(token)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def counting(dd) -> CountingCopier:
    rt = dd._require_runtime()
    rt.copier = CountingCopier(rt.copier)
    return rt.copier


@contextlib.asynccontextmanager
async def small_local_pair() -> AsyncIterator[tuple[Any, list[torch.Tensor], Any, CountingCopier]]:
    """A same-host pair with a ``SMALL`` blocks cache each, the prompt's filled: ``(pair, its values, the
    decoder's cache, the decoder's copy engine counting its jobs)``."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(SMALL, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 3)
        dst = pair.dm.allocate_blocks_cache(SMALL, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        yield pair, values, dst, counting(pair.decoder)


def test_copy_now_copies_every_triple_and_returns_the_bytes():
    src, dst = bytearray(range(200)), bytearray(200)
    a = ctypes.addressof((ctypes.c_char * 200).from_buffer(src))
    b = ctypes.addressof((ctypes.c_char * 200).from_buffer(dst))
    assert _core.copy_now(array.array("Q", [b, a, 10, b + 100, a + 50, 30])) == 40
    assert dst[:10] == src[:10] and dst[100:130] == src[50:80]
    assert dst[10:100] == bytearray(90) and dst[130:] == bytearray(70)
    with pytest.raises(ValueError, match="triples"):
        _core.copy_now(array.array("Q", [b, a]))


@pytest.mark.asyncio
@pytest.mark.parametrize("threshold", [None, 0], ids=["default", "zero"])
async def test_a_small_pull_copies_inline_and_a_large_one_on_the_threads(monkeypatch, threshold):
    """Threshold 0 (``AIO_DATADIST_INLINE_COPY_MAX=0``, for comparisons) hands every copy to the threads."""
    if threshold is not None:
        monkeypatch.setattr(same_host, "INLINE_COPY_MAX", threshold)
    async with small_local_pair() as (pair, values, dst, copier):
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [1, 7], [2, 9])  # 4 x 2 x 64 KiB
        assert copier.jobs == (0 if threshold is None else 1)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[[2, 9]], v[[1, 7]])
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(16)), list(range(16)))  # 4 MiB
        assert copier.jobs == (1 if threshold is None else 2)
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d, v)


@pytest.mark.asyncio
async def test_a_pull_of_exactly_the_bound_copies_inline_and_one_block_more_does_not():
    """At the bound: a pull of exactly ``INLINE_COPY_MAX`` (8 blocks of 4 x 64 KiB) copies inline, one of a block
    more goes to the threads (the test above pulls 512 KiB and 4 MiB, and passed with ``<`` for ``<=``; audit,
    2026-12-07)."""
    block = 4 * 64 * 1024
    assert same_host.INLINE_COPY_MAX == 8 * block
    async with small_local_pair() as (pair, values, dst, copier):
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(8)), list(range(8)))
        assert copier.jobs == 0, "a copy of exactly INLINE_COPY_MAX went to the threads"
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, list(range(9)), list(range(7, 16)))
        assert copier.jobs == 1, "a copy over INLINE_COPY_MAX ran inline"
        for d, v in zip(dst.tensors, values, strict=True):
            assert torch.equal(d[:7], v[:7]) and torch.equal(d[7:16], v[:9])


@pytest.mark.asyncio
@pytest.mark.parametrize("small", ["pull", "push"])
async def test_a_small_pull_beside_a_running_copy_goes_to_the_threads_too(small):
    """While the threads have work (any copy of the runtime's, here a large pull), a small copy queues there
    too instead of holding the loop: a small pull's, and the owner's of a small push into it (the pull alone
    passed with the owner's check of the threads' work removed; audit, 2026-12-07)."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        big_src = pair.pm.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT_ID, 0))
        small_src = pair.pm.allocate_blocks_cache(SMALL, BlocksCacheKey(PROMPT_ID, 1))
        big_values, small_values = fill(big_src, 5), fill(small_src, 6)
        big_dst = pair.dm.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER_ID, 0))
        small_dst = pair.dm.allocate_blocks_cache(SMALL, BlocksCacheKey(DECODER_ID, 1))
        await pair.link()
        copier = counting(pair.decoder)
        big = asyncio.ensure_future(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), big_dst, list(range(64)),
                                                        list(range(64))))
        for _ in range(2000):  # until the 128 MiB copy is on the threads (bounded: 2 s)
            if copier.pending() or big.done():
                break
            await asyncio.sleep(0.001)
        assert copier.pending() == 1, "the large copy never started"
        if small == "pull":
            await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 1), small_dst, [0], [3])
        else:  # the decoder owns the pushed-into cache: its copy
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 1), small_src, [0], [3])
        await big
        assert copier.jobs == 2 and copier.pending() == 0
        for d, v in zip(big_dst.tensors, big_values):
            assert torch.equal(d, v)
        for d, v in zip(small_dst.tensors, small_values):
            assert torch.equal(d[3], v[0])


@pytest.mark.asyncio
async def test_the_owner_of_a_small_push_copies_inline_and_of_a_large_one_on_the_threads():
    """A same-host push is the owner's copy out of the pusher's region (``PUSH_LOCAL``): the same rule."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(SMALL, BlocksCacheKey(PROMPT_ID, 0))
        values = fill(src, 8)
        dst = pair.dm.allocate_blocks_cache(SMALL, BlocksCacheKey(DECODER_ID, 0))
        await pair.link()
        copier = counting(pair.decoder)  # the owner of the pushed-into cache copies
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, [4, 5], [10, 12])
        assert copier.jobs == 0
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d[[10, 12]], v[[4, 5]])
        await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID, 0), src, list(range(16)), list(range(15, -1, -1)))
        assert copier.jobs == 1
        for d, v in zip(dst.tensors, values):
            assert torch.equal(d, v.flip(0))
