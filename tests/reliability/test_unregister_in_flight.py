"""No byte after return, for the owner of a registered cache: unregistering it cuts what peers move.

A registered cache is memory the caller owns: once ``unregister_cache`` (v2) or
``deallocate_cache`` (v1) returned, the framework frees or reuses it. A peer's
transfer that the owner serves against it over the TCP data channels (a push
writing into it, a pull reading it) is cut by that call, which returns only once
no job of the owner's touches the memory any more; the peer's call fails.

Each case sends 16 MiB (stepped by the owner's event loop, ``loop_io``) or 32 MiB
(the native engine's thread) through a :class:`SlowPath` both ways, so the
transfer is in flight when the owner unregisters: for a push, the owner's
memory is copied the moment the call returned and must be unchanged 300 ms
later, after the pusher's call ended; for a pull, the owner paints its memory
anew at once (the framework reusing it), and no byte of that paint may reach
the puller.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from _harness import endpoint
from _slowpath import SlowPath
from peers import cluster_info, port_of

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import engine_state, registry_of, runtime_of, usable_link

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
PROMPT, DECODER = 71, 72
BLOCKS = 32
#: 16 MiB (the owner's event loop steps it) and 32 MiB (the engine thread moves it).
SIZES = {"loop": CacheDesc(4, (BLOCKS, 64 * 1024), DataType.DT_FLOAT16, Placement.HOST),
         "engine": CacheDesc(4, (BLOCKS, 128 * 1024), DataType.DT_FLOAT16, Placement.HOST)}
ALL = list(range(BLOCKS))
RATE = 48e6
LATENCY_S = 0.05
QUIET_S = 0.3


class SlowBothWays(SlowPath):
    """A :class:`SlowPath` that is slow towards the listener too (a peer's push crosses it that way)."""

    async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._line(reader, writer)


@contextlib.asynccontextmanager
async def v2_pair() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A v2 PROMPT (listening) and DECODER over TCP, the decoder linked through a :class:`SlowBothWays`."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", enable_cache_manager=True))
        dec = await stack.enter_async_context(
            endpoint(LLMRole.DECODER, DECODER, transport="tcp", enable_cache_manager=True))
        path = await stack.enter_async_context(SlowBothWays(port_of(prompt), RATE, LATENCY_S))
        status, _ = await dec.link_clusters([cluster_info(PROMPT, path.address)], timeout=10_000)
        assert status == S.LLM_SUCCESS
        yield prompt, dec


@contextlib.asynccontextmanager
async def v1_pair() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A v1 PROMPT (listening) and DECODER over TCP, the decoder linked through a :class:`SlowPath`."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp"))
        dec = await stack.enter_async_context(endpoint(LLMRole.DECODER, DECODER, transport="tcp"))
        path = await stack.enter_async_context(SlowPath(port_of(prompt), RATE, LATENCY_S))
        status, _ = await dec.link_clusters([cluster_info(PROMPT, path.address)], timeout=10_000)
        assert status == S.LLM_SUCCESS
        yield prompt, dec


def paint(tensors: list[torch.Tensor], value: float) -> None:
    for t in tensors:
        t.fill_(value)


def share(tensors: list[torch.Tensor], value: float) -> float:
    return sum(int((t == value).sum()) for t in tensors) / sum(t.numel() for t in tensors)


async def until_moving(tensors: list[torch.Tensor], value: float) -> float:
    """Wait (bounded) until some of ``tensors`` hold ``value``: the transfer is under way."""
    deadline = time.monotonic() + 5
    while (got := share(tensors, value)) == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    return got


async def outcome(task: asyncio.Task) -> Any:
    try:
        async with asyncio.timeout(10):
            return await task
    except LLMException as exc:
        return exc.status_code


