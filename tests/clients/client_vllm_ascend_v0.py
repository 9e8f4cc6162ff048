"""Port of vllm-ascend's older ``LLMDataDistConnector`` (vLLM v0, KvCacheManager / v1 mode).

Source: vllm-project/vllm-ascend, ``vllm_ascend/distributed/llmdatadist_connector.py``,
commit 0594ea235871ee5bf79447521615d8d8ff222196 (option defaults from
``vllm_ascend/envs.py``: ``LLMDATADIST_COMM_PORT="26000"``,
``LLMDATADIST_SYNC_CACHE_WAIT_TIME="5000"``).

Ported, llm_datadist calls verbatim and in order: ``KVTransferEngine``
(``__init__``, ``prepare_data_dist`` with a hand-built options dict --
``llm.SyncKvCacheWaitTime``, ``ge.exec.deviceId``, ``llm.listenIpInfo`` on the
prompt -- and ``kv_cache_manager``; ``make_cluster`` with local port 0 and
remote port 26000), ``LLMDataDistConnector.__init__`` (the decoder's
``link_clusters([cluster], 20000)``, result not checked),
``send_kv_caches_and_hidden_states`` (four ``CacheDesc`` -- K and V with
``seq_len_dim_index=1`` --, four ``CacheKey(cluster_id, 0, model_id=1..4)``,
four ``allocate_cache``, ``per_device_tensor_addrs[0]``),
``recv_kv_caches_and_hidden_states`` (the same descs with
``seq_len_dim_index=-1``, four ``allocate_cache`` without keys,
``CacheKeyByIdAndIndex(remote_cluster_id, 1..4, 0)`` -- it relies on the
prompt's cache ids being 1..4 -- and ``pull_cache(key, buffer, 0)``) and
``close`` (``unlink_clusters([cluster], 5000)``). Both sides use
``cluster_id = local_rank = 0``: the decoder links to a remote cluster id equal
to its own.

Scaffolding replaced:
- ``npu-smi`` / ``hccn_tool`` device ips -> ``["127.0.0.1", "127.0.0.2", ...]``;
  ``PROMPT_DEVICE_ID="0"``, ``DECODE_DEVICE_ID="1"``; port 26000 -> a free port
  (the same value for ``LLMDATADIST_COMM_PORT`` and ``make_cluster``'s 26000).
- the model runner input (tokens, slot mapping, per-layer paged KV) -> plain
  tensors of 2 layers, 6 tokens, 2 heads of 8; ``torchair...create_npu_tensors``
  -> :func:`tensors_at`; ``torch_npu.scatter_update_`` -> a copy into the
  buffers; ``_npu_reshape_and_cache`` on the decoder -> checks of the pulled buffers.
- ``finalize`` is never called by the connector; the harness calls it last.
"""

from __future__ import annotations

import _client_harness as harness
import torch

import aio_datadist.compat as llm_datadist  # was: import llm_datadist

TORCH_DTYPE_TO_NPU_DTYPE = {
    torch.half: llm_datadist.DataType.DT_FLOAT16,
    torch.float16: llm_datadist.DataType.DT_FLOAT16,
    torch.bfloat16: llm_datadist.DataType.DT_BF16,
    torch.float: llm_datadist.DataType.DT_FLOAT,
    torch.float32: llm_datadist.DataType.DT_FLOAT,
    torch.int8: llm_datadist.DataType.DT_INT8,
    torch.int64: llm_datadist.DataType.DT_INT64,
    torch.int32: llm_datadist.DataType.DT_INT32,
}

NUM_LAYER = 2
NUM_TOKENS = 6
NUM_HEADS = 2
HEAD_SIZE = 8
HIDDEN_SIZE = 16
LLMDATADIST_SYNC_CACHE_WAIT_TIME = "5000"


def get_device_ips():
    return ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8"]


