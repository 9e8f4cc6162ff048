"""Pulls whose receive is posted before the request (``ReqFlag.POSTED``), against an owner that lies.

A pull over a plain TCP channel posts one gated receive: the owner's
``ANSWER`` header, then the bytes (``transport/stream.py``). A relay in
front of an honest owner rewrites the headers on the data connections the
way a buggy or hostile owner would: an answer to another request, another
size, a refusal whose text never ends, a refusal. Each time the pull fails
with the documented status, the destination keeps every byte it had (the
core reads nothing past a header it did not ask for), and the next pull on
the same link moves the right bytes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from peers import BLOCKS_DESC, DECODER_ID, PROMPT_ID, cluster_info, endpoint, fill, port_of, snapshot
from relay import Relay

from aio_datadist import (BlocksCacheKey, CacheDesc, DataType, LLMException, LLMRole, LLMStatusCode, Placement, _core,
                          link_channels, wire)
from aio_datadist.link_channels import LOOP_LOWAT_MAX
from aio_datadist.testing import links_of, runtime_of

pytestmark = pytest.mark.asyncio
S = LLMStatusCode
TEXT = b"no blocks cache is bound to that model (the relay says)"
FORGED = "ok\nCRITICAL aio_datadist.links forged line \x1b[31m\u202e".encode()


class LyingOwner(Relay):
    """Forwards a link, rewriting the next ``ANSWER`` on a data connection as ``lie`` says (once)."""

    def __init__(self, target: tuple[str, int], lie: str) -> None:
        super().__init__(target)
        self.lie = lie
        self.lied = 0

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readexactly(4)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        writer.write(first)
        if first != wire.ATTACH_MAGIC:  # the control connection
            await self.pipe(reader, writer)
            return
        try:
            writer.write(await reader.readexactly(wire.ATTACH_OK.size - 4))
            while True:
                magic, status, req_id, total = wire.ANSWER.unpack(await reader.readexactly(wire.ANSWER.size))
                body = await reader.readexactly(total)
                if not self.lied:
                    self.lied += 1
                    writer.write(self.rewrite(status, req_id, total, body))
                else:
                    writer.write(wire.ANSWER.pack(magic, status, req_id, total) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            writer.transport.abort()

    def rewrite(self, status: int, req_id: int, total: int, body: bytes) -> bytes:
        answer = wire.ANSWER.pack
        if self.lie == "another request":
            return answer(wire.ANSWER_MAGIC, status, req_id + 2, total) + body
        if self.lie == "fewer bytes":
            return answer(wire.ANSWER_MAGIC, status, req_id, total - 64) + body
        if self.lie == "more bytes":
            return answer(wire.ANSWER_MAGIC, status, req_id, total + 64) + body + bytes(64)
        if self.lie == "not an answer":
            return b"AIOD" + answer(wire.ANSWER_MAGIC, status, req_id, total)[4:] + body
        if self.lie == "endless refusal":
            return answer(wire.ANSWER_MAGIC, int(S.LLM_KV_CACHE_NOT_EXIST), req_id, wire.MAX_TEXT + 1) + body
        if self.lie == "longest refusal":  # an owner's text is cut to MAX_TEXT bytes: the longest it sends
            text = TEXT.ljust(wire.MAX_TEXT, b".")
            return answer(wire.ANSWER_MAGIC, int(S.LLM_KV_CACHE_NOT_EXIST), req_id, len(text)) + text
        if self.lie == "forged refusal":  # a text meant to forge a log line: shown escaped (row 182)
            return answer(wire.ANSWER_MAGIC, int(S.LLM_KV_CACHE_NOT_EXIST), req_id, len(FORGED)) + FORGED
        assert self.lie == "refusal"
        return answer(wire.ANSWER_MAGIC, int(S.LLM_KV_CACHE_NOT_EXIST), req_id, len(TEXT)) + TEXT


@pytest.mark.parametrize("lie, code", [
    ("another request", S.LLM_LINK_FAILED),
    ("not an answer", S.LLM_LINK_FAILED),
    ("fewer bytes", S.LLM_PARAM_INVALID),
    ("more bytes", S.LLM_PARAM_INVALID),
    ("endless refusal", S.LLM_LINK_FAILED),
    ("refusal", S.LLM_KV_CACHE_NOT_EXIST),
    ("longest refusal", S.LLM_KV_CACHE_NOT_EXIST),  # exactly MAX_TEXT: `>=` for `>` passed (audit, 2026-12-07)
    ("forged refusal", S.LLM_KV_CACHE_NOT_EXIST),  # raw text passed test_refusals.py (audit, 2026-12-07)
])
async def test_a_lying_answer_fails_the_pull_lands_nothing_and_the_link_goes_on(lie, code):
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="tcp") as decoder:
        src = prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        values = fill(src, 3)
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        before = snapshot(dst)
        async with LyingOwner(port_of(prompt), lie) as relay:
            status, _ = await decoder.link_clusters([cluster_info(PROMPT_ID, relay.address)], timeout=3000)
            assert status == S.LLM_SUCCESS
            link = links_of(decoder)[PROMPT_ID]
            generations = [ch.generation for ch in link.channels]
            with pytest.raises(LLMException) as caught:
                await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1, 2], [5, 6],
                                                           timeout=3000)
            assert caught.value.status_code == code, caught.value
            assert relay.lied == 1
            if lie in ("refusal", "longest refusal"):
                assert TEXT.decode() in str(caught.value)
                assert [ch.generation for ch in link.channels] == generations  # in step: nothing reset
            if lie == "forged refusal":
                shown = str(caught.value)
                assert shown.isprintable() and "\\n" in shown and "\\x1b" in shown and "\\u202e" in shown, shown
            assert all(torch.equal(d, b) for d, b in zip(dst.tensors, before, strict=True)), "a byte landed"
            await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1, 2], [5, 6],
                                                       timeout=3000)
            assert all(torch.equal(d[5:7], v[1:3]) for d, v in zip(dst.tensors, values, strict=True))
            await decoder.unlink_clusters([cluster_info(PROMPT_ID, relay.address)])


async def test_an_honest_refusal_of_a_posted_pull_keeps_the_channel(monkeypatch):
    """The owner refuses on the channel (header and text): the requester gets the status and text, and
    the channel is not reset. Its text here is longer than a refusal carries: the owner cuts it to MAX_TEXT.
    Each pull's loop receive is gated and asks for ``SO_RCVLOWAT`` (row 94: its tests drove ``LoopJob`` alone
    and passed with the link's ``LOOP_LOWAT_MAX`` dropped; audit, 2026-12-07)."""
    from aio_datadist import owner
    from aio_datadist.transport import stream

    monkeypatch.setattr(owner, "refuse_posted", lambda link, req_id, req, code, text: stream.refuse_posted(
        link, req_id, req, code, text.ljust(2 * wire.MAX_TEXT, ".")))
    jobs: list[dict] = []

    def recording(*args, loop_job=_core.LoopJob, **kwargs):
        jobs.append(dict(zip(("fd", "send", "pairs", "gate_id", "gated", "lowat_max"), args), **kwargs))
        return loop_job(*args, **kwargs)

    monkeypatch.setattr(link_channels, "LoopJob", recording)  # each pull's loop receive, as the link made it
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="tcp") as decoder:
        prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        assert (await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        link = links_of(decoder)[PROMPT_ID]
        generations = [ch.generation for ch in link.channels]
        for _ in range(3 * link.nchannels):
            with pytest.raises(LLMException) as caught:
                await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 7), dst, [1], [1])
            assert caught.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
            assert "model_id 7" in str(caught.value)
        assert [ch.generation for ch in link.channels] == generations
        assert link.pending == {}
        received = [job for job in jobs if not job["send"]]
        assert sum(job["gated"] for job in received) == 3 * link.nchannels  # each pull's answer, gated
        assert all(job.get("lowat_max", 0) == LOOP_LOWAT_MAX > 0 for job in received), "a receive without SO_RCVLOWAT"


