"""Cancellation storms: hundreds of transfers cut at random moments, then the link works and nothing leaked.

Pulls, pushes, layer-wise tasks and local copies run in waves on a linked
pair and are cut by ``task.cancel()``, ``asyncio.timeout``,
``anyio.move_on_after`` or their own ``timeout=`` after a seeded random
delay (0 to 4 ms: before the request leaves, while the owner answers,
while bytes move, around the end). Each ends within 1 s of the cut, the way
its cut says (``CancelledError`` is never swallowed, a ``timeout=`` gives
``LLM_TIMEOUT``) or with success if it finished first. Afterwards both
endpoints hold no token, no job, no claimed key and no extra fd, and the same
link moves verified bytes both ways, more transfers at once than it has
channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aio_datadist.testing import link_table_of, links_of
from peers import cluster_info, fill, port_of

from _harness import endpoint, open_fds, settle, state
from _budget import SEED, scaled
from _tally import count

S = LLMStatusCode
PROMPT, DECODER = 1, 2
BIG = CacheDesc(8, (32, 16384), DataType.DT_FLOAT16, Placement.HOST)  # 32 blocks of 32 KiB per tensor, 8 MiB
ROWS = CacheDesc(8, (4, 65536), DataType.DT_FLOAT16, Placement.HOST)  # rows of 128 KiB per tensor
ALL = list(range(32))
KEYED = CacheDesc(8, (16, 262144), DataType.DT_FLOAT16, Placement.HOST)  # rows of 512 KiB per tensor, one key each
WAVES, PER_WAVE = scaled(15), 20  # 300 transfers per run
BOUND_S = 1.0
REDIAL_S = 5.0  # how long the channels reset by the cuts may take to be redialled, after the storm
HOW = ("task.cancel", "asyncio.timeout", "anyio.move_on_after", "timeout=")


class Ready(LayerSynchronizer):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0)
        return True


def fd_kinds() -> tuple[Counter, set[str]]:
    """Sockets by count (a reset channel is redialled on a new fd), every other fd by name."""
    fds = open_fds()
    return Counter("socket" for fd in fds if "socket:" in fd), {fd for fd in fds if "socket:" not in fd}


def channels(dd: Any) -> list[str]:
    """Each link's data channels: up (a socket) or not, and being redialled."""
    return [f"link {link.link_id}: {''.join('+' if ch.sock is not None else '-' for ch in link.channels)}"
            f" redialling {sorted(link.redialling)}" for link in links_of(dd).values()]


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_hundreds_of_cancelled_transfers_leave_a_working_link_and_no_leak(transport):
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport) as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport=transport) as dec:
        pm, dm = dd.kv_cache_manager, dec.kv_cache_manager
        src = pm.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT, 0))
        rows = pm.allocate_cache(ROWS)
        dst = dm.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER, 0))
        dst_rows = dm.allocate_cache(ROWS)
        fill(src, 1)
        fill(rows, 2)
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        before = (state(dd), state(dec), fd_kinds())
        rng = random.Random(f"{transport}-{SEED}")

        def transfer(kind: str, timeout: int) -> Any:
            n = rng.choice((1, 8, 32))
            srcs, dsts = rng.sample(ALL, n), rng.sample(ALL, n)
            if kind == "pull_blocks":
                return dm.pull_blocks(BlocksCacheKey(PROMPT), dst, srcs, dsts, timeout=timeout)
            if kind == "pull_cache":
                return dm.pull_cache(CacheKeyByIdAndIndex(PROMPT, rows.cache_id, rng.randrange(4)), dst_rows,
                                     rng.randrange(4), timeout=timeout)
            if kind == "push_blocks":
                return pm.push_blocks(BlocksCacheKey(DECODER), src, srcs, dsts, timeout=timeout)
            if kind == "push_cache":
                return pm.push_cache(CacheIndex(DECODER, dst_rows.cache_id, rng.randrange(4)), rows,
                                     rng.randrange(4), timeout=timeout)
            if kind == "copy_blocks":
                return dm.copy_blocks(dst, {srcs[0]: [b for b in dsts if b != srcs[0]] or [(srcs[0] + 1) % 32]},
                                      timeout=timeout)

            async def layerwise() -> None:
                await pm.transfer_cache_async(src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0))],
                                              srcs, dsts)
            return layerwise()

        async def one(kind: str, how: str, delay: float) -> tuple[str, float]:
            """Run and cut one transfer; its outcome and how long it took past the cut."""
            if how == "timeout=":
                t0 = time.monotonic()
                try:
                    await transfer(kind, max(1, int(delay * 1000)))
                    return "done", 0.0
                except LLMException as exc:
                    assert exc.status_code == S.LLM_TIMEOUT or kind == "layerwise", exc
                    return "timeout", time.monotonic() - t0 - delay
            if how == "task.cancel":
                task = asyncio.ensure_future(transfer(kind, 10_000))
                await asyncio.sleep(delay)
                task.cancel()
                cut = time.monotonic()
                try:
                    await task
                    return "done", 0.0
                except asyncio.CancelledError:
                    assert task.cancelled()
                    return "cancelled", time.monotonic() - cut
            if how == "asyncio.timeout":
                try:
                    async with asyncio.timeout(delay):
                        await transfer(kind, 10_000)
                    return "done", 0.0
                except TimeoutError:
                    return "cancelled", 0.0
            with anyio.move_on_after(delay) as scope:
                await transfer(kind, 10_000)
            return ("cancelled" if scope.cancelled_caught else "done"), 0.0

        outcomes: Counter = Counter()
        kinds = ("pull_blocks", "pull_cache", "push_blocks", "push_cache", "copy_blocks", "layerwise")
        for _ in range(WAVES):
            wave = [one(rng.choice(kinds), rng.choice(HOW), rng.choice((0.0, rng.uniform(0, 0.004))))
                    for _ in range(PER_WAVE)]
            t0 = time.monotonic()
            results = await asyncio.gather(*wave)
            assert time.monotonic() - t0 < 0.004 + BOUND_S + 0.5
            for outcome, late in results:
                outcomes[outcome] += 1
                assert late < BOUND_S, f"a cut transfer took {late:.2f} s to end"
        assert outcomes["cancelled"] + outcomes["timeout"] >= WAVES * PER_WAVE // 3, outcomes
        count("cancelled transfers", outcomes["cancelled"] + outcomes["timeout"])

        await settle(dd, before[0], within=BOUND_S)
        await settle(dec, before[1], within=BOUND_S)
        # Channels the cuts reset are redialled at once, but on a loaded 2-core VM a redial's accept and
        # handshake took longer than BOUND_S (one socket short in 2 of many full CI runs): what is checked
        # here is that nothing leaks, so the redials get REDIAL_S.
        deadline = time.monotonic() + REDIAL_S
        while fd_kinds() != before[2] and time.monotonic() < deadline:  # channels being redialled
            await asyncio.sleep(0.01)
        now = fd_kinds()
        assert now == before[2], (f"sockets {now[0]} (before {before[2][0]}); other fds opened "
                                  f"{sorted(now[1] - before[2][1])}, closed {sorted(before[2][1] - now[1])}; "
                                  f"channels (prompt, decoder): {channels(dd)}, {channels(dec)}")

        # the link works: more transfers at once than it has channels, both ways, bytes checked
        for t in dst.tensors + dst_rows.tensors:
            t.zero_()
        await asyncio.gather(*(dm.pull_blocks(BlocksCacheKey(PROMPT), dst, [b], [b]) for b in ALL[:16]),
                             dm.pull_blocks(BlocksCacheKey(PROMPT), dst, ALL[16:], ALL[16:]),
                             *(pm.push_cache(CacheIndex(DECODER, dst_rows.cache_id, r), rows, r) for r in range(4)))
        assert all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dst.tensors, src.tensors))
        assert all(torch.equal(d.view(torch.int16), s.view(torch.int16))
                   for d, s in zip(dst_rows.tensors, rows.tensors))



