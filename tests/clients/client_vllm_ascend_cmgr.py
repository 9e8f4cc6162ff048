"""Port of vllm-ascend's ``LLMDataDistCMgrConnector`` worker (v2 CacheManager, bilateral ``link``).

Source: vllm-project/vllm-ascend, ``vllm_ascend/distributed/llmdatadist_c_mgr_connector.py``,
commit 08c4a38caf830904a98855ecf1148a8b2b0e487b (``get_transfer_timeout_value``
from ``vllm_ascend/distributed/utils.py``).

Ported from ``LLMDataDistCMgrConnectorWorker``, llm_datadist calls verbatim and
in order: ``__init__`` (role mapping, ``LLMDataDist(role, cluster_id)``),
``init_llm_datadist`` (``device_id``, ``sync_kv_timeout``,
``enable_switch_role``, ``enable_cache_manager``,
``enable_remote_cache_accessible``, ``cache_manager``), ``read_offline_rank_table``,
``read_agent_metadata``, ``register_kv_caches`` (the MHA branch with its 2 MiB
alignment assert, the MLA and the sparse branches: ``CacheDesc`` +
``BlocksCacheKey(cluster_id=..., model_id=...)`` + ``register_blocks_cache``, each
wrapped in ``except (TypeError, ValueError)``), ``listen_for_agent_metadata_req``,
``add_remote_agent`` (rank table "1.2", ``super_pod_list`` on A3,
``comm_name = f"pd_comm_{p_ip}_{d_ip}"``, ``link`` then
``query_register_mem_status(comm_id=comm_id)`` polled every second against
``llm_datadist.RegisterMemStatus``), ``remove_remote_agent`` (``unlink``,
``except LLMException``), ``connect_to_remote_agent``, ``send_finish_to_remote``,
``start_load_kv`` (a 1-thread executor) and ``_read_blocks`` (``pull_blocks``
positional, the last ``n`` remote blocks when fewer local ones, ``except
(TypeError, ValueError)`` and ``except LLMException`` turned into RuntimeError).

Scaffolding replaced:
- vLLM config and parallel groups -> plain values: tp/pcp/dcp size 1, rank 0,
  ``local_rank=0``; ``get_ip()`` -> the side's loopback address; the soc type ->
  a flag ``a3`` (adds ``super_pod_list``); ``ASCEND_RT_VISIBLE_DEVICES`` unset.
- ``DISAGGREGATED_PREFILL_RANK_TABLE_PATH`` -> a JSON file written under ``tmp_path``
  with ``prefill_device_list`` / ``decode_device_list`` entries.
- ZMQ ROUTER / REQ with msgspec -> :class:`Peer` send / recv of the same
  ``[event, payload]`` messages (the ROUTER thread stays a thread);
  ``_get_kv_split_metadata`` -> its point-to-point branch (cp = dcp = 1).
- the scheduler's request bookkeeping -> one request ``req-0`` with
  ``remote_block_ids=[0, 1, 3]`` and ``local_block_ids=[2, 3]``.
- NPU KV tensors -> CPU tensors (2 MiB aligned for the MHA branch), seeded on
  the prefill side; the decode side checks the pulled blocks.
- teardown: vLLM never finalizes; the harness calls ``remove_remote_agent`` on
  both sides and ``finalize``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import _client_harness as harness
import torch

import aio_datadist.compat as llm_datadist  # was: import llm_datadist
from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    CacheDesc,
    LLMConfig,
    LLMDataDist,
    LLMException,
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

NUM_LAYERS = 2
NUM_BLOCKS = 4
BLOCK_SIZE = 16
PREFILL_CLUSTER = 1
DECODE_CLUSTER = 2
REMOTE_BLOCK_IDS = [0, 1, 3]
LOCAL_BLOCK_IDS = [2, 3]
RPC_PORT = 5557  # VLLM_ASCEND_LLMDD_RPC_PORT default; only carried along, the side channel is a pipe


def get_transfer_timeout_value():
    hccl_rdma_timeout = 20  # HCCL_RDMA_TIMEOUT default
    hccl_rdma_retry_cnt = 7  # HCCL_RDMA_RETRY_CNT default
    return int((4.096 * (2**hccl_rdma_timeout)) * hccl_rdma_retry_cnt // 1000 + 3000)


class LLMDataDistCMgrEvent(Enum):
    ReqForMetadata = 0
    ReqForFinished = 1


@dataclass
class LLMDataDistCMgrAgentMetadata:
    super_pod_id: str | None
    server_id: str
    device_id: str
    device_ip: str
    super_device_id: str | None
    cluster_id: int


@dataclass
class ReqMeta:
    local_block_ids: list
    remote_block_ids: list
    remote_host: str
    remote_port: str
    engine_id: str
    remote_tp_size: str
    remote_pcp_size: str
    remote_dcp_size: str


class Worker:
    """``LLMDataDistCMgrConnectorWorker`` with vLLM's parallel state replaced by plain values."""

    def __init__(self, peer, kv_role: str, rank_table_path: str, local_ip: str, a3: bool):
        self.peer = peer
        self.local_rank = 0
        self.tp_size, self.tp_rank, self.pcp_size, self.pcp_rank, self.dcp_size = 1, 0, 1, 0, 1
        self.rank = 0
        self.use_mla = False
        self.local_ip = local_ip
        self.rank_table_path = rank_table_path
        self.executor = ThreadPoolExecutor(1)
        self.thread_lock = threading.Lock()
        self.stop_listening = threading.Event()

        if kv_role == "kv_producer":
            self.llm_datadist_role = LLMRole.PROMPT
            self.llm_datadist_remote_role = LLMRole.DECODER
        elif kv_role == "kv_consumer":
            self.llm_datadist_role = LLMRole.DECODER
            self.llm_datadist_remote_role = LLMRole.PROMPT
        else:
            raise RuntimeError(f"unexpected kv role {kv_role}")

        self.linked_cluster: dict[Any, Any] = {}
        self.prefill_device_list: list = []
        self.decode_device_list: list = []
        global_rank_table = self.read_offline_rank_table()
        self.local_agent_metadata = self.read_agent_metadata(global_rank_table)
        self.llm_datadist = LLMDataDist(self.llm_datadist_role, self.local_agent_metadata.cluster_id)
        self.init_llm_datadist()
        self.finished_reqs: set = set()
        self.a3 = a3
        self.reqs_to_send: dict = {}

    def listen_for_agent_metadata_req(self, event: threading.Event):
        msg_to_send = asdict(self.local_agent_metadata)
        event.set()
        while not self.stop_listening.is_set():
            if not self.peer.poll(0.1):
                continue
            try:
                event_msg, decode_msg = self.peer.recv()
            except harness.PeerFailed:  # the decode side is done and gone (a ZMQ ROUTER would just idle)
                return
            event_msg = LLMDataDistCMgrEvent(event_msg)
            if event_msg == LLMDataDistCMgrEvent.ReqForMetadata:
                if "cluster_id" in decode_msg:
                    decode_msg = LLMDataDistCMgrAgentMetadata(**decode_msg)
                    self.peer.send(msg_to_send)
                    self.add_remote_agent(decode_msg)
            elif event_msg == LLMDataDistCMgrEvent.ReqForFinished:
                finished_req_id = decode_msg[0]
                with self.thread_lock:
                    if finished_req_id in self.reqs_to_send:
                        self.finished_reqs.add(finished_req_id)
                        del self.reqs_to_send[finished_req_id]
                self.peer.send(b"receiving decode finished")
            else:
                raise RuntimeError(f"unexpected request event {event_msg}")

    def init_llm_datadist(self):
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.sync_kv_timeout = get_transfer_timeout_value()
        llm_config.enable_switch_role = True
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config_options = llm_config.generate_options()
        llm_config_options.update(harness.extra_options())  # harness: transport / link-address options
        self.llm_datadist.init(llm_config_options)
        self.cache_manager = self.llm_datadist.cache_manager

    def read_offline_rank_table(self):
        with open(self.rank_table_path, encoding="utf-8") as f:
            global_rank_table = json.load(f)
        for decode_device in global_rank_table["decode_device_list"]:
            self.decode_device_list.append((decode_device["server_id"], decode_device["device_id"]))
        for prefill_device in global_rank_table["prefill_device_list"]:
            self.prefill_device_list.append((prefill_device["server_id"], prefill_device["device_id"]))
        return global_rank_table

    @staticmethod
    def _get_visible_devices() -> Callable[[str], bool]:
        visible_devices = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")
        if not visible_devices:
            return lambda device_id: True
        visible_device_list = visible_devices.split(",")
        return lambda device_id: device_id in visible_device_list

    def read_agent_metadata(self, global_rank_table):
        device_filter = Worker._get_visible_devices()
        devices_type_list = []
        agent_metadata = None
        if self.llm_datadist_role == LLMRole.PROMPT:
            devices_type_list.append("prefill_device_list")
        elif self.llm_datadist_role == LLMRole.DECODER:
            devices_type_list.append("decode_device_list")
        else:
            devices_type_list.append("prefill_device_list")
            devices_type_list.append("decode_device_list")
        for device_type in devices_type_list:
            device_list = global_rank_table[device_type]
            device_list = [d for d in device_list
                           if d.get("server_id") == self.local_ip and device_filter(d.get("device_id", ""))]
            if len(device_list) <= self.pcp_rank * self.tp_size + self.tp_rank:
                continue
            device_info = device_list[self.pcp_rank * self.tp_size + self.tp_rank]
            agent_metadata = LLMDataDistCMgrAgentMetadata(
                super_pod_id=device_info.get("super_pod_id", None),
                server_id=device_info["server_id"],
                device_id=device_info["device_id"],
                device_ip=device_info["device_ip"],
                super_device_id=device_info.get("super_device_id", None),
                cluster_id=int(device_info["cluster_id"]),
            )
        assert agent_metadata is not None, f"no entry for server_id {self.local_ip} in the rank table"
        return agent_metadata

    def register_kv_caches(self, kv_caches: dict):
        _, first_kv_cache_tuple = next(iter(kv_caches.items()))
        first_kv_cache = first_kv_cache_tuple[0]
        assert len(first_kv_cache_tuple) > 1
        kv_cache_dtype = first_kv_cache.dtype
        self.use_mla = (first_kv_cache_tuple[0].size(-1) != first_kv_cache_tuple[1].size(-1)
                        and len(first_kv_cache_tuple) == 2)
        self.use_sparse = len(first_kv_cache_tuple) == 3
        self.num_blocks = first_kv_cache.shape[0]
        block_rank = 3
        block_shape = first_kv_cache.shape[-block_rank:]
        self.block_len = math.prod(block_shape)
        self.cache_addr: Any = []
        alignment = 2 * 1024 * 1024
        if self.use_mla:
            cache_k_normed_addr_list = []
            cache_k_pe_addr_list = []
            k_normed = None
            k_pe = None
            for cache_or_caches in kv_caches.values():
                assert len(cache_or_caches) > 1
                k_normed, k_pe = cache_or_caches[0], cache_or_caches[1]
                cache_k_normed_addr_list.append(k_normed.data_ptr())
                cache_k_pe_addr_list.append(k_pe.data_ptr())
            self.cache_addr = (cache_k_normed_addr_list, cache_k_pe_addr_list)

            cache_desc_k_normed = CacheDesc(len(self.cache_addr[0]), [*k_normed.shape],
                                            TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            cache_desc_k_pe = CacheDesc(len(self.cache_addr[1]), [*k_pe.shape],
                                        TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            cache_key_k_normed = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id), model_id=0)
            cache_key_k_pe = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id), model_id=1)
            self.cache_desc = (cache_desc_k_normed, cache_desc_k_pe)
            self.cache_key = (cache_key_k_normed, cache_key_k_pe)
            try:
                cache_k_normed = self.cache_manager.register_blocks_cache(
                    self.cache_desc[0], self.cache_addr[0], self.cache_key[0])
                cache_k_pe = self.cache_manager.register_blocks_cache(
                    self.cache_desc[1], self.cache_addr[1], self.cache_key[1])
                self.cache = (cache_k_normed, cache_k_pe)
            except (TypeError, ValueError):
                raise RuntimeError("unexpected parameter to register_block_cache") from None
        elif self.use_sparse:
            cache_k_normed_addr_list = []
            cache_k_pe_addr_list = []
            cache_k_idx_addr_list = []
            k_normed = None
            k_pe = None
            k_idx = None
            for cache_or_caches in kv_caches.values():
                assert len(cache_or_caches) > 1
                k_normed, k_pe, k_idx = cache_or_caches[0], cache_or_caches[1], cache_or_caches[2]
                cache_k_normed_addr_list.append(k_normed.data_ptr())
                cache_k_pe_addr_list.append(k_pe.data_ptr())
                cache_k_idx_addr_list.append(k_idx.data_ptr())
            self.cache_addr = (cache_k_normed_addr_list, cache_k_pe_addr_list, cache_k_idx_addr_list)

            cache_desc_k_normed = CacheDesc(len(self.cache_addr[0]), [*k_normed.shape],
                                            TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            cache_desc_k_pe = CacheDesc(len(self.cache_addr[1]), [*k_pe.shape],
                                        TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            cache_desc_k_idx = CacheDesc(len(self.cache_addr[2]), [*k_idx.shape],
                                         TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            cache_key_k_normed = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id), model_id=0)
            cache_key_k_pe = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id), model_id=1)
            cache_key_k_idx = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id), model_id=2)
            self.cache_desc = (cache_desc_k_normed, cache_desc_k_pe, cache_desc_k_idx)
            self.cache_key = (cache_key_k_normed, cache_key_k_pe, cache_key_k_idx)
            try:
                cache_k_normed = self.cache_manager.register_blocks_cache(
                    self.cache_desc[0], self.cache_addr[0], self.cache_key[0])
                cache_k_pe = self.cache_manager.register_blocks_cache(
                    self.cache_desc[1], self.cache_addr[1], self.cache_key[1])
                cache_k_idx = self.cache_manager.register_blocks_cache(
                    self.cache_desc[2], self.cache_addr[2], self.cache_key[2])
                self.cache = (cache_k_normed, cache_k_pe, cache_k_idx)
            except (TypeError, ValueError):
                raise RuntimeError("unexpected parameter to register_block_cache") from None
        else:
            for cache_or_caches in kv_caches.values():
                for cache in cache_or_caches:
                    base_addr = cache.data_ptr()
                    assert base_addr % alignment == 0, "The address of the registered kv cache should be aligned to 2M"
                    self.cache_addr.append(base_addr)
            self.cache_desc = CacheDesc(len(self.cache_addr), [*cache.shape], TORCH_DTYPE_TO_NPU_DTYPE[kv_cache_dtype])
            self.cache_key = BlocksCacheKey(cluster_id=int(self.local_agent_metadata.cluster_id))
            try:
                self.cache = self.cache_manager.register_blocks_cache(self.cache_desc, self.cache_addr, self.cache_key)
            except (TypeError, ValueError):
                raise RuntimeError("unexpected parameter to register_block_cache") from None
        self.ready_event = threading.Event()
        self.metadata_agent_listener_t = threading.Thread(
            target=self.listen_for_agent_metadata_req, args=(self.ready_event,), daemon=True,
            name="metadata_agent_listener")
        self.metadata_agent_listener_t.start()
        self.ready_event.wait()

    def start_load_kv(self, requests: dict):
        futures = []
        for req_id, meta in requests.items():
            future = self.executor.submit(
                self._read_blocks,
                local_block_ids=meta.local_block_ids,
                remote_block_ids=meta.remote_block_ids,
                remote_ip=meta.remote_host,
                remote_port=int(meta.remote_port),
                remote_engine_id=meta.engine_id,
                request_id=req_id,
                remote_tp_size=meta.remote_tp_size,
                remote_pcp_size=meta.remote_pcp_size,
                remote_dcp_size=meta.remote_dcp_size,
            )
            futures.append(future)
        return futures  # harness: vLLM only logs their exceptions; the run waits on them

    def add_remote_agent(self, metadata: LLMDataDistCMgrAgentMetadata) -> int:
        remote_cluster_id = metadata.cluster_id
        if remote_cluster_id in self.linked_cluster:
            return remote_cluster_id
        remote_super_pod_id = metadata.super_pod_id
        remote_server_id = metadata.server_id
        is_same_server = remote_server_id == self.local_agent_metadata.server_id
        is_same_pod = remote_super_pod_id == self.local_agent_metadata.super_pod_id
        if self.llm_datadist_role == LLMRole.PROMPT:
            prefill_metadata = self.local_agent_metadata
            decode_metadata = metadata
        else:
            prefill_metadata = metadata
            decode_metadata = self.local_agent_metadata
        comm_name = f"pd_comm_{prefill_metadata.device_ip}_{decode_metadata.device_ip}"
        cluster_rank_info = {prefill_metadata.cluster_id: 0, decode_metadata.cluster_id: 1}
        rank_table: dict[str, Any] = {}
        rank_table["version"] = "1.2"
        rank_table["server_count"] = "1" if is_same_server else "2"
        rank_table["status"] = "completed"

        def device_entry(meta, rank_id):
            return {k: v for k, v in [("device_id", meta.device_id), ("device_ip", meta.device_ip),
                                      ("super_device_id", meta.super_device_id), ("rank_id", rank_id)]
                    if v is not None}

        rank_table["server_list"] = []
        decode_server_device_info = None
        prefill_server_device_info = {"device": [device_entry(prefill_metadata, "0")],
                                      "server_id": prefill_metadata.server_id}
        if is_same_server:
            prefill_server_device_info["device"].append(device_entry(decode_metadata, "1"))
        else:
            decode_server_device_info = {"device": [device_entry(decode_metadata, "1")],
                                         "server_id": decode_metadata.server_id}
        rank_table["server_list"].append(prefill_server_device_info)
        if decode_server_device_info is not None:
            rank_table["server_list"].append(decode_server_device_info)

        if self.a3:
            super_pod_list = []
            prefill_super_pod_info = {"super_pod_id": prefill_metadata.super_pod_id,
                                      "server_list": [{"server_id": prefill_metadata.server_id}]}
            if is_same_pod and not is_same_server:
                prefill_super_pod_info["server_list"].append({"server_id": decode_metadata.server_id})
            super_pod_list.append(prefill_super_pod_info)
            if not is_same_pod:
                super_pod_list.append({"super_pod_id": decode_metadata.super_pod_id,
                                       "server_list": [{"server_id": decode_metadata.server_id}]})
            rank_table["super_pod_list"] = super_pod_list
        self.peer.note("rank_table", rank_table)
        comm_id = self.llm_datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
        while True:
            ret = self.llm_datadist.query_register_mem_status(comm_id=comm_id)
            if ret == llm_datadist.RegisterMemStatus.OK:
                break
            elif ret == llm_datadist.RegisterMemStatus.FAILED:
                raise RuntimeError(f"Linking failed, comm id: {comm_id}")
            time.sleep(1)
        self.linked_cluster.update({remote_cluster_id: comm_id})
        return remote_cluster_id

    def remove_remote_agent(self, cluster_id: int):
        comm_id = self.linked_cluster[cluster_id]
        try:
            self.llm_datadist.unlink(comm_id)
            self.linked_cluster.pop(cluster_id)
        except LLMException:
            self.peer.note("unlink_failed", True)

    def connect_to_remote_agent(self, host: str, port: int) -> int:
        self.peer.send([LLMDataDistCMgrEvent.ReqForMetadata.value, asdict(self.local_agent_metadata)])
        metadata = LLMDataDistCMgrAgentMetadata(**self.peer.recv())
        return self.add_remote_agent(metadata)

    def send_finish_to_remote(self, host: str, ports: list, request_id):
        for _port in ports:
            self.peer.send([LLMDataDistCMgrEvent.ReqForFinished.value, [request_id]])
            _ = self.peer.recv()

    def _get_kv_split_metadata(self, local_block_ids, remote_block_ids, remote_port, remote_tp_size,
                               remote_pcp_size, remote_dcp_size):
        # cp = dcp = 1 on both sides: point to point
        remote_ports = [remote_port + self.pcp_rank * self.tp_size + tp_offset
                        for tp_offset in range(self.tp_rank, int(remote_tp_size), self.tp_size)]
        return 1, remote_ports, [len(remote_block_ids)]

    def _read_blocks(self, local_block_ids, remote_block_ids, remote_ip, remote_port, remote_engine_id,
                     request_id, remote_tp_size, remote_pcp_size, remote_dcp_size):
        remote_kv_num, remote_ports, remote_block_nums = self._get_kv_split_metadata(
            local_block_ids=local_block_ids, remote_block_ids=remote_block_ids, remote_port=remote_port,
            remote_tp_size=int(remote_tp_size), remote_pcp_size=int(remote_pcp_size),
            remote_dcp_size=int(remote_dcp_size))
        local_block_offset = 0
        remote_block_ids_full = remote_block_ids
        local_block_ids_full = local_block_ids
        for remote_kv_id in range(remote_kv_num):
            remote_port = remote_ports[remote_kv_id]
            num_blocks_to_pull = remote_block_nums[remote_kv_id]
            if num_blocks_to_pull == 0:
                continue
            remote_block_ids = remote_block_ids_full[:num_blocks_to_pull]
            local_block_ids = local_block_ids_full[local_block_offset:local_block_offset + num_blocks_to_pull]
            local_block_offset += num_blocks_to_pull
            remote_cluster_id = self.connect_to_remote_agent(remote_ip, remote_port)
            num_local_blocks = len(local_block_ids)
            if num_local_blocks == 0:
                return
            num_remote_blocks = len(remote_block_ids)
            assert num_local_blocks <= num_remote_blocks
            if num_local_blocks < num_remote_blocks:
                remote_block_ids = remote_block_ids[-num_local_blocks:]

            if self.use_mla:
                remote_cache_key_k_normed = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=0)
                remote_cache_key_k_pe = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=1)
                try:
                    self.cache_manager.pull_blocks(remote_cache_key_k_normed, self.cache[0], remote_block_ids,
                                                   local_block_ids)
                    self.cache_manager.pull_blocks(remote_cache_key_k_pe, self.cache[1], remote_block_ids,
                                                   local_block_ids)
                except (TypeError, ValueError):
                    raise RuntimeError("unexpected parameter to pull_blocks") from None
                except LLMException:
                    raise RuntimeError("Timeout during pull_blocks, you can try to increase the "
                                       "sync_kv_timeout config or checking your connect status") from None
            elif self.use_sparse:
                remote_cache_key_k_normed = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=0)
                remote_cache_key_k_pe = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=1)
                remote_cache_key_k_idx = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=2)
                try:
                    self.cache_manager.pull_blocks(remote_cache_key_k_normed, self.cache[0], remote_block_ids,
                                                   local_block_ids)
                    self.cache_manager.pull_blocks(remote_cache_key_k_pe, self.cache[1], remote_block_ids,
                                                   local_block_ids)
                    self.cache_manager.pull_blocks(remote_cache_key_k_idx, self.cache[2], remote_block_ids,
                                                   local_block_ids)
                except (TypeError, ValueError):
                    raise RuntimeError("unexpected parameter to pull_blocks") from None
                except LLMException:
                    raise RuntimeError("Timeout during pull_blocks, you can try to increase the "
                                       "sync_kv_timeout config or checking your connect status") from None
            else:
                remote_cache_key = BlocksCacheKey(cluster_id=remote_cluster_id)
                try:
                    self.cache_manager.pull_blocks(remote_cache_key, self.cache, remote_block_ids, local_block_ids)
                except (TypeError, ValueError):
                    raise RuntimeError("unexpected parameter to pull_blocks") from None
                except LLMException:
                    raise RuntimeError("Timeout during pull_blocks, you can try to increase the "
                                       "sync_kv_timeout config or checking your connect status") from None
        self.send_finish_to_remote(remote_ip, remote_ports, request_id)
        with self.thread_lock:
            self.finished_reqs.add(request_id)


