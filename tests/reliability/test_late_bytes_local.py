"""No byte after return on the same-host transport (issue 14, point 6).

A same-host pull is a copy job of the requester's; a same-host push is a
copy job of the owner's, reading the pusher's region. Calls here are cut
by a timeout or a cancel while 128 MiB are being copied. After the call has
returned the destination is snapshotted, and 300 ms later it must be the
same: a copy that went on after the return would have changed it. Then the
link moves verified bytes again.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist.testing import usable_link
from peers import cluster_info, port_of

from _harness import endpoint, settle, state
from _tally import count

S = LLMStatusCode
PROMPT, DECODER = 1, 2
BLOCKS = CacheDesc(2, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 2 x 64 blocks of 1 MiB: 128 MiB
ALL = list(range(64))
LOCAL = {"transport": "local"}
CUTS_MS = (1, 3, 8, 20)


async def quiet(dst, within: float = 0.3) -> None:
    """The destination does not change any more once the call returned."""
    before = [t.clone() for t in dst.tensors]
    await asyncio.sleep(within)
    assert all(torch.equal(a, b) for a, b in zip(before, dst.tensors)), "bytes landed after the call returned"


async def pair():
    prompt_cm = endpoint(LLMRole.PROMPT, PROMPT, listen=True, **LOCAL)
    decoder_cm = endpoint(LLMRole.DECODER, DECODER, **LOCAL)
    prompt = await prompt_cm.__aenter__()
    decoder = await decoder_cm.__aenter__()
    return prompt, decoder, (decoder_cm, prompt_cm)


async def link(prompt, decoder) -> None:
    status, _ = await decoder.link_clusters([cluster_info(PROMPT, port_of(prompt))])
    assert status == S.LLM_SUCCESS
    assert usable_link(decoder, PROMPT).local is not None and usable_link(prompt, DECODER).local is not None


async def cut(call, how: str, after_ms: int) -> None:
    """Run ``call(timeout_ms)`` and cut it by its timeout or by cancelling it after ``after_ms``."""
    if how == "timeout":
        try:
            await call(after_ms)
        except LLMException as exc:
            assert exc.status_code == S.LLM_TIMEOUT
        return
    task = asyncio.ensure_future(call(60_000))
    await asyncio.sleep(after_ms / 1000)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["timeout", "cancel"])
@pytest.mark.parametrize("direction", ["pull", "push"])
async def test_a_cut_same_host_transfer_writes_nothing_after_it_returned(direction, how):
    """A pull's destination is the requester's (the decoder's) cache, a push's the owner's (also the
    decoder's here); either way it is watched after the call returned."""
    prompt, decoder, cms = await pair()
    try:
        pull = direction == "pull"
        mark = 0xAB if pull else 0xCD
        src = prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT, 0) if pull else None)
        for t in src.tensors:
            t.fill_(mark)
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS, None if pull else BlocksCacheKey(DECODER, 0))
        await link(prompt, decoder)
        baseline = state(decoder)

        async def transfer(timeout_ms: int | None = None) -> None:
            if pull:
                await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL, ALL,
                                                           timeout=timeout_ms)
            else:
                await prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, ALL, ALL,
                                                          timeout=timeout_ms)

        for after_ms in CUTS_MS:
            for t in dst.tensors:
                t.zero_()
            await cut(transfer, how, after_ms)
            held = state(decoder)  # the decoder's copy into dst (either way) is over once the call returned
            assert [held[k] - baseline[k] for k in ("copy jobs", "pending tokens")] == [0, 0], held
            await quiet(dst)
            count("cut transfers checked for late bytes", 1)
        await settle(decoder, baseline)
        await transfer()
        assert all(bool((t == mark).all()) for t in dst.tensors)
    finally:
        for cm in cms:
            await cm.__aexit__(None, None, None)
