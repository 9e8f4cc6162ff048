"""Port of the HIXL sample ``push_blocks_sample.py`` (v2, one-sided link, the DECODER pushes).

Source: hicann/hixl, ``examples/python/push_blocks_sample.py``,
commit 3df13c0e543c557612afe117880235e501ff309b.

Ported: ``init_llm_datadist``, ``run_prompt_sample``, ``run_decoder_sample``;
every llm_datadist call, keyword and argument shape in the sample's order.

Scaffolding replaced:
- ``torch.distributed`` gloo group + ``dist.barrier()`` -> :meth:`Peer.barrier`.
- ``torch.npu.set_device`` and ``.npu()`` tensors -> CPU tensors. The prompt's
  ``torch.ones`` and the decoder's zeros become two seeded patterns, so that the
  check sees which block went where.
- argparse: ``device_id=0``, both host ips ``127.0.0.1``, no ``--local_comm_res``,
  no ``--transfer_backend``; the fixed ports 26000 (prompt) / 26001 (decoder)
  become two free loopback ports.
- the logging of the tensors after the push -> checks of the prompt's blocks.
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


def init_llm_datadist(role: LLMRole, cluster_id, args) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = args.device_id
    llm_config.local_comm_res = ""
    if args.transfer_backend == "hixl":
        llm_config.transfer_backend = "hixl"
    elif args.transfer_backend:
        raise RuntimeError(f"unsupported transfer_backend: {args.transfer_backend}")
    if role == LLMRole.PROMPT:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{args.prompt_port}"
    else:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{args.decoder_port}"
    if args.local_comm_res:
        llm_config.local_comm_res = args.local_comm_res
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    datadist.init(llm_options)
    return datadist


def run_prompt_sample(peer, datadist):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(
        num_tensors=NUM_TENSORS,
        shape=[BLOCKS_NUM, KV_SHAPE],
        data_type=DataType.DT_FLOAT,
        placement=Placement.DEVICE,
    )
    tensor = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=1)  # was torch.ones(...).npu()
    tensor2 = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=2)
    addr = int(tensor.data_ptr())
    addr2 = int(tensor2.data_ptr())
    cache = cache_manager.register_blocks_cache(
        cache_desc, [addr, addr2], BlocksCacheKey(PROMPT_CLUSTER_ID, 0)
    )

    peer.barrier()  # register end
    peer.barrier()  # decoder push blocks end

    # decoder pushed its blocks [0, 1] into our blocks [0, 2]; block 1 is untouched
    for mine, theirs, name in ((tensor, 11, "tensor"), (tensor2, 12, "tensor2")):
        src = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=theirs)
        own = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=theirs - 10)
        peer.check(f"{name}_block0_from_decoder_block0", torch.equal(mine[0], src[0]))
        peer.check(f"{name}_block2_from_decoder_block1", torch.equal(mine[2], src[1]))
        peer.check(f"{name}_block1_untouched", torch.equal(mine[1], own[1]))

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
    tensor = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=11)  # was torch.full(..., 0).npu()
    tensor2 = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=12)
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

    cache_manager.push_blocks(
        BlocksCacheKey(PROMPT_CLUSTER_ID, 0),
        cache,
        src_blocks=[0, 1],
        dst_blocks=[0, 2],
    )
    peer.check("push_blocks_returned", True)

    peer.barrier()  # push_blocks end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def _prompt(peer, args):
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args)
    run_prompt_sample(peer, datadist)


def _decoder(peer, args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args)
    run_decoder_sample(peer, datadist, args.local_host_ip, args.remote_host_ip, args)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks the prompt's blocks after the decoder's push."""
    prompt_port, decoder_port = harness.free_ports(2)
    args = SimpleNamespace(device_id=0, local_host_ip=harness.LOCALHOST, remote_host_ip=harness.LOCALHOST,
                           local_comm_res=None, transfer_backend="", prompt_port=prompt_port,
                           decoder_port=decoder_port)
    return harness.run_pair(_prompt, _decoder, prefill_args=(args,), decode_args=(args,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
