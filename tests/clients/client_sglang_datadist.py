"""Port of SGLang's llm_datadist disaggregation backend ``DataDistKVManager`` (v2 with ``local_comm_res``,
one-sided ``link_clusters`` from the decode side, the PREFILL pushes into the decoder's blocks).

Upstream sgl-project/sglang's Ascend backend (``python/sglang/srt/disaggregation/ascend/``)
moves KV through ``memfabric_hybrid`` and makes no llm_datadist call; the llm_datadist
backend lives in forks. Source: zhuyijie88/sglang,
``python/sglang/srt/disaggregation/datadist/conn.py``,
commit 5a5a6801fe8eacac76649a6921b04aed6c034de3 (other forks carrying variants of
this file: xing-wenjin/sglang, luogx2025/sglang, Zzz913977094/sglang).

Ported, llm_datadist calls verbatim and in order: ``generate_rank_table_a3``
(the JSON given as ``local_comm_res``: version "1.2", one server, one device
without ``rank_id``, ``super_pod_list``), ``DataDistKVManager.__init__``
(``LLMConfig``: ``device_id``, ``sync_kv_timeout=20000``, ``local_comm_res``,
``listen_ip_info = host:26000+gpu_id`` on the prefill side only; cluster ids
``device_id + world_size*node_rank`` (+ ``world_size*nnodes`` on decode);
``LLMDataDist(role, cluster_id)``, ``init``, ``cache_manager``),
``register_buffer_to_engine`` (two ``register_blocks_cache`` with
``BlocksCacheKey(cluster_id, 0)`` for the KV buffers and ``(cluster_id, 1)`` for
the aux ``output_ids``), ``register_link`` (``LLMClusterInfo()`` with only
``append_remote_ip_info(rank_ip, 26000 + gpu_id)`` -- no ``remote_cluster_id``,
no local ip -- then ``link_clusters(cluster_list, 20000)`` checked against
``llm_datadist.LLMStatusCode.LLM_SUCCESS``) and ``transfer_worker``
(``push_blocks(BlocksCacheKey(req.cluster_id, 0), cache, src, dst,
range(n), range(n), 1)`` with the layer ranges and ``tensor_num_per_layer``
passed positionally, then the aux buffer the same way).

Scaffolding replaced:
- ``npu-smi`` / ``hccn_tool`` device info -> plain values (device id 0, device
  ip, super device id, super pod id 0, device count 8); ``get_local_ip_by_remote``
  -> loopback; ``ServerArgs.node_rank=0``, ``nnodes=1``.
- the ZMQ PUSH/PULL bootstrap and status messages -> :class:`Peer` send / recv
  of the same fields; the twelve transfer queues -> one direct call; the
  bootstrap server -> the prefill's address passed in.
- KV pool buffers -> CPU tensors: 4 buffers (2 layers, K and V) of 16 token
  slots x 2 heads x 8, and ``output_ids`` (8 x 16 int32); seeded on prefill.
- port 26000 -> a free port (the same base on both sides).
- ``finalize`` is never called by the manager; the harness calls it last.
"""

from __future__ import annotations

import dataclasses
import json

import _client_harness as harness
import numpy as np
import torch
from numpy import typing as npt

import aio_datadist.compat as llm_datadist  # was: import llm_datadist
from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    Cache,
    CacheDesc,
    LLMConfig,
    LLMDataDist,
    LLMRole,
)

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

PREFILL, DECODE = "prefill", "decode"
KV_SHAPE = (16, 2, 8)  # token slots, heads, head_dim
NUM_KV_BUFFERS = 4  # 2 layers x (K, V)
METADATA_BUFFER_SIZE = 8
DEVICE_COUNT = 8
NODE_RANK, NNODES = 0, 1
PREFILL_KV_INDICES = [1, 2, 3]
DECODE_KV_INDICES = [9, 4, 5]
PREFILL_AUX_INDEX, DECODE_AUX_INDEX = 2, 6


@dataclasses.dataclass
class KVArgs:
    gpu_id: int
    engine_rank: int
    kv_data_ptrs: list[int]
    kv_data_shape: tuple
    kv_data_dtype: torch.dtype
    aux_data_ptrs: list[int]
    metadata_buffer_size: int


@dataclasses.dataclass
class TransferInfo:
    room: int
    endpoint: str
    dst_port: int
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int
    required_dst_info_num: int
    cluster_id: int

    def is_dummy(self):
        return self.dst_kv_indices.size == 0

    @classmethod
    def from_msg(cls, msg: list[bytes]) -> TransferInfo:
        return cls(room=int(msg[0].decode("ascii")), endpoint=msg[1].decode("ascii"),
                   dst_port=int(msg[2].decode("ascii")), dst_kv_indices=np.frombuffer(msg[3], dtype=np.int32),
                   dst_aux_index=int(msg[4].decode("ascii")), required_dst_info_num=int(msg[5].decode("ascii")),
                   cluster_id=int(msg[6].decode("ascii")))