#: 4 tensors of 8 blocks of 256 KiB: one request of all blocks is 8 MiB, more than the socket buffers hold, so
#: the owner's first job is still waiting to write when the second request comes.
WIDE = CacheDesc(4, (8, 128 * 1024), DataType.DT_FLOAT16, Placement.HOST)


def _two_requests_on_one_channel(address: tuple[str, int], cache_id: int, row_bytes: int) -> int:
    """A peer that sends two posted pulls on data channel 0 back to back, then reads what comes."""
    from aio_datadist.types import UINT64_MAX
    from reliability._rawpeer import RawLink, recv_exactly

    with RawLink(address, 60, PROMPT_ID, None).connect() as raw:
        fields = dict(channel=0, target_kind=2, cluster_id=PROMPT_ID, cache_id=cache_id, key_req_id=UINT64_MAX,
                      prefix_id=UINT64_MAX, model_id=0, batch_index=0, layer_first=-1, layer_last=-1,
                      tensor_num_per_layer=2, tensor_count=WIDE.num_tensors,
                      data_type=WIDE.data_type.value, offset=0, nbytes=row_bytes,
                      flags=int(wire.ReqFlag.BLOCKS | wire.ReqFlag.EXACT | wire.ReqFlag.POSTED), timeout_ms=2000,
                      rows=tuple(range(8)))
        for _ in range(2):
            raw.send_raw(wire.encode(wire.Msg.PULL_REQ, raw.new_req_id(), **fields))
        total = WIDE.num_tensors * 8 * row_bytes
        got = recv_exactly(raw.data[0], 2 * (wire.ANSWER.size + total))  # interleaved or not: all of both
        return len(got)


