"""The owner's word that comes right after its answer is not lost: a transfer cut by the owner a moment after it
accepted it fails with the reason the owner gave.

The owner of a registered cache that unregisters it (v2 ``unregister_cache``) while serving a peer's transfer
tells the peer why (a pull's ``RESP``, a push's ``DONE``: ``LLM_KV_CACHE_NOT_EXIST``), then resets the data
channel (``ABORT``; row 128). When that happens right after the owner's answer, the peer can read the answer,
the reason and the ``ABORT`` before its task resumes from the answer. Before, the reason was dropped (nobody
waited for a second reply yet): a same-host link's pull of a registered cache (the stream plane, asked with
``RESP``) failed with ``LLM_LINK_FAILED`` or ``LLM_FAILED`` ("data channel N was closed"), and a TCP push
waited for the ``DONE`` it had dropped. ``Link.expect``'s ``then`` waits for the next reply from the moment
the answer is read. Each case also checks that no byte moves after the call returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _harness import endpoint
from peers import cluster_info, port_of

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    wire,
)
from aio_datadist.testing import link_to, registry_of
from aio_datadist.transport.stream import StreamPlane

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
PROMPT, DECODER = 91, 92
BLOCKS = 16
#: 8 MiB (stepped by the event loop, ``loop_io``) and 32 MiB (the engine thread) per transfer.
SIZES = {"loop": CacheDesc(2, (BLOCKS, 128 * 1024), DataType.DT_FLOAT16, Placement.HOST),
         "engine": CacheDesc(2, (BLOCKS, 512 * 1024), DataType.DT_FLOAT16, Placement.HOST)}
ALL = list(range(BLOCKS))
QUIET_S = 0.3


@contextlib.asynccontextmanager
async def pair(transport: str) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport, enable_cache_manager=True))
        dec = await stack.enter_async_context(
            endpoint(LLMRole.DECODER, DECODER, transport=transport, enable_cache_manager=True))
        status, _ = await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=10_000)
        assert status == S.LLM_SUCCESS
        yield prompt, dec


def unregister_after_answering(owner: LLMDataDist, cache_id: int) -> list[int]:
    """Have the owner's caller unregister ``cache_id`` in the loop pass right after the one that sent the
    accepting ``RESP`` (status 0) and started the job: before the peer's end (on the same
    loop) reads the answer, so the reason and the ``ABORT`` leave right behind it."""
    link = link_to(owner, DECODER)
    assert link is not None
    send, done = link.send, []

    def send_then_cut(msg: wire.Msg, req_id: int, **fields: Any) -> None:
        send(msg, req_id, **fields)
        if msg is wire.Msg.RESP and fields.get("status") == 0 and not done:
            done.append(req_id)
            asyncio.get_running_loop().call_soon(owner.cache_manager.unregister_cache, cache_id)

    link.send = send_then_cut  # type: ignore[method-assign]
    return done


async def outcome(call: Any) -> Any:
    started = time.monotonic()
    try:
        async with asyncio.timeout(10):
            await call
        result: Any = S.LLM_SUCCESS
    except LLMException as exc:
        result = exc.status_code
    return result, time.monotonic() - started


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("size", list(SIZES))
async def test_a_same_host_pull_cut_right_after_its_answer_fails_with_the_owners_reason(size: str) -> None:
    desc = SIZES[size]
    async with pair("local") as (prompt, dec):
        mine = [torch.full(desc.shape, 3, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        dst = dec.cache_manager.allocate_blocks_cache(desc)
        for t in dst.tensors:
            t.fill_(0)
        cut = unregister_after_answering(prompt, owned.cache_id)
        result, took = await outcome(dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL, ALL,
                                                                   timeout=5000))
        for t in mine:
            t.fill_(9)  # the caller's memory again: none of this may reach the puller
        before = [t.clone() for t in dst.tensors]
        await asyncio.sleep(QUIET_S)
        assert cut, "the owner never answered the pull"
        assert result == S.LLM_KV_CACHE_NOT_EXIST, f"{size}: the cut pull gave {result!r} after {took:.2f} s"
        assert all(torch.equal(a, b) for a, b in zip(before, dst.tensors, strict=True)), "bytes after the return"
        assert not any(bool((t == 9).any()) for t in dst.tensors)
        # the link carries the next pull
        again = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL, ALL, timeout=5000)
        assert all(bool((t == 9).all()) for t in dst.tensors)
        prompt.cache_manager.unregister_cache(again.cache_id)
        # a pull the owner serves in place (an allocated cache: shared memory) waits for no reply after its
        # answer, and leaves no waiter behind either
        shared = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT, 1))
        for t in shared.tensors:
            t.fill_(7)
        await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 1), dst, ALL, ALL, timeout=5000)
        assert all(bool((t == 7).all()) for t in dst.tensors)
        link = link_to(dec, PROMPT)
        assert link is not None and not link.pending and not link._then, "waiters left behind"


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("size", list(SIZES))
async def test_a_tcp_push_cut_right_after_its_answer_fails_with_the_owners_reason_in_time(size: str) -> None:
    desc = SIZES[size]
    async with pair("tcp") as (prompt, dec):
        mine = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        src = dec.cache_manager.allocate_blocks_cache(desc)
        for t in src.tensors:
            t.fill_(5)
        cut = unregister_after_answering(prompt, owned.cache_id)
        result, took = await outcome(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL,
                                                                   timeout=5000))
        before = [t.clone() for t in mine]
        await asyncio.sleep(QUIET_S)
        assert cut, "the owner never answered the push"
        assert result == S.LLM_KV_CACHE_NOT_EXIST, f"{size}: the cut push gave {result!r} after {took:.2f} s"
        assert took < 1.0, f"{size}: the cut push took {took:.2f} s"
        assert all(torch.equal(a, b) for a, b in zip(before, mine, strict=True)), "bytes after the return"
        assert link_to(dec, PROMPT) is not None and link_to(dec, PROMPT).broken is None
        again = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        await dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL, timeout=5000)
        assert all(bool((t == 5).all()) for t in mine)
        prompt.cache_manager.unregister_cache(again.cache_id)
        assert registry_of(prompt).serving_count() == 0
        link = link_to(dec, PROMPT)
        assert link is not None and not link.pending and not link._then, "waiters left behind"


@pytest.mark.loops_take_turns
async def test_a_second_accepting_resp_does_not_confirm_a_push() -> None:
    """The reply after a push's answer may only be its ``DONE``: an owner that sends a second accepting ``RESP``
    instead (a buggy or hostile peer) breaks the protocol, and the push fails with the link, unconfirmed. Before,
    the ``RESP`` read as the push's confirmation once the push waited for its ``DONE``."""
    desc = SIZES["loop"]
    async with pair("tcp") as (prompt, dec):
        target = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT, 0))
        src = dec.cache_manager.allocate_blocks_cache(desc)
        link = link_to(prompt, DECODER)
        assert link is not None
        send = link.send

        def twice(msg: wire.Msg, req_id: int, **fields: Any) -> None:
            send(msg, req_id, **fields)
            if msg is wire.Msg.RESP and fields.get("status") == 0:
                send(msg, req_id, **fields)  # "accepted" again, where only DONE may come

        link.send = twice  # type: ignore[method-assign]
        result, _ = await outcome(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL,
                                                                timeout=5000))
        assert result == S.LLM_LINK_FAILED, f"the push gave {result!r}"
        assert "RESP answers request" in str(link_to(dec, PROMPT).broken)
        del target


