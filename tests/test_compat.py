"""The blocking facade runs llm_datadist-style programs unchanged but for the import."""

from __future__ import annotations

import asyncio
import importlib
import os
import pathlib
import sys

import pytest

from aio_datadist import LLMStatusCode, compat
from aio_datadist.compat import LLMConfig, LLMDataDist, LLMRole

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def port_example():
    sys.path.insert(0, str(EXAMPLES))  # spawned children inherit sys.path and import it by name
    try:
        yield importlib.import_module("llm_datadist_port")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def private_loop():
    yield
    compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def test_reference_flows_run_through_the_facade(port_example):
    outcome = port_example.main(limit_s=120)
    assert outcome["exitcodes"] == [0, 0]
    assert outcome["pull_cache"], "pull_cache rows differ from the prompt's cache"
    assert outcome["repeat_pull"] == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "a pulled key must be consumed"
    assert outcome["pull_blocks"] and outcome["swap_blocks"]
    assert outcome["unlink"] == LLMStatusCode.LLM_SUCCESS


def test_blocking_calls_and_return_shapes(private_loop):
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    try:
        status, per_cluster = dd.unlink_clusters([], 1000)
        assert status == LLMStatusCode.LLM_SUCCESS and per_cluster == []
        assert dd.kv_cache_manager.is_initialized()
    finally:
        dd.finalize()
    assert not dd.kv_cache_manager.is_initialized()


def test_a_finalize_refused_before_it_ran_leaves_the_endpoint_to_the_exit_finalize(private_loop):
    """Before, ``finalize`` dropped the endpoint from the ones finalized at exit before its call ran: one refused
    (from inside a running event loop) left a live endpoint nothing would unlink at exit (row 286; found by
    audit)."""
    dd = _init(LLMRole.PROMPT, 41, listen=True)
    try:
        async def misuse() -> None:
            dd.finalize()

        with pytest.raises(RuntimeError, match="async API"):
            asyncio.run(misuse())
        assert dd.listen_address is not None and dd in compat._LIVE
    finally:
        dd.finalize()
    assert dd not in compat._LIVE


def test_an_init_of_another_thread_that_ends_right_after_a_finalize_is_kept_for_the_exit(private_loop, monkeypatch):
    """Thread A finalizes an endpoint, thread B initialises it again and B's init ends on the loop just after A's
    finalize did, before A's call returned (forced here: B's init runs in that gap). The endpoint is live, so the
    exit must finalize it. Before, A's call dropped it from the exit's endpoints once it returned, after B's init
    had added it (found by a hunt's reading: row 286's situation by another way)."""
    dd = _init(LLMRole.PROMPT, 42, listen=True)
    run = compat._RUNNER.run
    again: list[bool] = []

    def run_then_init(coro, *args, **kwargs):
        out = run(coro, *args, **kwargs)
        if not again:  # the finalize's call ended on the loop: B's init runs in the gap before A returns
            again.append(True)
            monkeypatch.setattr(compat._RUNNER, "run", run)
            cfg = LLMConfig()
            cfg.device_id = 0
            cfg.listen_ip_info = "127.0.0.1:0"
            dd.init(cfg.generate_options())
        return out

    monkeypatch.setattr(compat._RUNNER, "run", run_then_init)
    try:
        dd.finalize()  # thread A
        assert again and dd.listen_address is not None  # initialised by B
        assert dd in compat._LIVE, "a live endpoint the exit will not finalize"
    finally:
        dd.finalize()
    assert dd not in compat._LIVE


@pytest.mark.asyncio
async def test_refuses_to_block_inside_an_event_loop():
    dd = LLMDataDist(LLMRole.PROMPT, 8)
    cfg = LLMConfig()
    cfg.device_id = 0
    with pytest.raises(RuntimeError, match="async API"):
        dd.init(cfg.generate_options())


# ---- llm_datadist's spellings and return conventions (issue 16, "what the clients still pass") ----


def _init(role: LLMRole, cluster_id: int, *, listen: bool = False, v2: bool = False) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    cfg = LLMConfig()
    cfg.device_id = 0
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    if v2:
        cfg.enable_cache_manager = True
        cfg.enable_remote_cache_accessible = True
    dd.init(cfg.generate_options())
    return dd


def _info(cluster_id: int | None, address: tuple[str, int]) -> compat.LLMClusterInfo:
    info = compat.LLMClusterInfo()
    if cluster_id is not None:
        info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


