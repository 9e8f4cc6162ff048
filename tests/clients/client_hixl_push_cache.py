"""Port of the HIXL sample ``push_cache_sample.py`` (v2, one-sided link, the DECODER pushes a row).

Source: hicann/hixl, ``examples/python/push_cache_sample.py``,
commit 3df13c0e543c557612afe117880235e501ff309b.

Ported: ``init_llm_datadist``, ``run_prompt_sample``, ``run_decoder_sample``,
llm_datadist calls verbatim and in order. The decoder addresses the prompt's
cache as ``CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0)``: it
relies on the prompt's first registered cache getting id 1.

Scaffolding replaced:
- gloo group + ``dist.barrier()`` -> :meth:`Peer.barrier`.
- ``.npu()`` tensors -> CPU tensors; the prompt's zeros and the decoder's ones
  become seeded patterns so the check sees which row moved.
- argparse -> ``device_id=0``, loopback host ips, no local_comm_res / backend;
  ports 26000 / 26001 -> two free loopback ports.
- the logging of the tensors -> checks of the prompt's rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    CacheDesc,
    CacheKeyByIdAndIndex,
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
    tensor = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=1)  # was torch.full(..., 0).npu()
    tensor2 = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=2)
    addr = int(tensor.data_ptr())
    addr2 = int(tensor2.data_ptr())
    cache = cache_manager.register_cache(cache_desc, [addr, addr2])
    peer.note("prompt_cache_id", cache.cache_id)

    peer.barrier()  # register end
    peer.barrier()  # decoder push cache end

    # row 0 of both tensors now holds the decoder's row 0; rows 1 and 2 are ours
    for mine, seed, name in ((tensor, 1, "tensor"), (tensor2, 2, "tensor2")):
        src = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=seed + 10)
        own = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=seed)
        peer.check(f"{name}_row0_from_decoder", torch.equal(mine[0], src[0]))
        peer.check(f"{name}_rows1_2_untouched", torch.equal(mine[1:], own[1:]))

    peer.barrier()  # wait unlink end

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
    tensor = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=11)  # was torch.full(..., 1).npu()
    tensor2 = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=12)
    addr = int(tensor.data_ptr())
    addr2 = int(tensor2.data_ptr())
    cache = cache_manager.register_cache(cache_desc, [addr, addr2])
    peer.barrier()  # register end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, args.decoder_port)
    cluster.append_remote_ip_info(remote_host_ip, args.prompt_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    cache_manager.push_cache(
        CacheKeyByIdAndIndex(cluster_id=PROMPT_CLUSTER_ID, cache_id=1, batch_index=0),
        cache,
        src_batch_index=0,
    )
    peer.check("push_cache_returned", True)

    peer.barrier()  # push cache end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    cluster.append_remote_ip_info(remote_host_ip, args.prompt_port)
    ret, _ = datadist.unlink_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")
    peer.barrier()  # unlink end

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def _prompt(peer, args):
    run_prompt_sample(peer, init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args))


def _decoder(peer, args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args)
    run_decoder_sample(peer, datadist, args.local_host_ip, args.remote_host_ip, args)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks the prompt's rows after the decoder's push_cache."""
    prompt_port, decoder_port = harness.free_ports(2)
    args = SimpleNamespace(device_id=0, local_host_ip=harness.LOCALHOST, remote_host_ip=harness.LOCALHOST,
                           local_comm_res=None, transfer_backend="", prompt_port=prompt_port,
                           decoder_port=decoder_port)
    return harness.run_pair(_prompt, _decoder, prefill_args=(args,), decode_args=(args,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