@pytest.mark.loops_take_turns
async def test_a_pull_given_up_after_its_owner_finished_sending_keeps_the_link(monkeypatch) -> None:
    """A stream pull given up (here: cancelled) once its owner sent the last byte and forgot the request, but before
    we read it: the owner answers our ``ABORT`` with ``DONE`` (``LLM_FAILED``, "aborted"), which reaches the pull's
    waiter for the reply after its answer while its job settles. That ``DONE`` is honest: the link stays up (a
    pull's follow-up may be ``RESP`` or ``DONE``; only a push's is ``DONE`` alone). Found by review of an earlier
    form that failed the link there ("DONE answers request N, which waits for RESP")."""
    from aio_datadist.transport import base as transport_base

    desc = CacheDesc(2, (4, 1024 * 1024), DataType.DT_FLOAT16, Placement.HOST)
    async with pair("local") as (prompt, dec):
        mine = [torch.full(desc.shape, 3, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        dst = dec.cache_manager.allocate_blocks_cache(desc)
        link, owner_link = link_to(dec, PROMPT), link_to(prompt, DECODER)
        assert link is not None and owner_link is not None
        settle = transport_base.wait_out

        async def slow_settle(fut: Any, bound: float, cancelled: list) -> bool:
            await asyncio.sleep(0.05)  # a job that takes a moment to settle (a busy engine, staged device copies)
            return await settle(fut, bound, cancelled)

        monkeypatch.setattr(transport_base, "wait_out", slow_settle)
        pull: asyncio.Task | None = None
        forgotten: list[int] = []

        class Serving(dict):
            def __delitem__(self, req_id: Any) -> None:
                super().__delitem__(req_id)
                forgotten.append(req_id)
                if pull is not None and not pull.done():
                    pull.cancel()  # the owner sent its last byte and forgot the request: we give the pull up now

        owner_link.serving = Serving(owner_link.serving)
        pull = asyncio.create_task(dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL[:4], ALL[:4],
                                                                 timeout=5000))
        with contextlib.suppress(asyncio.CancelledError, LLMException):
            await pull
        await asyncio.sleep(QUIET_S)
        assert forgotten, "the owner never served the pull"
        assert link.broken is None, f"an honest owner's answer to our ABORT broke the link: {link.broken}"
        await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL[:4], ALL[:4], timeout=5000)
        assert all(bool((t == 3).all()) for t in dst.tensors)
        prompt.cache_manager.unregister_cache(owned.cache_id)
        assert not link.pending and not link._then, "waiters left behind"


