"""One table of bad API input over every public call: the documented code, the argument named, nothing written.

A linked PROMPT / DECODER pair in this loop, each with blocks and contiguous
caches full of random bytes. Each row is one bad call; it must raise
``LLMException`` with the documented code (``docs/api.md``), name the
argument where the code is ``LLM_PARAM_INVALID``, and leave every byte of
every cache on both ends as it was (and start no native work). The
per-module tests (``test_transfer_errors.py``, ``test_local_bad_input.py``)
go deeper into single calls; this table covers every call in one place.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist.leases import allocate_leased_cache
from peers import LOCALHOST, cluster_info, port_of

from _harness import endpoint, state
from _tally import count

S = LLMStatusCode
INVALID, NOT_EXIST, NOT_LINKED = S.LLM_PARAM_INVALID, S.LLM_KV_CACHE_NOT_EXIST, S.LLM_NOT_YET_LINK
PROMPT, DECODER, STRANGER = 1, 2, 9
BLOCKS = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)  # 2 layers, 8 blocks of 128 B
ROWS = CacheDesc(4, (3, 256), DataType.DT_FLOAT16, Placement.HOST)  # 2 layers, 3 rows of 512 B
OTHER_ROWS = CacheDesc(4, (3, 128), DataType.DT_FLOAT16, Placement.HOST)


class Ready(LayerSynchronizer):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


@dataclasses.dataclass
class Ctx:
    """Everything a row of the table may use."""

    prompt: LLMDataDist
    decoder: LLMDataDist
    p_blocks: KvCache
    p_rows: KvCache
    d_blocks: KvCache
    d_rows: KvCache
    d_other_rows: KvCache
    gone: KvCache

    @property
    def pm(self) -> Any:
        return self.prompt.kv_cache_manager

    @property
    def dm(self) -> Any:
        return self.decoder.kv_cache_manager

    def caches(self) -> list[KvCache]:
        return [self.p_blocks, self.p_rows, self.d_blocks, self.d_rows, self.d_other_rows]


def bkey(cluster: int = PROMPT) -> BlocksCacheKey:
    return BlocksCacheKey(cluster, 0)


def many_clusters(n: int) -> list[LLMClusterInfo]:
    return [cluster_info(100 + i, (LOCALHOST, 1)) for i in range(n)]


def bad_config(name: str, value: Any) -> Callable[[Ctx], Any]:
    def call(c: Ctx) -> None:
        setattr(LLMConfig(), name, value)
    return call


#: (what, code, argument named in the message or None, call)
CASES: list[tuple[str, LLMStatusCode, str | None, Callable[[Ctx], Any]]] = [
    # LLMDataDist and LLMConfig
    ("LLMDataDist role", INVALID, "role", lambda c: LLMDataDist(1, 5)),
    ("LLMDataDist cluster_id < 0", INVALID, "cluster_id", lambda c: LLMDataDist(LLMRole.DECODER, -1)),
    ("LLMDataDist cluster_id bool", INVALID, "cluster_id", lambda c: LLMDataDist(LLMRole.DECODER, True)),
    ("LLMConfig sync_kv_timeout", INVALID, "sync_kv_timeout", bad_config("sync_kv_timeout", -5)),
    ("LLMConfig data_channels", INVALID, "data_channels", bad_config("data_channels", 0)),
    ("LLMConfig heartbeat_interval", INVALID, "heartbeat_interval", bad_config("heartbeat_interval", "1s")),
    ("LLMConfig transport", INVALID, "transport", bad_config("transport", "carrier-pigeon")),
    # links
    ("link_clusters not a list", INVALID, "clusters", lambda c: c.decoder.link_clusters(c.prompt)),
    ("link_clusters no remote id", INVALID, "clusters[0]", lambda c: c.decoder.link_clusters([LLMClusterInfo()])),
    ("link_clusters timeout 0", INVALID, "timeout",
     lambda c: c.decoder.link_clusters([cluster_info(PROMPT, port_of(c.prompt))], timeout=0)),
    ("unlink_clusters force not bool", INVALID, "force",
     lambda c: c.decoder.unlink_clusters([cluster_info(PROMPT, port_of(c.prompt))], force="yes")),
    ("check_link_status unlinked", NOT_LINKED, None, lambda c: c.decoder.check_link_status(STRANGER)),
    ("check_link_status bad id", INVALID, "remote_cluster_id", lambda c: c.decoder.check_link_status(-3)),
    ("switch_role not enabled", S.LLM_FEATURE_NOT_ENABLED, None,
     lambda c: c.decoder.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "127.0.0.1:0"})),
    # as LLM-DataDist: the arguments are checked before the feature
    ("switch_role to PROMPT without a listen address", INVALID, "switch_options",
     lambda c: c.decoder.switch_role(LLMRole.PROMPT)),
    ("switch_role to its own role", INVALID, "role", lambda c: c.decoder.switch_role(LLMRole.DECODER)),
    # allocation, registration, keys
    ("allocate_cache desc", INVALID, "cache_desc", lambda c: c.pm.allocate_cache("desc")),
    ("allocate_cache too many keys", INVALID, "cache_keys",
     lambda c: c.pm.allocate_cache(ROWS, [CacheKey(PROMPT, i) for i in range(4)])),
    ("allocate_cache bound key", INVALID, "cache_keys[0]", lambda c: c.pm.allocate_cache(ROWS, [CacheKey(PROMPT, 1)])),
    ("allocate_blocks_cache bound model", INVALID, "blocks_cache_key",
     lambda c: c.pm.allocate_blocks_cache(BLOCKS, bkey())),
    ("register_cache wrong shape", INVALID, "tensors_or_addrs",
     lambda c: c.pm.register_cache(ROWS, [torch.zeros(3, 255, dtype=torch.float16) for _ in range(4)])),
    ("register_cache overlaps a cache", INVALID, "tensors_or_addrs",
     lambda c: c.pm.register_cache(ROWS, c.p_rows.tensors)),
    ("deallocate_cache of another LLMDataDist", NOT_EXIST, "cache", lambda c: c.pm.deallocate_cache(c.d_rows)),
    ("remove_cache_key on a decoder", INVALID, "role", lambda c: c.dm.remove_cache_key(CacheKey(PROMPT, 1))),
    ("remove_cache_key type", INVALID, "cache_key", lambda c: c.pm.remove_cache_key(bkey())),
    ("get_cache_tensors index", INVALID, "tensor_index", lambda c: c.pm.get_cache_tensors(c.p_rows, 4)),
    ("create_cpu_cache device desc", INVALID, "cache_desc",
     lambda c: KvCache.create_cpu_cache(CacheDesc(1, (2, 2), DataType.DT_FLOAT16, Placement.DEVICE), [4096])),
    # pulls
    ("pull_cache on a prompt", INVALID, "role", lambda c: c.pm.pull_cache(CacheKey(PROMPT, 1), c.p_rows)),
    ("pull_cache deallocated dst", NOT_EXIST, "kv_cache", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.gone)),
    ("pull_cache unlinked cluster", NOT_LINKED, None, lambda c: c.dm.pull_cache(CacheKey(STRANGER, 1), c.d_rows)),
    ("pull_cache batch_index", INVALID, "batch_index", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, 3)),
    ("pull_cache size 0", INVALID, "size", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, size=0)),
    ("pull_cache into blocks", INVALID, "kv_cache", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_blocks)),
    ("pull_cache key neither id", INVALID, "cache_key",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 2**64 - 1), c.d_rows)),
    ("pull_cache layer range step", INVALID, "src_layer_range",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, src_layer_range=range(0, 2, 2))),
    ("pull_cache dst layer beyond", INVALID, "dst_layer_range",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, dst_layer_range=range(2, 3))),
    ("pull_cache tensor_num_per_layer 0", INVALID, "tensor_num_per_layer",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, tensor_num_per_layer=0)),
    ("pull_cache tensor_num_per_layer 3", INVALID, "tensor_num_per_layer",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, dst_layer_range=range(0, 1), tensor_num_per_layer=3)),
    ("pull_cache unknown kwarg", INVALID, "offset", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, offset=1)),
    ("pull_cache timeout 0", INVALID, "timeout", lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, timeout=0)),
    ("pull_cache unknown key (owner)", NOT_EXIST, None, lambda c: c.dm.pull_cache(CacheKey(PROMPT, 77), c.d_rows)),
    ("pull_cache rows differ (owner)", INVALID, "cache_key",
     lambda c: c.dm.pull_cache(CacheKey(PROMPT, 1), c.d_other_rows)),
    ("pull_cache remote row (owner)", INVALID, "cache_key.batch_index",
     lambda c: c.dm.pull_cache(CacheKeyByIdAndIndex(PROMPT, c.p_rows.cache_id, 3), c.d_rows)),
    ("pull_blocks lengths differ", INVALID, "src_blocks", lambda c: c.dm.pull_blocks(bkey(), c.d_blocks, [0, 1], [0])),
    ("pull_blocks dst out of range", INVALID, "dst_blocks", lambda c: c.dm.pull_blocks(bkey(), c.d_blocks, [0], [8])),
    ("pull_blocks negative src", INVALID, "src_blocks", lambda c: c.dm.pull_blocks(bkey(), c.d_blocks, [-1], [0])),
    ("pull_blocks dst twice", INVALID, "dst_blocks", lambda c: c.dm.pull_blocks(bkey(), c.d_blocks, [0, 1], [2, 2])),
    ("pull_blocks src with a CacheKey", INVALID, "src_blocks",
     lambda c: c.dm.pull_blocks(CacheKey(PROMPT, 1), c.d_blocks, [0], [0])),
    ("pull_blocks remote block (owner)", INVALID, "src_blocks",
     lambda c: c.dm.pull_blocks(bkey(), c.d_blocks, [8], [0])),
    ("pull_blocks a key's row over more blocks than it holds (owner)", INVALID, "dst_blocks",
     lambda c: c.dm.pull_blocks(CacheKey(PROMPT, 1), c.d_blocks, [], [0, 1, 2, 3, 4])),
    ("pull_blocks unknown model (owner)", NOT_EXIST, None,
     lambda c: c.dm.pull_blocks(BlocksCacheKey(PROMPT, 5), c.d_blocks, [0], [0])),
    # pushes
    ("push_blocks on a decoder", INVALID, "role", lambda c: c.dm.push_blocks(bkey(), c.d_blocks, [0], [0])),
    ("push_blocks src range vs dst", INVALID, None,
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [0], [0], KvCacheExtParam((0, 0), (0, 1)))),
    ("push_blocks layer beyond", INVALID, None,
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [0], [0], KvCacheExtParam((2, 2), (0, 0)))),
    ("push_blocks ext_param type", INVALID, "ext_param",
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [0], [0], ext_param=(0, 0))),
    ("push_blocks empty", INVALID, "src_blocks", lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [], [])),
    ("push_blocks contiguous src", INVALID, "src_cache", lambda c: c.pm.push_blocks(bkey(DECODER), c.p_rows, [0], [0])),
    ("push_blocks src out of range", INVALID, "src_blocks",
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [8], [0])),
    ("push_blocks lengths differ", INVALID, "dst_blocks",
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [0, 1], [0])),
    ("push_blocks CacheIndex row", INVALID, "dst_cache_index_or_key",
     lambda c: c.pm.push_blocks(CacheIndex(DECODER, c.d_blocks.cache_id, 1), c.p_blocks, [0], [0])),
    ("push_blocks unlinked", NOT_LINKED, None, lambda c: c.pm.push_blocks(bkey(STRANGER), c.p_blocks, [0], [0])),
    ("push_blocks remote block (owner)", INVALID, "dst_blocks",
     lambda c: c.pm.push_blocks(bkey(DECODER), c.p_blocks, [0], [2**40])),
    ("push_blocks unknown cache (owner)", NOT_EXIST, None,
     lambda c: c.pm.push_blocks(CacheIndex(DECODER, 99), c.p_blocks, [0], [0])),
    ("push_cache size", INVALID, "size",
     lambda c: c.pm.push_cache(CacheIndex(DECODER, c.d_rows.cache_id), c.p_rows, size=512)),
    ("push_cache src_batch_index", INVALID, "src_batch_index",
     lambda c: c.pm.push_cache(CacheIndex(DECODER, c.d_rows.cache_id), c.p_rows, src_batch_index=3)),
    ("push_cache remote row (owner)", INVALID, "dst_cache_index_or_key.batch_index",
     lambda c: c.pm.push_cache(CacheIndex(DECODER, c.d_rows.cache_id, 3), c.p_rows)),
    ("push_cache rows differ (owner)", INVALID, "dst_cache_index_or_key",
     lambda c: c.pm.push_cache(CacheIndex(DECODER, c.d_other_rows.cache_id, 0), c.p_rows)),
    # local copies
    ("copy_cache blocks", INVALID, "dst", lambda c: c.dm.copy_cache(c.d_blocks, c.d_rows)),
    ("copy_cache rows differ", INVALID, "src", lambda c: c.dm.copy_cache(c.d_rows, c.d_other_rows)),
    ("copy_blocks src is dst", INVALID, "copy_block_info", lambda c: c.dm.copy_blocks(c.d_blocks, {0: [0]})),
    ("copy_blocks out of range", INVALID, "copy_block_info", lambda c: c.dm.copy_blocks(c.d_blocks, {0: [8]})),
    ("swap_blocks same placement", INVALID, "dst", lambda c: c.dm.swap_blocks(c.d_blocks, c.d_blocks, {0: 1})),
    # layer-wise
    ("transfer_cache_async on a decoder", INVALID, "role",
     lambda c: c.dm.transfer_cache_async(c.d_blocks, Ready(), [TransferWithCacheKeyConfig(bkey())], [0], [0])),
    ("transfer_cache_async configs not a list", INVALID, "transfer_configs",
     lambda c: c.pm.transfer_cache_async(c.p_blocks, Ready(), "configs", [0], [0])),
    ("transfer_cache_async synchronizer", INVALID, "layer_synchronizer",
     lambda c: c.pm.transfer_cache_async(c.p_blocks, object(), [TransferWithCacheKeyConfig(bkey(DECODER))], [0], [0])),
    ("transfer_cache_async layer range", INVALID, "transfer_configs[0].src_layer_range",
     lambda c: c.pm.transfer_cache_async(c.p_blocks, Ready(), [TransferWithCacheKeyConfig(
         bkey(DECODER), src_layer_range=range(0, 3))], [0], [0])),
    ("transfer_cache_async dst twice", INVALID, "dst_block_indices",
     lambda c: c.pm.transfer_cache_async(c.p_blocks, Ready(), [TransferWithCacheKeyConfig(bkey(DECODER))],
                                         [0, 1], [2, 2])),
    ("transfer_cache_async addr count", INVALID, "dst_addrs",
     lambda c: c.pm.transfer_cache_async(c.p_blocks, Ready(), [TransferConfig(DECODER, [1, 2, 3])], [0], [0])),
    ("transfer_cache_async unlinked", NOT_LINKED, None,
     lambda c: c.pm.transfer_cache_async(c.p_blocks, Ready(), [TransferWithCacheKeyConfig(bkey(STRANGER))],
                                         [0], [0])),
    # push watches, leases
    ("watch_pushes rows", INVALID, "rows", lambda c: c.dm.watch_pushes(c.d_blocks, [8])),
    ("watch_pushes layers", INVALID, "layers", lambda c: c.dm.watch_pushes(c.d_blocks, [0], range(0, 3))),
    ("allocate_leased_cache lease_ms", INVALID, "lease_ms",
     lambda c: allocate_leased_cache(c.pm, ROWS, [CacheKey(PROMPT, 50)], lease_ms=0)),
]


async def run_case(c: Ctx, what: str, code: LLMStatusCode, arg: str | None, call: Callable[[Ctx], Any]) -> None:
    with pytest.raises(LLMException) as info:
        result = call(c)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result
    assert info.value.status_code == code, f"{what}: {info.value!r}"
    if arg is not None:
        assert f"'{arg}'" in str(info.value), f"{what}: message does not name {arg!r}: {info.value}"


@pytest.mark.asyncio
async def test_every_public_call_rejects_bad_input_with_its_code_and_writes_nothing():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as prompt, endpoint(LLMRole.DECODER, DECODER) as dec:
        pm, dm = prompt.kv_cache_manager, dec.kv_cache_manager
        p_blocks = pm.allocate_blocks_cache(BLOCKS, bkey(PROMPT))
        d_blocks = dm.allocate_blocks_cache(BLOCKS, bkey(DECODER))
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))]))[0] == S.LLM_SUCCESS
        gone = pm.allocate_cache(ROWS)
        pm.deallocate_cache(gone)
        c = Ctx(prompt, dec, p_blocks, pm.allocate_cache(ROWS, [CacheKey(PROMPT, 1)]), d_blocks,
                dm.allocate_cache(ROWS), dm.allocate_cache(OTHER_ROWS), gone)
        for cache in c.caches():
            for t in cache.tensors:
                raw = t.view(torch.uint8).reshape(-1)
                raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
        before = [t.view(torch.uint8).clone() for cache in c.caches() for t in cache.tensors]  # bytes: NaNs differ
        states = (state(prompt), state(dec))
        assert len(CASES) >= 40
        for what, code, arg, call in CASES:
            await run_case(c, what, code, arg, call)
            after = [t.view(torch.uint8) for cache in c.caches() for t in cache.tensors]
            assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{what}: a cache was written"
            assert (state(prompt), state(dec)) == states, f"{what}: work was started or memory registered"
            count("bad-input cases")
        # reference §2.1 / §4.9: more than 16 clusters is a returned status, not an exception, and
        # §2.4: a second deallocate_cache is a no-op; neither dials, writes or frees anything
        exceed = S.LLM_CLUSTER_NUM_EXCEED_LIMIT
        assert await dec.link_clusters(many_clusters(17)) == (exceed, [exceed] * 17)
        assert await dec.unlink_clusters(many_clusters(17)) == (exceed, [exceed] * 17)
        pm.deallocate_cache(gone)
        after = [t.view(torch.uint8) for cache in c.caches() for t in cache.tensors]
        assert all(torch.equal(a, b) for a, b in zip(after, before))
        assert (state(prompt), state(dec)) == states
        count("bad-input cases", 3)
        # the pair still works, and a finalized endpoint refuses every call with LLM_ENGINE_FINALIZED (but init,
        # which starts a new life of it: tests/test_reinit.py)
        await dm.pull_cache(CacheKey(PROMPT, 1), c.d_rows, 2)
        assert all(torch.equal(d[2].view(torch.uint8), p[0].view(torch.uint8))
                   for d, p in zip(c.d_rows.tensors, c.p_rows.tensors))
    for what, call in [("link_clusters", lambda: dec.link_clusters([cluster_info(PROMPT, (LOCALHOST, 1))])),
                       ("check_link_status", lambda: dec.check_link_status(PROMPT)),
                       ("allocate_cache", lambda: pm.allocate_cache(ROWS)),
                       ("pull_blocks", lambda: dm.pull_blocks(bkey(), d_blocks, [0], [0]))]:
        with pytest.raises(LLMException) as info:
            result = call()
            if asyncio.iscoroutine(result):
                await result
        assert info.value.status_code == S.LLM_ENGINE_FINALIZED, what
        count("bad-input cases")