async def test_two_posted_pulls_on_one_channel_both_end_and_the_owner_serves_on():
    """A peer that breaks the one-request-per-channel rule gets both answers' bytes (in whatever order the
    two jobs wrote them: its own stream), nothing of the owner hangs, and honest links are served."""
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="tcp") as decoder:
        src = prompt.kv_cache_manager.allocate_blocks_cache(WIDE, BlocksCacheKey(PROMPT_ID))
        values = fill(src, 11)
        row_bytes = src.layout.row_bytes
        got = await asyncio.wait_for(asyncio.to_thread(_two_requests_on_one_channel, port_of(prompt),
                                                       src.cache_id, row_bytes), 20)
        assert got == 2 * (wire.ANSWER.size + WIDE.num_tensors * 8 * row_bytes)
        assert runtime_of(prompt).completions.pending_count() == 0
        dst = decoder.kv_cache_manager.allocate_blocks_cache(WIDE)
        assert (await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0, 7], [3, 4], timeout=3000)
        assert all(torch.equal(d[3], v[0]) and torch.equal(d[4], v[7]) for d, v in zip(dst.tensors, values,
                                                                                       strict=True))


@pytest.mark.asyncio
async def test_a_refusal_in_the_cleanup_of_a_cancelled_task_is_still_the_refusal():
    """A task that is being cancelled (``cancelling() == 1``) and pulls in its cleanup: an owner that
    refuses with ``RESP`` gives that pull an ``LLMException``, not a ``CancelledError`` of its own."""
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="tcp") as decoder:
        prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        assert (await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        links_of(prompt)[DECODER_ID].peer_channel_ok = lambda index: False  # the owner refuses with RESP
        seen: list[BaseException] = []

        async def worker() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                try:
                    await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1], [1],
                                                               timeout=3000)
                except BaseException as exc:  # noqa: BLE001 - what the pull raised is the point
                    seen.append(exc)
                raise

        task = asyncio.ensure_future(worker())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [type(e) for e in seen] == [LLMException]
        assert seen[0].status_code == S.LLM_LINK_FAILED
        seen.clear()  # its traceback holds dst


@pytest.mark.parametrize("how", ["link fails", "peer resets the channel"])
async def test_a_refusal_read_as_its_channel_goes_ends_within_the_pulls_timeout(how):
    """The owner refuses a posted pull on its channel (an unknown blocks key) and, in the loop pass that reads the
    refusal's header, the channel goes (the link fails, or the peer's ABORT of the channel is acted on): the
    refusal's text can no longer be read, and the pull fails within its own timeout instead of waiting
    JOB_SETTLE_S for a text receive that was never started."""
    import time

    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, transport="tcp") as decoder:
        prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        assert (await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]))[0] == S.LLM_SUCCESS
        link = links_of(decoder)[PROMPT_ID]
        original = link.move

        def move(index, pairs, **kw):
            job = original(index, pairs, **kw)
            if kw.get("gated"):
                generation = link.channels[index].generation

                def gone(_: asyncio.Future) -> None:  # runs before the pull's task wakes for the header
                    if how == "link fails":
                        link.fail(LLMException("control connection lost", status_code=S.LLM_LINK_FAILED))
                    else:  # what Link._dispatch does with the peer's ABORT of the channel
                        link.reset_channel(index, tell_peer=False)
                        link._peer_resets(index, generation)

                job.add_done_callback(gone)
            return job

        link.move = move
        started = time.monotonic()
        with pytest.raises(LLMException) as caught:
            await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 7), dst, [1], [1], timeout=200)
        took = time.monotonic() - started
        assert caught.value.status_code == S.LLM_LINK_FAILED, caught.value
        assert took < 0.2 + 0.3, f"a pull with timeout=200 ms returned after {took:.2f} s ({caught.value})"