def generate_rank_table_a3(device_id, host_ip, device_ip):
    # info: npuId, chipId, deviceId, super_device_id, super_pod_id (was npu-smi / hccn_tool)
    device_info = [str(device_id), "0", str(device_id), device_ip, str(100 + device_id), "0"]
    rank_info = {
        "status": "completed",
        "version": "1.2",
        "server_count": "1",
        "server_list": [{
            "server_id": f"{host_ip}",
            "device": [{"device_id": f"{device_info[2]}", "super_device_id": f"{device_info[4]}",
                        "device_ip": f"{device_info[3]}"}],
        }],
        "super_pod_list": [{"super_pod_id": f"{device_info[5]}", "server_list": [{"server_id": f"{host_ip}"}]}],
    }
    return json.dumps(rank_info), DEVICE_COUNT


class DataDistKVManager:
    def __init__(self, peer, args: KVArgs, disaggregation_mode: str, host_ip: str, device_ip: str, port_base: int):
        self.peer = peer
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.port_base = port_base
        self.registered_kv_caches: list[Cache] = []
        self.device_id = self.kv_args.gpu_id
        self.local_host_ip = host_ip
        self.is_mla_backend = False
        llm_config = LLMConfig()
        llm_config.device_id = self.device_id
        llm_config.sync_kv_timeout = 20000
        rank_table, self.world_size = generate_rank_table_a3(self.device_id, host_ip, device_ip)
        llm_config.local_comm_res = rank_table
        self.cluster_id = self.device_id + self.world_size * NODE_RANK
        if self.disaggregation_mode == PREFILL:
            self.role = LLMRole.PROMPT
            llm_config.listen_ip_info = f"{self.local_host_ip}:{port_base + self.kv_args.gpu_id}"  # was 26000 + gpu_id
        elif self.disaggregation_mode == DECODE:
            self.role = LLMRole.DECODER
            self.cluster_id += self.world_size * NNODES
        else:
            raise ValueError(f"Unsupported DisaggregationMode: {self.disaggregation_mode}")
        self.llm_datadist = LLMDataDist(self.role, self.cluster_id)
        engine_options = llm_config.generate_options()
        engine_options.update(harness.extra_options())  # harness: transport selection
        self.llm_datadist.init(engine_options)

        self.cache_manager = self.llm_datadist.cache_manager
        self.register_buffer_to_engine()
        if self.disaggregation_mode == PREFILL:
            self.transfer_infos: dict[int, dict[int, TransferInfo]] = {}
        if self.disaggregation_mode == DECODE:
            self.link_clusters_dict = {}

    def register_buffer_to_engine(self):
        buf_shape = self.kv_args.kv_data_shape
        cache_desc = CacheDesc(
            num_tensors=len(self.kv_args.kv_data_ptrs),
            shape=tuple(buf_shape),
            data_type=TORCH_DTYPE_TO_NPU_DTYPE[self.kv_args.kv_data_dtype],
        )
        cache_addrs = self.kv_args.kv_data_ptrs
        cache_key = BlocksCacheKey(self.cluster_id, 0)
        self.registered_kv_caches.append(self.cache_manager.register_blocks_cache(cache_desc, cache_addrs, cache_key))

        output_ids_addr = self.kv_args.aux_data_ptrs[0]
        cache_desc = CacheDesc(
            num_tensors=1,
            shape=(self.kv_args.metadata_buffer_size, 16),
            data_type=TORCH_DTYPE_TO_NPU_DTYPE[torch.int32],
        )
        cache_addrs = [output_ids_addr]
        cache_key = BlocksCacheKey(self.cluster_id, 1)
        self.registered_kv_caches.append(self.cache_manager.register_blocks_cache(cache_desc, cache_addrs, cache_key))

    def register_link(self, link_register_key, bootstrap_infos):
        if link_register_key in self.link_clusters_dict:
            return
        cluster_list = []
        for bootstrap_info in bootstrap_infos:
            cluster = llm_datadist.LLMClusterInfo()
            cluster.append_remote_ip_info(bootstrap_info["rank_ip"], self.port_base + bootstrap_info["gpu_id"])
            cluster_list.append(cluster)
        ret, rets = self.llm_datadist.link_clusters(cluster_list, 20000)
        if ret != llm_datadist.LLMStatusCode.LLM_SUCCESS:
            raise Exception(f"link cluster failure {ret} {rets}")
        self.link_clusters_dict[link_register_key] = cluster_list

    def transfer_chunk(self, bootstrap_room: int, prefill_kv_indices, index_slice: slice, is_last: bool,
                       prefill_aux_index: int | None):
        """``transfer_worker``'s body for one chunk taken off its queue."""
        reqs_to_be_processed = self.transfer_infos[bootstrap_room].values()
        for req in reqs_to_be_processed:
            if req.is_dummy():
                continue
            chunked_dst_kv_indices = req.dst_kv_indices[index_slice]
            decode_cache_key = BlocksCacheKey(req.cluster_id, 0)
            self.cache_manager.push_blocks(
                decode_cache_key,
                self.registered_kv_caches[0],
                prefill_kv_indices.tolist(),
                chunked_dst_kv_indices.tolist(),
                range(len(self.kv_args.kv_data_ptrs)),
                range(len(self.kv_args.kv_data_ptrs)),
                1,
            )
            if is_last:
                decode_cache_key = BlocksCacheKey(req.cluster_id, 1)
                self.cache_manager.push_blocks(
                    decode_cache_key,
                    self.registered_kv_caches[1],
                    [prefill_aux_index],
                    [req.dst_aux_index],
                    range(1),
                    range(1),
                    1,
                )
        if is_last:
            for req in reqs_to_be_processed:
                if not req.is_dummy():
                    self.peer.send(["status", str(req.room), "success", str(self.kv_args.engine_rank)])
            del self.transfer_infos[bootstrap_room]