@pytest.mark.loops_take_turns  # each size on one loop, the loops taking turns
@pytest.mark.parametrize("size", list(SIZES))
async def test_unregistering_a_cache_a_peer_pushes_into_lands_nothing_after_it_returned(size: str):
    desc = SIZES[size]
    async with v2_pair() as (prompt, dec):
        mine = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        src = dec.cache_manager.allocate_blocks_cache(desc)
        paint(src.tensors, 5)
        push = asyncio.ensure_future(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL,
                                                                   timeout=20_000))
        at_cut = await until_moving(mine, 5)
        started = time.monotonic()
        prompt.cache_manager.unregister_cache(owned.cache_id)
        took = time.monotonic() - started
        before = [t.clone() for t in mine]
        result = await outcome(push)
        await asyncio.sleep(QUIET_S)
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(mine, before, strict=True))
        assert not owned.alive
        assert changed == 0, (f"{size}: {changed} bytes of the unregistered cache changed after unregister_cache "
                              f"returned ({at_cut:.0%} had landed at the cut, the push gave {result!r}, "
                              f"unregister took {took * 1000:.1f} ms)")
        assert took < 1.5, f"unregister_cache took {took:.2f} s"
        assert result in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED), f"the cut push gave {result!r}"
        # the link carries the next push into a cache registered anew
        again = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        paint(src.tensors, 6)
        await dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, ALL, ALL, timeout=20_000)
        assert share(mine, 6) == 1
        prompt.cache_manager.unregister_cache(again.cache_id)
        assert not engine_state(prompt)["claimed keys"]
        assert registry_of(prompt).all_caches() == []


@pytest.mark.loops_take_turns  # each size on one loop, the loops taking turns
@pytest.mark.parametrize("size", list(SIZES))
async def test_unregistering_a_cache_a_peer_pulls_from_reads_nothing_after_it_returned(size: str):
    desc = SIZES[size]
    async with v2_pair() as (prompt, dec):
        mine = [torch.full(desc.shape, 3, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        dst: KvCache = dec.cache_manager.allocate_blocks_cache(desc)
        paint(dst.tensors, 0)
        pull = asyncio.ensure_future(dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL, ALL,
                                                                   timeout=20_000))
        at_cut = await until_moving(dst.tensors, 3)
        started = time.monotonic()
        prompt.cache_manager.unregister_cache(owned.cache_id)
        took = time.monotonic() - started
        paint(mine, 9)  # the framework reuses its memory at once
        result = await outcome(pull)
        await asyncio.sleep(QUIET_S)
        late = share(dst.tensors, 9)
        assert late == 0, (f"{size}: {late:.1%} of the puller's cache was read from the owner's memory after "
                           f"unregister_cache returned ({at_cut:.0%} had landed at the cut, the pull gave "
                           f"{result!r}, unregister took {took * 1000:.1f} ms)")
        assert took < 1.5, f"unregister_cache took {took:.2f} s"
        assert result in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED), f"the cut pull gave {result!r}"
        again = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, ALL, ALL, timeout=20_000)
        assert share(dst.tensors, 9) == 1
        prompt.cache_manager.unregister_cache(again.cache_id)


@pytest.mark.loops_take_turns  # each size on one loop, the loops taking turns
@pytest.mark.parametrize("size", list(SIZES))
async def test_unregistering_a_cache_under_a_peer_s_push_and_pull_is_quick(size: str):
    """The cut is a reset, not a wait: ``unregister_cache`` under a peer's push and a peer's pull returns in
    milliseconds (row 128: well under 5 ms; 200 ms here for a loaded host), not at the tests' 1.5 s bound."""
    desc = SIZES[size]
    async with v2_pair() as (prompt, dec):
        for pulling in (False, True):
            mine = [torch.full(desc.shape, 3, dtype=torch.float16) for _ in range(desc.num_tensors)]
            owned = prompt.cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(PROMPT, 0),
                                                              remote_accessible=True)
            theirs = dec.cache_manager.allocate_blocks_cache(desc)
            paint(theirs.tensors, 0 if pulling else 5)
            call = dec.cache_manager.pull_blocks if pulling else dec.cache_manager.push_blocks
            job = asyncio.ensure_future(call(BlocksCacheKey(PROMPT, 0), theirs, ALL, ALL, timeout=20_000))
            assert await until_moving(theirs.tensors if pulling else mine, 3 if pulling else 5) > 0
            started = time.monotonic()
            prompt.cache_manager.unregister_cache(owned.cache_id)
            took = time.monotonic() - started
            assert await outcome(job) in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED)
            assert took < 0.2, f"unregister_cache under a {'pull' if pulling else 'push'} took {took * 1000:.0f} ms"
            dec.cache_manager.deallocate_blocks_cache(theirs)


