"""A linked NIXL peer that lies in its records: what it can and cannot make us keep or do.

The attacker is the decoder of an in-process pair: it sends ``Msg.NIXL``
records of its own making on its link (``NixlPeer._send``).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable

import pytest
import torch
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, fill, linked_pair

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, Placement
from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import nixl

NIXL = {"transport": "nixl"}
BLOCKS = CacheDesc(4, (16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)  # 16 blocks of 512 B

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.usefixtures("fork_server")]

_AGENT = b"nixlSerDes|Agent"


def renamed(metadata: bytes, name: bytes) -> bytes:
    """NIXL agent metadata naming agent ``name`` (its connection info unchanged: it still reaches the agent)."""
    assert metadata.startswith(_AGENT)
    (length,) = struct.unpack_from("<Q", metadata, len(_AGENT))
    return _AGENT + struct.pack("<Q", len(name)) + name + metadata[len(_AGENT) + 8 + length:]


async def prepared(owner, peer_id: int, cache) -> None:
    """Until the peer has prepared its NIXL list for ``cache``: until then requests for it use TCP."""
    async with asyncio.timeout(5):
        while True:
            link = link_to(owner, peer_id)
            if link is not None and link.nixl is not None and cache.cache_id in link.nixl.prepared:
                return
            await asyncio.sleep(0.005)


async def on_worker(dd, fn):
    """``fn(nixl_agent)`` run on ``dd``'s NIXL worker (the one thread that calls into its agent)."""
    return await nixl_agent_of(dd).start(fn, "test")


@needs_nixl
async def test_metadata_naming_another_agent_is_not_kept_loaded():
    """An OFFER (or HELLO) whose metadata names an agent other than the peer's is refused, and that other
    agent does not stay loaded in ours: before, every such record left one more remote agent (its sections
    and a UCX endpoint) in our agent for the endpoint's life, after the link was gone."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        attacker = link_to(pair.decoder, PROMPT_ID).nixl
        victim_link = link_to(pair.prompt, DECODER_ID)
        victim = victim_link.nixl
        assert attacker.usable() and victim.usable()
        metadata = nixl_agent_of(pair.decoder).metadata
        names = [b"forged-%03d" % n for n in range(20)]
        for n, name in enumerate(names):
            attacker._send(nixl.OFFER, 1000 + n, 16, 512, (1 << 20,), renamed(metadata, name))
        async with asyncio.timeout(10):
            while victim._pending:  # every load ran (and failed: the link goes on, those caches take TCP)
                await asyncio.sleep(0.01)
        assert link_to(pair.prompt, DECODER_ID) is victim_link and victim.usable()
        await pair.unlink()
        loaded = await on_worker(pair.prompt, lambda agent: [n for n in names
                                                             if agent.check_remote_metadata(n.decode())])
        assert loaded == [], f"{len(loaded)} agents named by the peer's metadata stay loaded"


def slowed_writes(dd, seconds: float) -> tuple[list[float], Callable[[], None]]:
    """Make ``dd``'s NIXL worker post every transfer (none from the loop, as when the worker is busy) and wait
    ``seconds`` before each: when each was posted, and a function that ends the delay."""
    engine = nixl_agent_of(dd).engine
    start, try_post, posted = engine._start, engine.try_post, []

    def slow(*args):
        time.sleep(seconds)
        posted.append(time.monotonic())
        return start(*args)

    def restore() -> None:
        engine._start, engine.try_post = start, try_post

    engine._start, engine.try_post = slow, lambda *args: None
    return posted, restore


async def push_cut_by_unlink(pair, src, dst) -> None:
    """A push from the prompt into the decoder's ``dst`` whose WRITE is posted after the decoder dropped the
    link (force): over UCX shared memory it then stays in flight until the decoder's agent makes progress
    again, on the next link (the prompt's call gave up after its timeout by then)."""
    await prepared(pair.decoder, PROMPT_ID, dst)
    posted, restore = slowed_writes(pair.prompt, 0.3)
    push = asyncio.create_task(pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0], [0], timeout=2000))
    async with asyncio.timeout(5):
        while not link_to(pair.decoder, PROMPT_ID).serving:
            await asyncio.sleep(0.005)
    await pair.unlink(force=True)
    with pytest.raises(LLMException):
        await push
    restore()
    assert len(posted) == 1  # the WRITE went out (and its notification)
    await pair.link()
    await prepared(pair.decoder, PROMPT_ID, dst)
    await prepared(pair.prompt, DECODER_ID, src)


@needs_nixl
async def test_closing_a_link_does_not_unload_the_agent_of_the_next_link_to_the_same_peer():
    """A link's close unloads the peer's agent once no transfer of ours uses it any more. Before, a transfer
    still in flight deferred that past the next link to the same endpoint, which had loaded the same agent
    meanwhile (a no-op then): the unload took it from the new link, whose NIXL transfers then failed."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        await pair.link()
        await push_cut_by_unlink(pair, src, dst)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [2], [2])  # the cut WRITE settles now
        want = fill(src, 4)
        posted = posted_count(pair.prompt)
        for n in range(3):  # the prompt writes the decoder's cache: its agent must still know the decoder's
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [n + 4], [n + 4], timeout=2000)
        assert posted_count(pair.prompt) == posted + 3  # by NIXL
        assert all(torch.equal(d[4:7], w[4:7]) for d, w in zip(dst.tensors, want, strict=True))


def posted_count(dd) -> int:
    return nixl_agent_of(dd).engine.posted


@needs_nixl
async def test_a_late_notification_of_an_earlier_link_does_not_confirm_a_push_of_the_next():
    """Request ids start again on every link. A WRITE cut by its link's end stays in flight over UCX shared
    memory until the owner's agent progresses again, on the next link to the same peer, and its notification
    then comes late. It must not confirm the next link's push of the same id: before, that push was reported
    done before its own WRITE was even posted, its bytes not in place."""
    async with linked_pair(link=False, prompt_config=NIXL, decoder_config=NIXL) as pair:
        src = pair.pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID))
        dst = pair.dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID))
        await pair.link()
        await push_cut_by_unlink(pair, src, dst)
        await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [2], [2])  # the decoder's agent progresses
        want = fill(src, 4)
        posted, restore = slowed_writes(pair.prompt, 0.3)  # the late notification is there first
        try:
            await pair.pm.push_blocks(BlocksCacheKey(DECODER_ID), src, [0], [0], timeout=3000)
            assert posted, "confirmed before its WRITE was posted"
            assert all(torch.equal(d[0], w[0]) for d, w in zip(dst.tensors, want, strict=True))
        finally:
            restore()