@contextlib.asynccontextmanager
async def _one_channel_pair(listening: LLMRole) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A prompt and a decoder over TCP with one data channel each way, ``listening`` the end that listens and the
    other linked to it; an 8 MiB blocks cache each, the prompt's filled: ``(prompt, decoder, its cache, the
    decoder's)``."""
    ids = {LLMRole.PROMPT: PROMPT, LLMRole.DECODER: DECODER}
    other = LLMRole.DECODER if listening is LLMRole.PROMPT else LLMRole.PROMPT
    async with endpoint(listening, ids[listening], listen=True, transport="tcp", data_channels=1) as listener, \
            endpoint(other, ids[other], transport="tcp", data_channels=1) as linker:
        dd, dec = (listener, linker) if listening is LLMRole.PROMPT else (linker, listener)
        src = dd.kv_cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT, 0))
        dst = dec.kv_cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER, 0))
        fill(src, 3)
        assert (await linker.link_clusters([cluster_info(ids[listening], port_of(listener))]))[0] == S.LLM_SUCCESS
        yield dd, dec, src, dst


@pytest.mark.asyncio
async def test_a_request_on_a_channel_still_being_redialled_waits_for_it():
    """A cut transfer resets its channel and the linking side redials it. The other side may use the channel
    the moment it accepted the redial; its request can overtake the acknowledgement the redial waits for.
    It must be served once the channel is back, not refused with "data channel not usable"."""
    async with _one_channel_pair(listening=LLMRole.PROMPT) as (dd, dec, src, dst):
        table = link_table_of(dec)
        dial = table.dial_data

        async def slow_dial(*args: Any) -> Any:  # the acknowledgement arrives late
            sock = await dial(*args)
            await asyncio.sleep(0.05)
            return sock

        table.dial_data = slow_dial
        link = table.links[PROMPT]
        for round_ in range(3):
            link.reset_channel(1, tell_peer=True)  # the prompt's channel, reset by the decoder
            await dd.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER), src, [round_], [round_], timeout=5000)
            assert all(torch.equal(d[round_].view(torch.int16), s[round_].view(torch.int16))
                       for d, s in zip(dst.tensors, src.tensors))
        del table.dial_data


