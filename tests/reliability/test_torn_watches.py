"""A push that fails part-way fails the push watches of the rows it was filling.

``KvCacheManager.watch_pushes`` hands a decoder futures that complete when
peer pushes into its rows complete. A push that the decoder accepted (so
some of its bytes may have landed) and that then failed - the pusher gave
it up (cancel, timeout), the link went, the job failed - fails every
still-pending layer of every open watch whose rows and layers it touched,
and the watch's all-future, at once: the decoder's ``await watch.layer(i)``
raises instead of waiting forever. Layers already landed stay done; a watch
of other rows stays pending. Every serving path that records arrivals: the
stream plane (TCP, TLS), in-place planes (NIXL, via ``InPlacePlane.serve``)
and the same-host copy (``serve_copy``).

TCP and TLS pushes go through a :class:`~_slowpath.SlowPath` (50 ms,
32 MB/s), so a layer's bytes are on their way when the push is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    KvCache,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    PushWatch,
    TransferWithCacheKeyConfig,
)
from aio_datadist.testing import link_to
from peers import NIXL_MISSING, cluster_info, port_of
from tls_certs import client_context, make_pki, server_context

from _harness import endpoint
from _slowpath import SlowPath

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
PROMPT, DECODER = 71, 72
BLOCKS = 32
#: 4 tensors (2 layers) of 32 blocks of 64 KiB: a layer of 24 blocks is 3 MiB, about 0.1 s through the slow path.
SLOW = CacheDesc(4, (BLOCKS, 32 * 1024), DataType.DT_FLOAT16, Placement.HOST)
RATE = 32e6
LATENCY_S = 0.05
PUSHED = list(range(24))  # the rows pushed and watched
OTHER = list(range(24, BLOCKS))  # rows watched and never pushed
PROMPTLY_S = 1.0  # a torn watch fails this soon after the push was cut (the bound awaited is 2 s)
PKI = make_pki("torn watches")


@contextlib.asynccontextmanager
async def pair(desc: CacheDesc, *, slow: bool = False, tls: bool = False, **config: Any
               ) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist, KvCache, KvCache, tuple[str, int]]]:
    """A linked PROMPT (listening) and DECODER, a blocks cache of ``desc`` each (the decoder's keyed
    ``(DECODER, 0)``); with ``slow`` the decoder dials through a :class:`SlowPath`, whose address is yielded."""
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(
            LLMRole.PROMPT, PROMPT, listen=True, **config, **({"tls_server_context": server_context(PKI)} if tls
                                                              else {})))
        dec = await stack.enter_async_context(endpoint(
            LLMRole.DECODER, DECODER, **config, **({"tls_client_context": client_context(PKI)} if tls else {})))
        address = port_of(prompt)
        if slow:
            address = (await stack.enter_async_context(SlowPath(address, RATE, LATENCY_S))).address
        src = prompt.kv_cache_manager.allocate_blocks_cache(desc)
        dst = dec.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(DECODER, 0))
        for t in src.tensors:
            t.fill_(5)
        assert (await dec.link_clusters([cluster_info(PROMPT, address)], timeout=10_000))[0] == S.LLM_SUCCESS
        yield prompt, dec, src, dst, address


class Gate(LayerSynchronizer):
    """Layer 0 at once, layer 1 once ``opened`` is set."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index:
            await self.opened.wait()
        return True


async def landing(dst: KvCache, tensor: int, rows: list[int]) -> None:
    """Until some bytes of ``rows`` of ``tensor`` landed (2 s at most); not all of them yet."""
    async with asyncio.timeout(2):
        while not bool((dst.tensors[tensor][rows] == 5).any()):
            await asyncio.sleep(0.002)
    assert not bool((dst.tensors[tensor][rows] == 5).all()), "the layer landed whole before the cut"


async def torn(watch: PushWatch, layer: int | None) -> LLMException:
    """The failure ``await watch.layer(layer)`` (``await watch`` for None) raises, soon."""
    started = time.monotonic()
    with pytest.raises(LLMException) as err:
        async with asyncio.timeout(2):
            await (watch if layer is None else watch.layer(layer))
    assert time.monotonic() - started < PROMPTLY_S, f"the watch failed {time.monotonic() - started:.2f} s late"
    return err.value


def landed_ok(watch: PushWatch, layer: int) -> None:
    waiter = watch.layer(layer)
    assert waiter.done() and waiter.exception() is None, f"layer {layer} did not stay landed"


