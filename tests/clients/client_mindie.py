"""Port of MindIE-LLM's separate-deployment engine (v2 CacheManager, bilateral ``link``, K and V caches).

Source: Ascend/MindIE-LLM, ``mindie_llm/text_generator/utils/separate_deployment_engine.py``,
commit bf1c0e134517324edbb3997de86b4b795d86f9a5.

Ported, llm_datadist calls verbatim and in order:
- ``RankInfo`` (rank ids by device-ip order, ``get_rank_table``: version "1.0",
  one server entry holding both devices when the server ids match, else two
  entries ordered by rank; "1.2" with ``super_pod_list`` when a super device id
  is given; ``get_cluster_rank_info`` ordered by rank).
- ``SeparateDeploymentEngine``: role mapping (prefill -> PROMPT, decoder ->
  DECODER, flex -> MIX), ``LLMConfig`` (``device_id``, ``enable_cache_manager``,
  ``enable_remote_cache_accessible``, ``link_total_time``, ``link_retry_count=80``,
  ``sync_kv_timeout``), the raw ``llm.RdmaServiceLevel`` / ``llm.RdmaTrafficClass``
  option keys, ``init``; ``link`` (link name from the device ips and dp ids,
  ``result == LLMStatusCode.LLM_ALREADY_LINK``, ``except LLMException`` reading
  ``e.status_code``); ``unlink``; ``pull_kv`` (``cache_manager.pull_blocks`` with
  ``BlocksCacheKey(cluster_id=remote, model_id=...)``); ``register_blocks_cache``;
  ``query_register_mem_status``; ``finalize``.
- ``SeparateDeploymentWorker``: ``build`` (``CacheDesc(num_tensors=...,
  shape=(num_blocks, *block_shape), data_type=..., placement=Placement.DEVICE)``),
  ``set_npu_cache`` (K model_id 0, V model_id 1), ``pull_blocks`` (every
  model_id), ``_try_create_link``, ``_query_mem_status`` (three queries 50 ms
  apart per round, then requeue), ``unlink`` / ``_unlink_after_queue_cleanup``,
  ``unlink_all``, ``finalize``.

Scaffolding replaced:
- the link queue and the two window threads -> one link at a time: create,
  then repeat ``_query_mem_status`` rounds while it says "retry" (the calls
  are the same; only the thread hand-off is gone).
- MindIE's status / error-code enums -> small local enums; ``get_ip_obj`` ->
  ``ipaddress.ip_address``; logging dropped.
- NPU KV tensors -> CPU tensors (one per layer for K and for V), seeded on
  the prefill side; the coordinator's link / pull requests -> direct calls.
- device ips ``127.0.0.1`` (prefill) / ``127.0.0.2`` (decode), host ``127.0.0.1``
  for both (one server entry) or ``127.0.0.2`` for the decoder (two entries).
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from enum import Enum, IntEnum

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import ...
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from aio_datadist.compat import LLMConfig as LLMDataDistConfig

STR_DTYPE_TO_DTYPE = {
    "float16": DataType.DT_FLOAT16,
    "bfloat16": DataType.DT_BF16,
    "float": DataType.DT_FLOAT,
    "int8": DataType.DT_INT8,
}

NUM_LAYERS = 2
NUM_BLOCKS = 8
BLOCK_SHAPE = (16, 32)  # block_size, heads * head_dim
SRC_BLOCKS = [1, 2, 5]
DST_BLOCKS = [0, 3, 4]


class MindieLlmStatusCode(IntEnum):
    SUCCESS = 0
    TEXT_GENERATOR_PD_ALREADY_LINK = 1
    TEXT_GENERATOR_PD_RETRY_QUERY = 2


class ErrorCode(IntEnum):
    TEXT_GENERATOR_PD_LINK_ERROR = 101
    TEXT_GENERATOR_PD_UNLINK_ERROR = 102
    TEXT_GENERATOR_PD_PULL_KV_ERROR = 103
    TEXT_GENERATOR_PD_MODEL_INSTANCE_ID_ERROR = 104
    TEXT_GENERATOR_PD_BLOCK_ID_OUT_OF_RANGE = 105


class DmiModeNodeRole(str, Enum):  # noqa: UP042  (as MindIE defines it)
    PREFILL = "prefill"
    DECODER = "decoder"
    FLEX = "flex"


class RankInfo:
    def __init__(self, remote_cluster_id, remote_physical_device_id, remote_device_ip, remote_host_ip,
                 local_host_ip, local_cluster_id, local_device_ip, local_physical_device_id,
                 local_super_device_id=None, remote_super_device_id=None, local_super_pod_id=None,
                 remote_super_pod_id=None):
        self.local_cluster_id = local_cluster_id
        self.remote_cluster_id = remote_cluster_id
        self.remote_physical_device_id = str(remote_physical_device_id)
        self.remote_device_ip = remote_device_ip
        self.remote_server_id = remote_host_ip
        self.local_server_id = local_host_ip
        self.local_device_ip = local_device_ip
        self.local_physical_device_id = str(local_physical_device_id)
        rank_ids = self.assign_rank_id(remote_device_ip, local_device_ip)
        self.local_rank_id = rank_ids[local_device_ip]
        self.remote_rank_id = rank_ids[remote_device_ip]
        self.local_super_device_id = local_super_device_id
        self.remote_super_device_id = remote_super_device_id
        self.local_super_pod_id = local_super_pod_id
        self.remote_super_pod_id = remote_super_pod_id

    @staticmethod
    def assign_rank_id(remote_device_ip: str, local_device_ip: str) -> dict[str, int]:
        # the smaller device ip gets rank 0
        if ipaddress.ip_address(remote_device_ip) < ipaddress.ip_address(local_device_ip):
            return {remote_device_ip: 0, local_device_ip: 1}
        return {remote_device_ip: 1, local_device_ip: 0}

    @staticmethod
    def create_device(device_id, device_ip, rank_id, super_device_id=None) -> dict:
        device_info = {"device_id": device_id, "device_ip": device_ip, "rank_id": str(rank_id)}
        if super_device_id is not None:
            device_info["super_device_id"] = str(super_device_id)
        return device_info

    def create_super_pod_list(self):
        server_list = [{"server_id": str(self.local_server_id)}]
        if self.local_super_pod_id == self.remote_super_pod_id:
            if self.local_server_id != self.remote_server_id:
                server_list.append({"server_id": str(self.remote_server_id)})
            return [{"super_pod_id": str(self.local_super_pod_id), "server_list": server_list}]
        return [
            {"super_pod_id": str(self.local_super_pod_id), "server_list": [{"server_id": str(self.local_server_id)}]},
            {"super_pod_id": str(self.remote_super_pod_id),
             "server_list": [{"server_id": str(self.remote_server_id)}]},
        ]

    def get_rank_table(self) -> str:
        server_list: list[dict] = []
        local = self.create_device(self.local_physical_device_id, self.local_device_ip, self.local_rank_id,
                                   self.local_super_device_id)
        remote = self.create_device(self.remote_physical_device_id, self.remote_device_ip, self.remote_rank_id,
                                    self.remote_super_device_id)
        if self.remote_server_id == self.local_server_id:
            server_list.append({"device": [local, remote], "server_id": str(self.local_server_id)})
            server_count = "1"
        else:
            mine = {"device": [local], "server_id": str(self.local_server_id)}
            theirs = {"device": [remote], "server_id": str(self.remote_server_id)}
            server_list.extend([mine, theirs] if self.local_rank_id < self.remote_rank_id else [theirs, mine])
            server_count = "2"
        rank_table_dict = {"server_count": server_count, "server_list": server_list, "status": "completed",
                           "version": "1.0"}
        if self.local_super_device_id is not None:
            rank_table_dict["version"] = "1.2"
            rank_table_dict["super_pod_list"] = self.create_super_pod_list()
        return json.dumps(rank_table_dict)

    def get_cluster_rank_info(self) -> dict:
        if self.local_rank_id < self.remote_rank_id:
            return {int(self.local_cluster_id): self.local_rank_id, int(self.remote_cluster_id): self.remote_rank_id}
        return {int(self.remote_cluster_id): self.remote_rank_id, int(self.local_cluster_id): self.local_rank_id}


class SeparateDeploymentEngine:
    def __init__(self, role=DmiModeNodeRole.DECODER, local_cluster_id=0, local_logic_device_id=0, kv_trans_timeout=1,
                 kv_rdma_sl=-1, kv_rdma_tc=-1, kv_link_timeout=1080):
        engine_role = None
        if role == DmiModeNodeRole.PREFILL:
            engine_role = LLMRole.PROMPT
        elif role == DmiModeNodeRole.DECODER:
            engine_role = LLMRole.DECODER
        elif role == DmiModeNodeRole.FLEX:
            engine_role = LLMRole.MIX
        self.role = role
        self.separate_deployment_engine = LLMDataDist(engine_role, local_cluster_id)

        llm_config = LLMDataDistConfig()
        llm_config.device_id = local_logic_device_id
        llm_config.enable_cache_manager = True
        llm_config.enable_remote_cache_accessible = True
        llm_config.link_total_time = int(kv_link_timeout)
        llm_config.link_retry_count = 80
        if kv_trans_timeout <= 0:
            kv_trans_timeout = 1
        llm_config.sync_kv_timeout = kv_trans_timeout * 1000
        llm_options = llm_config.generate_options()
        if kv_rdma_sl != -1 and kv_rdma_tc != -1:
            if kv_rdma_sl < 0 or kv_rdma_sl > 7:
                raise Exception("SeparateDeploymentEngine: kv_rdma_sl only support: 0-7.")
            if kv_rdma_tc < 0 or kv_rdma_tc > 255:
                raise Exception("SeparateDeploymentEngine: kv_rdma_tc only support: 0-255.")
            llm_options["llm.RdmaServiceLevel"] = str(kv_rdma_sl)
            llm_options["llm.RdmaTrafficClass"] = str(kv_rdma_tc)
        llm_options.update(harness.extra_options())  # harness: transport / link-address options
        self.separate_deployment_engine.init(llm_options)
        self.npu_tensors = []
        self.npu_cache_map = {}

    def link(self, cluster_rank_info: dict[int, int], rank_table: str, remote_dp_instance_id: int,
             local_dp_instance_id: int):
        rank_table_dict = json.loads(rank_table)
        server_count = rank_table_dict.get("server_count")
        server_list = rank_table_dict.get("server_list", [])
        if server_count == "1":
            devices = server_list[0].get("device", [])
            device_ip1 = devices[0].get("device_ip")
            device_ip2 = devices[1].get("device_ip")
        elif server_count == "2":
            device_ip1 = server_list[0].get("device", [])[0].get("device_ip")
            device_ip2 = server_list[1].get("device", [])[0].get("device_ip")
        link_name = f"link{device_ip1}:{device_ip2}" if device_ip1 > device_ip2 else f"link{device_ip2}:{device_ip1}"
        if remote_dp_instance_id < local_dp_instance_id:
            link_name = link_name + f"_{remote_dp_instance_id}:{local_dp_instance_id}"
        else:
            link_name = link_name + f"_{local_dp_instance_id}:{remote_dp_instance_id}"
        try:
            result = self.separate_deployment_engine.link(link_name, cluster_rank_info, rank_table)
            if result == LLMStatusCode.LLM_ALREADY_LINK:
                return {"status": MindieLlmStatusCode.TEXT_GENERATOR_PD_ALREADY_LINK, "comm_id": None}
            return {"status": MindieLlmStatusCode.SUCCESS, "comm_id": result}
        except LLMException as e:
            return {"status": ErrorCode.TEXT_GENERATOR_PD_LINK_ERROR, "comm_id": None,
                    "error": f"{e} (status {e.status_code})"}

    def unlink(self, comm_id: int):
        try:
            self.separate_deployment_engine.unlink(comm_id)
            return MindieLlmStatusCode.SUCCESS
        except LLMException:
            return ErrorCode.TEXT_GENERATOR_PD_UNLINK_ERROR

    def set_npu_cache(self, model_id, npu_cache):
        self.npu_cache_map[model_id] = npu_cache

    def pull_kv(self, model_id: int, src_block_table: list[int], dst_block_table: list[int], remote_cluster_id: int):
        remote_cache_key = BlocksCacheKey(cluster_id=remote_cluster_id, model_id=model_id)
        try:
            self.separate_deployment_engine.cache_manager.pull_blocks(remote_cache_key, self.npu_cache_map[model_id],
                                                                      src_block_table, dst_block_table)
            return MindieLlmStatusCode.SUCCESS
        except LLMException as e:
            self.last_pull_error = f"{e} (status {e.status_code})"
            return ErrorCode.TEXT_GENERATOR_PD_PULL_KV_ERROR

    def register_blocks_cache(self, cache_desc, npu_addrs, cache_key):
        cache_manager = self.separate_deployment_engine.cache_manager
        return cache_manager.register_blocks_cache(cache_desc, npu_addrs, cache_key)

    def query_register_mem_status(self, comm_id: int):
        return self.separate_deployment_engine.query_register_mem_status(comm_id)

    def finalize(self):
        self.separate_deployment_engine.finalize()


class SeparateDeploymentWorker:
    """The worker's llm_datadist-facing part; one link at a time instead of the queue and window threads."""

    def __init__(self, role, local_logic_device_id, local_physical_device_id, local_cluster_id, local_device_ip,
                 local_host_ip, local_super_pod_id=None, local_super_device_id=None, kv_trans_timeout=1,
                 kv_link_timeout=1080, kv_rdma_sl=-1, kv_rdma_tc=-1):
        self.role = role
        self.local_physical_device_id = local_physical_device_id
        self.local_cluster_id = local_cluster_id
        self.local_device_ip = local_device_ip
        self.local_host_ip = local_host_ip
        self.local_super_device_id = local_super_device_id
        self.local_super_pod_id = local_super_pod_id
        self.cluster_comm_map = {}
        self.cluster_device_ip_map = {}
        self.cluster_map_lock = threading.Lock()
        self.link_time_out = kv_link_timeout if kv_link_timeout > 0 else 1080
        self.cache_desc_map = {}
        self.max_block_nums_map = {}
        self.last_link_error = None
        self.separate_deployment_engine = SeparateDeploymentEngine(
            role=role, local_cluster_id=local_cluster_id, local_logic_device_id=local_logic_device_id,
            kv_trans_timeout=kv_trans_timeout, kv_rdma_sl=kv_rdma_sl, kv_rdma_tc=kv_rdma_tc,
            kv_link_timeout=kv_link_timeout)

    def build(self, model_id: int, num_tensors, num_blocks, blockshape, dtype):
        block_shape = tuple(map(int, blockshape))
        self.cache_desc_map[model_id] = CacheDesc(num_tensors=int(num_tensors), shape=(int(num_blocks), *block_shape),
                                                  data_type=STR_DTYPE_TO_DTYPE[dtype], placement=Placement.DEVICE)
        self.max_block_nums_map[model_id] = num_blocks

    def set_npu_cache(self, model_id: int, npu_addrs: list[int]):
        try:
            cache_key = BlocksCacheKey(cluster_id=self.local_cluster_id, model_id=model_id)
            npu_cache = self.separate_deployment_engine.register_blocks_cache(self.cache_desc_map[model_id],
                                                                              npu_addrs, cache_key)
            self.separate_deployment_engine.set_npu_cache(model_id, npu_cache)
        except Exception as e:
            raise Exception("Failed to register blocks cache") from e

    def pull_blocks(self, remote_model_instance_id: int, src_block_table: list[int], dst_block_table: list[int]):
        with self.cluster_map_lock:
            if remote_model_instance_id not in self.cluster_comm_map:
                return ErrorCode.TEXT_GENERATOR_PD_MODEL_INSTANCE_ID_ERROR
        for model_id in self.cache_desc_map:
            if not all(0 <= x < self.max_block_nums_map[model_id] for x in dst_block_table):
                return ErrorCode.TEXT_GENERATOR_PD_BLOCK_ID_OUT_OF_RANGE
            rt = self.separate_deployment_engine.pull_kv(model_id=model_id, src_block_table=src_block_table,
                                                         dst_block_table=dst_block_table,
                                                         remote_cluster_id=remote_model_instance_id)
            if rt != MindieLlmStatusCode.SUCCESS:
                return rt
        return MindieLlmStatusCode.SUCCESS

    def _try_create_link(self, link_params):
        rank_info = RankInfo(
            remote_cluster_id=link_params["remote_cluster_id"],
            remote_physical_device_id=link_params["remote_physical_device_id"],
            remote_device_ip=link_params["remote_device_ip"], remote_host_ip=link_params["remote_host_ip"],
            local_host_ip=self.local_host_ip, local_cluster_id=self.local_cluster_id,
            local_device_ip=self.local_device_ip, local_physical_device_id=self.local_physical_device_id,
            local_super_pod_id=self.local_super_pod_id, remote_super_pod_id=link_params.get("remote_super_pod_id"),
            local_super_device_id=self.local_super_device_id,
            remote_super_device_id=link_params.get("remote_super_device_id"))
        cluster_rank_info = rank_info.get_cluster_rank_info()
        rank_table = rank_info.get_rank_table()
        self.rank_table = json.loads(rank_table)
        result = self.separate_deployment_engine.link(cluster_rank_info, rank_table,
                                                      link_params["remote_dp_instance_id"],
                                                      link_params["local_dp_instance_id"])
        status = result.get("status")
        comm_id = result.get("comm_id")
        if status == MindieLlmStatusCode.SUCCESS and comm_id is not None:
            with self.cluster_map_lock:
                self.cluster_comm_map[link_params["remote_cluster_id"]] = comm_id
            return True, {"comm_id": comm_id, "link_params": link_params}
        self.last_link_error = result.get("error", status)
        return False, None

    def _query_mem_status(self, link_item):
        comm_id = link_item["comm_id"]
        link_params = link_item["link_params"]
        remote_cluster_id = link_params["remote_cluster_id"]
        max_query_attempts = 3
        query_attempt = 0
        while query_attempt < max_query_attempts:
            try:
                query_status = self.separate_deployment_engine.query_register_mem_status(comm_id)
                if query_status == RegisterMemStatus.OK:
                    with self.cluster_map_lock:
                        self.cluster_device_ip_map[remote_cluster_id] = link_params["remote_device_ip"]
                    return MindieLlmStatusCode.SUCCESS
                elif query_status == RegisterMemStatus.FAILED:
                    self.unlink(remote_cluster_id)
                    return ErrorCode.TEXT_GENERATOR_PD_LINK_ERROR
                else:
                    query_attempt += 1
                    if query_attempt < max_query_attempts:
                        time.sleep(0.05)
            except Exception as e:
                self.last_link_error = f"{type(e).__name__}: {e}"
                self.unlink(remote_cluster_id)
                return ErrorCode.TEXT_GENERATOR_PD_LINK_ERROR
        return MindieLlmStatusCode.TEXT_GENERATOR_PD_RETRY_QUERY

    def link_one(self, link_params, deadline_s: float):
        """Harness: what the fill / process window threads do for one queued link."""
        linked, window_item = self._try_create_link(link_params)
        if not linked:
            return ErrorCode.TEXT_GENERATOR_PD_LINK_ERROR
        deadline = time.monotonic() + deadline_s
        status = MindieLlmStatusCode.TEXT_GENERATOR_PD_RETRY_QUERY
        while status == MindieLlmStatusCode.TEXT_GENERATOR_PD_RETRY_QUERY and time.monotonic() < deadline:
            status = self._query_mem_status(window_item)
        return status

    def unlink(self, remote_cluster_id):
        return self._unlink_after_queue_cleanup(remote_cluster_id)

    def unlink_all(self):
        for cluster_id in list(self.cluster_comm_map):
            ret = self.unlink(cluster_id)
            if ret != MindieLlmStatusCode.SUCCESS:
                raise Exception("SeparateDeploymentEngine: unlink_all fail")

    def finalize(self):
        self.unlink_all()
        self.separate_deployment_engine.finalize()

    def _unlink_after_queue_cleanup(self, remote_cluster_id):
        with self.cluster_map_lock:
            if remote_cluster_id not in self.cluster_comm_map:
                return ErrorCode.TEXT_GENERATOR_PD_UNLINK_ERROR
            comm_id = self.cluster_comm_map.pop(remote_cluster_id)
            self.cluster_device_ip_map.pop(remote_cluster_id, None)
        return self.separate_deployment_engine.unlink(comm_id)


