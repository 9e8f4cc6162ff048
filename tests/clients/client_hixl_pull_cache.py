"""Port of the HIXL sample ``pull_cache_sample.py`` (v2, bilateral ``link``, caches from the
``mem_pool_cfg`` pool, ``pull_cache`` by ``CacheKey`` row by row, ``remove_cache_key``).

Source: libochao-huawei/hixl (a copy of the HIXL repository), ``examples/python/pull_cache_sample.py``,
commit 16d506d7cbd3bbc8f06318377e5e12bdc065fbca.

Ported: ``init_llm_datadist`` (``enable_cache_manager`` and
``mem_pool_cfg='{"memory_size": 1073741824}'``), ``link``, ``run_prompt_sample``,
``run_decoder_sample``; llm_datadist calls verbatim and in order. Note the
order: both sides ``link`` *before* allocating, and the decoder reads the
pulled data through ``cache.tensor_addrs``.

Scaffolding replaced:
- ``torchair.llm_datadist.create_npu_tensors(shape, dtype, addrs)`` ->
  :func:`tensors_at` (CPU tensors over the same addresses).
- ``tensors[0].fill_(1)`` on the prompt -> every tensor filled with a seeded
  pattern, so all four tensors and both rows are checked.
- the rank table's addresses -> loopback (prompt ``127.0.0.1``, decoder
  ``127.0.0.2``); the ``is_single`` branch is dropped.
- ``time.sleep(5)`` / ``time.sleep(30)`` -> :meth:`Peer.barrier` pairs.
"""

from __future__ import annotations

import json
import time

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import ...
    Cache,  # noqa: F401  (imported by the sample)
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    RegisterMemStatus,
)

PROMPT_HOST_IP = harness.LOCALHOST
PROMPT_IP_LIST = [harness.LOCALHOST] * 8
DECODER_HOST_IP = harness.OTHER_LOCALHOST
DECODER_IP_LIST = [harness.OTHER_LOCALHOST] * 8


def init_llm_datadist(role: LLMRole, cluster_id, device_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.enable_cache_manager = True
    llm_config.mem_pool_cfg = '{"memory_size": 1073741824}'
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport / link-address options
    datadist.init(llm_options)
    return datadist


def link(datadist, device_id):
    rank_table_dict = {
        "server_count": "2",
        "status": "completed",
        "version": "1.2",
        "server_list": [
            {
                "device": [{"device_id": str(device_id), "device_ip": PROMPT_IP_LIST[device_id], "rank_id": "0"}],
                "host_ip": PROMPT_HOST_IP,
                "server_id": "1",
            },
            {
                "device": [{"device_id": str(device_id), "device_ip": DECODER_IP_LIST[device_id], "rank_id": "1"}],
                "host_ip": DECODER_HOST_IP,
                "server_id": "2",
            },
        ],
    }
    cluster_rank_info = {1: 0, 2: 1}
    rank_table = json.dumps(rank_table_dict)
    comm_id = datadist.link("link", cluster_rank_info, rank_table)
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            break
        elif ret == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        time.sleep(1)
    return comm_id


def run_decoder_sample(peer, datadist, device_id: int):
    comm_id = link(datadist, device_id)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=4, shape=[2, 1024 * 1024], data_type=DataType.DT_FLOAT16,
                           placement=Placement.DEVICE)
    cache = cache_manager.allocate_cache(cache_desc)

    peer.barrier()  # was time.sleep(5): wait prompt prepared
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache_manager.pull_cache(cache_key_0, cache, batch_index=0)
    cache_manager.pull_cache(cache_key_1, cache, batch_index=1)
    tensor_addrs = cache.tensor_addrs
    tensors = harness.tensors_at(cache.cache_desc.shape, torch.float16, tensor_addrs)
    for i, t in enumerate(tensors):
        peer.check(f"tensor{i}_equal_prompt", torch.equal(t, harness.pattern(t.shape, torch.float16, seed=i)))
    del tensors
    peer.barrier()  # harness: the prompt's wait ends

    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()


def run_prompt_sample(peer, datadist, device_id: int):
    comm_id = link(datadist, device_id)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=4, shape=[2, 1024 * 1024], data_type=DataType.DT_FLOAT16,
                           placement=Placement.DEVICE)
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(cache_desc, [cache_key_0, cache_key_1])
    tensor_addrs = cache.tensor_addrs
    tensors = harness.tensors_at(cache.cache_desc.shape, torch.float16, tensor_addrs)
    for i, t in enumerate(tensors):  # was tensors[0].fill_(1)
        t.copy_(harness.pattern(t.shape, torch.float16, seed=i))
    del tensors

    peer.barrier()  # was time.sleep(30), first half: prepared
    peer.barrier()  # second half: the decoder pulled
    # a no-op when the decoder pulled (the keys are gone); frees the rows otherwise
    cache_manager.remove_cache_key(cache_key_0)
    cache_manager.remove_cache_key(cache_key_1)
    cache_manager.deallocate_cache(cache)
    datadist.unlink(comm_id)
    datadist.finalize()


def _prompt(peer):
    run_prompt_sample(peer, init_llm_datadist(LLMRole.PROMPT, 1, 0), 0)


def _decoder(peer):
    run_decoder_sample(peer, init_llm_datadist(LLMRole.DECODER, 2, 0), 0)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks both pulled rows of all four tensors."""
    return harness.run_pair(_prompt, _decoder, options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
