"""Leases: a hand-off cache whose decoder vanished is released when its lease runs out.

``aio_datadist.leases`` (see its docstring for the design): the prompt
allocates a request's cache with its keys and a lease, drops its own
reference, and a decoder pulls the keys. If the decoder dies first, the keys
it never pulled are unbound when the lease runs out, and the memory goes.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from aio_datadist import CacheDesc, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist.leases import allocate_leased_cache, lease_cache, lease_of
from aio_datadist.testing import engine_state
from peers import CacheSpec, EndpointSpec, Ref, cluster_info, fill, port_of, tensors_from_dump

from _forked import forked
from _harness import endpoint, settle, state

S = LLMStatusCode
PROMPT, DECODER = 1, 2
ROWS = CacheDesc(4, (3, 1024), DataType.DT_FLOAT16, Placement.HOST)
BIG_ROW = CacheDesc(4, (1, 8 << 20), DataType.DT_FLOAT16, Placement.HOST)  # one 64 MiB row
LEASE_MS = 300
BOUND_S = 1.0


def keys_for(first: int, n: int = 3) -> list[CacheKey]:
    return [CacheKey(PROMPT, first + i) for i in range(n)]


async def hand_off(kv, desc: CacheDesc, keys: list[CacheKey], seed: int, lease_ms: int):
    cache, lease = allocate_leased_cache(kv, desc, keys, lease_ms=lease_ms)
    values = fill(cache, seed)
    kv.deallocate_cache(cache)
    return lease, values


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_lease_releases_what_a_killed_decoder_never_pulled(fork_server):
    decoder_spec = EndpointSpec(LLMRole.DECODER, DECODER, listen=False, caches=(CacheSpec("rows", ROWS, 0),))
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd:
        kv = dd.kv_cache_manager
        baseline = state(dd)
        keys = keys_for(100)
        async with forked(decoder_spec) as (decoder,):
            assert (await decoder.call("link", PROMPT, port_of(dd)[1]))[0] == S.LLM_SUCCESS
            lease, values = await hand_off(kv, ROWS, keys, seed=1, lease_ms=LEASE_MS)
            started = time.monotonic()
            await decoder.call("kv", "pull_cache", keys[0], Ref("rows"), 0)
            got = tensors_from_dump(ROWS, await decoder.call("dump", "rows"))
            assert all(torch.equal(g[0], v[0]) for g, v in zip(got, values))
            decoder.kill()
        assert state(dd)["registered bytes"] > baseline["registered bytes"]  # keys 1 and 2 still hold it
        assert not lease.expired
        await settle(dd, baseline, within=LEASE_MS / 1000 + BOUND_S)
        assert lease.expired and time.monotonic() - started >= LEASE_MS / 1000 * 0.9
        async with forked(decoder_spec) as (late,):
            assert (await late.call("link", PROMPT, port_of(dd)[1]))[0] == S.LLM_SUCCESS
            for row, key in enumerate(keys[1:], 1):
                with pytest.raises(LLMException) as info:
                    await late.call("kv", "pull_cache", key, Ref("rows"), row)
                assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_expiry_does_not_cut_a_pull_in_flight_and_the_memory_goes_after_it():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec:
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(BIG_ROW)
        baseline = state(dd)
        key = CacheKey(PROMPT, 7)
        lease, values = await hand_off(dd.kv_cache_manager, BIG_ROW, [key], seed=2, lease_ms=60_000)
        pull = asyncio.ensure_future(dec.kv_cache_manager.pull_cache(key, dst, timeout=10_000))
        async with asyncio.timeout(5):
            while not engine_state(dd)["claimed keys"]:  # the owner has claimed the key: bytes are moving
                await asyncio.sleep(0)
        lease.release()
        assert lease.expired
        await pull  # not cut
        assert all(torch.equal(d.view(torch.int16), v.view(torch.int16)) for d, v in zip(dst.tensors, values))
        await settle(dd, baseline, within=BOUND_S)
        with pytest.raises(LLMException) as info:
            await dec.kv_cache_manager.pull_cache(key, dst)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_renew_cancel_and_pulled_keys():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv = dd.kv_cache_manager
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        baseline = state(dd)
        loop = asyncio.get_running_loop()

        # renewed: still there after the first deadline, gone after the second
        lease, _ = await hand_off(kv, ROWS, keys_for(10), seed=3, lease_ms=100)
        lease.renew(400)
        assert lease.deadline is not None and lease.deadline - loop.time() > 0.3
        await asyncio.sleep(0.2)
        assert state(dd) != baseline
        await settle(dd, baseline, within=0.4 + BOUND_S)

        # cancelled: kept (the prompt took the cache back), its keys still pullable
        lease, values = await hand_off(kv, ROWS, keys_for(20), seed=4, lease_ms=50)
        lease.cancel()
        await asyncio.sleep(0.15)
        for row, key in enumerate(keys_for(20)):
            await dec.kv_cache_manager.pull_cache(key, dst, row)
        assert all(torch.equal(d, v) for d, v in zip(dst.tensors, values))
        await settle(dd, baseline, within=BOUND_S)  # every key pulled: the cache went without the lease
        assert not lease.expired

        # all keys pulled before expiry: the lease has nothing left to do
        lease, _ = await hand_off(kv, ROWS, keys_for(30), seed=5, lease_ms=100)
        for row, key in enumerate(keys_for(30)):
            await dec.kv_cache_manager.pull_cache(key, dst, row)
        await settle(dd, baseline, within=BOUND_S)
        await asyncio.sleep(0.15)
        assert lease.expired and state(dd) == baseline

        # a lease on a cache the prompt keeps: expiry drops the keys and the id reference
        cache = kv.allocate_cache(ROWS, keys_for(40))
        lease = lease_cache(kv, cache, keys_for(40), lease_ms=50)
        await settle(dd, baseline, within=0.05 + BOUND_S)
        kv.deallocate_cache(cache)  # the lease released it already: a second release is a no-op (reference 2.3)
        assert state(dd) == baseline
        with pytest.raises(LLMException):
            lease.renew(100)

        # bad input
        for bad in (0, -1, 1.5, "100", None, 2**31):
            with pytest.raises(LLMException) as info:
                allocate_leased_cache(kv, ROWS, keys_for(50), lease_ms=bad)
            assert info.value.status_code == S.LLM_PARAM_INVALID and "'lease_ms'" in str(info.value)
        with pytest.raises(LLMException) as info:
            allocate_leased_cache(dec.kv_cache_manager, ROWS, keys_for(60), lease_ms=100)
        assert info.value.status_code == S.LLM_PARAM_INVALID
        assert state(dd) == baseline  # nothing was allocated by the refused calls


@pytest.mark.asyncio
async def test_allocate_cache_takes_a_lease():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv = dd.kv_cache_manager
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        baseline = state(dd)

        # handed off with a lease: one key pulled in time, the others released at expiry
        keys = keys_for(70)
        started = time.monotonic()
        cache = kv.allocate_cache(ROWS, keys, lease_ms=150)
        values = fill(cache, 6)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        assert lease is not None and not lease.expired
        await dec.kv_cache_manager.pull_cache(keys[0], dst, 0)
        assert all(torch.equal(d[0], v[0]) for d, v in zip(dst.tensors, values))
        async with asyncio.timeout(0.15 + BOUND_S):  # it runs out at its deadline, not before
            while not lease.expired:
                await asyncio.sleep(0.005)
        # (less 2 ms: uvloop's timers count whole milliseconds of a clock read before ``started``)
        assert time.monotonic() - started >= 0.15 - 0.002, "the lease ran out before its lease_ms"
        await settle(dd, baseline, within=0.15 + BOUND_S)
        assert lease.expired
        with pytest.raises(LLMException) as info:
            await dec.kv_cache_manager.pull_cache(keys[1], dst, 1)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST

        # the lease it returns through lease_of is the one that runs: cancelled, the cache stays
        cache = kv.allocate_cache(ROWS, keys_for(80), lease_ms=50)
        lease_of(cache).cancel()
        await asyncio.sleep(0.1)
        assert kv.get_cache_tensors(cache)  # still allocated
        kv.deallocate_cache(cache)
        for key in keys_for(80):
            kv.remove_cache_key(key)
        await settle(dd, baseline, within=BOUND_S)
        plain = kv.allocate_cache(ROWS)
        assert lease_of(plain) is None  # no lease asked, none put
        kv.deallocate_cache(plain)

        # bad leases: LLM_PARAM_INVALID naming lease_ms, and nothing is allocated
        before = state(dd)
        for bad in (0, -1, 1.5, "100", True, 2**31):
            with pytest.raises(LLMException) as info:
                kv.allocate_cache(ROWS, keys_for(90), lease_ms=bad)
            assert info.value.status_code == S.LLM_PARAM_INVALID and "'lease_ms'" in str(info.value)
        with pytest.raises(LLMException) as info:  # a decoder may not lease (a lease removes keys)
            dec.kv_cache_manager.allocate_cache(ROWS, lease_ms=100)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'lease_ms'" in str(info.value)
        assert state(dd) == before


@pytest.mark.asyncio
async def test_a_leased_cache_takes_no_second_lease_and_lease_of_is_the_one_that_runs():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv = dd.kv_cache_manager
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        baseline = state(dd)
        keys = keys_for(110)
        cache = kv.allocate_cache(ROWS, keys, lease_ms=100)
        first = lease_of(cache)
        with pytest.raises(LLMException) as info:  # a second lease would run beside the first, out of reach
            lease_cache(kv, cache, keys, lease_ms=60_000)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'cache'" in str(info.value)
        assert lease_of(cache) is first
        lease_of(cache).renew(400)  # renewing it holds: its first 100 ms pass and nothing expires
        await asyncio.sleep(0.2)
        assert cache.alive and not first.expired
        lease_of(cache).cancel()  # the prompt keeps the cache: nothing may expire it now (the renewed 400 ms pass)
        values = fill(cache, 7)
        await asyncio.sleep(0.3)
        await dec.kv_cache_manager.pull_cache(keys[0], dst, 0)
        assert all(torch.equal(d[0], v[0]) for d, v in zip(dst.tensors, values))

        # once a lease ended (cancelled, expired), a new one may be put on the cache
        second = lease_cache(kv, cache, keys[1:], lease_ms=50)
        assert lease_of(cache) is second
        kv.deallocate_cache(cache)
        await settle(dd, baseline, within=0.05 + BOUND_S)
        assert second.expired


@pytest.mark.asyncio
async def test_an_expired_lease_drops_the_id_reference_the_prompt_kept():
    # the prompt never calls deallocate_cache: at expiry the lease drops the id reference too, and the memory goes
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv = dd.kv_cache_manager
        baseline, dec_baseline = state(dd), state(dec)
        keys = keys_for(130)
        cache = kv.allocate_cache(ROWS, keys, lease_ms=100)
        lease = lease_of(cache)
        assert state(dd) != baseline
        await settle(dd, baseline, within=0.1 + BOUND_S)
        assert lease.expired and not cache.alive
        with pytest.raises(LLMException) as info:  # a refused decoder lease allocates nothing on the decoder either
            dec.kv_cache_manager.allocate_cache(ROWS, lease_ms=100)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'lease_ms'" in str(info.value)
        assert state(dec) == dec_baseline
