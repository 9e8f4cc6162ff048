"""Port of Torchair's LLaMA PD-separation benchmark (v1 KvCacheManager: the PROMPT allocates batch caches
with one ``CacheKey`` per batch row, the DECODER pulls them by ``CacheKey`` row by row into one cache of its
own, a warmup batch and then a second batch over the same rows; the prompt frees with ``deallocate_cache``
and ``remove_cache_key`` of keys the pulls already took).

Source: Ascend/torchair, commit 2098362fed45e3ca1f0305f8d78990149f5d5116:
``npu_tuned_model/llm/llama/benchmark/pd_separate/run_prompt.py`` and
``npu_tuned_model/llm/llama/benchmark/pd_separate/run_decoder.py``.

Ported, llm_datadist calls verbatim and in order:
- ``run_prompt.py``: ``init_llm_engine`` (``LLMDataDist(LLMRole.PROMPT, 0)``; ``LLMConfig`` with
  ``device_id``, ``listen_ip_info`` and ``ge_options = {"ge.flowGraphMemMaxSize": "2589934592"}``;
  ``init(llm_config.generate_options())``), ``_allocate_kv_cache`` (``CacheDesc(num_tensors=160, shape=[4,
  ..., 8 // world_size, ...], data_type=DataType.DT_FLOAT16)`` and ``allocate_cache(kv_cache_desc,
  kv_cache_keys)`` with ``CacheKey(prompt_cluster_id=0, req_id=i, model_id=0)`` for ``i`` in
  ``range(start_id, end_id)``: req ids 0..3 for the warmup cache, 4..7 for the second), ``run_model``
  (``cache.per_device_tensor_addrs[0]``, ``cache.cache_desc.shape``), and the main block's clean-up:
  ``deallocate_cache`` of both caches, then ``remove_cache_key`` of all eight keys (every one of them
  already taken by the decoder's pulls), ``finalize``.
- ``run_decoder.py``: ``init_clusters_info`` (``remote_cluster_id = 0`` -- the decoder's own cluster id is
  0 too --, ``append_local_ip_info(local_ip, 26000)``, ``append_remote_ip_info(remote_ip, 26000)``),
  ``init_llm_engine`` (``LLMDataDist(LLMRole.DECODER, 0)``, ``device_id``, ``ge_options``),
  ``link_clusters(clusters_info)`` without a timeout and without checking the result, ``_allocate_kv_cache``
  (the same desc, no keys), ``_init_kv_cache`` (``pull_cache(CacheKey(prompt_cluster_id=0, req_id=index,
  model_id=0), cache, index % bs)`` for req ids 0..3, later 4..7, ``bs = 4``), ``run_model``,
  ``deallocate_cache``, ``unlink_clusters(clusters_info)`` without a timeout, ``finalize``.

Scaffolding replaced:
- the model (``SeparateDeployModelRunner``: tokenizer, weights, graph compile, the decode loop of
  ``max_new_tokens``) -> the prompt's ``run_model`` writes a seeded pattern into every tensor of the cache
  it is given (what the forward pass writes into ``kv_tensors``); the decoder's ``run_model`` checks that
  every row of its cache holds the prompt's row it pulled (it runs once for the warmup batch and once for
  the second, in place of the decode loop).
- the KV shape ``[4, 2048, 8 // world_size, 128]`` -> ``[4, 16, 8 // world_size, 8]`` (160 tensors of
  8 KiB instead of 16 MiB); ``WORLD_SIZE`` unset (1); ``local_rank`` 0.
- ``torchair.llm_datadist.create_npu_tensors`` -> :func:`tensors_at`; ``torch.npu.set_device`` dropped.
- the device ips: the prompt's ``_LISTEN_IP_INFO`` / the decoder's ``_REMOTE_IP_INFOS`` -> ``127.0.0.1``,
  the decoder's ``_LOCAL_IP_INFOS`` -> ``127.0.0.2``; port 26000 (all three places) -> one free port.
- ``send_prompt_outputs`` / ``recv_inputs_from_prompt`` (a pickle file ``prompt.pkl``) -> :meth:`Peer.send`
  / :meth:`Peer.recv`; the two processes are started by hand one after the other upstream -> a
  :meth:`Peer.barrier` before the decoder links (the prompt listens) and one before its first pull (the
  prompt ran its model; upstream the decoder's model compile gives it that time); the prompt's
  ``time.sleep(1200)`` ("keep the prompt up while the decoder links and pulls") -> a barrier the decoder
  passes after its ``finalize``.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
)

SEQ_LEN = 16  # was 2048
HEAD_DIM = 8  # was 128


def _seed(req_base: int, tensor_index: int) -> int:
    """harness: the pattern the prompt's "model" writes into tensor ``tensor_index`` of the cache whose
    first req id is ``req_base`` (0: the warmup cache, 4: the second one)."""
    return req_base * 1000 + tensor_index


# -- run_prompt.py -----------------------------------------------------------------------------------


def init_prompt_engine(args, rank_id: int) -> LLMDataDist:
    cluster_id = 0
    engine = LLMDataDist(LLMRole.PROMPT, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = rank_id
    llm_config.listen_ip_info = args.listen_ip_info[rank_id]
    ge_options = {
        "ge.flowGraphMemMaxSize": "2589934592",
    }
    llm_config.ge_options = ge_options
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    engine.init(llm_options)
    return engine


def run_prompt_model(cache: KvCache, req_base: int):
    kv_tensor_addrs = cache.per_device_tensor_addrs[0]
    kv_tensors = harness.tensors_at(cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # was create_npu_tensors
    # harness: the forward pass writes the KV of the batch into kv_tensors
    for index, kv_tensor in enumerate(kv_tensors):
        kv_tensor.copy_(harness.pattern(cache.cache_desc.shape, torch.float16, seed=_seed(req_base, index)))


def _allocate_prompt_kv_cache(cache_manager, start_id, end_id):
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    kv_cache_desc = CacheDesc(num_tensors=160, shape=[4, SEQ_LEN, 8 // world_size, HEAD_DIM],
                              data_type=DataType.DT_FLOAT16)
    kv_cache_keys = []
    for i in range(start_id, end_id):
        kv_cache_keys.append(CacheKey(prompt_cluster_id=0, req_id=i, model_id=0))
    cache = cache_manager.allocate_cache(kv_cache_desc, kv_cache_keys)
    return cache, kv_cache_keys


def _prompt(peer, args):
    local_rank = 0
    prompt_engine = init_prompt_engine(args, local_rank)
    peer.barrier()  # harness: the prompt listens; the decoder may link

    kv_cache_manager = prompt_engine.kv_cache_manager

    # warmup
    warmup_kv_cache, warmup_cache_keys = _allocate_prompt_kv_cache(kv_cache_manager, 0, 4)
    run_prompt_model(warmup_kv_cache, 0)

    kv_cache, cache_keys = _allocate_prompt_kv_cache(prompt_engine.kv_cache_manager, 4, 8)
    run_prompt_model(kv_cache, 4)
    peer.send({"prompt_cache_ids": [warmup_kv_cache.cache_id, kv_cache.cache_id]})  # was send_prompt_outputs
    peer.barrier()  # harness: the prompt ran its model (the decoder's compile time upstream)
    peer.barrier()  # was time.sleep(1200): the decoder pulled, unlinked and finalized

    for allocated_cache in [warmup_kv_cache, kv_cache]:
        kv_cache_manager.deallocate_cache(allocated_cache)
    for cache_keys in (warmup_cache_keys + cache_keys):
        kv_cache_manager.remove_cache_key(cache_keys)
    prompt_engine.finalize()


# -- run_decoder.py ----------------------------------------------------------------------------------


def init_clusters_info(args, rank_id):
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 0
    cluster.append_local_ip_info(args.local_ip_infos[rank_id], args.port)  # was 26000
    cluster.append_remote_ip_info(args.remote_ip_infos[rank_id], args.port)  # was 26000
    clusters = [cluster]
    return clusters


def init_decoder_engine(rank_id: int) -> LLMDataDist:
    cluster_id = 0
    engine = LLMDataDist(LLMRole.DECODER, cluster_id)
    llm_config = LLMConfig()
    llm_config.device_id = rank_id
    ge_options = {
        "ge.flowGraphMemMaxSize": "2589934592",
    }
    llm_config.ge_options = ge_options
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    engine.init(llm_options)
    return engine


def run_decoder_model(peer, cache: KvCache, req_base: int, name: str):
    kv_tensor_addrs = cache.per_device_tensor_addrs[0]
    kv_tensors = harness.tensors_at(cache.cache_desc.shape, torch.float16, kv_tensor_addrs)  # was create_npu_tensors
    # harness: in place of the forward pass, check that row ``index % bs`` holds the prompt's row of req ``index``
    shape = cache.cache_desc.shape
    same = all(torch.equal(kv_tensor, harness.pattern(shape, torch.float16, seed=_seed(req_base, index)))
               for index, kv_tensor in enumerate(kv_tensors))
    peer.check(f"{name}_rows_equal_prompt", same)
    del kv_tensors


def _allocate_decoder_kv_cache(cache_manager):
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    kv_cache_desc = CacheDesc(num_tensors=160, shape=[4, SEQ_LEN, 8 // world_size, HEAD_DIM],
                              data_type=DataType.DT_FLOAT16)
    cache = cache_manager.allocate_cache(kv_cache_desc)
    return cache


def _init_kv_cache(cache_manager, cache, start_id, end_id, bs):
    for index in range(start_id, end_id):
        prompt_cache_key = CacheKey(prompt_cluster_id=0, req_id=index, model_id=0)
        cache_manager.pull_cache(prompt_cache_key, cache, index % bs)


def _decoder(peer, args):
    local_rank = 0
    decoder_engine = init_decoder_engine(local_rank)
    clusters_info = init_clusters_info(args, local_rank)
    peer.barrier()  # harness: the prompt listens
    decoder_engine.link_clusters(clusters_info)

    kv_cache_manager = decoder_engine.kv_cache_manager
    kv_cache = _allocate_decoder_kv_cache(kv_cache_manager)

    batch_size = 4
    peer.barrier()  # harness: the prompt ran its model
    _init_kv_cache(kv_cache_manager, kv_cache, 0, 4, batch_size)
    step_inputs = peer.recv(30.0)  # was recv_inputs_from_prompt()
    peer.note("prompt_cache_ids", step_inputs["prompt_cache_ids"])
    run_decoder_model(peer, kv_cache, 0, "warmup")

    _init_kv_cache(kv_cache_manager, kv_cache, 4, 8, batch_size)
    run_decoder_model(peer, kv_cache, 4, "second_batch")

    kv_cache_manager.deallocate_cache(kv_cache)
    decoder_engine.unlink_clusters(clusters_info)
    decoder_engine.finalize()
    peer.barrier()  # harness: ends the prompt's time.sleep(1200)


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Prompt and decoder on loopback; checks the decoder's cache after each batch of four pulls."""
    (port,) = harness.free_ports(1)
    args = SimpleNamespace(
        port=port,
        listen_ip_info=[f"{harness.LOCALHOST}:{port}"],
        local_ip_infos=[harness.OTHER_LOCALHOST],
        remote_ip_infos=[harness.LOCALHOST],
    )
    return harness.run_pair(_prompt, _decoder, prefill_args=(args,), decode_args=(args,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
