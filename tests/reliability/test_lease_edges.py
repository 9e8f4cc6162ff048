"""Leases at their edges: the event loop a lease's timer lives on, the role of the endpoint when the
lease releases, and v1 ``remove_cache_key`` on a registered cache (reference 4.2).

Everything here is in-process and local (no peer is needed to see what the owner still holds).
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref

import pytest
import torch
from _harness import endpoint, options
from peers import cluster_info, fill, port_of

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
from aio_datadist.leases import allocate_leased_cache, lease_cache, lease_of

S = LLMStatusCode
PROMPT, DECODER = 1, 2
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

        # a refused renew leaves the timer as it was: a lease about to run out still runs out
        cache = kv.allocate_cache(ROWS, keys_for(30), lease_ms=500)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, renew()), 5)
        assert info.value.status_code == S.LLM_FAILED
        async with asyncio.timeout(2):
            while held(dd) != before:
                await asyncio.sleep(0.01)
        assert lease.expired


@pytest.mark.asyncio
async def test_lease_cache_from_another_loop_is_refused_and_leases_nothing():
    """``lease_cache`` (not only ``allocate_cache(..., lease_ms=)``) from a helper loop is refused with
    ``LLM_FAILED`` and leaves the cache unleased: its timer would live on a loop that then closes."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        before = held(dd)
        cache = kv.allocate_cache(ROWS, keys_for(60))
        taken = held(dd)

        async def take():
            return lease_cache(kv, cache, keys_for(60), lease_ms=50)

        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, take()), 5)
        assert info.value.status_code == S.LLM_FAILED and "event loop" in str(info.value)
        assert (lease_of(cache) is None or not lease_of(cache).active) and dd.stats().leases == 0
        assert held(dd) == taken
        lease = lease_cache(kv, cache, keys_for(60), lease_ms=20)  # on its own loop it runs out there
        async with asyncio.timeout(2):
            while held(dd) != before:
                await asyncio.sleep(0.01)
        assert lease.expired


@pytest.mark.asyncio
async def test_a_lease_whose_cache_its_keys_freed_no_longer_counts_as_running():
    """A leased cache whose id reference was dropped and whose keys all went (pulled, or removed by hand) is
    freed: its lease has nothing left to release, is not ``active`` and is not in ``stats().leases`` (it
    was, beside ``caches`` 0 and ``keys`` 0)."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        keys = keys_for(40)
        cache = kv.allocate_cache(ROWS, keys, lease_ms=60_000)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        assert lease.active and dd.stats().leases == 1  # the keys hold the memory still
        for key in keys:
            kv.remove_cache_key(key)
        stats = dd.stats()
        assert (cache.alive, lease.active, stats.caches, stats.keys, stats.leases) == (False, False, 0, 0, 0)
        lease.release()  # nothing to release: a no-op
        assert held(dd) == (0, 0, 0)


@pytest.mark.asyncio
async def test_a_release_the_role_refuses_changes_nothing_and_works_once_the_role_allows_it():
    """A v1 DECODER removes no keys (reference 2.4: ``remove_cache_key`` is PROMPT only), so a lease
    whose endpoint switched to DECODER may not release its keys, by hand or by its timer. Before, the
    refused release had already marked the lease expired: its keys and memory stayed held for good
    (``release`` after switching back was a no-op, ``renew`` refused, ``stats().leases`` said 0)."""
    async with endpoint(LLMRole.PROMPT, PROMPT, enable_switch_role=True) as dd:
        kv = dd.kv_cache_manager
        before = held(dd)
        cache = kv.allocate_cache(ROWS, keys_for(30), lease_ms=60_000)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        kept = lease_cache(kv, kv.allocate_cache(ROWS), [], lease_ms=60_000)  # no keys: only an id reference
        await dd.switch_role(LLMRole.DECODER)
        with pytest.raises(LLMException) as info:
            lease.release()
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'role'" in str(info.value)
        assert lease.active and not lease.expired and dd.stats().leases == 2
        assert lease.deadline is not None  # still runs out on its own: the refused release kept its timer

        lease.renew(20)  # its timer runs out while the endpoint is a DECODER: refused and logged, nothing changes
        await asyncio.sleep(0.15)
        assert lease.active and not lease.expired and lease.deadline is None and dd.stats().leases == 2
        kept.release()  # a lease with no key left drops the id reference only, which any role may
        assert kept.expired and dd.stats().leases == 1

        await dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})  # v1 PROMPT: needs one
        lease.release()
        assert lease.expired and not lease.active and dd.stats().leases == 0
        assert held(dd) == before


@pytest.mark.asyncio
async def test_a_release_its_timer_is_refused_logs_the_message_only(caplog):
    """The warning of a timer's refused release holds the message, not the exception: a record holding it holds
    ``release()``'s frame through its traceback, and the cache in it, for as long as a handler keeps the record."""
    async with endpoint(LLMRole.PROMPT, PROMPT, enable_switch_role=True) as dd:
        kv = dd.kv_cache_manager
        cache = kv.allocate_cache(ROWS, keys_for(70), lease_ms=60_000)
        kv.deallocate_cache(cache)
        lease = lease_of(cache)
        await dd.switch_role(LLMRole.DECODER)
        with caplog.at_level("WARNING", logger="aio_datadist.leases"):
            lease.renew(10)
            async with asyncio.timeout(2):
                while lease.deadline is not None:
                    await asyncio.sleep(0.01)
        records = [r for r in caplog.records if r.name == "aio_datadist.leases"]
        assert len(records) == 1 and "'role'" in records[0].getMessage()
        assert records[0].exc_info is None
        assert not any(isinstance(arg, BaseException) for arg in records[0].args or ())
        await dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
        lease.release()
        assert lease.expired and held(dd) == (0, 0, 0)