async def untouched(watch: PushWatch, layers: range) -> None:
    await asyncio.sleep(0.05)
    assert not watch.done() and not any(watch.layer(i).done() for i in layers), "a watch of other rows was touched"


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("cut", ["cancel", "unlink"])
async def test_a_layerwise_push_cut_mid_layer_fails_the_watch_of_its_rows(cut):
    """Layer 0 lands, then layer 1's push is cut while its bytes come in (the task cancelled, or the
    prompt force-unlinks): the decoder's ``await watch.layer(1)`` raises at once (``LLM_LINK_FAILED``
    when the link went), ``await watch`` too; layer 0 stays done; a watch of rows not pushed stays pending."""
    async with pair(SLOW, slow=True, transport="tcp") as (prompt, dec, src, dst, address):
        with dec.kv_cache_manager.watch_pushes(dst, PUSHED) as watch, \
                dec.kv_cache_manager.watch_pushes(dst, OTHER) as other:
            gate = Gate()
            task = prompt.kv_cache_manager.transfer_cache_async(
                src, gate, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER, 0))], PUSHED, PUSHED)
            async with asyncio.timeout(2):
                await watch.layer(0)
            gate.opened.set()
            await landing(dst, 2, PUSHED)
            if cut == "cancel":
                task.cancel()
            else:
                assert await prompt.unlink_clusters([cluster_info(DECODER, address)], force=True) == (
                    S.LLM_SUCCESS, [S.LLM_SUCCESS])
            exc = await torn(watch, 1)
            assert exc.status_code == (S.LLM_LINK_FAILED if cut == "unlink" else S.LLM_FAILED), exc
            assert f"cluster {PROMPT}" in str(exc) and "layers [1]" in str(exc) and "rows 0-23" in str(exc), exc
            assert (await torn(watch, None)).status_code == exc.status_code
            landed_ok(watch, 0)
            await untouched(other, range(2))
            with contextlib.suppress(asyncio.CancelledError, LLMException):
                async with asyncio.timeout(2):
                    await task


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("cut", ["cancel", "timeout="])
async def test_a_tls_push_cut_mid_way_fails_the_watch_of_its_rows(cut):
    """``push_blocks`` over TLS cancelled, or given up by its own timeout, while its bytes come in: the watch of
    the rows it pushes fails at once, every layer of it (one request carried them all); a watch of other rows
    stays pending."""
    async with pair(SLOW, slow=True, tls=True, transport="tcp") as (prompt, dec, src, dst, _):
        with dec.kv_cache_manager.watch_pushes(dst, PUSHED) as watch, \
                dec.kv_cache_manager.watch_pushes(dst, OTHER) as other:
            if cut == "cancel":
                pushing = asyncio.ensure_future(prompt.kv_cache_manager.push_blocks(
                    BlocksCacheKey(DECODER, 0), src, PUSHED, PUSHED, timeout=20_000))
                await landing(dst, 0, PUSHED)
                pushing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pushing
            else:
                with pytest.raises(LLMException) as err:
                    await prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, PUSHED, PUSHED,
                                                              timeout=120)  # past the latency, mid-way
                assert err.value.status_code == S.LLM_TIMEOUT, err.value
                assert bool((dst.tensors[0][PUSHED] == 5).any()), "the cut came before any byte landed"
            exc = await torn(watch, None)
            assert exc.status_code == S.LLM_FAILED and f"cluster {PROMPT}" in str(exc), exc
            for layer in range(2):
                assert (await torn(watch, layer)).status_code == S.LLM_FAILED
            await untouched(other, range(2))


# -- NIXL (an in-place plane: InPlacePlane.serve) -------------------------------------------------------


async def nixl_prepared(owner: LLMDataDist, peer_id: int, cache: KvCache) -> None:
    async with asyncio.timeout(5):
        while cache.cache_id not in link_to(owner, peer_id).nixl.prepared:
            await asyncio.sleep(0.005)


@pytest.mark.nixl
@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)
async def test_a_nixl_push_given_up_fails_the_watch_of_its_rows():
    """A NIXL WRITE that never completes (its posting is replaced by one that hangs) is given up by the push's
    timeout after the decoder answered it: the decoder hears the failed ``DONE`` and the watch's layer fails;
    the layer pushed before stays done."""
    small = CacheDesc(4, (BLOCKS, 256), DataType.DT_FLOAT16, Placement.HOST)
    async with pair(small, transport="nixl") as (prompt, dec, src, dst, _):
        await nixl_prepared(prompt, DECODER, src)
        await nixl_prepared(dec, PROMPT, dst)
        with dec.kv_cache_manager.watch_pushes(dst, PUSHED) as watch:
            layer = {0: KvCacheExtParam((0, 0), (0, 0)), 1: KvCacheExtParam((1, 1), (1, 1))}
            await prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, PUSHED, PUSHED, layer[0],
                                                      timeout=2000)
            landed_ok(watch, 0)
            peer = link_to(prompt, DECODER).nixl

            def hanging(*args: Any) -> tuple[asyncio.Future, asyncio.Future, Any]:
                moved = asyncio.get_running_loop().create_future()
                return moved, moved, str  # settled once cancelled, as a cancelled WRITE

            peer.transfer = hanging
            with pytest.raises(LLMException) as err:
                await prompt.kv_cache_manager.push_blocks(BlocksCacheKey(DECODER, 0), src, PUSHED, PUSHED,
                                                          layer[1], timeout=200)
            assert err.value.status_code == S.LLM_TIMEOUT, err.value
            exc = await torn(watch, 1)
            assert exc.status_code == S.LLM_FAILED and f"cluster {PROMPT}" in str(exc), exc
            landed_ok(watch, 0)