async def test_deallocating_a_registered_cache_a_peer_pushes_into_lands_nothing_after_it_returned():
    """The v1 spelling (``KvCacheManager.deallocate_cache``): a PROMPT pushes into a DECODER's registered cache."""
    desc = SIZES["engine"]
    async with v1_pair() as (prompt, dec):
        mine = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = dec.kv_cache_manager.register_blocks_cache(desc, mine, BlocksCacheKey(DECODER, 0))
        src = prompt.kv_cache_manager.allocate_blocks_cache(desc)
        paint(src.tensors, 5)
        push = asyncio.ensure_future(prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, ALL, ALL,
                                                                         timeout=20_000))
        at_cut = await until_moving(mine, 5)
        dec.kv_cache_manager.deallocate_cache(owned)
        before = [t.clone() for t in mine]
        result = await outcome(push)
        await asyncio.sleep(QUIET_S)
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(mine, before, strict=True))
        assert changed == 0, (f"{changed} bytes of the deallocated registered cache changed after deallocate_cache "
                              f"returned ({at_cut:.0%} had landed at the cut, the push gave {result!r})")
        assert result in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED), f"the cut push gave {result!r}"
        assert registry_of(dec).serving_count() == 0
        prompt.kv_cache_manager.deallocate_cache(src)


async def test_deallocating_a_registered_cache_a_peer_pulls_by_key_reads_nothing_after_it_returned():
    """v1, a registered cache bound to a key (which a pull never consumes): ``deallocate_cache`` unbinds the key
    and cuts the decoder's pull by it, though the key kept the cache bound until then."""
    desc = CacheDesc(4, (1, 2 * 1024 * 1024), DataType.DT_FLOAT16, Placement.HOST)  # 16 MiB in its one row
    key = CacheKey(PROMPT, req_id=7)
    async with v1_pair() as (prompt, dec):
        mine = [torch.full(desc.shape, 3, dtype=torch.float16) for _ in range(desc.num_tensors)]
        owned = prompt.kv_cache_manager.register_cache(desc, mine, [key])
        dst = dec.kv_cache_manager.allocate_cache(desc)
        paint(dst.tensors, 0)
        pull = asyncio.ensure_future(dec.kv_cache_manager.pull_cache(key, dst, 0, timeout=20_000))
        at_cut = await until_moving(dst.tensors, 3)
        prompt.kv_cache_manager.deallocate_cache(owned)
        paint(mine, 9)  # the framework reuses its memory at once
        result = await outcome(pull)
        await asyncio.sleep(QUIET_S)
        late = share(dst.tensors, 9)
        assert late == 0, (f"{late:.1%} of the puller's cache was read from the owner's memory after deallocate_cache "
                           f"returned ({at_cut:.0%} had landed at the cut, the pull gave {result!r})")
        assert result in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED), f"the cut pull gave {result!r}"
        assert registry_of(prompt).serving_count() == 0 and registry_of(prompt).all_caches() == []


# -- the same-host plane: a peer's push is the owner's own copy (``PUSH_LOCAL``) --------------------------------

#: 4 x 64 blocks of 1 MiB (256 MiB) copied by one copy thread: the owner's copy runs for tens of ms.
LOCAL_DESC = CacheDesc(4, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)
LOCAL_ALL = list(range(64))
#: Bounded tries at cutting the owner's copy while it runs (a try whose copy was over at the cut proves nothing).
LOCAL_TRIES = 5


@contextlib.asynccontextmanager
async def local_pair(v2: bool) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A PROMPT (listening) and DECODER linked same-host, each with one copy thread."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local", enable_cache_manager=v2,
                     copy_threads=1))
        dec = await stack.enter_async_context(
            endpoint(LLMRole.DECODER, DECODER, transport="local", enable_cache_manager=v2, copy_threads=1))
        status, _ = await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=10_000)
        assert status == S.LLM_SUCCESS
        assert usable_link(dec, PROMPT).local is not None and usable_link(prompt, DECODER).local is not None
        yield prompt, dec


