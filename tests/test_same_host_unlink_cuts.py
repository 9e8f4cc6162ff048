"""Same-host pulls in flight when their link is unlinked: row 346, the same-host side of row 337 (NIXL)."""

from __future__ import annotations

import asyncio

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.testing import runtime_of, usable_link
from aio_datadist.transport import same_host
from peers import DECODER_ID, PROMPT_ID, cluster_info, linked_pair, same, snapshot

S = LLMStatusCode
LOCAL = {"transport": "local"}
KEY = BlocksCacheKey(PROMPT_ID, 0)
BIG = CacheDesc(4, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 4 x 64 blocks of 1 MiB: 256 MiB
ALL = list(range(64))


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["read-without-asking", "asked"])
@pytest.mark.parametrize("who", ["owner", "requester"])
async def test_a_same_host_read_in_flight_returns_no_byte_the_owner_wrote_after_its_unlink(who, how, monkeypatch):
    """A same-host pull of 256 MiB (read without asking, or asked: ``carry``) is being copied on the copy threads
    when its link is unlinked, by the owner or by the requester; the owner writes its cache again as soon as the
    unlink returned. The pull succeeds with what it read before, or fails ``LLM_NOT_YET_LINK``, and reads no
    byte after the unlink returned (found by a hunt, 2026-12-07: it succeeded with up to 240 MB written after)."""
    async with linked_pair(link=False, prompt_config=LOCAL, decoder_config=LOCAL) as pair:
        src = pair.pm.allocate_blocks_cache(BIG, KEY)
        for t in src.tensors:
            t.fill_(0x5C)
        dst = pair.dm.allocate_blocks_cache(BIG)
        await pair.link()
        share = usable_link(pair.decoder, PROMPT_ID).local
        assert share is not None and share.listed_region(0) is not None  # read without asking
        if how == "asked":  # the owner answers, then the requester copies out of its mapping (``carry``)
            monkeypatch.setattr(same_host.SameHostPlane, "reader", lambda *a: None)
        copier = runtime_of(pair.decoder).copier
        pull = asyncio.ensure_future(pair.dm.pull_blocks(KEY, dst, ALL, ALL, timeout=20_000))
        async with asyncio.timeout(5):
            while not copier.pending():
                await asyncio.sleep(0)
        if who == "owner":
            status = await pair.prompt.unlink_clusters([cluster_info(DECODER_ID, ("127.0.0.1", 1))])
        else:
            status = await pair.decoder.unlink_clusters([cluster_info(PROMPT_ID, ("127.0.0.1", 1))])
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        still_copying = copier.pending()
        for t in src.tensors:
            t.fill_(3)  # the owner's memory is its own again: it writes its cache
        try:
            await pull
            outcome = "succeeded"
        except LLMException as exc:
            outcome = exc.status_code.name
        late = sum(int((t == 3).sum()) for t in dst.tensors)
        assert (outcome in ("succeeded", "LLM_NOT_YET_LINK"), late) == (True, 0), (
            f"the pull {outcome} with {late} bytes the owner wrote after its unlink returned "
            f"(copy still running at the unlink's return: {still_copying})")
        before = snapshot(dst)
        await asyncio.sleep(0.3)
        assert same(before, snapshot(dst)), "bytes landed after the pull returned"