# -- same host (serve_copy) -------------------------------------------------------------------------------


#: 2 tensors (1 layer) of 64 blocks of 1 MiB: 128 MiB, tens of ms to copy.
BIG = CacheDesc(2, (64, 1 << 20), DataType.DT_UINT8, Placement.HOST)


async def test_a_same_host_push_cut_while_copied_fails_the_watch_of_its_rows():
    """A same-host push (the decoder copies the rows out of the prompt's shared region) cancelled while the
    decoder copies: the watch of its rows fails at once; a watch of rows it does not push stays pending."""
    async with pair(BIG, transport="local") as (prompt, dec, src, dst, _):
        link = link_to(dec, PROMPT)
        assert link.local is not None and link_to(prompt, DECODER).local is not None
        rows, others = list(range(48)), list(range(48, 64))
        outcomes = []
        with dec.kv_cache_manager.watch_pushes(dst, others, tensors_per_layer=2) as other:
            for _ in range(4):
                with dec.kv_cache_manager.watch_pushes(dst, rows, tensors_per_layer=2) as watch:
                    serving = set(link.serving)
                    pushing = asyncio.ensure_future(prompt.kv_cache_manager.push_blocks(
                        BlocksCacheKey(DECODER, 0), src, rows, rows, timeout=20_000))
                    async with asyncio.timeout(2):  # the decoder is copying
                        while set(link.serving) <= serving and not pushing.done():
                            await asyncio.sleep(0)
                    pushing.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pushing
                    started = time.monotonic()
                    try:
                        async with asyncio.timeout(2):
                            await watch
                        outcomes.append("landed")  # the copy was over before the cancel reached it
                    except LLMException as exc:
                        assert time.monotonic() - started < PROMPTLY_S
                        assert exc.status_code == S.LLM_FAILED and f"cluster {PROMPT}" in str(exc), exc
                        outcomes.append("torn")
                        break
            assert "torn" in outcomes, outcomes
            await untouched(other, range(1))


# -- the watch's own bookkeeping --------------------------------------------------------------------------


async def test_a_torn_layer_stays_failed_and_the_watch_goes_once_every_layer_is_settled():
    """``Arrivals.torn`` fails only pending layers of watched rows among the push's tensors; a later push of
    a failed layer neither completes nor breaks it; the watch leaves ``Arrivals`` once every layer settled."""
    from aio_datadist.arrivals import Arrivals

    class Cache:  # what a watch uses of a KvCache: its identity
        pass

    cache, arrivals = Cache(), Arrivals()
    watch = arrivals.add(PushWatch(arrivals, cache, [1, 2], range(0, 3), 2))  # type: ignore[arg-type]
    exc = LLMException("a push from cluster 9 failed: gone", status_code=S.LLM_LINK_FAILED)
    arrivals.record(cache, range(0, 2), [1, 2])  # layer 0 landed
    arrivals.torn(cache, range(0, 4), [3], exc)  # rows not watched
    arrivals.torn(Cache(), range(0, 6), [1, 2], exc)  # another cache
    assert not watch.layer(1).done() and not watch.done()
    arrivals.torn(cache, range(0, 4), [2, 5], exc)  # layers 0 (landed) and 1
    assert watch.layer(0).exception() is None
    failed = watch.layer(1).exception()
    assert isinstance(failed, LLMException) and failed.status_code == S.LLM_LINK_FAILED
    assert "layers [1] of rows 2" in str(failed) and "cluster 9" in str(failed), failed
    assert watch.done() and not watch.layer(2).done()
    arrivals.record(cache, range(2, 4), [1, 2])  # a retried push of the failed layer: it stays failed
    assert watch.layer(1).exception() is not None and arrivals.watched(cache)
    arrivals.record(cache, range(4, 6), [1, 2])  # the last layer lands: every layer settled
    assert watch.layer(2).exception() is None and not arrivals.watched(cache)
    with pytest.raises(LLMException) as err:
        await watch
    assert err.value.status_code == S.LLM_LINK_FAILED