async def copy_started(tensor: torch.Tensor, value: int) -> bool:
    """Wait (bounded) until the first byte of ``tensor`` holds ``value``: the owner's copy has begun."""
    flat = tensor.view(-1)
    deadline = time.monotonic() + 5
    while int(flat[0]) != value:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.0002)
    return True


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("api", ["v2", "v1"])
async def test_unregistering_a_cache_a_same_host_peer_pushes_into_lands_nothing_after_it_returned(api: str):
    """A same-host push into a registered cache is copied by the owner's copy thread out of the pusher's
    region: ``unregister_cache`` (v2: a PROMPT's cache, the DECODER pushing) / ``deallocate_cache`` (v1: a
    DECODER's, the PROMPT pushing) returns only once that copy stopped, and the push fails."""
    desc, v2 = LOCAL_DESC, api == "v2"
    async with local_pair(v2) as (prompt, dec):
        owner, pusher, owner_id = (prompt, dec, PROMPT) if v2 else (dec, prompt, DECODER)
        owner_kv = owner.cache_manager if v2 else owner.kv_cache_manager
        pusher_kv = pusher.cache_manager if v2 else pusher.kv_cache_manager
        key = BlocksCacheKey(owner_id, 0)

        def register() -> KvCache:
            if v2:
                return owner_kv.register_blocks_cache(desc, mine, key, remote_accessible=True)
            return owner_kv.register_blocks_cache(desc, mine, key)

        def release(cache: KvCache) -> None:
            if v2:
                owner_kv.unregister_cache(cache.cache_id)
            else:
                owner_kv.deallocate_cache(cache)

        mine = [torch.zeros(desc.shape, dtype=torch.uint8) for _ in range(desc.num_tensors)]
        src = pusher_kv.allocate_blocks_cache(desc)
        tries = []
        for value in range(5, 5 + LOCAL_TRIES):
            for t in mine:
                t.zero_()
            paint(src.tensors, value)
            owned = register()
            push = asyncio.ensure_future(pusher_kv.push_blocks(key, src, LOCAL_ALL, LOCAL_ALL, timeout=20_000))
            assert await copy_started(mine[0], value), "the owner's copy never began"
            started = time.monotonic()
            release(owned)
            took = time.monotonic() - started
            running = int(mine[-1].view(-1)[-1]) != value  # the copy had not reached its last byte
            before = [t.clone() for t in mine]
            result = await outcome(push)
            await asyncio.sleep(QUIET_S)
            changed = sum(int((t != b).sum()) for t, b in zip(mine, before, strict=True))
            tries.append((running, changed, result, round(took * 1000, 2)))
            assert changed == 0, (f"{api}: {changed} bytes of the registered cache changed after it was released "
                                  f"(release took {took * 1000:.2f} ms, the push gave {result!r}); tries "
                                  f"(running at the cut, bytes changed, push result, release ms): {tries}")
            assert took < 1.5, f"releasing the cache took {took:.2f} s"
            if running:
                assert result == S.LLM_KV_CACHE_NOT_EXIST, f"the cut push gave {result!r}"
                break
        else:
            pytest.fail(f"the owner's copy was never cut while it ran: {tries}")
        assert registry_of(owner).serving_count() == 0
        # the link carries the next push into the cache registered anew
        again = register()
        paint(src.tensors, 99)
        await pusher_kv.push_blocks(key, src, LOCAL_ALL, LOCAL_ALL, timeout=20_000)
        assert all(bool((t == 99).all()) for t in mine)
        release(again)
        if v2:
            pusher_kv.deallocate_blocks_cache(src)
        else:
            pusher_kv.deallocate_cache(src)


# -- the staging plane: a registered device cache, its device copies queued on the owner's copy stream -----------

#: 4 tensors x 8 blocks of 64 KiB on the host backend ("device" memory moved by its ordered copy stream).
DEVICE_DESC = CacheDesc(4, (8, 32 * 1024), DataType.DT_FLOAT16, Placement.DEVICE)
DEVICE_ALL = list(range(8))
#: How long the owner's copy stream is held (from a thread: unregistering blocks the loop while it waits).
GATE_S = 0.3