def test_kv_cache_manager_keyword_spellings_of_llm_datadist(private_loop):
    """Reference §2.4 (KvCacheManager, v1): ``pull_cache(..., src_cache_offset=, dst_cache_offset=)``
    (bytes into the source / destination row, §4.3), ``pull_blocks(prompt_cache_key=, decoder_kv_cache=,
    prompt_blocks=, decoder_blocks=)``, ``copy_cache(..., req_id=)``; §2.6: ``register_*(..., remote_accessible=)``."""
    import torch

    from aio_datadist.compat import BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMException

    prompt, decoder = _init(LLMRole.PROMPT, 1, listen=True), _init(LLMRole.DECODER, 2)
    try:
        pm, dm = prompt.kv_cache_manager, decoder.kv_cache_manager
        rows_desc = CacheDesc(2, [2, 16], DataType.DT_UINT8)
        blocks_desc = CacheDesc(2, [4, 8], DataType.DT_UINT8)
        p_rows, p_blocks = pm.allocate_cache(rows_desc), pm.allocate_blocks_cache(blocks_desc, BlocksCacheKey(1))
        for cache in (p_rows, p_blocks):
            for i, t in enumerate(cache.tensors):
                t.copy_(torch.arange(t.numel(), dtype=torch.uint8).view(t.shape) + 64 * i)
        hidden_memory = torch.full((2, 16), 7, dtype=torch.uint8)
        hidden = pm.register_cache(CacheDesc(1, [2, 16], DataType.DT_UINT8), [hidden_memory.data_ptr()],
                                   remote_accessible=False)
        assert decoder.link_clusters([_info(1, prompt.listen_address)]) == (LLMStatusCode.LLM_SUCCESS,
                                                                             [LLMStatusCode.LLM_SUCCESS])
        d_rows, d_blocks = dm.allocate_cache(rows_desc), dm.allocate_blocks_cache(blocks_desc)

        # 5 bytes from byte 3 of remote row 1 into byte 10 of local row 0; the rest stays zero
        dm.pull_cache(CacheKeyByIdAndIndex(1, p_rows.cache_id, 1), d_rows, 0, 5, src_cache_offset=3,
                      dst_cache_offset=10)
        for d, p in zip(d_rows.tensors, p_rows.tensors, strict=True):
            assert torch.equal(d[0, 10:15], p[1, 3:8]) and not d[0, :10].any() and not d[0, 15:].any()
            assert not d[1].any()
        # size -1 with an offset: the rest of the local row
        dm.pull_cache(CacheKeyByIdAndIndex(1, p_rows.cache_id, 0), d_rows, 1, dst_cache_offset=4)
        assert all(torch.equal(d[1, 4:], p[0, :12]) for d, p in zip(d_rows.tensors, p_rows.tensors, strict=True))
        for bad, kind in ((-1, ValueError), ("3", TypeError)):
            with pytest.raises(kind):
                dm.pull_cache(CacheKeyByIdAndIndex(1, p_rows.cache_id, 0), d_rows, 0, src_cache_offset=bad)

        dm.pull_blocks(prompt_cache_key=BlocksCacheKey(1), decoder_kv_cache=d_blocks, prompt_blocks=[0, 3],
                       decoder_blocks=[2, 1])
        assert all(torch.equal(d[2], p[0]) and torch.equal(d[1], p[3])
                   for d, p in zip(d_blocks.tensors, p_blocks.tensors, strict=True))
        with pytest.raises(TypeError):
            dm.pull_blocks(BlocksCacheKey(1), d_blocks, [0], [0], prompt_blocks=[1])
        # swap_blocks(src, dst, src_to_dst): v1's names (v2's CacheManager says src_cache, dst_cache)
        host_memory = [torch.zeros((4, 8), dtype=torch.uint8) for _ in range(2)]
        cpu = compat.KvCache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_UINT8, compat.Placement.HOST),
                                              [t.data_ptr() for t in host_memory])
        dm.swap_blocks(src=d_blocks, dst=cpu, src_to_dst={2: 0})
        assert all(torch.equal(h[0], d[2]) for h, d in zip(host_memory, d_blocks.tensors, strict=True))

        copy_dst = dm.allocate_cache(rows_desc)
        dm.copy_cache(copy_dst, d_rows, 0, 1, req_id=9)
        assert all(torch.equal(c[0], d[1]) for c, d in zip(copy_dst.tensors, d_rows.tensors, strict=True))
        with pytest.raises(ValueError):
            dm.copy_cache(copy_dst, d_rows, req_id=-1)

        # registered with remote_accessible=False: peers cannot reach it
        with pytest.raises(LLMException) as exc:
            dm.pull_cache(CacheKeyByIdAndIndex(1, hidden.cache_id, 0), dm.allocate_cache(
                CacheDesc(1, [2, 16], DataType.DT_UINT8)), 0)
        assert exc.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        with pytest.raises(TypeError):
            pm.register_blocks_cache(blocks_desc, [hidden_memory.data_ptr(), hidden_memory.data_ptr() + 8],
                                     remote_accessible="no")

        # push_cache / push_blocks(dst_cache_key, ...): errors name dst_cache_key, the async v1 calls'
        # dst_cache_index_or_key never (a check here, and the owner's refusal of a row past its cache)
        before = [t.clone() for t in d_rows.tensors]
        for call in (lambda: pm.push_cache(dst_cache_key="row 5", src_cache=p_rows),
                     lambda: pm.push_blocks(dst_cache_key="blocks", src_cache=p_blocks, src_blocks=[0],
                                            dst_blocks=[0]),
                     lambda: pm.push_cache(dst_cache_key=CacheKeyByIdAndIndex(2, d_rows.cache_id, 5),
                                           src_cache=p_rows)):
            with pytest.raises(LLMException) as exc:
                call()
            assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert "invalid argument 'dst_cache_key" in str(exc.value), str(exc.value)
            assert exc.value.argument is not None and exc.value.argument.startswith("dst_cache_key")
        assert "cluster 2: " in str(exc.value)  # the last one is the owner's
        assert all(torch.equal(d, b) for d, b in zip(d_rows.tensors, before, strict=True))
    finally:
        decoder.finalize()
        prompt.finalize()


