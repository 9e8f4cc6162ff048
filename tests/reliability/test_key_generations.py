"""Key bindings have generations: a pull of a binding that went away never touches the key's next binding.

A pull claims and, once the decoder confirmed it, consumes the *binding* it
resolved (key -> row of a cache), not the key. When the key is removed
(``remove_cache_key`` or a lease running out) and bound to a new cache while
that pull is in flight, the pull ends as it may, and the new binding stays
bound, unclaimed and pullable with its own bytes; a pull of it then consumes
it as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from aio_datadist import (
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
from aio_datadist.cache import CacheRegistry
from aio_datadist.leases import lease_of
from aio_datadist.testing import engine_state, link_to, registry_of
from peers import cluster_info, port_of

from _harness import endpoint
from _slowpath import SlowPath

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
PROMPT, DECODER = 71, 72
KEY = CacheKey(PROMPT, req_id=7)
#: 4 tensors of one 2 MiB row: 8 MiB, about 0.3 s through the slow path.
KEYED = CacheDesc(4, (1, 1024 * 1024), DataType.DT_FLOAT16, Placement.HOST)
SMALL = CacheDesc(2, (2, 64), DataType.DT_FLOAT16, Placement.HOST)
RATE, LATENCY_S = 32e6, 0.05


def paint(cache: KvCache, value: float) -> None:
    for t in cache.tensors:
        t.fill_(value)


def holds(cache: KvCache, value: float) -> bool:
    return all(bool((t == value).all()) for t in cache.tensors)


# -- the registry, driven as the owner drives it ------------------------------------------


def registry_with(reg: CacheRegistry, key: CacheKey, desc: CacheDesc = SMALL) -> KvCache:
    """An allocated (owned) cache bound to ``key`` at row 0, its id reference dropped (a hand-off)."""
    cache = reg.add(lambda cid: KvCache(cid, desc, [torch.zeros(desc.shape, dtype=torch.float16)
                                                      for _ in range(desc.num_tensors)], is_blocks=False,
                                        owned=True), 0, reg.check_keys(desc, [key]), None)
    return cache


async def test_a_pull_of_a_removed_binding_neither_consumes_nor_blocks_the_rebound_key():
    reg = CacheRegistry(1 << 30)
    ident = KEY.lookup_key()
    registry_with(reg, KEY)
    _, first = reg.resolve_key(ident)
    all_tensors = range(SMALL.num_tensors)
    assert reg.claim_key(first, all_tensors)
    assert not reg.claim_key(first, range(1))  # one pull of a binding at a time, as before

    assert reg.remove_key(KEY)
    new = registry_with(reg, KEY)
    _, second = reg.resolve_key(ident)
    assert second is not first and second.generation > first.generation
    assert reg.claim_key(second, all_tensors), "the old binding's claim blocked the new binding"
    reg.release_key(second, all_tensors)

    # the old pull ends well: it consumes its own binding, which is gone, and nothing else
    reg.release_key(first, all_tensors)
    reg.consume(first, all_tensors, SMALL.num_tensors)
    assert reg.by_key(ident) == (new, 0)
    assert not reg._reserved
    # the old pull ends badly after the new one claimed: releasing the old claim frees nothing of the new
    assert reg.claim_key(second, all_tensors)
    reg.release_key(first, all_tensors)
    assert not reg.claim_key(second, range(1))
    reg.release_key(second, all_tensors)
    # a pull of the new binding consumes it
    reg.consume(second, all_tensors, SMALL.num_tensors)
    assert reg.by_key(ident) is None


# -- live: a decoder pulls while the prompt rebinds the key ---------------------------------


@contextlib.asynccontextmanager
async def slow_pair(transport: str = "tcp") -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A PROMPT and a DECODER that reaches it over a slow path, so that a pull of KEYED takes a while (with
    ``transport="local"`` the copy is quick, but the RESP and the DONE that consumes the key cross the path)."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport) as prompt, \
            endpoint(LLMRole.DECODER, DECODER, transport=transport) as dec, \
            SlowPath(port_of(prompt), RATE, LATENCY_S) as path:
        assert (await dec.link_clusters([cluster_info(PROMPT, path.address)], timeout=10_000))[0] == S.LLM_SUCCESS
        yield prompt, dec


async def claimed(prompt: LLMDataDist) -> None:
    """Until the prompt has claimed a binding for a pull: bytes are about to move."""
    async with asyncio.timeout(5):
        while not engine_state(prompt)["claimed keys"]:
            await asyncio.sleep(0.002)


async def rebind_during_a_pull(prompt: LLMDataDist, dec: LLMDataDist, unbind: Any, hand_off: bool = True) -> None:
    pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
    old = pm.allocate_cache(KEYED, [KEY], lease_ms=60_000)
    paint(old, 1)
    if hand_off:  # the key holds the memory (else the cache outlives its key, and the pull of it goes on)
        pm.deallocate_cache(old)
    dst = dm.allocate_cache(KEYED)
    pull = asyncio.ensure_future(dm.pull_cache(KEY, dst, 0, timeout=20_000))
    await claimed(prompt)
    unbind(old)
    new = pm.allocate_cache(KEYED, [KEY])
    paint(new, 2)
    pm.deallocate_cache(new)
    with contextlib.suppress(LLMException):
        await pull  # whatever it gives (the old bytes, here): it must not touch the new binding
    assert pull.exception() is not None or holds(dst, 1)
    async with asyncio.timeout(2):  # the owner hears the pull's DONE (or its failure) a moment later
        while engine_state(prompt)["claimed keys"]:
            await asyncio.sleep(0.005)
    assert registry_of(prompt).by_key(KEY.lookup_key()) is not None, "the old pull consumed the new binding"

    paint(dst, 0)
    await dm.pull_cache(KEY, dst, 0, timeout=20_000)
    assert holds(dst, 2), "the new binding did not give its own bytes"
    with pytest.raises(LLMException) as info:  # and that pull consumed the new binding, as any pull does
        await dm.pull_cache(KEY, dst, 0, timeout=20_000)
    assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_a_key_removed_and_bound_again_during_a_pull_keeps_its_new_binding():
    async with slow_pair() as (prompt, dec):
        await rebind_during_a_pull(prompt, dec, lambda old: prompt.kv_cache_manager.remove_cache_key(KEY))


async def test_a_key_removed_and_bound_again_during_a_same_host_pull_keeps_its_new_binding():
    async with slow_pair("local") as (prompt, dec):
        # the old cache kept (a hand-off freed at its key's removal cuts a same-host pull): its pull succeeds
        await rebind_during_a_pull(prompt, dec, lambda old: prompt.kv_cache_manager.remove_cache_key(KEY),
                                   hand_off=False)
        assert link_to(dec, PROMPT).transport == "local", "the pulls did not go through shared memory"


async def test_a_lease_running_out_during_a_pull_leaves_the_key_s_next_binding_alone():
    async with slow_pair() as (prompt, dec):
        await rebind_during_a_pull(prompt, dec, lambda old: lease_of(old).release())


async def test_a_lease_that_runs_out_after_its_key_was_bound_again_removes_nothing():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as prompt, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec:
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))]))[0] == S.LLM_SUCCESS
        old = pm.allocate_cache(SMALL, [KEY], lease_ms=60_000)
        lease = lease_of(old)
        pm.remove_cache_key(KEY)
        new = pm.allocate_cache(SMALL, [KEY])
        paint(new, 3)
        lease.release()  # expires now: the key is bound to another cache, not ours to remove
        assert lease.expired
        assert registry_of(prompt).by_key(KEY.lookup_key()) == (new, 0)
        dst = dm.allocate_cache(SMALL)
        await dm.pull_cache(KEY, dst, 0, timeout=5_000)
        assert all(bool((t[0] == 3).all()) for t in dst.tensors)


# -- keys a pull never consumes are not held by one pull --------------------------------------

#: Bound to a prefix: a pull never consumes it (reference 4.2), so any number may pull it.
PREFIX = CacheKey(PROMPT, req_id=2**64 - 1, prefix_id=5)


@pytest.mark.parametrize("kind", ["prefix key", "registered cache", "allocated cache"])
async def test_a_key_no_pull_consumes_is_pulled_by_two_requests_at_once(kind: str):
    async with slow_pair() as (prompt, dec):
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        if kind == "prefix key":
            key = PREFIX
            src = pm.allocate_cache(KEYED, [key])
        elif kind == "allocated cache":  # the contrast: a req_id key a pull consumes is claimed by one pull
            key = KEY
            src = pm.allocate_cache(KEYED, [key])
        else:  # a registered (framework-owned) cache keeps its keys, as in LLM-DataDist
            key = KEY
            owned = [torch.empty(KEYED.shape, dtype=torch.float16) for _ in range(KEYED.num_tensors)]
            src = pm.register_cache(KEYED, owned, [key])
        paint(src, 5)
        dsts = [dm.allocate_cache(KEYED) for _ in range(2)]
        # two pulls of the key at once (two data channels): each takes about 0.3 s through the slow path
        results = await asyncio.gather(*(dm.pull_cache(key, d, 0, timeout=20_000) for d in dsts),
                                       return_exceptions=True)
        if kind == "allocated cache":
            refused = [r for r in results if r is not None]
            assert len(refused) == 1 and refused[0].status_code == S.LLM_KV_CACHE_NOT_EXIST, results
            pm.deallocate_cache(src)
            return
        assert results == [None, None], f"a pull of a key no pull consumes was refused: {results}"
        assert all(holds(d, 5) for d in dsts)
        assert registry_of(prompt).by_key(key.lookup_key()) == (src, 0)  # still bound, as before
        assert not engine_state(prompt)["claimed keys"]
        pm.deallocate_cache(src)
