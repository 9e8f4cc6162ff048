"""Port of the HIXL sample ``transfer_cache_async_sample.py`` (v2, remote-cache-accessible,
layer-wise push from the PROMPT into the DECODER's blocks cache, the decoder listens).

Source: hicann/hixl, ``examples/python/transfer_cache_async_sample.py``,
commit 3df13c0e543c557612afe117880235e501ff309b.

Ported: ``init_llm_datadist``, ``LayerSynchronizerImpl``, ``run_prompt_sample``,
``run_decoder_sample``; llm_datadist calls verbatim and in order. Note both
sides listen (decoder on "26000", prompt on "26001") and the PROMPT dials.

Scaffolding replaced:
- gloo group + ``dist.barrier()`` -> :meth:`Peer.barrier`.
- ``.npu()`` tensors -> CPU tensors with seeded patterns (the sample's ones /
  zeros), so the check sees the bytes that moved.
- argparse -> ``device_id=0``, loopback ips, no local_comm_res / backend; ports
  26000 / 26001 -> two free loopback ports.
- the logging of the decoder's tensors -> checks; ``get_results()`` is recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
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
    if args.transfer_backend == "hixl":
        llm_config.transfer_backend = "hixl"
    elif args.transfer_backend:
        raise RuntimeError(f"unsupported transfer_backend: {args.transfer_backend}")
    if role == LLMRole.DECODER:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{args.decoder_port}"
    else:
        llm_config.listen_ip_info = f"{args.local_host_ip}:{args.prompt_port}"
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True
    if args.local_comm_res:
        llm_config.local_comm_res = args.local_comm_res
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    datadist.init(llm_options)
    return datadist


class LayerSynchronizerImpl(LayerSynchronizer):
    def __init__(self, ret=True):
        self._ret = ret

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return self._ret


def run_prompt_sample(peer, datadist, local_host_ip, remote_host_ip, args):
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

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    cluster.append_local_ip_info(local_host_ip, args.prompt_port)
    cluster.append_remote_ip_info(remote_host_ip, args.decoder_port)
    ret, _ = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    transfer_config = TransferWithCacheKeyConfig(
        BlocksCacheKey(DECODER_CLUSTER_ID, 0), range(0, 1), range(0, 1)
    )
    cache_task = cache_manager.transfer_cache_async(
        cache, LayerSynchronizerImpl(True), [transfer_config]
    )
    results = cache_task.get_results()
    peer.note("get_results", [None if r is None else getattr(r, "name", str(r)) for r in results])
    peer.check("get_results_success", list(results) == [LLMStatusCode.LLM_SUCCESS])
    peer.barrier()  # transfer cache end

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = DECODER_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(peer, datadist, local_host_ip, remote_host_ip):
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
    peer.barrier()  # prompt transfer cache end

    # layer 0 (tensors 0 and 1) came from the prompt. Without block indices LLM-DataDist's layer-wise
    # job moves a blocks cache as a one-row cache whose row is block 0: block 0 arrived, the rest kept.
    for mine, seed, own_seed, name in ((tensor, 1, 11, "tensor"), (tensor2, 2, 12, "tensor2")):
        src = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=seed)
        own = harness.pattern((BLOCKS_NUM, KV_SHAPE), torch.float, seed=own_seed)
        peer.check(f"{name}_block0_equals_prompt", torch.equal(mine[0], src[0]))
        peer.check(f"{name}_other_blocks_kept", torch.equal(mine[1:], own[1:]))

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER_ID
    ret, _ = datadist.unlink_clusters([cluster], 5000, force=True)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def _prompt(peer, args):
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, args)
    run_prompt_sample(peer, datadist, args.local_host_ip, args.remote_host_ip, args)


def _decoder(peer, args):
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, args)
    run_decoder_sample(peer, datadist, args.local_host_ip, args.remote_host_ip)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Both sides on loopback; checks the decoder's blocks after the layer-wise push."""
    decoder_port, prompt_port = harness.free_ports(2)
    args = SimpleNamespace(device_id=0, local_host_ip=harness.LOCALHOST, remote_host_ip=harness.LOCALHOST,
                           local_comm_res=None, transfer_backend="", prompt_port=prompt_port,
                           decoder_port=decoder_port)
    return harness.run_pair(_prompt, _decoder, prefill_args=(args,), decode_args=(args,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