class KVTransferEngine:

    def __init__(self, world_size, n_layer, role, local_rank, comm_port):
        self.world_size = world_size
        self.n_layer = n_layer
        self.role = role
        self.device_ip_list = get_device_ips()
        self.local_rank = local_rank
        self.cluster_id = local_rank
        self.comm_port = comm_port
        self.data_dist = llm_datadist.LLMDataDist(self.role, self.cluster_id)

        prompt_ids = [0]  # PROMPT_DEVICE_ID="0"
        decode_ids = [1]  # DECODE_DEVICE_ID="1"
        self.prompt_ip_list = [self.device_ip_list[i] for i in prompt_ids]
        self.decode_ip_list = [self.device_ip_list[i] for i in decode_ids]

    def prepare_data_dist(self):
        options = {
            "llm.SyncKvCacheWaitTime": LLMDATADIST_SYNC_CACHE_WAIT_TIME,
        }
        if self.role == llm_datadist.LLMRole.PROMPT:
            options["ge.exec.deviceId"] = str(self.local_rank)
            options["llm.listenIpInfo"] = f"{self.prompt_ip_list[self.local_rank]}:{self.comm_port}"
        else:
            options["ge.exec.deviceId"] = str(self.local_rank)
        options.update(harness.extra_options())  # harness: transport selection
        self.data_dist.init(options)
        self.kv_transfer = self.data_dist.kv_cache_manager

    def make_cluster(self, prefill_ip, cluster_id=-1):
        cluster = llm_datadist.LLMClusterInfo()
        cluster.remote_cluster_id = cluster_id
        local_ip = self.decode_ip_list[self.local_rank]
        remote_ip = prefill_ip
        cluster.append_local_ip_info(local_ip, 0)
        cluster.append_remote_ip_info(remote_ip, self.comm_port)  # was the literal 26000
        return cluster