# -- harness -------------------------------------------------------------------

PREFILL = {"cluster_id": 11, "device_ip": harness.LOCALHOST, "physical_device_id": 0, "dp": 0}
DECODE = {"cluster_id": 22, "device_ip": harness.OTHER_LOCALHOST, "physical_device_id": 1, "dp": 1}


def _side(peer, role, me, other, my_host, other_host, a3, seeded):
    worker = SeparateDeploymentWorker(
        role=role, local_logic_device_id=0, local_physical_device_id=me["physical_device_id"],
        local_cluster_id=me["cluster_id"], local_device_ip=me["device_ip"], local_host_ip=my_host,
        local_super_pod_id=0 if a3 else None, local_super_device_id=(100 + me["physical_device_id"]) if a3 else None,
        kv_trans_timeout=5, kv_link_timeout=60, kv_rdma_sl=4, kv_rdma_tc=132)
    caches = {}
    for model_id in (0, 1):  # K, V
        worker.build(model_id, NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE, "float16")
        tensors = [harness.pattern((NUM_BLOCKS, *BLOCK_SHAPE), torch.float16, seed=10 * model_id + layer)
                   if seeded else torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.float16)
                   for layer in range(NUM_LAYERS)]
        worker.set_npu_cache(model_id, [t.data_ptr() for t in tensors])
        caches[model_id] = tensors
    peer.barrier()  # both registered
    link_params = {"remote_cluster_id": other["cluster_id"], "remote_physical_device_id": other["physical_device_id"],
                   "remote_device_ip": other["device_ip"], "remote_host_ip": other_host, "retry_count": 0,
                   "remote_dp_instance_id": other["dp"], "local_dp_instance_id": me["dp"]}
    if a3:
        link_params.update({"remote_super_device_id": 100 + other["physical_device_id"], "remote_super_pod_id": 0})
    status = worker.link_one(link_params, deadline_s=50)
    peer.note("rank_table", getattr(worker, "rank_table", None))
    if status != MindieLlmStatusCode.SUCCESS:
        raise RuntimeError(f"link failed: {getattr(status, 'name', status)}; {worker.last_link_error}")
    peer.check("linked", True)
    return worker, caches