# -- harness -------------------------------------------------------------------

def _kv_shapes(layout: str) -> list[tuple]:
    if layout == "mha":  # (k, v): [num_blocks, block_size, heads, head_dim]
        return [(NUM_BLOCKS, BLOCK_SIZE, 2, 8)] * 2
    if layout == "mla":  # (k_normed, k_pe)
        return [(NUM_BLOCKS, BLOCK_SIZE, 1, 32), (NUM_BLOCKS, BLOCK_SIZE, 1, 8)]
    if layout == "sparse":  # (k_normed, k_pe, k_idx)
        return [(NUM_BLOCKS, BLOCK_SIZE, 1, 32), (NUM_BLOCKS, BLOCK_SIZE, 1, 8), (NUM_BLOCKS, BLOCK_SIZE, 1, 16)]
    raise ValueError(layout)


def _kv_caches(layout: str, seeded: bool) -> dict:
    caches = {}
    for layer in range(NUM_LAYERS):
        parts = []
        for j, shape in enumerate(_kv_shapes(layout)):
            t = harness.aligned(shape, torch.float16)
            if seeded:
                t.copy_(harness.pattern(shape, torch.float16, seed=10 * layer + j))
            parts.append(t)
        caches[f"model.layers.{layer}.self_attn.attn"] = tuple(parts)
    return caches