@contextlib.asynccontextmanager
async def device_pair() -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A v2 PROMPT (listening) and DECODER over TCP, both on the host backend, with 64 KiB staging chunks."""
    from aio_datadist.devices.staging import DeviceStaging
    from aio_datadist.testing import runtime_of

    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", enable_cache_manager=True,
                     device_type="host"))
        dec = await stack.enter_async_context(
            endpoint(LLMRole.DECODER, DECODER, transport="tcp", enable_cache_manager=True, device_type="host"))
        for dd in (prompt, dec):
            rt = runtime_of(dd)
            rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=64 * 1024, buffers=4)
        status, _ = await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=10_000)
        assert status == S.LLM_SUCCESS
        yield prompt, dec


async def stream_holds_copies(stream: Any) -> bool:
    """Wait (bounded) until the owner's held copy stream has copies queued behind its gate (the gate counts one)."""
    deadline = time.monotonic() + 5
    while stream.pending() < 2:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def _unregister_behind_a_held_stream(backend: Any, start: Any, unregister: Any, mine: list[torch.Tensor], *,
                                          reuse: bool = False) -> tuple[float, int, list[torch.Tensor], Any]:
    """Hold ``backend``'s copy stream, start a staged transfer (``start()``, a coroutine) and, once its copies
    queue behind the stream with nothing of them in ``mine`` (the cache's memory), ``unregister()`` it, the stream
    let go ``GATE_S`` after that began (from a thread: the call blocks the loop while it waits). ``reuse``: the
    caller writes its memory at once after the return. ``(how long the call took, copies still queued at its
    return, mine as it was then, the transfer's outcome)``, read once the stream moved on (``GATE_S`` later)."""
    gate = backend.stream.gate()
    opener = threading.Timer(5.0, gate.open)  # at the latest: never leave the stream held
    opener.start()
    try:
        task = asyncio.ensure_future(start())
        assert await stream_holds_copies(backend.stream)
        assert share(mine, 5) == 0  # nothing landed yet: the copies wait behind the gate
        threading.Timer(GATE_S, gate.open).start()
        started = time.monotonic()
        unregister()
        took = time.monotonic() - started
        queued = backend.stream.pending()
        if reuse:
            for t in mine:
                t.fill_(-1)
        before = [t.clone() for t in mine]
        result = await outcome(task)
        await asyncio.sleep(GATE_S + 0.2)
    finally:
        gate.open()
        opener.cancel()
    return took, queued, before, result


@pytest.mark.parametrize("direction", ["push", "pull"])
async def test_unregistering_a_device_cache_a_staged_peer_uses_leaves_no_copy_queued(direction: str):
    """A registered device cache served through the staging plane: the owner's scatters into it (a peer's push)
    or gathers out of it (a peer's pull) wait on its copy stream. ``unregister_cache`` returns only once none is
    left there: the push's memory is unchanged after the return (the stream is let go 0.3 s after the call),
    and no gather of the pull is still queued to read it."""
    from aio_datadist.testing import runtime_of

    async with device_pair() as (prompt, dec):
        backend = runtime_of(prompt).devices
        mine = [torch.zeros(DEVICE_DESC.shape, dtype=torch.float16) for _ in range(DEVICE_DESC.num_tensors)]
        owned = prompt.cache_manager.register_blocks_cache(DEVICE_DESC, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        other = dec.cache_manager.allocate_blocks_cache(DEVICE_DESC)
        paint(other.tensors, 5)
        move = dec.cache_manager.push_blocks if direction == "push" else dec.cache_manager.pull_blocks
        took, queued, before, result = await _unregister_behind_a_held_stream(
            backend, lambda: move(BlocksCacheKey(PROMPT, 0), other, DEVICE_ALL, DEVICE_ALL, timeout=20_000),
            lambda: prompt.cache_manager.unregister_cache(owned.cache_id), mine)
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(mine, before, strict=True))
        assert changed == 0, f"{direction}: {changed} bytes of the unregistered cache changed after the return"
        assert queued == 0, f"{direction}: {queued} copies still queued on the stream when unregister_cache returned"
        assert GATE_S - 0.05 < took < 1.5, f"unregister_cache took {took:.2f} s"
        assert result in (S.LLM_KV_CACHE_NOT_EXIST, S.LLM_LINK_FAILED), f"the cut {direction} gave {result!r}"
        assert registry_of(prompt).serving_count() == 0
        # the link carries the next transfer into (or out of) the cache registered anew
        again = prompt.cache_manager.register_blocks_cache(DEVICE_DESC, mine, BlocksCacheKey(PROMPT, 0),
                                                          remote_accessible=True)
        paint(other.tensors, 6)
        paint(mine, 6) if direction == "pull" else None
        if direction == "push":
            await dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), other, DEVICE_ALL, DEVICE_ALL, timeout=5_000)
        else:
            await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), other, DEVICE_ALL, DEVICE_ALL, timeout=5_000)
        assert share(mine, 6) == 1 and share(other.tensors, 6) == 1
        prompt.cache_manager.unregister_cache(again.cache_id)