def test_deallocate_twice_and_too_many_clusters_as_llm_datadist(private_loop):
    """Reference §2.4: deallocate_cache is a no-op for a cache already freed; §2.1 / §4.9: more than
    16 clusters is ``(LLM_CLUSTER_NUM_EXCEED_LIMIT, [...])`` returned, not raised."""
    from aio_datadist.compat import CacheDesc, DataType

    dd = _init(LLMRole.DECODER, 3)
    try:
        cache = dd.kv_cache_manager.allocate_cache(CacheDesc(1, [2, 8], DataType.DT_UINT8))
        dd.kv_cache_manager.deallocate_cache(cache)
        dd.kv_cache_manager.deallocate_cache(cache)
        exceed = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
        infos = [_info(100 + i, ("127.0.0.1", 1)) for i in range(17)]
        assert dd.link_clusters(infos, 1000) == (exceed, [exceed] * 17)
        assert dd.unlink_clusters(infos, 1000, force=True) == (exceed, [exceed] * 17)
    finally:
        dd.finalize()


def test_switch_role_takes_generate_options_in_cache_manager_mode(private_loop):
    """clients_gap items 9 and 10 (HIXL switch_role_sample): in CacheManager mode the role is a
    label (reference §2.1, §4.7): no enable_switch_role, and ``LLMConfig().generate_options()`` (which
    always carries ``llm.MemoryUtilization``) is taken, its listen address used, the rest ignored."""
    dd = _init(LLMRole.PROMPT, 4, listen=True, v2=True)
    try:
        dd.switch_role(LLMRole.DECODER, LLMConfig().generate_options())
        assert dd.role == LLMRole.DECODER and dd.listen_address is None
        cfg = LLMConfig()
        cfg.listen_ip_info = "127.0.0.1:0"
        dd.switch_role(LLMRole.PROMPT, cfg.generate_options())
        assert dd.role == LLMRole.PROMPT and dd.listen_address is not None
    finally:
        dd.finalize()


