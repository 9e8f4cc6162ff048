"""``init`` after ``finalize`` on the same LLMDataDist: a new life, as LLM-DataDist's finalize resets its object.

A serving process that frees and re-allocates its KV caches (vLLM's sleep and
wake-up, an elastic restart of the engine) finalizes its ``LLMDataDist`` and
calls ``init`` on the same object again (Omni-Infer's newer manager does:
``_finalize_llm_data_dist`` then ``_reinit_llm_data_dist``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import pytest
import torch
from peers import BLOCKS_DESC, DECODER_ID, PROMPT_ID, cluster_info, fill, free_port, options, port_of
from test_share_listener_emfile import no_free_fds

from aio_datadist import BlocksCacheKey, KvCache, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode, compat
from aio_datadist.compat import LLMDataDist as BlockingLLMDataDist
from aio_datadist.testing import link_count

S = LLMStatusCode


def _v2(**config: object) -> dict[str, str]:
    opts = options(**config)  # type: ignore[arg-type]
    opts["llm.EnableCacheManager"] = "1"
    return opts


async def _life(prompt: LLMDataDist, decoder: LLMDataDist, seed: int) -> tuple[KvCache, KvCache]:
    """One life of the pair: blocks caches registered by address (ids from 1), a link, a verified pull."""
    src = [torch.zeros(BLOCKS_DESC.shape, dtype=torch.float16) for _ in range(BLOCKS_DESC.num_tensors)]
    dst = [torch.zeros(BLOCKS_DESC.shape, dtype=torch.float16) for _ in range(BLOCKS_DESC.num_tensors)]
    src_cache = prompt.cache_manager.register_blocks_cache(BLOCKS_DESC, [t.data_ptr() for t in src],
                                                           BlocksCacheKey(PROMPT_ID, 0), remote_accessible=True)
    dst_cache = decoder.cache_manager.register_blocks_cache(BLOCKS_DESC, [t.data_ptr() for t in dst])
    assert (src_cache.cache_id, dst_cache.cache_id) == (1, 1)  # as LLM-DataDist's new engine counts
    values = fill(src_cache, seed)
    status, _ = await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))], 3000)
    assert status == S.LLM_SUCCESS
    await decoder.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst_cache, [0, 3], [5, 1])
    assert all(torch.equal(d[5], v[0]) and torch.equal(d[1], v[3]) for d, v in zip(dst, values, strict=True))
    return src_cache, dst_cache


@pytest.mark.asyncio
async def test_a_finalized_endpoint_is_initialised_again_with_nothing_of_its_last_life():
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, PROMPT_ID), LLMDataDist(LLMRole.DECODER, DECODER_ID)
    try:
        await prompt.init(_v2(listen=True))
        await decoder.init(_v2())
        address = port_of(prompt)
        kept = decoder.cache_manager  # a manager taken in the first life carries on with the second
        _, old_dst = await _life(prompt, decoder, 1)
        await decoder.finalize()
        await prompt.finalize()
        with pytest.raises(LLMException) as exc:
            decoder.stats()
        assert exc.value.status_code == S.LLM_ENGINE_FINALIZED

        prompt_options = _v2()
        prompt_options["llm.listenIpInfo"] = f"{address[0]}:{address[1]}"  # the same address again
        await prompt.init(prompt_options)
        await decoder.init(_v2())
        assert port_of(prompt) == address and link_count(decoder) == 0  # no link of the last life is back
        assert decoder.stats().caches == 0
        _, new_dst = await _life(prompt, decoder, 2)
        assert kept is decoder.cache_manager
        with pytest.raises(LLMException) as exc:  # the last life's cache object, though its id is 1 again
            await kept.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), old_dst, [0], [0])
        assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        await decoder.init(_v2())  # a second init of this life is a no-op
        assert decoder.stats().caches == 1 and link_count(decoder) == 1
    finally:
        await decoder.finalize()
        await prompt.finalize()


@pytest.mark.asyncio
async def test_a_new_life_chooses_its_mode_anew_and_bad_options_leave_it_finalized():
    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    try:
        await dd.init(options())  # KvCacheManager mode
        dd.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        await dd.finalize()
        with pytest.raises(LLMException) as exc:
            await dd.init({**_v2(), "llm.SyncKvCacheWaitTime": "soon"})
        assert exc.value.status_code == S.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc:
            dd.stats()
        assert exc.value.status_code == S.LLM_ENGINE_FINALIZED  # refused options changed nothing
        await dd.init(_v2())  # CacheManager mode this time
        tensors = [torch.zeros(BLOCKS_DESC.shape, dtype=torch.float16) for _ in range(BLOCKS_DESC.num_tensors)]
        assert dd.cache_manager.register_blocks_cache(BLOCKS_DESC, [t.data_ptr() for t in tensors]).cache_id == 1
        with pytest.raises(LLMException) as exc:
            dd.kv_cache_manager  # noqa: B018
        assert exc.value.status_code == S.LLM_PARAM_INVALID
    finally:
        await dd.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("why", ["address in use", "tls context", "no fd"])
async def test_a_new_life_that_cannot_start_leaves_the_endpoint_finalized(why):
    """Options that parse but a life that cannot start (its listen address is taken; a TLS client context on an
    endpoint that listens without a server one; no fd for its engines, the process at its ``RLIMIT_NOFILE``):
    the endpoint is finalized as before (``LLM_ENGINE_FINALIZED``, its KvCacheManager mode kept), nothing listens,
    and the next init starts a life. Before, the endpoint was left "not initialized" (``LLM_FAILED``) with no mode
    (found by the options audit, 2026-12-06)."""
    dd = LLMDataDist(LLMRole.DECODER, DECODER_ID)
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        await dd.init(options())  # KvCacheManager mode
        kv = dd.kv_cache_manager
        await dd.finalize()
        if why == "address in use":
            refused = {**options(), "llm.listenIpInfo": f"127.0.0.1:{taken.getsockname()[1]}"}
        elif why == "tls context":
            config = LLMConfig()
            config.device_id, config.listen_ip_info = 0, f"127.0.0.1:{free_port('127.0.0.1')}"
            config.tls_client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            refused = config.generate_options()
        else:
            refused = options()
        with pytest.raises(LLMException) as exc, no_free_fds() if why == "no fd" else contextlib.nullcontext():
            await dd.init(refused)
        assert exc.value.status_code == {"address in use": S.LLM_LINK_FAILED, "tls context": S.LLM_PARAM_INVALID,
                                         "no fd": S.LLM_FAILED}[why], exc.value
        if why == "tls context":  # nothing listens on its address: we can take it (a listener left open holds it)
            socket.create_server(("127.0.0.1", int(config.listen_ip_info.rsplit(":", 1)[1]))).close()
        for call in (dd.stats, lambda: dd.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)):
            with pytest.raises(LLMException) as exc:
                call()
            assert exc.value.status_code == S.LLM_ENGINE_FINALIZED, exc.value
        assert dd.listen_address is None and not kv.is_initialized()
        await dd.init(options(listen=True))
        assert dd.listen_address is not None and dd.stats().caches == 0
    finally:
        taken.close()
        await dd.finalize()


def _finalize_cut_on_a_loop_closed_after(dd: LLMDataDist) -> None:
    """``dd`` initialised on a loop whose tasks are then all cancelled, its finalize among them, and which is
    closed without its shutdown step: the release is left for a later finalize or init on another loop."""
    old = asyncio.new_event_loop()
    old.run_until_complete(dd.init(options(listen=True)))

    async def start_finalize() -> None:
        asyncio.get_running_loop().create_task(dd.finalize())

    old.run_until_complete(start_finalize())
    running = asyncio.all_tasks(old)
    for task in running:
        task.cancel()
    old.run_until_complete(asyncio.gather(*running, return_exceptions=True))
    old.close()


@pytest.mark.parametrize("failed_first", [False, True])
def test_an_init_that_cannot_start_after_a_cut_finalize_leaves_the_endpoint_initialisable(failed_first):
    """An init on another loop finishes a release its loop's end cut short; one whose life then cannot start puts
    back the finalized state of after that release, not the cut one: the next init starts a life. The first form
    of the restore put back the closed loop's pending release, and every later init was refused ``LLM_FAILED``
    ("still releasing") for good (found by its review)."""
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
    _finalize_cut_on_a_loop_closed_after(dd)
    taken = socket.create_server(("127.0.0.1", 0))

    async def again() -> None:
        try:
            if failed_first:
                with pytest.raises(LLMException) as exc:
                    await dd.init({**options(), "llm.listenIpInfo": f"127.0.0.1:{taken.getsockname()[1]}"})
                assert exc.value.status_code == S.LLM_LINK_FAILED, exc.value
            await dd.init(options(listen=True))
            assert dd.listen_address is not None and dd.stats().caches == 0
        finally:
            await dd.finalize()

    try:
        asyncio.run(again())
    finally:
        taken.close()


def test_a_life_on_one_event_loop_and_the_next_on_another():
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)

    async def life() -> int:
        await dd.init(options(listen=True))
        dd.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        caches = dd.stats().caches
        await dd.finalize()
        return caches

    assert asyncio.run(life()) == 1
    assert asyncio.run(life()) == 1


@pytest.fixture
def private_loop():
    yield
    compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def test_the_blocking_facade_initialises_a_finalized_endpoint_again(private_loop):
    prompt, decoder = BlockingLLMDataDist(LLMRole.PROMPT, PROMPT_ID), BlockingLLMDataDist(LLMRole.DECODER, DECODER_ID)
    try:
        for life in range(2):
            prompt.init(options(listen=True))
            decoder.init(options())
            src = prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID, 0))
            dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS_DESC)
            assert (src.cache_id, dst.cache_id) == (1, 1)
            values = fill(src, 10 + life)
            ret, _ = decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))], 3000)
            assert ret == S.LLM_SUCCESS
            decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [2], [4])
            assert all(torch.equal(d[4], v[2]) for d, v in zip(dst.tensors, values, strict=True))
            decoder.finalize()
            prompt.finalize()
    finally:
        decoder.finalize()
        prompt.finalize()


def test_a_finalize_on_one_loop_leaves_the_next_life_on_another_its_shutdown_guard(monkeypatch):
    """A finalize on loop A ends its life's loop-shutdown guard before it says the life is released: an init on
    loop B that saw it released keeps its own guard, and loop B's shutdown finalizes the new life (found by a
    review: A's finalize, preempted between the two, ended B's guard, and the endpoint listened on after B's
    ``asyncio.run`` returned)."""
    import socket
    import threading
    import time

    import aio_datadist.datadist as datadist_mod

    real = datadist_mod.end_shutdown_guard
    finalizing: list[threading.Thread] = []

    def preempted(endpoint: object) -> None:  # thread A held up around its guard's end
        if threading.current_thread() in finalizing:
            time.sleep(0.5)
        real(endpoint)  # type: ignore[arg-type]

    monkeypatch.setattr(datadist_mod, "end_shutdown_guard", preempted)
    dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)

    async def first_life() -> None:
        await dd.init(options(listen=True))
        await dd.finalize()

    a = threading.Thread(target=asyncio.run, args=(first_life(),))
    finalizing.append(a)
    a.start()
    released = None
    for _ in range(10_000):  # until life 1 is released (10 s at most)
        released = dd._endpoint.released
        if released is not None and released.done():
            break
        time.sleep(0.001)

    async def second_life() -> tuple[tuple[str, int], bool]:
        await dd.init(options(listen=True))
        await asyncio.sleep(1.0)  # thread A's finalize ends meanwhile
        return port_of(dd), dd._endpoint.shutdown_guard is not None

    address, guarded = asyncio.run(second_life())  # no finalize: loop B's shutdown does it
    a.join(10)
    try:
        assert guarded and dd._endpoint.finalized
        with pytest.raises(OSError), socket.create_connection(address, timeout=1):
            pass
    finally:
        if dd._endpoint.runtime is not None:
            asyncio.run(dd.finalize())


def test_two_threads_that_init_one_endpoint_at_once_start_one_life():
    """``init`` called at once from two threads, each on its loop: one starts the life, the other is a second
    ``init`` (a no-op). Before, both passed the "already initialised?" check before either assigned its life, so
    both started engines and a listener, and the endpoint kept the last: the other life's listener, engine threads
    and fds stayed open for good (finalize knew nothing of them)."""
    import os
    import threading

    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()
    try:
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            dd = LLMDataDist(LLMRole.PROMPT, PROMPT_ID)
            opts = options(listen=True)
            done = [asyncio.run_coroutine_threadsafe(dd.init(opts), loop) for loop in loops]
            for future in done:
                future.result(10)
            home = dd._endpoint.runtime.loop
            asyncio.run_coroutine_threadsafe(dd.finalize(), home).result(10)
            assert len(os.listdir("/proc/self/fd")) == fds, "an init's life was left open"
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(loop.stop)
        for thread in threads:
            thread.join(5)
        for loop in loops:
            loop.close()