def _prefill(peer, same_server, a3):
    host_d = harness.LOCALHOST if same_server else harness.OTHER_LOCALHOST
    worker, _ = _side(peer, DmiModeNodeRole.PREFILL, PREFILL, DECODE, harness.LOCALHOST, host_d, a3, seeded=True)
    peer.barrier()  # the decoder pulled
    worker.finalize()


def _decode(peer, same_server, a3, decode_role):
    host_d = harness.LOCALHOST if same_server else harness.OTHER_LOCALHOST
    worker, caches = _side(peer, DmiModeNodeRole(decode_role), DECODE, PREFILL, host_d, harness.LOCALHOST, a3,
                           seeded=False)
    rt = worker.pull_blocks(PREFILL["cluster_id"], SRC_BLOCKS, DST_BLOCKS)
    if rt != MindieLlmStatusCode.SUCCESS:
        raise RuntimeError(f"pull_blocks: {getattr(rt, 'name', rt)}; "
                           f"{getattr(worker.separate_deployment_engine, 'last_pull_error', '')}")
    for model_id, tensors in caches.items():
        for layer, t in enumerate(tensors):
            src = harness.pattern(t.shape, torch.float16, seed=10 * model_id + layer)
            same = all(torch.equal(t[d], src[s]) for s, d in zip(SRC_BLOCKS, DST_BLOCKS, strict=True))
            rest = all(bool((t[b] == 0).all()) for b in range(NUM_BLOCKS) if b not in DST_BLOCKS)
            peer.check(f"model{model_id}_layer{layer}_blocks_pulled", same)
            peer.check(f"model{model_id}_layer{layer}_other_blocks_untouched", rest)
    peer.barrier()
    worker.finalize()


def run(tmp_path, options=None, *, same_server: bool = True, a3: bool = False, decode_role: str = "decoder",
        limit_s: float = 60.0) -> dict:
    """Prefill and decoder (or flex) engines on loopback; the decoder pulls K and V blocks and checks them."""
    return harness.run_pair(_prefill, _decode, prefill_args=(same_server, a3),
                            decode_args=(same_server, a3, decode_role), options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
