"""Our own unlink while many of our pulls use the link: an unlink, not a failure (row 324)."""

from __future__ import annotations

import asyncio

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from peers import CacheSpec, EndpointSpec, cluster_info

from _forked import forked
from _harness import endpoint

S = LLMStatusCode


UNLINK_PROMPT = EndpointSpec(LLMRole.PROMPT, 1, listen=True, lifetime=60.0, config=(("transport", "tcp"),),
                             caches=(CacheSpec("blocks", CacheDesc(4, (64, 8192), DataType.DT_FLOAT, Placement.HOST),
                                               3, blocks=True, model_id=0),))


@pytest.mark.asyncio
async def test_our_unlink_under_more_pulls_than_channels_is_an_unlink(fork_server):
    """``unlink_clusters`` while 8 tasks pull over the link (more than its data channels: requests wait for
    one, as a multi-threaded server's calls do): the unlink succeeds and the cut pulls read ``LLM_NOT_YET_LINK``.
    Before, what we sent after our ``UNLINK`` (requests that found a channel, the cut pulls' ``ABORT``s, our
    answers to the peer's heartbeat) was left unread as the peer closed, its kernel reset the connection and
    dropped its ``UNLINK_ACK``: the unlink reported ``LLM_NOTIFY_PROMPT_UNLINK_FAILED`` (the peer alive), and cut
    pulls ``LLM_LINK_FAILED`` "Connection reset by peer" (found by an audit of the blocking facade under threads,
    half the unlinks and every trial with 8 pulling threads)."""
    desc = CacheDesc(4, (64, 8192), DataType.DT_FLOAT, Placement.HOST)
    async with forked(UNLINK_PROMPT) as (prompt,), endpoint(LLMRole.DECODER, 2, transport="tcp") as dd:
        results, cuts = [], []
        for trial in range(4):
            assert (await dd.link_clusters([cluster_info(1, prompt.address)]))[0] == S.LLM_SUCCESS
            dst = dd.kv_cache_manager.allocate_blocks_cache(desc)

            async def pulls(k: int) -> None:
                mine = [k * 4 + j for j in range(4)]
                while True:
                    try:
                        await dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, mine, mine)
                    except LLMException as exc:
                        cuts.append((exc.status_code, str(exc)))
                        return

            pulling = [asyncio.ensure_future(pulls(k)) for k in range(8)]
            await asyncio.sleep(0.3)
            results.append((await dd.unlink_clusters([cluster_info(1, prompt.address)], 3000))[0])
            await asyncio.wait_for(asyncio.gather(*pulling), 10)
            dd.kv_cache_manager.deallocate_cache(dst)
        assert results == [S.LLM_SUCCESS] * 4, results
        assert cuts and all(code == S.LLM_NOT_YET_LINK for code, _ in cuts), cuts