def held_device_push(prompt: LLMDataDist, dec: LLMDataDist) -> tuple[Any, Any, Any, Any, threading.Timer]:
    """The prompt's device blocks cache (zeros) and the decoder's (fives) for a push, and the prompt's copy stream
    held: ``(dst, src, stream, its gate, the timer that opens it after 5 s at the latest)``."""
    from aio_datadist.testing import runtime_of

    dst = prompt.cache_manager.allocate_blocks_cache(DEVICE_DESC, BlocksCacheKey(PROMPT, 0))
    src = dec.cache_manager.allocate_blocks_cache(DEVICE_DESC)
    paint(dst.tensors, 0)
    paint(src.tensors, 5)
    stream = runtime_of(prompt).devices.stream
    gate = stream.gate()
    opener = threading.Timer(5.0, gate.open)  # at the latest: never leave the stream held
    opener.start()
    return dst, src, stream, gate, opener


async def test_an_unlink_is_answered_once_the_owners_staged_copies_of_the_peers_push_are_done():
    """A peer unlinks while we (the owner) serve its staged push, our copy stream holding the push's
    scatters: we answer the peer's ``UNLINK`` only once those copies are done (at most
    ``links.SERVED_SETTLE_S``), so its ``unlink_clusters`` returns with nothing of its push left to land in
    our cache. Before, the answer went at once: the unlink returned in 2 ms and 256 KiB of the failed push
    landed in our cache when our stream moved on."""

    async with device_pair() as (prompt, dec):
        dst, src, stream, gate, opener = held_device_push(prompt, dec)
        try:
            push = asyncio.ensure_future(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, DEVICE_ALL,
                                                                       DEVICE_ALL, timeout=20_000))
            assert await stream_holds_copies(stream)
            asyncio.get_running_loop().call_later(GATE_S, gate.open)  # the owner's loop is free: no thread
            started = time.monotonic()
            status, _ = await dec.unlink_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=3000)
            took = time.monotonic() - started
            queued = stream.pending()
            before = [t.clone() for t in dst.tensors]
            result = await outcome(push)
            await asyncio.sleep(GATE_S + 0.2)
        finally:
            gate.open()
            opener.cancel()
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(dst.tensors, before, strict=True))
        assert status == S.LLM_SUCCESS
        assert changed == 0, f"{changed} bytes of the owner's cache changed after the peer's unlink returned"
        assert queued == 0, f"{queued} copies still queued on the owner's stream when the unlink returned"
        assert GATE_S - 0.05 < took < 1.5, f"unlink_clusters took {took:.2f} s"
        # stopped by the owner as it answered the unlink (LLM_FAILED, its word), or the link's end got there first
        assert result in (S.LLM_FAILED, S.LLM_NOT_YET_LINK, S.LLM_LINK_FAILED), f"the cut push gave {result!r}"


