"""Port of the HIXL sample ``pull_blocks_sample.py`` (v2, bilateral ``link`` by rank table,
registered blocks caches, ``pull_blocks``, then ``swap_blocks`` out to a CPU cache and back).

Source: libochao-huawei/hixl (a copy of the HIXL repository; hicann/hixl's stored
copy lacks the pull samples), ``examples/python/pull_blocks_sample.py``,
commit 1ce7f2229a998b66313c32190ff01ff21e0efc6d.

Ported: ``init_llm_datadist``, ``link`` (rank table "1.2" for two servers,
``cluster_rank_info={1: 0, 2: 1}``, ``datadist.link("link", ...)`` then
``query_register_mem_status`` polled every second until ``RegisterMemStatus.OK``),
``_allocate_cpu_cache`` (``Cache.create_cpu_cache``), ``run_prompt_sample``,
``run_decoder_sample``; llm_datadist calls verbatim and in order.

Scaffolding replaced:
- ``torch.npu.set_device`` and ``.npu()`` tensors -> CPU tensors; the prompt's
  ``torch.ones`` becomes a seeded pattern and the decoder's a second one.
- the rank table's addresses: prompt host/device ip ``127.0.0.1``, decoder host /
  device ip ``127.0.0.2`` (both loopback) instead of 10.10.10.x / 192.168.x.x;
  the ``is_single`` branch (``hccn_tool``, ``/dev/davinci*``) is dropped.
- ``time.sleep(5)`` on the decoder ("wait prompt prepared") and ``time.sleep(30)``
  on the prompt -> :meth:`Peer.barrier` pairs; the logging -> checks.
"""

from __future__ import annotations

import json
import time

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    Cache,
    CacheDesc,
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
SHAPE = (2, 1024 * 1024)


def init_llm_datadist(role: LLMRole, cluster_id, device_id: int) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.enable_cache_manager = True
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


def _allocate_cpu_cache(block_size, num_block, num_tensors):
    cpu_addrs = []
    cpu_tensors = []
    for _ in range(num_tensors):
        kv_tensor = torch.rand(size=(num_block, block_size), dtype=torch.float32, device="cpu")
        cpu_addrs.append(kv_tensor.data_ptr())
        cpu_tensors.append(kv_tensor)
    cpu_cache_desc = CacheDesc(
        num_tensors=num_tensors,
        shape=[num_block, block_size],
        data_type=DataType.DT_FLOAT,
        placement=Placement.HOST,
    )
    return Cache.create_cpu_cache(cpu_cache_desc, cpu_addrs), cpu_tensors


def run_decoder_sample(peer, datadist, device_id: int):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[2, 1024 * 1024],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern(SHAPE, torch.float, seed=2)  # was torch.ones(...).npu()
    addr = int(tensor.data_ptr())
    cache = cache_manager.register_blocks_cache(cache_desc, [addr])

    comm_id = link(datadist, device_id)

    peer.barrier()  # was time.sleep(5): wait prompt prepared
    cache_manager.pull_blocks(
        BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1]
    )
    expected = harness.pattern(SHAPE, torch.float, seed=1)
    peer.check("pulled_blocks_equal_prompt", torch.equal(tensor, expected))
    cpu_cache, cpu_tensors = _allocate_cpu_cache(1024 * 1024, 2, 1)
    cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})
    peer.check("swapped_out_equal", torch.equal(cpu_tensors[0], expected))
    tensor.zero_()  # harness: so that the swap-in is seen
    cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})
    peer.check("swapped_in_equal", torch.equal(tensor, expected))
    peer.barrier()  # harness: the prompt's wait ends

    datadist.unlink(comm_id)
    datadist.finalize()


def run_prompt_sample(peer, datadist, device_id: int):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=1,
        shape=[2, 1024 * 1024],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern(SHAPE, torch.float, seed=1)  # was torch.ones(...).npu()
    addr = int(tensor.data_ptr())
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr], BlocksCacheKey(1, 0)
    )
    peer.note("prompt_cache_id", cache.cache_id)

    comm_id = link(datadist, device_id)
    peer.barrier()  # was time.sleep(30), first half: prepared
    peer.barrier()  # second half: the decoder is done
    datadist.unlink(comm_id)
    datadist.finalize()


def _prompt(peer):
    run_prompt_sample(peer, init_llm_datadist(LLMRole.PROMPT, 1, 0), 0)


def _decoder(peer):
    run_decoder_sample(peer, init_llm_datadist(LLMRole.DECODER, 2, 0), 0)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks pulled blocks and a swap out and back in."""
    return harness.run_pair(_prompt, _decoder, options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
