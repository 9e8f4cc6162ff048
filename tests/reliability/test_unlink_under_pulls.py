"""Our own unlink while many of our pulls use the link, or while the peer unlinks us: an unlink, not a failure
(row 324)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from _forked import forked
from _harness import endpoint
from aio_datadist.testing import link_table_of
from peers import CacheSpec, EndpointSpec, cluster_info
from tls_certs import client_context, make_pki, server_context

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    KvCache,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    links,
)

S = LLMStatusCode
PKI = make_pki("unlink under pulls")


async def pull_until_cut(dd: LLMDataDist, dst: KvCache, blocks: list[int],
                         on_cut: Callable[[LLMException], object] | None = None) -> None:
    """Pull ``blocks`` of cluster 1's blocks cache into the same blocks of ``dst`` again and again, until a pull
    fails (``on_cut`` is told why)."""
    while True:
        try:
            await dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks)
        except LLMException as exc:
            if on_cut is not None:
                on_cut(exc)
            return


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
        for _ in range(4):
            assert (await dd.link_clusters([cluster_info(1, prompt.address)]))[0] == S.LLM_SUCCESS
            dst = dd.kv_cache_manager.allocate_blocks_cache(desc)

            pulling = [asyncio.ensure_future(pull_until_cut(dd, dst, [k * 4 + j for j in range(4)],
                                                            lambda exc: cuts.append((exc.status_code, str(exc)))))
                       for k in range(8)]
            await asyncio.sleep(0.3)
            results.append((await dd.unlink_clusters([cluster_info(1, prompt.address)], 3000))[0])
            await asyncio.wait_for(asyncio.gather(*pulling), 10)
            dd.kv_cache_manager.deallocate_cache(dst)
        assert results == [S.LLM_SUCCESS] * 4, results
        assert cuts and all(code == S.LLM_NOT_YET_LINK for code, _ in cuts), cuts


@pytest.mark.asyncio
@pytest.mark.parametrize("pulling", [False, True], ids=["idle", "pulling"])
async def test_unlinks_that_cross_both_succeed(pulling):
    """Both ends call ``unlink_clusters`` for each other at the same moment: each reads the other's ``UNLINK``
    while its own waits for an answer, which is the answer (the peer let the link go too). Before, each end tore
    the link down on the peer's ``UNLINK`` and failed its own wait: both usually reported
    ``LLM_NOTIFY_PROMPT_UNLINK_FAILED`` (found by the review of row 324)."""
    desc = CacheDesc(4, (64, 8192), DataType.DT_FLOAT, Placement.HOST)
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, 2, listen=True, transport="tcp") as dec:
        prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        results = []
        for _ in range(6):
            assert (await dec.link_clusters([cluster_info(1, prompt.listen_address)]))[0] == S.LLM_SUCCESS
            dst = dec.kv_cache_manager.allocate_blocks_cache(desc)

            tasks = [asyncio.ensure_future(pull_until_cut(dec, dst, [k])) for k in range(4)] if pulling else []
            await asyncio.sleep(0.05)
            (ours, _), (theirs, _) = await asyncio.gather(
                dec.unlink_clusters([cluster_info(1, prompt.listen_address)], 2000),
                prompt.unlink_clusters([cluster_info(2, dec.listen_address)], 2000))
            results.append((ours, theirs))
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            dec.kv_cache_manager.deallocate_cache(dst)
        assert results == [(S.LLM_SUCCESS, S.LLM_SUCCESS)] * 6, results


@pytest.mark.asyncio
async def test_a_pull_that_waited_for_a_channel_through_our_unlink_leaves_it_untouched(monkeypatch):
    """One data channel, four pulls queued on it, and a peer that takes 0.3 s to answer our ``UNLINK`` (its
    settle of what it serves may take up to ``links.SERVED_SETTLE_S``): a pull that gets the channel after our
    ``UNLINK`` is refused before anything is sent and gives the channel back as it was; the unlink succeeds.
    A first form of row 324 refused it only once it held the channel: giving it up reset the channel and
    redialled it into the peer, which had let the link go and refused, so the link failed under the unlink
    (``LLM_NOTIFY_PROMPT_UNLINK_FAILED``, 3 of 3; found by its review)."""
    settle = links.Link.settle_served

    async def slow_settle(self: links.Link, *, pushes_only: bool = False, **kwargs: Any) -> None:
        await settle(self, pushes_only=pushes_only, **kwargs)
        if not self.is_client and not pushes_only:  # the prompt's end, answering the decoder's UNLINK
            await asyncio.sleep(0.3)

    monkeypatch.setattr(links.Link, "settle_served", slow_settle)
    desc = CacheDesc(4, (64, 8192), DataType.DT_FLOAT, Placement.HOST)
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp", data_channels=1) as prompt, \
            endpoint(LLMRole.DECODER, 2, transport="tcp", data_channels=1) as dec:
        prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        results, cuts = [], []
        for _ in range(3):
            assert (await dec.link_clusters([cluster_info(1, prompt.listen_address)]))[0] == S.LLM_SUCCESS
            dst = dec.kv_cache_manager.allocate_blocks_cache(desc)

            tasks = [asyncio.ensure_future(pull_until_cut(dec, dst, [k], lambda exc: cuts.append(exc.status_code)))
                     for k in range(4)]
            await asyncio.sleep(0.1)
            results.append((await dec.unlink_clusters([cluster_info(1, prompt.listen_address)], 3000))[0])
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            dec.kv_cache_manager.deallocate_cache(dst)
        assert results == [S.LLM_SUCCESS] * 3, (results, cuts)
        assert set(cuts) == {S.LLM_NOT_YET_LINK}, cuts


async def _pull_under_way(dec: Any, link: Any, desc: CacheDesc) -> tuple[asyncio.Future, Any]:
    """A pull of all 64 blocks of cluster 1's ``BlocksCacheKey(1, 0)`` into a new cache, once ``link`` sent it;
    and that cache."""
    dst = dec.kv_cache_manager.allocate_blocks_cache(desc)
    blocks = list(range(64))
    pull = asyncio.ensure_future(dec.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks))
    for _ in range(1000):
        if link.pending:
            break
        await asyncio.sleep(0)
    assert link.pending, "the pull was never sent"
    return pull, dst


@pytest.mark.asyncio
async def test_a_pull_cut_after_our_unlink_is_not_redialled(monkeypatch):
    """A pull in flight on the one data channel is cancelled after we sent ``UNLINK`` (the peer slow to answer
    it): its channel is reset but not redialled (the peer lets the link go), and the unlink succeeds."""
    settle, redial = links.Link.settle_served, links.Link._redial
    late: list[Any] = []

    async def slow_settle(self: links.Link, *, pushes_only: bool = False, **kwargs: Any) -> None:
        await settle(self, pushes_only=pushes_only, **kwargs)
        if not self.is_client and not pushes_only:  # the prompt's end, answering the decoder's UNLINK
            await asyncio.sleep(0.3)

    async def watched_redial(self: links.Link, index: int, generation: int, done: asyncio.Future) -> None:
        if self.unlinking:
            late.append(("redial", index))
        await redial(self, index, generation, done)

    monkeypatch.setattr(links.Link, "settle_served", slow_settle)
    monkeypatch.setattr(links.Link, "_redial", watched_redial)
    desc = CacheDesc(4, (64, 65536), DataType.DT_FLOAT, Placement.HOST)
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp", data_channels=1) as prompt, \
            endpoint(LLMRole.DECODER, 2, transport="tcp", data_channels=1) as dec:
        prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        assert (await dec.link_clusters([cluster_info(1, prompt.listen_address)]))[0] == S.LLM_SUCCESS
        link = link_table_of(dec).links[1]
        pull, _ = await _pull_under_way(dec, link, desc)
        unlink = asyncio.ensure_future(dec.unlink_clusters([cluster_info(1, prompt.listen_address)], 3000))
        for _ in range(1000):
            if link.unlinking:
                break
            await asyncio.sleep(0)
        assert link.unlinking and not pull.done()
        pull.cancel()
        await asyncio.gather(pull, return_exceptions=True)
        assert (await unlink)[0] == S.LLM_SUCCESS
        assert late == [], late


async def unlink_with_a_redial_under_way(monkeypatch: Any, *, we_accept: bool, tls: bool) -> list[tuple[S, str]]:
    """Three rounds: the decoder's 64-block pull is cancelled (its one data channel reset, the redial on its way,
    ``delay`` as over a network), and one end unlinks at once while the other is slow to answer (its settle of
    what it serves: up to ``links.SERVED_SETTLE_S``). ``we_accept``: the prompt (accepting end) unlinks, else
    the decoder (dialling end); ``tls``: every connection of the link under TLS. Each round's unlink status and
    the decoder's link's failure, if any."""
    settle = links.Link.settle_served

    async def slow_settle(self: links.Link, *, pushes_only: bool = False, **kwargs: Any) -> None:
        await settle(self, pushes_only=pushes_only, **kwargs)
        if self.is_client == we_accept and not pushes_only:  # the end that answers the UNLINK
            await asyncio.sleep(0.3)

    monkeypatch.setattr(links.Link, "settle_served", slow_settle)
    desc = CacheDesc(4, (64, 65536), DataType.DT_FLOAT, Placement.HOST)
    delay = 0.05 if we_accept else 0.02
    server, client = ({"tls_server_context": server_context(PKI)}, {"tls_client_context": client_context(PKI)}) \
        if tls else ({}, {})
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp", data_channels=1, **server, **client) \
            as prompt, endpoint(LLMRole.DECODER, 2, transport="tcp", data_channels=1, **client) as dec:
        prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        table = link_table_of(dec)
        real = table.dial_data

        async def dial_data(address: Any, token: bytes, index: int, generation: int) -> Any:
            if generation > 0:  # a redial
                await asyncio.sleep(delay)
            return await real(address, token, index, generation)

        table.dial_data = dial_data  # type: ignore[method-assign]
        results = []
        for _ in range(3):
            assert (await dec.link_clusters([cluster_info(1, prompt.listen_address)]))[0] == S.LLM_SUCCESS
            link = table.links[1]
            pull, dst = await _pull_under_way(dec, link, desc)
            pull.cancel()
            await asyncio.gather(pull, return_exceptions=True)
            if we_accept:
                code = (await prompt.unlink_clusters([cluster_info(2, ("127.0.0.1", 1))], 3000))[0]
            else:
                code = (await dec.unlink_clusters([cluster_info(1, prompt.listen_address)], 3000))[0]
            results.append((code, str(link.broken)))
            dec.kv_cache_manager.deallocate_cache(dst)
            if we_accept:
                await asyncio.sleep(0.5)  # the decoder's end answered and closed
        return results


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_redial_under_way_at_our_unlink_does_not_fail_it(monkeypatch, tls):
    """A cancelled pull reset its channel, whose redial is under way when we unlink; the peer, slow to answer our
    ``UNLINK``, let the link go on reading it and refuses the redial: that is no failure of the link, and the
    unlink succeeds. A second form of row 324 stopped only redials started after our ``UNLINK``: this one failed
    the link under the unlink (``LLM_NOTIFY_PROMPT_UNLINK_FAILED``, 3 of 3; found by its review)."""
    results = await unlink_with_a_redial_under_way(monkeypatch, we_accept=False, tls=tls)
    assert [code for code, _ in results] == [S.LLM_SUCCESS] * 3, results


@pytest.mark.asyncio
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_peer_s_redial_under_way_at_our_unlink_does_not_fail_it(monkeypatch, tls):
    """The mirror: we are the accepting end and unlink while the peer's redial is on its way and the peer is slow
    to answer our ``UNLINK``. We refuse the redial saying we are unlinking (``LLM_NOT_YET_LINK`` in
    ``ATTACH_OK``), and the peer's redial ends without failing the link, whose ``UNLINK`` it then answers: the
    unlink succeeds. Before, the refusal read as a plain failure there, the peer's link broke, it never answered,
    and our unlink reported ``LLM_NOTIFY_PROMPT_UNLINK_FAILED`` (3 of 3; found by the final review of row 324).
    Over TLS the door refused it as a plain failure still (found by audit)."""
    results = await unlink_with_a_redial_under_way(monkeypatch, we_accept=True, tls=tls)
    assert [code for code, _ in results] == [S.LLM_SUCCESS] * 3, results