async def test_an_unlink_is_answered_once_the_owners_same_host_copy_of_the_peers_push_ended():
    """As above for a same-host push (the owner's copy job reads the pusher's region, ``Link.local_pushes``): the
    owner answers the pusher's ``UNLINK`` only once that copy ended, so nothing of it is running or lands in the
    owner's cache after the pusher's ``unlink_clusters`` returned."""
    desc = CacheDesc(2, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)  # 128 MiB: a copy of some milliseconds
    rows = list(range(64))
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(
            endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local", enable_cache_manager=True))
        dec = await stack.enter_async_context(
            endpoint(LLMRole.DECODER, DECODER, transport="local", enable_cache_manager=True))
        status, _ = await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=10_000)
        assert status == S.LLM_SUCCESS and usable_link(dec, PROMPT).local is not None
        dst = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT, 0))
        src = dec.cache_manager.allocate_blocks_cache(desc)
        paint(src.tensors, 5)
        owner = usable_link(prompt, DECODER)
        idle = engine_state(prompt)
        push = asyncio.ensure_future(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, rows, rows,
                                                                   timeout=20_000))
        async with asyncio.timeout(5):
            while not owner.local_pushes:  # the owner's copy is under way
                await asyncio.sleep(0)
        status, _ = await dec.unlink_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=3000)
        held = engine_state(prompt)
        before = [t.clone() for t in dst.tensors]
        await outcome(push)
        await asyncio.sleep(QUIET_S)
        assert status == S.LLM_SUCCESS
        assert [held[k] - idle[k] for k in ("copy jobs", "pending tokens")] == [0, 0], held
        assert all(torch.equal(t, b) for t, b in zip(dst.tensors, before, strict=True)), "landed after the unlink"


async def test_a_forced_unlink_under_a_staged_push_returns_only_once_the_owners_copies_of_it_are_done():
    """Row 133, the wait itself: the pusher's forced unlink under its staged push (a device cache, host
    backend) tells the owner and returns on its answer, which the owner sends only once the jobs it serves the
    pusher ended (``Link.settle_served``); a staged job ends once the copies it queued on the owner's stream ran.
    With the stream held, the forced unlink returns only once the stream was let go, and nothing lands in the
    owner's cache afterwards. An answer that did not wait for the stopped jobs came back in milliseconds, the
    push's queued copies landing afterwards (found by audit: over TCP without a device the stream job stops at
    once, and the named tests passed without the wait)."""

    async with device_pair() as (prompt, dec):
        dst, src, stream, gate, opener = held_device_push(prompt, dec)
        opened: list[float] = []

        def let_go() -> None:
            opened.append(time.monotonic())
            gate.open()

        try:
            push = asyncio.ensure_future(dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), src, DEVICE_ALL,
                                                                       DEVICE_ALL, timeout=20_000))
            assert await stream_holds_copies(stream)
            assert share(dst.tensors, 5) == 0, "a copy ran past the held stream"
            asyncio.get_running_loop().call_later(GATE_S, let_go)  # the owner's loop is free: no thread
            status = await dec.unlink_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=3000, force=True)
            returned = time.monotonic()
            queued = stream.pending()
            before = [t.clone() for t in dst.tensors]
            result = await outcome(push)
            async with asyncio.timeout(2):  # the stream was let go: what it still held (nothing, if fixed) ran
                while stream.pending():
                    await asyncio.sleep(0.005)
        finally:
            gate.open()
            opener.cancel()
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(dst.tensors, before, strict=True))
        assert status == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert opened and opened[0] <= returned, (
            "the forced unlink returned while the owner's stream still held the push's copies")
        assert queued == 0, f"{queued} copies still queued on the owner's stream when the forced unlink returned"
        assert changed == 0, f"{changed} bytes of the owner's cache changed after the forced unlink returned"
        assert returned - opened[0] < 0.5, "the forced unlink waited past the owner's copies"
        assert result in (S.LLM_FAILED, S.LLM_NOT_YET_LINK, S.LLM_LINK_FAILED), f"the cut push gave {result!r}"