def _buffers(seeded: bool):
    kv = [harness.pattern(KV_SHAPE, torch.float16, seed=i) if seeded else torch.zeros(KV_SHAPE, dtype=torch.float16)
          for i in range(NUM_KV_BUFFERS)]
    aux = (harness.pattern((METADATA_BUFFER_SIZE, 16), torch.int32, seed=50) if seeded
           else torch.zeros(METADATA_BUFFER_SIZE, 16, dtype=torch.int32))
    args = KVArgs(gpu_id=0, engine_rank=0, kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_shape=KV_SHAPE,
                  kv_data_dtype=torch.float16, aux_data_ptrs=[aux.data_ptr()],
                  metadata_buffer_size=METADATA_BUFFER_SIZE)
    return args, kv, aux


def _prefill(peer, port_base):
    args, _kv, _aux = _buffers(seeded=True)
    mgr = DataDistKVManager(peer, args, PREFILL, harness.LOCALHOST, harness.LOCALHOST, port_base)
    peer.barrier()  # listening, registered
    msg = peer.recv()  # the decode side's bootstrap message (was the ZMQ PULL socket)
    assert msg[0] == b"DataDistMsgGuard", "First message should be the guard"
    info = TransferInfo.from_msg(msg[1:])
    mgr.transfer_infos.setdefault(info.room, {})[info.cluster_id] = info
    mgr.transfer_chunk(info.room, np.array(PREFILL_KV_INDICES, dtype=np.int32), slice(0, len(PREFILL_KV_INDICES)),
                       True, PREFILL_AUX_INDEX)
    peer.check("pushed", True)
    peer.barrier()  # decode side checked
    mgr.llm_datadist.finalize()  # harness


def _decode(peer, port_base):
    args, kv, aux = _buffers(seeded=False)
    mgr = DataDistKVManager(peer, args, DECODE, harness.LOCALHOST, harness.OTHER_LOCALHOST, port_base)
    peer.barrier()
    bootstrap_infos = [{"rank_ip": harness.LOCALHOST, "rank_port": 0, "gpu_id": 0, "engine_rank": 0,
                        "is_dummy": False}]
    mgr.register_link(f"{harness.LOCALHOST}_0", bootstrap_infos)
    room = 7
    kv_indices = np.array(DECODE_KV_INDICES, dtype=np.int32)
    peer.send([b"DataDistMsgGuard", str(room).encode("ascii"), mgr.local_host_ip.encode("ascii"), b"0",
               kv_indices.tobytes(), str(DECODE_AUX_INDEX).encode("ascii"), b"1",
               str(mgr.cluster_id).encode("ascii")])
    status = peer.recv()
    peer.check("success_status_received", status[:3] == ["status", str(room), "success"])
    for i, t in enumerate(kv):
        src = harness.pattern(KV_SHAPE, torch.float16, seed=i)
        same = all(torch.equal(t[d], src[s]) for s, d in zip(PREFILL_KV_INDICES, DECODE_KV_INDICES, strict=True))
        rest = all(bool((t[b] == 0).all()) for b in range(KV_SHAPE[0]) if b not in DECODE_KV_INDICES)
        peer.check(f"kv{i}_slots_pushed", same)
        peer.check(f"kv{i}_other_slots_untouched", rest)
    aux_src = harness.pattern((METADATA_BUFFER_SIZE, 16), torch.int32, seed=50)
    peer.check("aux_row_pushed", torch.equal(aux[DECODE_AUX_INDEX], aux_src[PREFILL_AUX_INDEX]))
    peer.barrier()
    mgr.llm_datadist.finalize()  # harness


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """Prefill and decode managers on loopback; the prefill pushes KV slots and an aux row into the decoder."""
    (port_base,) = harness.free_ports(1)
    return harness.run_pair(_prefill, _decode, prefill_args=(port_base,), decode_args=(port_base,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
