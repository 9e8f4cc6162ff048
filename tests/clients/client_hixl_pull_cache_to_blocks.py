"""Port of the HIXL sample ``pull_from_cache_to_blocks.py`` (v2, bilateral ``link``, a pool
cache on the prompt pulled by ``CacheKey`` into one block of the decoder's blocks cache).

Source: libochao-huawei/hixl (a copy of the HIXL repository),
``examples/python/pull_from_cache_to_blocks.py`` at commit
0ea10cd82ea144f49d175d4eb351668a6bf1bd3c, with its helpers from
``examples/python/pull_sample_common.py`` at commit
639307898dd469621c31787d088b03033e4b7d13 (``init_llm_datadist`` with
``mem_pool_cfg`` of 64 MiB, ``link``, ``CACHE_NUM_TENSORS = 4``,
``CACHE_SHAPE = [2, 16 * 1024]``).

Ported: ``init_llm_datadist``, ``link``, ``run_prompt_sample``,
``run_decoder_sample``; llm_datadist calls verbatim and in order, in particular
``pull_blocks(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache,
src_blocks=[], dst_blocks=[0])`` (a contiguous remote row into a local block).

Scaffolding replaced:
- ``init_process_group`` + ``dist.barrier()`` -> :meth:`Peer.barrier`.
- ``.npu()`` tensors -> CPU tensors (the decoder's ``torch.ones`` kept). The
  prompt never writes its cache in the sample; here it writes a seeded pattern
  through ``cache.tensor_addrs`` (marked "harness") so the pulled bytes can be
  checked.
- the rank table's addresses -> loopback (prompt ``127.0.0.1``, decoder
  ``127.0.0.2``); the single-machine branch is dropped.
"""

from __future__ import annotations

import json
import time

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import ...
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
CACHE_NUM_TENSORS = 4
CACHE_SHAPE = [2, 16 * 1024]
MEM_POOL_SIZE = 64 * 1024 * 1024


def init_llm_datadist(role, cluster_id, device_id: int, enable_mem_pool: bool = True) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.enable_cache_manager = True
    if enable_mem_pool:
        llm_config.mem_pool_cfg = f'{{"memory_size": {MEM_POOL_SIZE}}}'
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport / link-address options
    datadist.init(llm_options)
    return datadist


def _build_distributed_rank_table(device_id):
    return {
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


def link(datadist, device_id):
    cluster_rank_info = {1: 0, 2: 1}
    rank_table = json.dumps(_build_distributed_rank_table(device_id))
    comm_id = datadist.link("link", cluster_rank_info, rank_table)
    while True:
        ret = datadist.query_register_mem_status(comm_id)
        if ret == RegisterMemStatus.OK:
            return comm_id
        if ret == RegisterMemStatus.FAILED:
            raise RuntimeError("link failed")
        time.sleep(1)


def run_decoder_sample(peer, datadist, device_id: int):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=CACHE_NUM_TENSORS,
        shape=CACHE_SHAPE,
        data_type=DataType.DT_FLOAT16,
        placement=Placement.DEVICE,
    )
    tensors = []
    addrs = []
    for _ in range(CACHE_NUM_TENSORS):
        tensor = torch.ones(*CACHE_SHAPE, dtype=torch.float16)  # was .npu()
        addrs.append(tensor.data_ptr())
        tensors.append(tensor)
    cache = cache_manager.register_blocks_cache(cache_desc, addrs)

    comm_id = link(datadist, device_id)

    peer.barrier()  # cache ready
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_manager.pull_blocks(cache_key, cache, src_blocks=[], dst_blocks=[0])
    for i, t in enumerate(tensors):
        row0 = harness.pattern(CACHE_SHAPE, torch.float16, seed=i)[0]
        peer.check(f"tensor{i}_block0_is_prompt_row0", torch.equal(t[0], row0))
        peer.check(f"tensor{i}_block1_untouched", bool((t[1] == 1).all()))

    peer.barrier()  # pull_blocks end
    datadist.unlink(comm_id)
    peer.barrier()  # wait peer unlink end
    datadist.finalize()


def run_prompt_sample(peer, datadist, device_id: int):
    comm_id = link(datadist, device_id)
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=CACHE_NUM_TENSORS,
        shape=CACHE_SHAPE,
        data_type=DataType.DT_FLOAT16,
        placement=Placement.DEVICE,
    )
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(cache_desc, [cache_key])
    # harness: give the cache contents the decoder can check
    for i, t in enumerate(harness.tensors_at(CACHE_SHAPE, torch.float16, cache.tensor_addrs)):
        t.copy_(harness.pattern(CACHE_SHAPE, torch.float16, seed=i))

    peer.barrier()  # cache ready
    peer.barrier()  # decoder pull_blocks end
    datadist.unlink(comm_id)
    peer.barrier()  # wait peer unlink end

    # a no-op when the decoder pulled; frees the row otherwise
    cache_manager.remove_cache_key(cache_key)
    cache_manager.deallocate_cache(cache)
    datadist.finalize()


def _prompt(peer):
    run_prompt_sample(peer, init_llm_datadist(LLMRole.PROMPT, 1, 0), 0)


def _decoder(peer):
    run_decoder_sample(peer, init_llm_datadist(LLMRole.DECODER, 2, 0), 0)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks the pulled row landed in block 0 of each tensor."""
    return harness.run_pair(_prompt, _decoder, options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
