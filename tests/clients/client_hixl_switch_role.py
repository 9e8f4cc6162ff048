"""Port of the HIXL sample ``switch_role_sample.py`` (v2: pull, unlink, swap roles, push back).

Source: hicann/hixl, ``examples/python/switch_role_sample.py``,
commit 8bb16aa2b7e312a6bacf9947dad8073b7d866e03.

Ported: ``init_llm_datadist``, ``run_prompt_sample``, ``run_decoder_sample``,
llm_datadist calls verbatim and in order: the decoder links and
``pull_blocks``, unlinks (non-forced); the prompt ``switch_role(DECODER)``
(closing its listener) and the decoder ``switch_role(PROMPT, options)`` with a
fresh ``LLMConfig().generate_options()`` holding only ``listen_ip_info``; the
old prompt dials the new one and the new prompt ``push_blocks`` with
``src_layer_range=range(0, 2)``, ``dst_layer_range=range(0, 2)``,
``tensor_num_per_layer=1``. Neither side sets ``enable_switch_role``.

Scaffolding replaced:
- gloo group + ``dist.barrier()`` -> :meth:`Peer.barrier`.
- ``.npu()`` tensors -> CPU tensors with seeded patterns (the sample's ones /
  zeros) so the checks see which block went where.
- argparse -> ``device_id=0``, loopback ips. The sample's two hosts both use
  port 26000; on one host each side's "26000" becomes its own free port (the
  prompt's first listener, later the decoder's listener).
- the logging of the tensors -> checks.
"""

from __future__ import annotations

from types import SimpleNamespace

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

NUM_TENSORS = 2
BLOCKS_NUM = 3
KV_SHAPE = 10
PROMPT_CLUSTER_ID = 0
DECODER_CLUSTER_ID = 1
SHAPE = (BLOCKS_NUM, KV_SHAPE)


def init_llm_datadist(role: LLMRole, cluster_id, device_id: int, local_host_ip, remote_host_ip,
                      port) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = device_id
    llm_config.local_comm_res = ""
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{local_host_ip}:{port}"
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    datadist.init(llm_options)
    return datadist


def run_prompt_sample(peer, datadist, local_host_ip, remote_host_ip, args):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern(SHAPE, torch.float, seed=1)  # was torch.ones(...).npu()
    tensor2 = harness.pattern(SHAPE, torch.float, seed=2)
    addr = int(tensor.data_ptr())
    addr2 = int(tensor2.data_ptr())
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr, addr2], BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )

    peer.barrier()  # register end
    peer.barrier()  # decoder unlink

    datadist.switch_role(LLMRole.DECODER)
    peer.barrier()  # prompt switch role end, close listen
    peer.barrier()  # decoder switch role end, listen

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, args.prompt_port)
    cluster.append_remote_ip_info(remote_host_ip, args.decoder_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")
    peer.barrier()  # prompt link end

    peer.barrier()  # decoder push blocks end
    # the decoder pushed all of its blocks (its blocks 0 and 2 hold our old 0 and 1)
    for mine, seed, name in ((tensor, 1, "tensor"), (tensor2, 2, "tensor2")):
        ours = harness.pattern(SHAPE, torch.float, seed=seed)
        theirs = harness.pattern(SHAPE, torch.float, seed=seed + 10)
        expected = torch.stack([ours[0], theirs[1], ours[1]])
        peer.check(f"{name}_after_push_back", torch.equal(mine, expected))

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(peer, datadist, local_host_ip, remote_host_ip, args):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern(SHAPE, torch.float, seed=11)  # was torch.full(..., 0).npu()
    tensor2 = harness.pattern(SHAPE, torch.float, seed=12)
    addr = int(tensor.data_ptr())
    addr2 = int(tensor2.data_ptr())
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr, addr2], BlocksCacheKey(DECODER_CLUSTER_ID, 0)
    )
    peer.barrier()  # register end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, args.decoder_port)
    cluster.append_remote_ip_info(remote_host_ip, args.prompt_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    cache_manager.pull_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[0, 1],
        dst_blocks=[0, 2],
    )
    for mine, seed, name in ((tensor, 1, "tensor"), (tensor2, 2, "tensor2")):
        src = harness.pattern(SHAPE, torch.float, seed=seed)
        own = harness.pattern(SHAPE, torch.float, seed=seed + 10)
        peer.check(f"{name}_pulled", torch.equal(mine, torch.stack([src[0], own[1], src[1]])))

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_remote_ip_info(remote_host_ip, args.prompt_port)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    peer.barrier()  # decoder unlink
    peer.barrier()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{local_host_ip}:{args.decoder_port}"
    llm_options = llm_config.generate_options()
    datadist.switch_role(LLMRole.PROMPT, llm_options)

    peer.barrier()  # decoder switch role end, listen
    peer.barrier()  # prompt link end

    cache_manager.push_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[0, 1, 2],
        dst_blocks=[0, 1, 2],
        src_layer_range=range(0, 2),
        dst_layer_range=range(0, 2),
        tensor_num_per_layer=1,
    )
    peer.barrier()  # decoder push blocks end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def _prompt(peer, args):
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args.device_id, args.local_host_ip,
                                 args.remote_host_ip, args.prompt_port)
    run_prompt_sample(peer, datadist, args.local_host_ip, args.remote_host_ip, args)


def _decoder(peer, args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args.device_id, args.local_host_ip,
                                 args.remote_host_ip, args.decoder_port)
    run_decoder_sample(peer, datadist, args.local_host_ip, args.remote_host_ip, args)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks the pulled blocks, then the blocks pushed back."""
    prompt_port, decoder_port = harness.free_ports(2)
    args = SimpleNamespace(device_id=0, local_host_ip=harness.LOCALHOST, remote_host_ip=harness.LOCALHOST,
                           prompt_port=prompt_port, decoder_port=decoder_port)
    return harness.run_pair(_prompt, _decoder, prefill_args=(args,), decode_args=(args,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