@pytest.mark.asyncio
async def test_v1_remove_cache_key_leaves_a_registered_cache_s_key_bound():
    """Reference 4.2: registered (user-owned) caches ignore ``remove_cache_key`` and keep their keys
    (``is_owned``); they go with the cache. Before, the key was unbound, so the next decoder's pull of
    a key the reference keeps offering got ``LLM_KV_CACHE_NOT_EXIST``."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv, reg = dd.kv_cache_manager, dd._endpoint.runtime.registry
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        before = held(dd)
        memory = [torch.zeros(ROWS.shape, dtype=torch.float16) for _ in range(ROWS.num_tensors)]
        key = CacheKey(PROMPT, 40)
        cache = kv.register_cache(ROWS, memory, [CacheKey(PROMPT, 2**64 - 1), key])
        values = fill(cache, 3)
        kv.remove_cache_key(key)  # ignored: a registered cache keeps its keys
        assert reg.by_key(key.lookup_key()) == (cache, 1)
        for _ in range(2):  # and a pull never consumes them
            await dec.kv_cache_manager.pull_cache(key, dst, 0, timeout=5_000)
        assert all(torch.equal(d[0], v[1]) for d, v in zip(dst.tensors, values, strict=True))

        # a lease on it still ends it: the key and the registration go, the memory stays the caller's
        lease = lease_cache(kv, cache, [key], lease_ms=60_000)
        lease.release()
        assert lease.expired and reg.by_key(key.lookup_key()) is None and not cache.alive
        assert held(dd) == before and all(torch.equal(m, v) for m, v in zip(memory, values, strict=True))
        with pytest.raises(LLMException) as info:
            await dec.kv_cache_manager.pull_cache(key, dst, 0, timeout=5_000)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_v2_remove_cache_key_leaves_a_registered_cache_s_key_bound():
    """The same through the v2 ``CacheManager``: its ``remove_cache_key`` leaves a registered cache's key bound
    (an allocated cache's key goes), and the key goes with ``unregister_cache``."""
    async with endpoint(LLMRole.PROMPT, PROMPT, enable_cache_manager=True) as dd:
        cm, reg = dd.cache_manager, dd._endpoint.runtime.registry
        memory = [torch.zeros(ROWS.shape, dtype=torch.float16) for _ in range(ROWS.num_tensors)]
        key, other = CacheKey(PROMPT, 80), CacheKey(PROMPT, 81)
        cache = cm.register_cache(ROWS, memory, [key], remote_accessible=True)  # by_key: what peers may pull
        allocated = cm.allocate_cache(ROWS, [other])
        cm.remove_cache_key(key)  # ignored: a registered cache keeps its keys
        cm.remove_cache_key(other)
        assert reg.by_key(key.lookup_key()) == (cache, 0) and reg.by_key(other.lookup_key()) is None
        cm.unregister_cache(cache.cache_id)
        cm.deallocate_cache(allocated)
        assert reg.by_key(key.lookup_key()) is None and held(dd) == (0, 0, 0)


@pytest.mark.asyncio
async def test_a_lease_on_anything_but_a_kv_cache_manager_is_refused_naming_manager():
    """``lease_cache`` / ``allocate_leased_cache`` take the ``KvCacheManager``; given the v2
    ``CacheManager`` (the one a CacheManager-mode endpoint hands out) or None they raised a bare
    ``AttributeError``. Now ``LLM_PARAM_INVALID`` naming ``manager`` (a ``TypeError`` too), nothing allocated."""
    async with endpoint(LLMRole.PROMPT, PROMPT, enable_cache_manager=True) as dd:
        cm = dd.cache_manager
        cache = cm.allocate_cache(ROWS, [CacheKey(PROMPT, 50)])
        before = held(dd)
        calls = (lambda m: lease_cache(m, cache, [CacheKey(PROMPT, 50)], lease_ms=100),
                 lambda m: allocate_leased_cache(m, ROWS, [CacheKey(PROMPT, 51)], lease_ms=100))
        for call in calls:
            for bad in (cm, None, dd):
                with pytest.raises(LLMException) as info:
                    call(bad)
                assert info.value.status_code == S.LLM_PARAM_INVALID and "'manager'" in str(info.value)
                assert isinstance(info.value, TypeError)
        assert held(dd) == before and lease_of(cache) is None
        cm.deallocate_cache(cache)
        cm.remove_cache_key(CacheKey(PROMPT, 50))


@pytest.mark.asyncio
async def test_a_lease_on_a_cpu_cache_is_refused_naming_cache():
    """A ``create_cpu_cache`` cache is the caller's memory: no lease can end it. Before, ``lease_cache`` took it,
    and its release (by hand; by the timer, a warning) raised ``LLM_PARAM_INVALID`` from ``deallocate_cache``
    after marking the lease expired (row 274; found by audit)."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        memory = [torch.zeros(ROWS.shape, dtype=torch.float16) for _ in range(ROWS.num_tensors)]
        cpu = KvCache.create_cpu_cache(ROWS, [t.data_ptr() for t in memory])
        with pytest.raises(LLMException) as info:
            lease_cache(dd.kv_cache_manager, cpu, [], lease_ms=50)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'cache'" in str(info.value)
        assert lease_of(cpu) is None


@pytest.mark.asyncio
async def test_a_lease_that_ends_a_watched_cache_fails_its_watch():
    """A lease that releases its cache ends every push watch of it with LLM_KV_CACHE_NOT_EXIST, as
    deallocate_cache does (before, the watch waited for pushes that could no longer land)."""
    async with endpoint(LLMRole.MIX, PROMPT) as dd:
        kv = dd.kv_cache_manager
        cache = kv.allocate_cache(ROWS, keys_for(60), lease_ms=60_000)
        watch = kv.watch_pushes(cache, [0, 1], tensors_per_layer=1)
        lease_of(cache).release()
        assert watch.done()
        with pytest.raises(LLMException) as info:
            await watch.layer(1)
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio
async def test_finalize_ends_every_lease_of_its_endpoint():
    """Before, finalize freed a leased cache but left its lease's timer armed on the loop (holding the lease and
    the finalized endpoint for up to 2**31 - 1 ms), ``deadline`` set and ``renew`` accepted (found by audit).
    Now the lease ends with the endpoint, and ``renew`` says why."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd, endpoint(LLMRole.PROMPT, DECODER + 1) as other:
        kv = dd.kv_cache_manager
        cache = kv.allocate_cache(ROWS, keys_for(60), lease_ms=2**31 - 1)
        kv.deallocate_cache(cache)  # its keys keep it; the lease would free it
        lease = lease_of(cache)
        assert lease is not None and lease.active
        timer = lease._timer
        assert timer is not None and not timer.cancelled()
        theirs = lease_of(other.kv_cache_manager.allocate_cache(ROWS, keys_for(60), lease_ms=2**31 - 1))
        await dd.finalize()
        assert lease.expired and not lease.active and lease.deadline is None
        assert timer.cancelled()  # the loop no longer holds the lease (nor, through it, the endpoint)
        assert theirs.active and theirs.deadline is not None  # another endpoint's lease runs on
        theirs.renew(10_000)
        with pytest.raises(LLMException) as info:
            lease.renew(10)
        assert info.value.status_code == S.LLM_ENGINE_FINALIZED
        lease.release()  # a no-op, as for any lease that ended
        lease.cancel()