@pytest.mark.asyncio
async def test_a_pull_on_a_channel_still_being_redialled_waits_for_it():
    """As above, a pull this time: the decoder (listening) resets the channel its pulls take, as a cut pull
    does, and the prompt (the linking side) redials it, its acknowledgement held until the test lets it go; the
    decoder pulls on the channel as soon as it accepted the redial, and the pull is served once the channel is
    back. The test above sends pushes only, and passed with only a push deferred (audit, 2026-12-07)."""
    async with _one_channel_pair(listening=LLMRole.DECODER) as (dd, dec, src, dst):
        table = link_table_of(dd)
        dial = table.dial_data
        let_go = asyncio.Event()

        async def held_dial(*args: Any) -> Any:  # the redial's acknowledgement, held
            sock = await dial(*args)
            await let_go.wait()
            return sock

        table.dial_data = held_dial
        link, theirs = table.links[DECODER], link_table_of(dec).links[PROMPT]
        for round_ in range(3):
            let_go.clear()
            theirs.reset_channel(1, tell_peer=True)  # the decoder's channel, reset by the decoder (a cut pull)
            async with asyncio.timeout(5):
                while 1 not in link.redialling:
                    await asyncio.sleep(0.005)
            pull = asyncio.ensure_future(dec.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, [round_],
                                                                          [round_], timeout=5000))
            await asyncio.sleep(0.05)  # its request is on its way, or waiting for the channel
            assert 1 in link.redialling and not pull.done()  # the case: the prompt still redials
            let_go.set()
            await asyncio.wait_for(pull, 10)
            assert all(torch.equal(d[round_].view(torch.int16), s[round_].view(torch.int16))
                       for d, s in zip(dst.tensors, src.tensors, strict=True))
        del table.dial_data


@pytest.mark.asyncio
async def test_a_cancel_that_reaches_a_running_transfer_is_always_raised():
    """``task.cancel()`` of a transfer that has not ended (the call returned True) must end it with
    ``CancelledError``, never with a normal return. The storm above counts a return after a cut as "done"
    (finished first), and passed, in 3 of its 4 runs, with every pull's and push's cancel swallowed."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec:
        pm, dm = dd.kv_cache_manager, dec.kv_cache_manager
        src, rows = pm.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT, 0)), pm.allocate_cache(ROWS)
        dst, dst_rows = dm.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER, 0)), dm.allocate_cache(ROWS)
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        calls = (lambda: dm.pull_blocks(BlocksCacheKey(PROMPT), dst, ALL, ALL, timeout=10_000),
                 lambda: dm.pull_cache(CacheKeyByIdAndIndex(PROMPT, rows.cache_id, 1), dst_rows, 2, timeout=10_000),
                 lambda: pm.push_blocks(BlocksCacheKey(DECODER), src, ALL, ALL, timeout=10_000),
                 lambda: pm.push_cache(CacheIndex(DECODER, dst_rows.cache_id, 3), rows, 0, timeout=10_000))
        rng = random.Random(f"swallow-{SEED}")
        reached = 0
        for i in range(80):
            task = asyncio.ensure_future(calls[i % len(calls)]())
            await asyncio.sleep(rng.choice((0, rng.uniform(0, 0.003))))
            if not task.cancel():  # it ended first
                task.result()
                continue
            reached += 1
            cut = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - cut < BOUND_S
        assert reached >= 20, reached
        count("cancelled transfers", reached)


@pytest.mark.asyncio
async def test_a_cut_pull_by_a_key_gives_its_claim_back():
    """The storm pulls by id and index and by blocks key, which claim no key: a pull by a ``CacheKey`` claims it
    while the owner serves it, and a cut one must give the claim back (the key stays for the next pull)."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec:
        keys = [CacheKey(PROMPT, k) for k in range(KEYED.shape[0])]
        values = fill(dd.kv_cache_manager.allocate_cache(KEYED, keys), 4)
        dst = dec.kv_cache_manager.allocate_cache(KEYED)
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        baseline, rng, reached = state(dd), random.Random(f"claims-{SEED}"), 0
        for _ in range(60):
            task = asyncio.ensure_future(dec.kv_cache_manager.pull_cache(keys[0], dst, 0, timeout=10_000))
            await asyncio.sleep(rng.uniform(0, 0.002))
            if not task.cancel():  # it ended first: the key is consumed
                task.result()
                keys.pop(0)
                if not keys:
                    break
                continue
            with pytest.raises(asyncio.CancelledError):
                await task
            reached += 1
            await settle(dd, baseline, within=BOUND_S)  # "claimed keys" back to 0
        assert reached >= 10, reached
        if keys:  # the key a cut pull held is still there, with its bytes (a claim consumed would refuse it)
            await dec.kv_cache_manager.pull_cache(keys[0], dst, 0)
            assert all(torch.equal(t[0], v[KEYED.shape[0] - len(keys)]) for t, v in zip(dst.tensors, values))