@pytest.mark.loops_take_turns
async def test_a_push_the_owner_stopped_with_its_answer_starts_no_job(monkeypatch) -> None:
    """The owner accepts a push and stops it in the same breath (its failed ``DONE`` right behind its ``RESP``):
    the push fails with the owner's reason and no plane starts a job for it. The tests above passed with the
    requester's check of the owner's word before a plane starts removed (audit, 2026-12-07)."""
    carried: list[Any] = []
    real = StreamPlane.carry

    async def carry(self, *args: Any, **kwargs: Any) -> Any:
        carried.append(args)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(StreamPlane, "carry", carry)
    async with pair("tcp") as (prompt, dec):
        prompt.cache_manager.allocate_blocks_cache(SIZES["loop"], BlocksCacheKey(PROMPT, 0))
        src = dec.cache_manager.allocate_blocks_cache(SIZES["loop"])
        link = link_to(prompt, DECODER)
        assert link is not None
        send = link.send

        def stop_at_once(msg: wire.Msg, req_id: int, **fields: Any) -> None:
            send(msg, req_id, **fields)
            if msg is wire.Msg.RESP and fields.get("status") == 0:  # accepted, and stopped in the same breath
                send(wire.Msg.DONE, req_id, status=S.LLM_KV_CACHE_NOT_EXIST.value, text="cut")

        link.send = stop_at_once  # type: ignore[method-assign]
        result, _ = await outcome(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL,
                                                                timeout=5000))
        assert result == S.LLM_KV_CACHE_NOT_EXIST, f"the push gave {result!r}"
        assert carried == [], "a plane started a job for a request its owner had stopped"