@pytest.mark.asyncio
async def test_the_async_managers_take_the_same_spellings():
    """The async KvCacheManager behind the facade takes llm_datadist's keywords too (reference §2.4,
    §2.6), on both event loops."""
    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMException
    from peers import linked_pair

    async with linked_pair() as pair:
        pm, dm = pair.prompt.kv_cache_manager, pair.decoder.kv_cache_manager
        desc = CacheDesc(2, [4, 8], DataType.DT_UINT8)
        p_blocks = pm.allocate_blocks_cache(desc, BlocksCacheKey(pair.prompt.cluster_id))
        for i, t in enumerate(p_blocks.tensors):
            t.copy_(torch.arange(32, dtype=torch.uint8).view(4, 8) + 100 * i)
        p_rows = pm.allocate_cache(desc)
        p_rows.tensors[0].copy_(p_blocks.tensors[0])
        d_blocks, d_rows = dm.allocate_blocks_cache(desc), dm.allocate_cache(desc)
        await dm.pull_blocks(prompt_cache_key=BlocksCacheKey(pair.prompt.cluster_id), decoder_kv_cache=d_blocks,
                             prompt_blocks=[1], decoder_blocks=[3])
        assert all(torch.equal(d[3], p[1]) for d, p in zip(d_blocks.tensors, p_blocks.tensors, strict=True))
        await dm.pull_cache(CacheKeyByIdAndIndex(pair.prompt.cluster_id, p_rows.cache_id, 2), d_rows, 1, 3,
                            src_cache_offset=5, dst_cache_offset=0)
        assert torch.equal(d_rows.tensors[0][1, :3], p_rows.tensors[0][2, 5:8]) and not d_rows.tensors[0][1, 3:].any()
        await dm.copy_cache(d_rows, d_rows, 0, 1, req_id=2**64 - 1)
        assert torch.equal(d_rows.tensors[0][0], d_rows.tensors[0][1])
        memory = torch.zeros(4, 8, dtype=torch.uint8)
        hidden = pm.register_cache(CacheDesc(1, [4, 8], DataType.DT_UINT8), [memory.data_ptr()],
                                   remote_accessible=False)
        with pytest.raises(LLMException) as exc:
            await dm.pull_cache(CacheKeyByIdAndIndex(pair.prompt.cluster_id, hidden.cache_id, 0),
                                dm.allocate_cache(CacheDesc(1, [4, 8], DataType.DT_UINT8)))
        assert exc.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        pm.deallocate_cache(hidden)
        pm.deallocate_cache(hidden)  # a no-op, as LLM-DataDist's


def test_vllm_ascend_tells_bad_parameters_from_transfer_failures(private_loop):
    """clients_gap item 38: vllm-ascend's connector catches ``(TypeError, ValueError)`` first ("unexpected
    parameter") and ``LLMException`` second ("Timeout during pull_blocks ..."). llm_datadist's
    check_isinstance / check_uint* raise the former (reference §2.11), a failed transfer the latter."""
    import torch

    from aio_datadist.compat import BlocksCacheKey, CacheDesc, DataType, LLMException

    def outcome(call) -> str:
        try:
            call()
        except (TypeError, ValueError):
            return "unexpected parameter"
        except LLMException:
            return "transfer failed"
        return "ok"

    dd = _init(LLMRole.DECODER, 6, v2=True)
    try:
        cm = dd.cache_manager
        desc = CacheDesc(2, [4, 8], DataType.DT_UINT8)
        memory = [torch.zeros(4, 8, dtype=torch.uint8) for _ in range(2)]
        addrs = [m.data_ptr() for m in memory]
        assert outcome(lambda: cm.register_blocks_cache(desc, "0x1000", BlocksCacheKey(6))) == "unexpected parameter"
        assert outcome(lambda: cm.register_blocks_cache(desc, addrs, "key")) == "unexpected parameter"
        # checked inside under another name ('tensors_or_addrs', 'src'), reported in the caller's: the type stays
        assert outcome(lambda: cm.register_blocks_cache(desc, ["0x1000", addrs[1]], BlocksCacheKey(6))) == \
            "unexpected parameter"
        cache = cm.register_blocks_cache(desc, addrs, BlocksCacheKey(6))
        assert outcome(lambda: cm.swap_blocks(object(), cache, {0: 0})) == "unexpected parameter"
        assert outcome(lambda: cm.pull_blocks(BlocksCacheKey(1), cache, ["0"], [0])) == "unexpected parameter"
        assert outcome(lambda: cm.pull_blocks(BlocksCacheKey(2**64), cache, [0], [0])) == "unexpected parameter"
        assert outcome(lambda: cm.pull_blocks(BlocksCacheKey(1), cache, [0], [0])) == "transfer failed"  # unlinked
    finally:
        dd.finalize()


def test_importing_the_facade_sets_auto_use_uc_memory_as_llm_datadist_does():
    """``import llm_datadist`` sets ``AUTO_USE_UC_MEMORY=0`` where it is not set (CANN reads it); so does the
    facade (``os.environ.setdefault``: a value set before stays). ``aio_datadist`` alone sets nothing."""
    import subprocess

    probe = ("import os, sys; import aio_datadist; before = os.environ.get('AUTO_USE_UC_MEMORY'); "
             "import aio_datadist.compat; print(before, os.environ.get('AUTO_USE_UC_MEMORY'))")
    env = {k: v for k, v in os.environ.items() if k != "AUTO_USE_UC_MEMORY"}
    unset = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert unset.stdout.split() == ["None", "0"], unset.stderr