@pytest.mark.asyncio
async def test_finalize_ends_the_lease_of_a_cache_its_keys_freed_and_its_caller_dropped():
    """The hand-off pattern: allocated with a lease, deallocated, every key pulled (the cache freed), the cache
    object dropped, the lease kept (found by review of row 305: finalize looked leases up by cache object)."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        keys = keys_for(70, 2)
        cache = kv.allocate_cache(ROWS, keys, lease_ms=2**31 - 1)
        lease = lease_of(cache)
        timer = lease._timer
        kv.deallocate_cache(cache)
        for key in keys:
            kv.remove_cache_key(key)  # as the decoder's pulls would
        del cache
        gc.collect()
        await dd.finalize()
        assert lease.expired and lease.deadline is None and timer.cancelled()
        with pytest.raises(LLMException) as info:
            lease.renew(10)
        assert info.value.status_code == S.LLM_ENGINE_FINALIZED


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_lease_released_in_a_forked_child_changes_nothing_of_the_parents():
    """A child forked after ``init`` that released a lease of the parent's ran the parent's release on the copied
    runtime: its keys unbound and the cache freed there, the share's withdrawal written to the socket the child
    shares with the parent's peer (found by review). Now ``LLM_FAILED``, as every call of the parent's endpoint."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        cache = kv.allocate_cache(ROWS, keys_for(80), lease_ms=60_000)
        lease = lease_of(cache)
        before = held(dd)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child never returns
            try:
                os.close(r)
                try:
                    lease.release()
                    said = b"released"
                except LLMException as exc:
                    said = str(int(exc.status_code)).encode() + (b" active" if lease.active else b" ended")
                os.write(w, said)
            finally:
                os._exit(0)
        os.close(w)
        try:
            said = os.read(r, 100)
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        assert said == str(int(S.LLM_FAILED)).encode() + b" active"
        assert held(dd) == before and cache.alive and lease.active
        lease.release()  # the parent's own release works
        assert not cache.alive


