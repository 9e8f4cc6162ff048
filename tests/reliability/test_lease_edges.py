"""Leases at their edges: the event loop a lease's timer lives on, the role of the endpoint when the
lease releases, and v1 ``remove_cache_key`` on a registered cache (reference 4.2).

Everything here is in-process and local (no peer is needed to see what the owner still holds).
"""

from __future__ import annotations

import asyncio

import pytest
from _harness import endpoint

from aio_datadist import CacheDesc, CacheKey, DataType, LLMException, LLMRole, LLMStatusCode, Placement
from aio_datadist.leases import lease_of

S = LLMStatusCode
PROMPT = 1
ROWS = CacheDesc(2, (3, 256), DataType.DT_FLOAT16, Placement.HOST)


def keys_for(first: int, n: int = 3) -> list[CacheKey]:
    return [CacheKey(PROMPT, first + i) for i in range(n)]


def held(dd) -> tuple[int, int, int]:
    """(caches, bound keys, registered bytes) of ``dd``."""
    reg = dd._endpoint.runtime.registry
    return len(reg), reg.key_count, reg.used_bytes


@pytest.mark.asyncio
async def test_a_lease_taken_on_a_loop_that_then_closed_does_not_stay_running_for_good():
    """A helper loop (``asyncio.run`` in a worker thread) that takes a lease and then ends must not
    leave a lease whose timer can never fire: before, the keys stayed bound for good, the lease said
    ``active``, blocked any new lease on the cache and ``renew`` raised a bare ``RuntimeError``."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        before = held(dd)

        async def take():
            return kv.allocate_cache(ROWS, keys_for(10), lease_ms=50)

        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, take()), 5)
        assert info.value.status_code == S.LLM_FAILED and "event loop" in str(info.value)
        assert held(dd) == before  # refused before anything was allocated

        # the same call on the endpoint's own loop takes the lease, and it runs out there
        cache = kv.allocate_cache(ROWS, keys_for(10), lease_ms=50)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        async with asyncio.timeout(2):
            while held(dd) != before:
                await asyncio.sleep(0.01)
        assert lease.expired and dd.stats().leases == 0

        # a lease is renewed from its own loop only (its timer lives there)
        cache = kv.allocate_cache(ROWS, keys_for(20), lease_ms=60_000)
        lease = lease_of(cache)

        async def renew():
            lease.renew(10)

        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, renew()), 5)
        assert info.value.status_code == S.LLM_FAILED and "event loop" in str(info.value)
        assert lease.active and lease.deadline is not None and lease.deadline - asyncio.get_running_loop().time() > 30
        lease.release()
        assert held(dd) == before