def test_a_facade_prefill_leases_its_hand_off_cache_and_handles_the_lease_from_its_own_thread(private_loop):
    """Before, the facade's ``allocate_cache`` took no ``lease_ms``, ``allocate_leased_cache`` refused its manager
    naming the class the caller had passed, and a lease could not be renewed off the facade's loop: a facade
    prefill had no bound on a vanished decoder's keys (found by audit). Now ``allocate_cache(..., lease_ms=)``
    and ``compat.lease_of`` (renew, cancel, release from the caller's thread)."""
    import time

    from aio_datadist.compat import CacheDesc, CacheKey, DataType
    from aio_datadist.leases import allocate_leased_cache

    dd = _init(LLMRole.PROMPT, 5)
    kv = dd.kv_cache_manager
    registry = dd._dd._endpoint.runtime.registry
    try:
        desc = CacheDesc(1, [2, 8], DataType.DT_UINT8)
        for bad in (0, -1, True, 1.5):
            with pytest.raises(compat.LLMException) as info:
                kv.allocate_cache(desc, [CacheKey(5, 1)], lease_ms=bad)
            assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "lease_ms" in str(info.value)
        kept = kv.allocate_cache(desc, [CacheKey(5, 2)], lease_ms=60_000)
        lease = compat.lease_of(kept)
        assert lease is not None and lease.active and lease.deadline is not None
        lease.renew(120_000)
        lease.cancel()
        assert not lease.active and not lease.expired and lease.deadline is None
        with pytest.raises(compat.LLMException) as info:
            lease.renew(10)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        released = kv.allocate_cache(desc, [CacheKey(5, 3)], lease_ms=60_000)
        compat.lease_of(released).release()
        assert compat.lease_of(released).expired and not released.alive
        expiring = kv.allocate_cache(desc, [CacheKey(5, 4)], lease_ms=50)
        kv.deallocate_cache(expiring)  # the keys keep it: the lease's expiry frees it
        deadline = time.monotonic() + 10
        while not compat.lease_of(expiring).expired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert compat.lease_of(expiring).expired and registry.key_count == 1  # only the cancelled lease's key
        assert compat.lease_of(kept) is not None and kept.alive
        with pytest.raises(compat.LLMException) as info:
            allocate_leased_cache(kv, desc, [CacheKey(5, 5)], lease_ms=100)
        assert "the blocking facade's KvCacheManager.allocate_cache takes lease_ms itself" in str(info.value)
        assert "aio_datadist.compat.KvCacheManager" in str(info.value)
    finally:
        dd.finalize()


@pytest.mark.asyncio
async def test_a_blocks_cache_registered_remote_accessible_false_is_kept_from_peers():
    """``register_blocks_cache(..., remote_accessible=False)`` (reference §2.6) as ``register_cache``'s: a peer's
    pull of its blocks key gets ``LLM_KV_CACHE_NOT_EXIST`` and moves nothing."""
    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException
    from peers import linked_pair

    async with linked_pair() as pair:
        pm, dm = pair.prompt.kv_cache_manager, pair.decoder.kv_cache_manager
        desc = CacheDesc(2, [4, 8], DataType.DT_UINT8)
        memory = [torch.full((4, 8), 9, dtype=torch.uint8) for _ in range(2)]
        pm.register_blocks_cache(desc, [m.data_ptr() for m in memory], BlocksCacheKey(pair.prompt.cluster_id),
                                 remote_accessible=False)
        d_blocks = dm.allocate_blocks_cache(desc)
        with pytest.raises(LLMException) as exc:
            await dm.pull_blocks(BlocksCacheKey(pair.prompt.cluster_id), d_blocks, [0, 1], [0, 1])
        assert exc.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, exc.value
        assert not any(d.any() for d in d_blocks.tensors)
        # nor by its raw addresses: a peer's TransferConfig push into a hidden cache's memory is refused, as into
        # memory registered nowhere, and writes nothing
        from aio_datadist import LayerSynchronizer, TransferConfig

        class Ready(LayerSynchronizer):
            def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
                return True

        hidden = [torch.full((4, 8), 9, dtype=torch.uint8) for _ in range(2)]
        dm.register_blocks_cache(desc, [m.data_ptr() for m in hidden], remote_accessible=False)
        src = pm.allocate_blocks_cache(desc)
        for t in src.tensors:
            t.fill_(1)
        task = pm.transfer_cache_async(src, Ready(), [TransferConfig(pair.decoder.cluster_id,
                                                                  [m.data_ptr() for m in hidden], range(0, 1))],
                                       [0], [0])
        with pytest.raises(LLMException) as exc:  # as memory registered nowhere: no cache there for peers
            await task
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, exc.value
        assert all(bool((m == 9).all()) for m in hidden), "a peer wrote into a cache kept from peers"