@pytest.mark.asyncio
@pytest.mark.parametrize("keys_go_by", ["pulls", "remove_cache_key"])
async def test_a_lease_whose_cache_was_freed_lets_go_of_its_timer_at_once(keys_go_by):
    """The hand-off pattern per request (allocated with a lease, deallocated, every key pulled by a decoder or
    removed) frees the cache: its lease ends then (expired, no deadline, its timer cancelled and gone from the
    loop) and nothing keeps it once the caller drops it. Before, the timer stayed armed for the rest of
    ``lease_ms`` (up to 2**31 - 1 ms), holding the lease, its keys and the endpoint on the loop: about 11
    objects per request piled up (found by the long-run audit: 200 leases and timers alive after 200 hand-offs
    with ``stats()`` at 0 caches, 0 keys, 0 leases)."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as dd, endpoint(LLMRole.DECODER, DECODER) as dec:
        kv = dd.kv_cache_manager
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        leases = []
        owners = dd._endpoint.owners
        held_before = owners._left  # a running lease holds the endpoint for the caller (owners.hold)
        for request in range(20):
            keys = keys_for(100 + 10 * request, 2)
            cache = kv.allocate_cache(ROWS, keys, lease_ms=2**31 - 1)
            fill(cache, request)
            assert owners._left == held_before + 1  # the running lease holds the endpoint
            lease = lease_of(cache)
            timer = lease._timer
            kv.deallocate_cache(cache)
            for row, key in enumerate(keys):
                if keys_go_by == "pulls":
                    await dec.kv_cache_manager.pull_cache(key, dst, row)
                else:
                    kv.remove_cache_key(key)
            for _ in range(200):  # a pull's DONE consumes its key once the owner read it
                if not cache.alive:
                    break
                await asyncio.sleep(0.005)
            assert (cache.alive, lease.active, lease.expired, lease.deadline) == (False, False, True, None)
            assert timer.cancelled()
            assert owners._left == held_before  # the ended lease holds the endpoint no longer
            with pytest.raises(LLMException) as info:
                lease.renew(10)
            assert info.value.status_code == S.LLM_PARAM_INVALID
            leases.append(weakref.ref(lease))
            del cache, lease, timer, info
        stats = dd.stats()
        assert (stats.caches, stats.keys, stats.leases) == (0, 0, 0)
        gc.collect()
        assert [ref() for ref in leases] == [None] * len(leases)  # no timer on the loop holds one


@pytest.mark.asyncio
@pytest.mark.parametrize("ends_by", ["cancel", "release", "expiry"])
async def test_leases_that_end_on_a_long_lived_cache_are_not_kept_by_it(ends_by):
    """Caches that outlive their leases (the framework keeps one and leases it per request; or a key of its own,
    not the lease's, holds it after the lease released it): each lease that ended (cancelled, released or
    expired) lets go of the cache's watch for its release (row 316), so none is kept by a cache. Found by the
    review of row 316: 200 of 200 cancelled leases stayed alive, with 200 watchers on the cache's entry."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        kv = dd.kv_cache_manager
        registry = dd._endpoint.runtime.registry
        kept = kv.allocate_cache(ROWS)
        refs, caches = [], []
        for i in range(50):
            if ends_by == "cancel":  # one cache, a lease per request
                cache = kept
            else:  # a cache per request, which a key of its own keeps after its lease released it
                cache = kv.allocate_cache(ROWS, [CacheKey(PROMPT, 1000 + i)])
            lease = lease_cache(kv, cache, [], lease_ms=1 if ends_by == "expiry" else 60_000)
            if ends_by == "cancel":
                lease.cancel()
            elif ends_by == "release":
                lease.release()
            else:
                for _ in range(100):
                    if lease.expired:
                        break
                    await asyncio.sleep(0.002)
                assert lease.expired
            assert cache.alive
            refs.append(weakref.ref(lease))
            caches.append(cache)
            del lease
        gc.collect()
        if ends_by == "cancel":  # (a cache that lives keeps its last lease for lease_of, and only that one)
            assert sum(ref() is not None for ref in refs) <= 1
        assert sum(len(registry._entries[c.cache_id].on_freed) for c in set(caches)) <= 1


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["release", "cancel"])
async def test_a_lease_released_or_cancelled_from_a_helper_loop_is_refused(what):
    """``docs/async.md``: leases raise ``LLM_FAILED`` on another loop; ``release`` and ``cancel`` too, which
    change the registry and the lease's timer of the endpoint's loop (found by a hunt, 2026-12-07: only
    ``renew`` checked)."""
    async with endpoint(LLMRole.PROMPT, PROMPT) as dd:
        cache = dd.kv_cache_manager.allocate_cache(ROWS, [CacheKey(PROMPT, 7)], lease_ms=60_000)
        lease = lease_of(cache)

        async def elsewhere() -> None:
            getattr(lease, what)()

        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.to_thread(asyncio.run, elsewhere()), 5)
        assert info.value.status_code == S.LLM_FAILED
        assert lease.active


