"""Our own unlink is an unlink, not a failure: what it cuts reads ``LLM_NOT_YET_LINK`` (row 275).

The peer answers our ``UNLINK`` and closes its end; our reader can hear that close before the unlink gets to
``Link.close()``. It used to take it for a lost connection: the link was marked broken and a transfer the
unlink cut failed ``LLM_LINK_FAILED`` ("connection lost"), its data channels reset, where one cut by the
peer's unlink reads ``LLM_NOT_YET_LINK`` ("was unlinked").
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
from typing import Any

import pytest
from peers import DECODER_ID, PROMPT_ID, cluster_info, linked_pair, port_of
from test_layerwise import DST_BLOCKS, LAYERS, SRC_BLOCKS, Gate, blocks_config, setup

from aio_datadist import CacheDesc, CacheKeyByIdAndIndex, DataType, LLMException, LLMStatusCode, Placement, links, wire
from aio_datadist.testing import link_to
from aio_datadist.transport.stream import StreamPlane
from aio_datadist.wire import Msg

pytestmark = pytest.mark.asyncio


async def _unlinked_under_a_task(s: Any) -> Any:
    """The prompt unlinks its decoder while a layer-wise task waits for layer 1: the unlink succeeds, the task
    fails ``LLM_NOT_YET_LINK``, and the prompt's link is not broken. The link."""
    gate = Gate()
    gate.open(0)
    task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
    await task.layer(0)
    link = link_to(s.prompt, DECODER_ID)
    assert link is not None
    status = await s.prompt.unlink_clusters([cluster_info(DECODER_ID, ("127.0.0.1", 1))])
    assert status == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
    gate.open(*range(1, LAYERS))
    with pytest.raises(LLMException) as info:
        async with asyncio.timeout(5):
            await task
    assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, info.value
    assert link.broken is None, link.broken
    return link


async def test_a_transfer_our_own_unlink_cuts_reads_unlinked_and_the_link_is_not_broken(monkeypatch) -> None:
    resets: list[bool] = []  # how each data channel was dropped: gracefully, not with a TCP reset
    real = links.Link._drop_socket
    monkeypatch.setattr(links.Link, "_drop_socket",
                        lambda self, ch, *, reset=False: (resets.append(reset), real(self, ch, reset=reset))[1])
    async with setup() as s:
        for _ in range(3):
            assert (await s.decoders[0].link_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]))[0] in (
                LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)
            link = await _unlinked_under_a_task(s)
            assert link.closed
            async with asyncio.timeout(5):  # the decoder forgets its end (it answered our UNLINK)
                while link_to(s.decoders[0], PROMPT_ID) is not None:
                    await asyncio.sleep(0.01)
            assert resets and not any(resets), resets


def _push_local_ahead_of_the_ack(link: Any) -> None:
    """``link`` (the peer's end) sends a same-host push request (``PUSH_LOCAL``, as one it made just before it
    read our UNLINK) in the write that carries its ``UNLINK_ACK``; then it closes its end as always."""
    real = link.send_soon

    def send_soon(msg: Msg, req_id: int, **fields: Any) -> None:
        if msg is Msg.UNLINK_ACK:
            push = {f.name: 0 for f in dataclasses.fields(wire.PushLocalReq)}
            push.update(rows=(), src_rows=b"")
            real(Msg.PUSH_LOCAL, link.new_req_id(), **push)
        real(msg, req_id, **fields)

    link.send_soon = send_soon


async def test_our_unlink_is_no_failure_when_a_held_same_host_push_sees_the_peer_gone_first() -> None:
    """A ``PUSH_LOCAL`` is held to the end of its chunk, and then served only if the peer's end is still open:
    that check saw the close the unlink's answer came with and failed the link (found by review)."""
    async with setup() as s:
        _push_local_ahead_of_the_ack(link_to(s.decoders[0], PROMPT_ID))
        await _unlinked_under_a_task(s)


@pytest.mark.parametrize("force", [False, True], ids=["unlink", "forced"])
async def test_an_unlink_whose_link_breaks_before_it_told_the_peer_says_so(monkeypatch, force):
    """Our unlink first stops what it serves the peer and cuts our NIXL transfers (``settle_served``); a link that
    breaks meanwhile (its connection lost, a cut transfer forced off) sends no ``UNLINK``: a non-forced unlink reads
    ``LLM_NOTIFY_PROMPT_UNLINK_FAILED``, the peer never told, as when the peer does not answer (row 337). Before,
    it read success. A forced unlink, which need not tell the peer, still succeeds."""
    real = links.Link.settle_served

    async def broken_meanwhile(self: links.Link, **kwargs: Any) -> None:
        await real(self, **kwargs)
        self.fail(LLMException("connection lost (a test's)", status_code=LLMStatusCode.LLM_LINK_FAILED))

    async with linked_pair() as pair:
        monkeypatch.setattr(links.Link, "settle_served", broken_meanwhile)
        status = await pair.decoder.unlink_clusters([pair.info], force=force)
        code = LLMStatusCode.LLM_SUCCESS if force else LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        assert status == (code, [code])
        assert link_to(pair.decoder, PROMPT_ID) is None


async def test_a_pull_moving_bytes_when_our_unlink_comes_reads_unlinked(monkeypatch) -> None:
    """The owner sent the first bytes of our pull and holds the rest when we unlink: it stops the job, answers and
    closes its end. Our pull's data channel sees that close first (the control link is held until it did): the pull
    reads "unlinked" (LLM_NOT_YET_LINK), not ``LLM_LINK_FAILED``, and the link is not broken (found by audit,
    2026-12-07)."""
    real = StreamPlane._serve_move
    sent: asyncio.Future = asyncio.get_running_loop().create_future()

    def first_bytes_then_hold(self: Any, rt: Any, link: Any, msg: Any, req_id: int, req: Any, served: Any,
                              answer: Any) -> asyncio.Future:
        # The answer's header and half the first run of the row, then nothing more
        part = dataclasses.replace(served, pairs=array.array("Q", (served.pairs[0], served.pairs[1] // 2)))
        real(self, rt, link, msg, req_id, req, part, answer).add_done_callback(lambda f: sent.set_result(None))
        return asyncio.get_running_loop().create_future()  # the rest: held until the unlink stops it

    monkeypatch.setattr(StreamPlane, "_serve_move", first_bytes_then_hold)
    row = CacheDesc(1, (1, 1 << 16), DataType.DT_FLOAT16, Placement.HOST)
    async with linked_pair(link=False) as pair:
        src, dst = pair.pm.allocate_cache(row), pair.dm.allocate_cache(row)
        await pair.link()
        link = link_to(pair.decoder, PROMPT_ID)
        assert link is not None
        real_unlink, real_reset = link.send_unlink, link.peer_reset

        def send_unlink(req_id: int) -> None:  # the peer's answer and close are read once our pull saw its channel go
            real_unlink(req_id)
            link.writer.transport.pause_reading()

        def peer_reset(index: int, generation: int) -> asyncio.Future:
            link.writer.transport.resume_reading()
            return real_reset(index, generation)

        link.send_unlink, link.peer_reset = send_unlink, peer_reset  # type: ignore[method-assign]
        pull = asyncio.ensure_future(pair.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, src.cache_id, 0), dst, 0,
                                                        timeout=5000))
        async with asyncio.timeout(5):
            await sent
            await pair.unlink()
            with pytest.raises(LLMException) as info:
                await pull
        assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, info.value
        assert link.broken is None, link.broken
        del src, dst