# -- the requester's own transfer of a cache it registered ------------------------------------------------------


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("kind", ["pull", "push"])
async def test_unregistering_a_cache_our_own_transfer_uses_stops_that_transfer(kind: str):
    """We register memory of ours and pull into it (or push out of it) through a slow path; unregistering it
    mid-way cuts our own transfer before the call returns, as it cuts a peer's (row 128): no byte lands in the
    memory after the return (pull), and nothing we write there after the return reaches the peer (push); the
    transfer fails with ``LLM_KV_CACHE_NOT_EXIST``. Before, unregister returned in 0.1 ms and the transfer
    went on: a pull wrote 33 MB of the caller's memory after the return, a push handed the peer 76 % of its
    bytes from memory the caller had written after the return, and both succeeded."""
    desc = SIZES["loop"]
    async with v2_pair() as (prompt, dec):
        theirs = prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT, 0))
        mine = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(desc.num_tensors)]
        own = dec.cache_manager.register_blocks_cache(desc, mine, None)
        if kind == "pull":
            paint(theirs.tensors, 3)
            moving = dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), own, ALL, ALL, timeout=20_000)
            watched = mine
        else:
            paint(mine, 5)
            paint(theirs.tensors, 0)
            moving = dec.cache_manager.push_blocks(BlocksCacheKey(PROMPT, 0), own, ALL, ALL, timeout=20_000)
            watched = theirs.tensors
        task = asyncio.ensure_future(moving)
        at_cut = await until_moving(watched, 3 if kind == "pull" else 5)
        started = time.monotonic()
        dec.cache_manager.unregister_cache(own.cache_id)
        took = time.monotonic() - started
        if kind == "push":
            paint(mine, 9)  # the caller reuses its memory at once
        before = [t.clone() for t in mine]
        result = await outcome(task)
        await asyncio.sleep(QUIET_S)
        assert took < 1.5, f"unregister_cache took {took:.2f} s"
        if kind == "pull":
            changed = sum(int((t != b).sum()) * 2 for t, b in zip(mine, before, strict=True))
            assert changed == 0, (f"{changed} bytes of the unregistered cache changed after unregister_cache "
                                  f"returned ({at_cut:.0%} had landed at the cut, the pull gave {result!r})")
        else:
            late = share(theirs.tensors, 9)
            assert late == 0, (f"{late:.1%} of the peer's cache holds bytes written after unregister_cache "
                               f"returned ({at_cut:.0%} had landed at the cut, the push gave {result!r})")
        assert result == S.LLM_KV_CACHE_NOT_EXIST, f"the cut {kind} gave {result!r}"
        assert registry_of(dec).serving_count() == 0
        # the link carries the next transfer
        again = dec.cache_manager.allocate_blocks_cache(desc)
        paint(theirs.tensors, 6)
        await dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), again, ALL, ALL, timeout=20_000)
        assert share(again.tensors, 6) == 1


async def test_unregistering_a_device_cache_our_staged_pull_writes_leaves_no_copy_queued():
    """Row 168 on the requester: unregistering a registered device cache that our own staged pull writes into
    returns only once the scatters that pull queued on our copy stream are done (``transfers._Cut``'s
    ``wait_cut_copies``), as the owner-side test above shows for a peer's transfer. Our stream is held, so the
    scatters queue behind it, and is let go ``GATE_S`` after the unregister starts (from a thread: the unregister
    blocks the loop while it waits). Until this test (an audit, 2026-12-06) only a reproducer in /tmp showed it:
    the kept tests passed with that wait removed, when 128 KiB of the unregistered cache changed after it returned."""
    async with device_pair() as (prompt, dec):
        backend = runtime_of(dec).devices
        theirs = prompt.cache_manager.allocate_blocks_cache(DEVICE_DESC, BlocksCacheKey(PROMPT, 0))
        paint(theirs.tensors, 5)
        mine = [torch.zeros(DEVICE_DESC.shape, dtype=torch.float16) for _ in range(DEVICE_DESC.num_tensors)]
        own = dec.cache_manager.register_blocks_cache(DEVICE_DESC, mine, None)
        assert own.on_device
        took, queued, before, result = await _unregister_behind_a_held_stream(
            backend, lambda: dec.cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), own, DEVICE_ALL, DEVICE_ALL,
                                                           timeout=20_000),
            lambda: dec.cache_manager.unregister_cache(own.cache_id), mine, reuse=True)
        changed = sum(int((t != b).sum()) * 2 for t, b in zip(mine, before, strict=True))
        assert changed == 0, f"{changed} bytes of the unregistered cache changed after unregister_cache returned"
        assert queued == 0, f"{queued} copies still queued on our stream when unregister_cache returned"
        assert GATE_S - 0.05 < took < 1.5, f"unregister_cache took {took:.2f} s"
        assert result == S.LLM_KV_CACHE_NOT_EXIST, f"the cut pull gave {result!r}"
        assert registry_of(dec).serving_count() == 0
