"""The blocking ``CacheManager`` of ``aio_datadist.compat`` and the v2 names it exports.

Every mirror method is called as llm_datadist code calls it (blocking, the
reference's keywords). The real clients' flows through it, in two processes
over TCP and same-host, are ``test_clients.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aio_datadist
from aio_datadist import compat
from aio_datadist.compat import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheManager,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    Tensor,
    TensorDesc,
    TransferWithCacheKeyConfig,
    code_2_status,
)

S = LLMStatusCode
BLOCKS = CacheDesc(4, [8, 4, 16], DataType.DT_FLOAT16, Placement.DEVICE)
ROWS = CacheDesc(4, (3, 256), DataType.DT_FLOAT16)


@pytest.fixture
def private_loop():
    yield
    compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def _init(dd: LLMDataDist, *, v2: bool = True, listen: bool = False) -> None:
    config = LLMConfig()
    config.device_id = 0
    config.device_type = "cpu"
    config.transport = "tcp"
    if v2:
        config.local_comm_res = ""
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    dd.init(config.generate_options())


def _memory(desc: CacheDesc, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(desc.shape)
    return [torch.randint(-100, 100, shape, generator=gen).to(torch.float16) for _ in range(desc.num_tensors)]


def test_reference_names():
    names = ["Cache", "CacheManager", "RegisterMemStatus", "Memtype", "MemInfo", "TensorDesc", "Tensor",
             "code_2_status", "KvCache", "KvCacheManager", "LlmConfig", "LLMConfig", "Status"]
    for name in names:
        assert getattr(compat, name) is not None and name in compat.__all__
        if name != "CacheManager" and name != "KvCacheManager":  # the blocking mirrors differ from the async ones
            assert getattr(compat, name) is getattr(aio_datadist, name)
    assert [m.value for m in RegisterMemStatus] == [0, 1, 2] and RegisterMemStatus.PREPARING.name == "PREPARING"
    assert (Memtype.MEM_TYPE_DEVICE.value, Memtype.MEM_TYPE_HOST.value) == (0, 1)
    assert code_2_status(0x5010B005) is S.LLM_PARAM_INVALID and code_2_status(12345) is S.LLM_FAILED
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 64)
    assert (info.addr, info.size) == (4096, 64)


def test_tensor_and_tensor_desc():
    desc = TensorDesc(DataType.DT_FLOAT16, [2, 3])
    assert (desc.dtype, desc.shape) == (DataType.DT_FLOAT16, [2, 3])
    data = np.arange(6, dtype=np.float16).reshape(2, 3)
    tensor = Tensor(data, desc)
    assert tensor.numpy() is data and np.array_equal(tensor.numpy(copy=True), data)
    assert tensor.numpy(copy=True) is not data
    bf16 = Tensor(torch.ones(2, dtype=torch.bfloat16))
    assert bf16.tensor_desc.dtype is DataType.DT_BF16 and bf16.numpy().dtype == np.float32
    for scalar in (np.array(5.0, np.float32), np.array(7, np.int64)):  # 0-d: a bare IndexError before (hunt)
        assert Tensor(scalar).tensor_desc.shape == [] and Tensor(scalar).numpy() is scalar
    text = Tensor(np.array(["a", "bc"]))
    assert text.tensor_desc.dtype is DataType.DT_STRING and list(text.numpy(copy=True)) == ["a", "bc"]
    assert Tensor(tensor).tensor_desc == desc
    for call, arg in ((lambda: text.numpy(), "copy"), (lambda: Tensor(data, TensorDesc(DataType.DT_FLOAT, [2, 3])),
                                                        "tensor_desc"),
                      (lambda: Tensor(data.T), "data"), (lambda: tensor.numpy(copy=1), "copy"),
                      # big-endian data (np.frombuffer, np.load): torch's bare ValueError before (found by audit)
                      (lambda: Tensor(np.zeros(4, dtype=">f4")), "data"),
                      (lambda: Tensor(torch.zeros(2, dtype=torch.complex64)), "data"),  # it named 'dtype' (hunt)
                      (lambda: Tensor(np.zeros(2, np.complex64)), "data")):  # (and so did numpy's: review)
        with pytest.raises(LLMException, match=f"'{arg}'"):
            call()
    with pytest.raises(TypeError, match="'dtype'"):
        TensorDesc("float16", [2])
    with pytest.raises(TypeError, match="'data'"):
        Tensor([1, 2])


def test_accessors_follow_the_mode(private_loop):
    v2, v1 = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.PROMPT, 2)
    _init(v2)
    _init(v1, v2=False)
    try:
        assert isinstance(v2.cache_manager, CacheManager) and v2.cache_manager is v2.cache_manager
        with pytest.raises(LLMException, match=r"kv_cache_manager is not supported when llm\.EnableCacheManager "
                                               r"is configured") as info:
            v2.kv_cache_manager  # noqa: B018
        assert info.value.status_code is S.LLM_PARAM_INVALID
        with pytest.raises(LLMException, match=r"cache_manager is not supported when llm\.EnableCacheManager "
                                               r"is not configured"):
            v1.cache_manager  # noqa: B018
        assert v1.kv_cache_manager.is_initialized()
    finally:
        v2.finalize()
        v1.finalize()


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def test_every_mirror_method_blocks_and_forwards(private_loop):
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    _init(prompt, listen=True)
    _init(decoder)
    try:
        pm, dm = prompt.cache_manager, decoder.cache_manager
        p_blocks_mem, d_blocks_mem = _memory(BLOCKS, 1), _memory(BLOCKS, 2)
        p_rows_mem, d_rows_mem = _memory(ROWS, 3), _memory(ROWS, 4)
        p_blocks = pm.register_blocks_cache(BLOCKS, [t.data_ptr() for t in p_blocks_mem], BlocksCacheKey(1, 0))
        p_rows = pm.register_cache(ROWS, [t.data_ptr() for t in p_rows_mem], [CacheKey(1, 0)],
                                   remote_accessible=True)
        d_blocks = dm.register_blocks_cache(BLOCKS, [t.data_ptr() for t in d_blocks_mem], BlocksCacheKey(2, 0))
        d_rows = dm.register_cache(ROWS, [t.data_ptr() for t in d_rows_mem], remote_accessible=True)
        assert isinstance(p_blocks, Cache) and (p_blocks.cache_id, p_rows.cache_id) == (1, 2)
        with pytest.raises(TypeError, match="'addrs'"):
            pm.register_cache(ROWS, tuple(t.data_ptr() for t in _memory(ROWS, 5)))
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_remote_ip_info(*prompt.listen_address)
        assert decoder.link_clusters([cluster], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])

        dm.push_blocks(BlocksCacheKey(1, 0), d_blocks, src_blocks=[0, 1], dst_blocks=[0, 2])  # a DECODER pushes
        assert all(torch.equal(p_blocks_mem[t][2], d_blocks_mem[t][1]) for t in range(4))
        dm.push_blocks(BlocksCacheKey(1, 0), d_blocks, [3], [3], range(1, 2), range(0, 1), 2)  # positional (SGLang)
        assert torch.equal(p_blocks_mem[0][3], d_blocks_mem[2][3])
        dm.pull_blocks(BlocksCacheKey(1, 0), d_blocks, src_blocks=[5], dst_blocks=[6])
        assert all(torch.equal(d_blocks_mem[t][6], p_blocks_mem[t][5]) for t in range(4))
        dm.push_cache(CacheKeyByIdAndIndex(1, p_rows.cache_id, 1), d_rows, src_batch_index=0)
        assert all(torch.equal(p_rows_mem[t][1], d_rows_mem[t][0]) for t in range(4))
        dm.pull_cache(CacheKey(1, 0), d_rows, batch_index=2)
        assert all(torch.equal(d_rows_mem[t][2], p_rows_mem[t][0]) for t in range(4))
        kept_row = [t[1].clone() for t in d_rows_mem]
        dm.pull_cache(CacheKeyByIdAndIndex(1, p_rows.cache_id, 2), d_rows, batch_index=1, size=128)  # 64 values
        assert all(torch.equal(d_rows_mem[t][1][:64], p_rows_mem[t][2][:64])
                   and torch.equal(d_rows_mem[t][1][64:], kept_row[t][64:]) for t in range(4))
        pm.pull_blocks(BlocksCacheKey(2, 0), p_blocks, [7], [7])  # a PROMPT pulls over the link it accepted
        assert all(torch.equal(p_blocks_mem[t][7], d_blocks_mem[t][7]) for t in range(4))
        kept = [t.clone() for t in d_blocks_mem]
        task = pm.transfer_cache_async(p_blocks, _Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0),
                                                                                     range(0, 1), range(0, 1))])
        assert task.get_results() == [S.LLM_SUCCESS] and task.synchronize() is S.LLM_SUCCESS
        # no block indices: block 0 of layer 0 (tensors 0 and 1) moves, as LLM-DataDist's layer-wise job does
        assert all(torch.equal(d_blocks_mem[t][0], p_blocks_mem[t][0]) for t in (0, 1))
        assert all(torch.equal(d_blocks_mem[t][1:], kept[t][1:]) for t in (0, 1))
        assert all(torch.equal(d_blocks_mem[t], kept[t]) for t in (2, 3))
        task = pm.transfer_cache_async(p_blocks, _Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0),
                                                                                     range(0, 1), range(0, 1))],
                                       src_block_indices=[1], dst_block_indices=[5])
        assert task.synchronize() is S.LLM_SUCCESS
        assert all(torch.equal(d_blocks_mem[t][5], p_blocks_mem[t][1]) for t in (0, 1))

        dm.copy_cache(d_rows, d_rows, 1, 2, req_id=3)
        assert torch.equal(d_rows_mem[0][1], d_rows_mem[0][2])
        dm.copy_blocks(d_blocks, {0: [4]})
        assert torch.equal(d_blocks_mem[3][4], d_blocks_mem[3][0])
        host_desc = CacheDesc(4, [8, 4, 16], DataType.DT_FLOAT16, Placement.HOST)
        host_mem = [torch.zeros(8, 4, 16, dtype=torch.float16) for _ in range(4)]
        dm.swap_blocks(d_blocks, Cache.create_cpu_cache(host_desc, [t.data_ptr() for t in host_mem]), {4: 0})
        assert torch.equal(host_mem[3][0], d_blocks_mem[3][4])
        pm.remap_registered_memory(MemInfo(Memtype.MEM_TYPE_DEVICE, p_blocks.tensor_addrs[0], 64))

        owned = pm.allocate_cache(ROWS, [CacheKey(1, 9)])
        owned_blocks = pm.allocate_blocks_cache(BLOCKS)
        pm.remove_cache_key(CacheKey(1, 9))
        pm.deallocate_cache(owned)
        assert not owned.alive  # its key was removed: nothing keeps it
        pm.deallocate_cache(owned)  # a second one is a no-op
        pm.deallocate_blocks_cache(owned_blocks)
        pm.deallocate_blocks_cache(owned_blocks)
        assert decoder.unlink_clusters([cluster], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        for manager, caches in ((pm, (p_blocks, p_rows)), (dm, (d_blocks, d_rows))):
            for cache in caches:
                manager.unregister_cache(cache.cache_id)
                manager.unregister_cache(cache.cache_id)
        with pytest.raises(LLMException) as info:
            dm.pull_blocks(BlocksCacheKey(1, 0), d_blocks, [0], [0])
        assert info.value.status_code is S.LLM_KV_CACHE_NOT_EXIST
    finally:
        decoder.finalize()
        prompt.finalize()