@pytest.mark.asyncio
async def test_a_lease_renewed_after_its_timer_was_refused_keeps_its_endpoint(caplog):
    """A lease whose timer fired while the endpoint was a DECODER (the release refused and logged) lets go of the
    endpoint; renewed once the role allows it, it runs to a deadline again and holds the endpoint again, as every
    running lease does (docs/api.md). Before, the dropped LLMDataDist was collected and finalized under it. Found
    by a hunt."""
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT)
    await dd.init(options(enable_switch_role=True))
    kv = dd.kv_cache_manager
    cache = kv.allocate_cache(ROWS, keys_for(30), lease_ms=60_000)
    kv.deallocate_cache(cache)
    lease = lease_of(cache)
    assert lease is not None
    await dd.switch_role(LLMRole.DECODER)
    with caplog.at_level("WARNING"):
        lease.renew(10)  # runs out while a DECODER: refused, logged, lets go of the endpoint
        async with asyncio.timeout(2):
            while lease.deadline is not None:
                await asyncio.sleep(0.01)
    await dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})
    lease.renew(600)  # the lease runs again, to its new deadline
    assert lease.active and lease.deadline is not None
    del kv, dd
    with caplog.at_level("WARNING", "aio_datadist"):
        gc.collect()
        await asyncio.sleep(0.3)  # well before the deadline
    dropped = [r.getMessage() for r in caplog.records if "collected without finalize" in r.getMessage()]
    try:
        assert not dropped, "endpoint finalized under a running lease"
        assert lease.active and not lease.expired
    finally:
        if lease.active:
            lease.release()  # the endpoint goes with it (dropped, and nothing holds it any more)
        await asyncio.sleep(0.5)