def _prefill(peer, rank_table_path, layout, local_ip, a3):
    worker = Worker(peer, "kv_producer", rank_table_path, local_ip, a3)
    kv_caches = _kv_caches(layout, seeded=True)
    worker.register_kv_caches(kv_caches)
    with worker.thread_lock:
        worker.reqs_to_send["req-0"] = time.perf_counter() + 60  # as request_finished records it
    peer.barrier()  # registered and listening
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline and not peer.other_failed():
        with worker.thread_lock:
            if "req-0" in worker.finished_reqs:
                break
        time.sleep(0.05)
    peer.check("finished_notice_received", "req-0" in worker.finished_reqs)
    peer.barrier()  # the decode side checked its blocks
    worker.stop_listening.set()
    worker.metadata_agent_listener_t.join(5)
    for cluster_id in list(worker.linked_cluster):
        worker.remove_remote_agent(cluster_id)
    worker.llm_datadist.finalize()
    worker.executor.shutdown()


def _decode(peer, rank_table_path, layout, local_ip, a3, prefill_ip):
    worker = Worker(peer, "kv_consumer", rank_table_path, local_ip, a3)
    kv_caches = _kv_caches(layout, seeded=False)
    worker.register_kv_caches(kv_caches)
    worker.stop_listening.set()  # the decode side's ROUTER is never asked here; free the pipe for the REQs
    worker.metadata_agent_listener_t.join(5)
    peer.barrier()
    meta = ReqMeta(local_block_ids=LOCAL_BLOCK_IDS, remote_block_ids=REMOTE_BLOCK_IDS, remote_host=prefill_ip,
                   remote_port=str(RPC_PORT), engine_id="0", remote_tp_size="1", remote_pcp_size="1",
                   remote_dcp_size="1")
    for future in worker.start_load_kv({"req-0": meta}):
        future.result(timeout=50)
    pulled = REMOTE_BLOCK_IDS[-len(LOCAL_BLOCK_IDS):]
    for layer, parts in enumerate(kv_caches.values()):
        for j, t in enumerate(parts):
            src = harness.pattern(t.shape, torch.float16, seed=10 * layer + j)
            same = all(torch.equal(t[d], src[s]) for s, d in zip(pulled, LOCAL_BLOCK_IDS, strict=True))
            untouched = all(bool((t[b] == 0).all()) for b in range(NUM_BLOCKS) if b not in LOCAL_BLOCK_IDS)
            peer.check(f"layer{layer}_part{j}_blocks_pulled", same)
            peer.check(f"layer{layer}_part{j}_other_blocks_untouched", untouched)
    peer.check("request_finished", "req-0" in worker.finished_reqs)
    peer.barrier()
    for cluster_id in list(worker.linked_cluster):
        worker.remove_remote_agent(cluster_id)
    worker.llm_datadist.finalize()
    worker.executor.shutdown()