class LLMDataDistConnector:

    def __init__(self, peer, role, comm_port):
        self.peer = peer
        self.role = role
        self.llm_datadist_engine = KVTransferEngine(2, NUM_LAYER, self.role, 0, comm_port)
        if self.role == llm_datadist.LLMRole.PROMPT:
            self.llm_datadist_engine.prepare_data_dist()
        else:
            self.llm_datadist_engine.prepare_data_dist()
            self.cluster = self.llm_datadist_engine.make_cluster(
                self.llm_datadist_engine.prompt_ip_list[0], self.llm_datadist_engine.cluster_id)
            _, ret = self.llm_datadist_engine.data_dist.link_clusters([self.cluster], 20000)
            self.peer.note("link_rets", [getattr(r, "name", str(r)) for r in ret])

    def _descs(self, kv_dtype, kv_seq_len_dim_index):
        kv_shape = (1, NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
        input_shape = (1, NUM_TOKENS, 1, 1)
        hidden_shape = (1, NUM_TOKENS, 1, HIDDEN_SIZE)
        key_desc = llm_datadist.CacheDesc(NUM_LAYER, kv_shape, TORCH_DTYPE_TO_NPU_DTYPE[kv_dtype],
                                          seq_len_dim_index=kv_seq_len_dim_index)
        value_desc = llm_datadist.CacheDesc(NUM_LAYER, kv_shape, TORCH_DTYPE_TO_NPU_DTYPE[kv_dtype],
                                            seq_len_dim_index=kv_seq_len_dim_index)
        input_desc = llm_datadist.CacheDesc(1, input_shape, TORCH_DTYPE_TO_NPU_DTYPE[torch.int32],
                                            seq_len_dim_index=-1)
        hidden_desc = llm_datadist.CacheDesc(1, hidden_shape, TORCH_DTYPE_TO_NPU_DTYPE[kv_dtype],
                                             seq_len_dim_index=-1)
        return key_desc, value_desc, input_desc, hidden_desc

    def send_kv_caches_and_hidden_states(self, kv_hidden_dtype, sources):
        key_desc, value_desc, input_desc, hidden_desc = self._descs(kv_hidden_dtype, 1)
        key_cache_keys = [llm_datadist.CacheKey(self.llm_datadist_engine.cluster_id, 0, 1)]
        value_cache_keys = [llm_datadist.CacheKey(self.llm_datadist_engine.cluster_id, 0, 2)]
        input_cache_keys = [llm_datadist.CacheKey(self.llm_datadist_engine.cluster_id, 0, 3)]
        hidden_cache_keys = [llm_datadist.CacheKey(self.llm_datadist_engine.cluster_id, 0, 4)]

        self.key_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(key_desc, key_cache_keys)
        self.value_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(value_desc, value_cache_keys)
        self.input_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(input_desc, input_cache_keys)
        self.hidden_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(hidden_desc, hidden_cache_keys)

        key_buffer_addr = self.key_buffer.per_device_tensor_addrs[0]
        value_buffer_addr = self.value_buffer.per_device_tensor_addrs[0]
        input_buffer_addr = self.input_buffer.per_device_tensor_addrs[0]
        hidden_buffer_addr = self.hidden_buffer.per_device_tensor_addrs[0]
        self.peer.note("prompt_cache_ids", [self.key_buffer.cache_id, self.value_buffer.cache_id,
                                            self.input_buffer.cache_id, self.hidden_buffer.cache_id])

        # harness: create_npu_tensors + scatter_update_ -> CPU views filled with the sources
        buffers = [
            harness.tensors_at(key_desc.shape, kv_hidden_dtype, key_buffer_addr),
            harness.tensors_at(value_desc.shape, kv_hidden_dtype, value_buffer_addr),
            harness.tensors_at(input_desc.shape, torch.int32, input_buffer_addr),
            harness.tensors_at(hidden_desc.shape, kv_hidden_dtype, hidden_buffer_addr),
        ]
        for views, src in zip(buffers, sources, strict=True):
            for view, s in zip(views, src, strict=True):
                view.copy_(s)

    def recv_kv_caches_and_hidden_states(self, kv_hidden_dtype):
        key_desc, value_desc, input_desc, hidden_desc = self._descs(kv_hidden_dtype, -1)
        self.decode_key_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(key_desc)
        self.decode_value_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(value_desc)
        self.decode_input_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(input_desc)
        self.decode_hidden_buffer = self.llm_datadist_engine.kv_transfer.allocate_cache(hidden_desc)
        key_buffer_addrs = self.decode_key_buffer.per_device_tensor_addrs[0]
        value_buffer_addrs = self.decode_value_buffer.per_device_tensor_addrs[0]
        input_buffer_addrs = self.decode_input_buffer.per_device_tensor_addrs[0]
        hidden_buffer_addrs = self.decode_hidden_buffer.per_device_tensor_addrs[0]

        key_cache_key = llm_datadist.CacheKeyByIdAndIndex(self.cluster.remote_cluster_id, 1, 0)
        value_cache_key = llm_datadist.CacheKeyByIdAndIndex(self.cluster.remote_cluster_id, 2, 0)
        input_cache_key = llm_datadist.CacheKeyByIdAndIndex(self.cluster.remote_cluster_id, 3, 0)
        hidden_cache_key = llm_datadist.CacheKeyByIdAndIndex(self.cluster.remote_cluster_id, 4, 0)

        self.llm_datadist_engine.kv_transfer.pull_cache(key_cache_key, self.decode_key_buffer, 0)
        self.llm_datadist_engine.kv_transfer.pull_cache(value_cache_key, self.decode_value_buffer, 0)
        self.llm_datadist_engine.kv_transfer.pull_cache(input_cache_key, self.decode_input_buffer, 0)
        self.llm_datadist_engine.kv_transfer.pull_cache(hidden_cache_key, self.decode_hidden_buffer, 0)

        return [
            harness.tensors_at(key_desc.shape, kv_hidden_dtype, key_buffer_addrs),
            harness.tensors_at(value_desc.shape, kv_hidden_dtype, value_buffer_addrs),
            harness.tensors_at(input_desc.shape, torch.int32, input_buffer_addrs),
            harness.tensors_at(hidden_desc.shape, kv_hidden_dtype, hidden_buffer_addrs),
        ]

    def close(self):
        self.llm_datadist_engine.data_dist.unlink_clusters([self.cluster], 5000)


def _sources(dtype):
    """Per buffer, per tensor: what the prompt writes (K and V per layer, tokens, hidden states)."""
    kv = (1, NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
    return [
        [harness.pattern(kv, dtype, seed=layer) for layer in range(NUM_LAYER)],
        [harness.pattern(kv, dtype, seed=10 + layer) for layer in range(NUM_LAYER)],
        [torch.arange(NUM_TOKENS, dtype=torch.int32).view(1, NUM_TOKENS, 1, 1) + 1000],
        [harness.pattern((1, NUM_TOKENS, 1, HIDDEN_SIZE), dtype, seed=20)],
    ]


def _prompt(peer, comm_port):
    connector = LLMDataDistConnector(peer, llm_datadist.LLMRole.PROMPT, comm_port)
    connector.send_kv_caches_and_hidden_states(torch.float16, _sources(torch.float16))
    peer.barrier()  # buffers filled; the decoder may link and pull
    peer.barrier()  # the decoder pulled
    connector.llm_datadist_engine.data_dist.finalize()  # harness


def _decoder(peer, comm_port):
    peer.barrier()  # harness: the decoder's connector starts once the prompt listens
    connector = LLMDataDistConnector(peer, llm_datadist.LLMRole.DECODER, comm_port)
    received = connector.recv_kv_caches_and_hidden_states(torch.float16)
    names = ("key", "value", "input", "hidden")
    for name, views, src in zip(names, received, _sources(torch.float16), strict=True):
        peer.check(f"{name}_buffer_equal_prompt", all(torch.equal(v, s) for v, s in zip(views, src, strict=True)))
    del received
    connector.close()
    peer.barrier()
    connector.llm_datadist_engine.data_dist.finalize()  # harness


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Prompt and decoder connectors on loopback; checks the four pulled buffers."""
    (comm_port,) = harness.free_ports(1)
    return harness.run_pair(_prompt, _decoder, prefill_args=(comm_port,), decode_args=(comm_port,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