def write_rank_table(path, *, same_server: bool, a3: bool) -> tuple[str, str]:
    """The ``DISAGGREGATED_PREFILL_RANK_TABLE_PATH`` file; returns (prefill_ip, decode_ip) used as server ids."""
    prefill_ip = harness.LOCALHOST
    decode_ip = harness.LOCALHOST if same_server else harness.OTHER_LOCALHOST

    def entry(server_id, device_id, device_ip, cluster_id):
        e = {"server_id": server_id, "device_id": device_id, "device_ip": device_ip, "cluster_id": str(cluster_id)}
        if a3:
            e.update({"super_pod_id": "0", "super_device_id": str(int(device_id) + 100)})
        return e

    table = {
        "prefill_device_list": [entry(prefill_ip, "0", harness.LOCALHOST, PREFILL_CLUSTER)],
        "decode_device_list": [entry(decode_ip, "1", harness.OTHER_LOCALHOST, DECODE_CLUSTER)],
    }
    path.write_text(json.dumps(table), encoding="utf-8")
    return prefill_ip, decode_ip


def run(tmp_path, options=None, *, layout: str = "mha", same_server: bool = True, a3: bool = False,
        limit_s: float = 60.0) -> dict:
    """Prefill and decode workers on loopback; the decoder pulls ``req-0``'s blocks and checks them.

    :param layout: ``"mha"`` (one cache of K and V), ``"mla"`` (two caches,
        model_id 0 and 1) or ``"sparse"`` (three caches).
    :param same_server: one ``server_list`` entry with both devices, or two servers.
    :param a3: add ``super_device_id`` / ``super_pod_list`` (Atlas A3 rank table).
    """
    path = tmp_path / "ranktable.json"
    prefill_ip, decode_ip = write_rank_table(path, same_server=same_server, a3=a3)
    return harness.run_pair(_prefill, _decode, prefill_args=(str(path), layout, prefill_ip, a3),
                            decode_args=(str(path), layout, decode_ip, a3, prefill_ip),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
