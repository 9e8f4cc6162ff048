"""Port of Omni-Infer's ``LLMDataDistManager`` (v1 manager) with its ``LLMDataDistConnector`` (v2 connector):
v2 selected by an empty ``local_comm_res``, one-sided ``link_clusters`` to 64-bit cluster ids that encode
``ip:port``, the decoder pulls; a PREFILL restart makes the decoder force-unlink the stale link and link again.

Source: omni-ai-npu/omni-infer, commit 755106da3ec0b5f4ad660cbe4b1e8655396679e6:
``omni/accelerators/pd/llmdatadist_manager_v1.py`` and ``omni/accelerators/pd/llmdatadist_connector_v2.py``
(which imports the manager from ``llmdatadist_manager_v1``). Later copies of the manager (for example the
``omni_npu/connector/llmdatadist_manager_v1.py`` of newer trees) keep these calls and add pipeline-parallel
caches, ``unregister_cache`` and a ``finalize`` / re-``init`` of the same object.

Ported, llm_datadist calls verbatim and in order:
- ``LLMDataDistConfig`` (role mapping kv_producer -> PROMPT, kv_consumer -> DECODER; ``cluster_id =
  ip_port_to_int(f"{ip}:{port + local_rank}", tp_size)`` -- ip in the top 32 bits, port and tp size below,
  so the ids are above 2**63 - 2**56 on loopback; ``host_cluster_id = (monotonic ms, ip_port_to_int(...))``).
- ``LLMDataDistManager._init_llm_data_dist``: ``LLMDataDist(role, cluster_id)``; ``LLMConfig`` with
  ``device_id``, ``local_comm_res = ""`` (set twice, as upstream), ``sync_kv_timeout = 5000``,
  ``enable_remote_cache_accessible = True`` and, on the prefill only, ``listen_ip_info``; no
  ``enable_cache_manager``: the empty ``local_comm_res`` alone selects CacheManager mode; ``init``.
- ``register_memory`` (``unzip_kv_cache_dict``, ``maybe_merge_kv_caches``,
  ``maybe_split_kv_caches_for_spec_layers``; per model_id a ``CacheDesc(num_tensors=..., shape=...,
  data_type=...)`` and ``cache_manager.register_blocks_cache(desc, addrs, key)`` with
  ``BlocksCacheKey(self.data_dist_engine.cluster_id, model_id=model_id)`` on the prefill and ``None`` on the
  decoder).
- ``register_link`` / ``close_link``: ``LLMClusterInfo()`` with ``remote_cluster_id``,
  ``append_local_ip_info(local_ip, 0)``, ``append_remote_ip_info(ip, port)`` decoded from the cluster id;
  ``ret, _ = link_clusters(clusters, timeout=LINK_TIMEOUT)`` and ``ret, _ = unlink_clusters(clusters,
  timeout=LINK_TIMEOUT, force=True)``, each checked against ``LLMStatusCode.LLM_SUCCESS``.
- ``get_real_remote_cluster_ids``: a request from an unknown ``host_cluster_id`` whose ip matches a
  registered one (the prefill restarted: new timestamp) closes the old link, then links anew.
- ``pull_kv`` / ``_pull_blocks``: ``cache_manager.pull_blocks(BlocksCacheKey(prompt_cluster_id=...,
  model_id=...), kv_cache, src_blocks, dst_blocks)`` positional, ``except LLMException`` reading
  ``e.status_code`` against ``RETRYABLE_CODES`` (seven ``LLMStatusCode`` members read at import),
  ``except (TypeError, ValueError)``; on failure ``_refresh_link`` (close + register) and one more pull.
- Connector: ``PrefillConnectorScheduler.request_finished`` (the ``kv_transfer_params``),
  ``PrefillConnectorWorker`` (``register_kv_caches``, ``get_finished``), ``DecodeConnectorWorker``
  (``register_kv_caches`` with a 1-thread executor, ``start_load_kv``'s flat-block-list branch: local blocks
  cut to the remote count, or the last N remote blocks; ``_read_blocks`` for tp = 1,
  ``_send_pulled_kv_req_list``, ``get_finished``).

Scaffolding replaced:
- vLLM config and parallel state -> a ``SimpleNamespace`` (tp = dp = 1, rank 0, local_rank 0, no
  ``additional_config``); ``extract_layer_index`` -> the one integer in the layer name (as vLLM's);
  ``get_p_start_rank`` (``omni/accelerators/pd/utils.py``) -> its value for tp = dp = 1 decode and
  prefill, 0; the Ray worker-ip discovery -> ``[local_host_ip]`` (its result without Ray);
  ``torch.npu.set_device`` dropped.
- ``get_local_ip`` / ``_get_local_ip`` (a UDP socket "connected" to 8.8.8.8) -> the side's loopback
  address (prefill ``127.0.0.1``, decode ``127.0.0.2``); ``VLLM_LLMDATADIST_BASE_PORT`` (15567) -> a free
  port; ``kv_port`` 5568 is only carried in ``remote_host_ip``.
- ZMQ: the proxy handing ``kv_transfer_params`` to the decoder (JSON, so ``host_cluster_id`` arrives as a
  list) and the decoder's PUSH of pulled request ids to the prefill's PULL thread -> :class:`Peer`
  send / recv; the scheduler's metadata -> ``DatadistConnectorMetadata.add_new_req`` called directly.
- NPU KV caches -> CPU tensors: 2 layers of (K, V), each 8 blocks x 4 tokens x 2 heads x 8, seeded on
  the prefill (a second seed after the restart); the decoder checks the pulled blocks.
- the prefill instance's restart (a new vLLM process in production) -> ``finalize()`` of the first
  ``LLMDataDist`` and a second connector / manager in the same process (same ip, port and cluster id,
  a new ``host_cluster_id`` timestamp).
- vLLM never finalizes; the harness calls ``finalize`` last on both sides.

What it holds aio_datadist to beyond the other ports: the CacheManager mode chosen by an empty
``local_comm_res`` alone; cluster ids just under 2**63 (an ip in their top 32 bits); ``link_clusters`` /
``unlink_clusters`` by keyword; the ``prompt_cluster_id=`` alias of ``BlocksCacheKey``; and the recovery after a
peer restart (the reference, 4.1): the decoder's ``unlink_clusters(clusters, timeout=5000, force=True)`` of a
link the old instance's ``finalize`` already took down answers ``LLM_SUCCESS``, as LLM-DataDist's forced unlink (HIXL
``link_msg_handler.cc`` ``UnlinkCluster`` -> ``comm_entity_manager.cc`` ``DestroyEntity``: ``SUCCESS`` when
the cluster has no link), and the next ``link_clusters`` reaches the new instance.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from types import SimpleNamespace
from typing import Any, Optional

import _client_harness as harness
import torch

import aio_datadist.compat as llm_datadist  # was: import llm_datadist
from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    CacheDesc,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

_ROLE_STR_TO_ENUM = {
    "kv_producer": LLMRole.PROMPT,
    "kv_consumer": LLMRole.DECODER
}

TORCH_DTYPE_TO_NPU_DTYPE = {
    torch.half: llm_datadist.DataType.DT_FLOAT16,
    torch.float16: llm_datadist.DataType.DT_FLOAT16,
    torch.bfloat16: llm_datadist.DataType.DT_BF16,
    torch.float: llm_datadist.DataType.DT_FLOAT,
    torch.float32: llm_datadist.DataType.DT_FLOAT,
    torch.int8: llm_datadist.DataType.DT_INT8,
    torch.int64: llm_datadist.DataType.DT_INT64,
    torch.int32: llm_datadist.DataType.DT_INT32
}

SCHEDULER_LINK_BATCH_SIZE = 32
SCHEDULER_LINK_INTERVAL = 0.5
KV_CACHE_RETRY_TIMES = 1
KV_CACHE_RETRY_WAIT_SECOND = 1
SYNC_KV_TIMEOUT = 5000  # ms
LINK_TIMEOUT = 5000  # ms

RETRYABLE_CODES = [
    LLMStatusCode.LLM_REPEAT_REQUEST,
    LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT,
    LLMStatusCode.LLM_PROCESSING_LINK,  # Building chain is in progress
    LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
    LLMStatusCode.LLM_TIMEOUT,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    LLMStatusCode.LLM_LINK_BUSY,
]

NUM_DIE_PER_MACH = 16  # was int(os.getenv("NUM_DIE_PER_MACH", "16"))
DECODE_POD_NUM = 1  # was int(os.getenv('DECODE_POD_NUM', "1"))
BLOCK_RELEASE_DELAY = 600  # was the BLOCK_RELEASE_DELAY env default

# -- harness values ------------------------------------------------------------
NUM_LAYERS = 2
NUM_BLOCKS = 8
BLOCK_SHAPE = (4, 2, 8)  # block_size tokens, heads, head_dim
KV_PORT = 5568  # the connector's ZMQ port (VLLM_LLMDATADIST_ZMQ_PORT default); only carried along
#: (request id, prefill's block ids, decoder's block ids): the first has more local blocks than remote
#: ones (lookahead: local ones are cut), the second more remote ones (the last N remote ones are used)
REQUESTS = [("req-1", [1, 2, 4], [3, 0, 5, 6]), ("req-2", [0, 1, 3, 6], [2, 7])]


def extract_layer_index(layer_name: str) -> int:
    """vLLM's ``extract_layer_index``: the one integer in the layer name."""
    int_vals = [int(x) for x in layer_name.split(".") if x.isdigit()]
    assert len(int_vals) == 1, f"layer name {layer_name} should only contain one integer"
    return int_vals[0]


def get_p_start_rank(p_tp_size, p_dp_size, d_tp_size, d_dp_size, d_node_num, cur_d_node, cur_d_rank):
    """``omni.accelerators.pd.utils.get_p_start_rank`` for this run's sizes (all 1): rank 0."""
    assert (p_tp_size, p_dp_size, d_tp_size, d_dp_size, d_node_num, cur_d_node, cur_d_rank) == (1, 1, 1, 1, 1, 0, 0)
    return 0


def get_world_group():
    return SimpleNamespace(rank_in_group=0, local_rank=0)


def get_tensor_model_parallel_rank():
    return 0


class RequestStatus(Enum):
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_ABORTED = 2


# -- omni/accelerators/pd/llmdatadist_manager_v1.py -------------------------------

class LLMDataDistConfig:
    """
    Configuration for the separate deployment.
    """
    def __init__(self, vllm_config, local_host_ip, host_port, ignore_load_rank=False) -> None:
        additional_config = vllm_config.additional_config
        if additional_config:
            self.multi_rank_pull_kv = additional_config.get("multi_rank_pull_kv", False)
        else:
            self.multi_rank_pull_kv = False
        self.local_host_ip = local_host_ip
        self.host_port = host_port
        self.kv_transfer_config = vllm_config.kv_transfer_config
        self.kv_role_tmp = self.kv_transfer_config.kv_role

        self.dp_rank = vllm_config.parallel_config.data_parallel_rank_local
        self.tp_rank = 0
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.dp_size = vllm_config.parallel_config.data_parallel_size

        if ignore_load_rank:
            self.rank = -1
            self.local_rank = -1
            self.cluster_id = -1
        else:
            self.rank = get_world_group().rank_in_group
            self.local_rank = get_world_group().local_rank
            self.cluster_id = ip_port_to_int(f"{self.local_host_ip}:{int(self.host_port)+self.local_rank}",
                                             self.tp_size)

        # will be used in d side to checkout which P rank is selected to build kv link
        self.kv_parallel_size = self.kv_transfer_config.kv_parallel_size
        self.kv_producer_dp_size = self.kv_transfer_config.kv_connector_extra_config.get("kv_producer_dp_size", 1)

        host_ip_list = self._get_worker_ips()
        self.host_ip_list = host_ip_list

        timestamp_ms = round(time.monotonic() * 1_000)
        # host_cluster_id is a list, in order to handle the case that multi-node for one TP group
        ip_integers = [
            ip_port_to_int(f"{ip}:{host_port}", self.tp_size)
            for ip in host_ip_list
        ]

        # (timestamp_ms, ip1_int, ip2_int, ip3_int, ...)
        self.host_cluster_id = (timestamp_ms, *ip_integers)

    # get all node ips in a TP group
    def _get_worker_ips(self):
        # harness: the Ray discovery is dropped; without Ray upstream returns this
        worker_ips = [self.local_host_ip]
        return worker_ips

    @cached_property
    def role(self):
        return _ROLE_STR_TO_ENUM[self.kv_transfer_config.kv_role]

    @cached_property
    def is_prefill(self):
        return self.role == LLMRole.PROMPT


class LLMDataDistManager:
    def __init__(self, vllm_config, local_host_ip, host_port):
        additional_config = vllm_config.additional_config
        if additional_config:  # pragma: no cover
            self.multi_rank_pull_kv = additional_config.get("multi_rank_pull_kv", False)
        else:  # pragma: no cover
            self.multi_rank_pull_kv = False
        self.kv_transfer_config = vllm_config.kv_transfer_config
        self.data_dist_config = LLMDataDistConfig(vllm_config, local_host_ip, host_port)
        self.rank = self.data_dist_config.rank
        self.local_rank = self.data_dist_config.local_rank
        self.tp_size = self.data_dist_config.tp_size
        self.tp_rank = self.data_dist_config.tp_rank
        self.dp_size = self.data_dist_config.dp_size
        self.dp_rank = self.data_dist_config.dp_rank
        self.prefill_dp_size = self.data_dist_config.kv_producer_dp_size
        if not self.data_dist_config.is_prefill:
            self.decode_id = self.dp_rank // NUM_DIE_PER_MACH

        self.data_dist_engine = self._init_llm_data_dist()

        self.registered_kv_caches = []
        self.rank_link_info_map = {}
        # the look-up table for pull kv, managed by each dp process
        # { key: (host_cluster_id, prefill_dp_rank, d_rank), value:[prompt_cluster_id_list] }
        self.registered_link_infos = {}

    def get_real_remote_cluster_ids(self, meta, tp_rank=0):
        # remote_cluster_id: (timestamp, ip1, ip2, ...)
        remote_id_key = (tuple(meta.remote_cluster_id) if isinstance(meta.remote_cluster_id, list)
                         else meta.remote_cluster_id)

        key = (remote_id_key, meta.remote_dp_rank, self.rank)
        remote_cluster_ids = self.registered_link_infos.get(key, None)

        if remote_cluster_ids is None:
            old_key = None
            for (reg_key, reg_dp_rank, reg_rank) in list(self.registered_link_infos.keys()):
                if (reg_dp_rank == meta.remote_dp_rank and reg_rank == self.rank and
                        any(ip in reg_key[1:] for ip in remote_id_key[1:])):
                    old_key = (reg_key, reg_dp_rank, reg_rank)  # reg_key: (time_stamp, ip1_int, .., ip2_int)
                    break
            if old_key:
                self.close_link(old_key[0], meta.remote_dp_rank, self.rank, tp_rank)
                self.events.append(("closed_old_link", old_key[0]))  # harness
            # Ensure register_link also receives hashable data
            self.register_link(remote_id_key, meta.remote_dp_rank, self.rank, tp_rank)
            remote_cluster_ids = self.registered_link_infos.get(key, None)

        return remote_cluster_ids

    def _init_llm_data_dist(self):
        self.events = []  # harness: what the manager did, for the checks
        data_dist = LLMDataDist(self.data_dist_config.role, self.data_dist_config.cluster_id)
        llm_config = LLMConfig()
        llm_config.device_id = self.local_rank
        llm_config.local_comm_res = ""
        # RoCE timeout is SYNC_KV_TIMEOUT ms， prevent pull kv timeout
        llm_config.sync_kv_timeout = SYNC_KV_TIMEOUT
        llm_config.enable_remote_cache_accessible = True

        # do new_datadist_link
        llm_config.local_comm_res = ""
        # if is prefill, need to listen on specific ip and port to accept decode side connection
        if self.data_dist_config.is_prefill:
            host_ip_t = self.data_dist_config.local_host_ip
            host_port_t = int(self.data_dist_config.host_port) + int(self.data_dist_config.local_rank)
            llm_config.listen_ip_info = f"{host_ip_t}:{host_port_t}"

        options = llm_config.generate_options()
        options.update(harness.extra_options())  # harness: transport selection
        data_dist.init(options)

        return data_dist

    # dynamically register link only when is needed
    def register_link(self, host_cluster_id, prefill_dp_rank, d_rank, tp_rank=0):
        prompt_cluster_id_list = self._get_cluster_id_list(host_cluster_id[1:], prefill_dp_rank, d_rank, tp_rank)
        clusters = []
        for PROMPT_CLUSTER_ID in prompt_cluster_id_list:
            cluster = LLMClusterInfo()
            host_ip, tp_size, tp_rank = cluster_id_to_ip_port(PROMPT_CLUSTER_ID)
            remote_host_ip, port = host_ip.split(':')
            cluster.remote_cluster_id = PROMPT_CLUSTER_ID
            cluster.append_local_ip_info(self._get_local_ip(), 0)
            cluster.append_remote_ip_info(remote_host_ip, int(port))
            clusters.append(cluster)
        ret, _ = self.data_dist_engine.link_clusters(clusters, timeout=LINK_TIMEOUT)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise Exception("link failed")
        # add the cluster_id to the dict
        if not self.data_dist_config.is_prefill:
            self.registered_link_infos[(host_cluster_id, prefill_dp_rank, d_rank)] = prompt_cluster_id_list
        self.events.append(("linked", prompt_cluster_id_list))  # harness

    # close the link when it is confirmed to be broken
    def close_link(self, host_cluster_id, prefill_dp_rank, d_rank, tp_rank=0):
        if not self.data_dist_config.is_prefill:
            prompt_cluster_id_list = self._get_cluster_id_list(host_cluster_id[1:], prefill_dp_rank, d_rank, tp_rank)
        else:
            prompt_cluster_id_list = [host_cluster_id]
        clusters = []
        for PROMPT_CLUSTER_ID in prompt_cluster_id_list:
            cluster = LLMClusterInfo()
            host_ip, tp_size, tp_rank = cluster_id_to_ip_port(PROMPT_CLUSTER_ID)
            remote_host_ip, port = host_ip.split(':')
            cluster.remote_cluster_id = PROMPT_CLUSTER_ID
            cluster.append_local_ip_info(self._get_local_ip(), 0)
            cluster.append_remote_ip_info(remote_host_ip, int(port))
            clusters.append(cluster)
        ret, _ = self.data_dist_engine.unlink_clusters(clusters, timeout=LINK_TIMEOUT, force=True)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise Exception("unlink failed")
        # remove the cluster_id from the dict
        if not self.data_dist_config.is_prefill:
            self.registered_link_infos.pop((host_cluster_id, prefill_dp_rank, d_rank), None)
        self.events.append(("unlinked", prompt_cluster_id_list))  # harness

    def _pull_blocks(self, src_cache_key, dst_cache, src_blocks, dst_blocks):
        """" pull kv from remote cache to local cache, support return error state if pull kv fails """
        for attempt in range(KV_CACHE_RETRY_TIMES):
            try:
                self.data_dist_engine.cache_manager.pull_blocks(
                    src_cache_key, dst_cache, src_blocks, dst_blocks
                )
                return True
            except LLMException as e:
                code = e.status_code
                self.events.append(("pull_failed", str(code), str(e)))  # harness (was logger.error)
                if code in RETRYABLE_CODES:
                    if attempt < KV_CACHE_RETRY_TIMES - 1:
                        time.sleep(KV_CACHE_RETRY_WAIT_SECOND)
                        continue
                    return False
                else:
                    return False
            except (TypeError, ValueError) as e:
                self.events.append(("pull_input_error", f"{type(e).__name__}: {e}"))  # harness
                return False
        return False

    def pull_kv(self, src_blocks, tgt_blocks, prompt_cluster_id, prefill_dp_rank):
        """ pull kv from remote cache to local cache, support to refresh link when pull kv fails """
        for model_id, kv_cache in enumerate(self.registered_kv_caches):
            prompt_cache_key = BlocksCacheKey(
                prompt_cluster_id=prompt_cluster_id, model_id=model_id)
            ret = self._pull_blocks(prompt_cache_key, kv_cache,
                                    src_blocks, tgt_blocks)
            if not ret:
                self._refresh_link(prompt_cluster_id, prefill_dp_rank, self.rank)
                ret_updated = self._pull_blocks(prompt_cache_key, kv_cache,
                                                src_blocks, tgt_blocks)
                if not ret_updated:
                    raise RuntimeError("Failed to pull kv even if rebuild the kv link!")

    def _refresh_link(self, prompt_cluster_id, prefill_dp_rank, d_rank):
        """ refresh the kv link: unlink + link """
        (host_cluster_id, prefill_dp_rank, d_rank) = \
            self._get_host_cluster_id(prompt_cluster_id, prefill_dp_rank, d_rank)
        if host_cluster_id is not None:
            self.close_link(host_cluster_id, prefill_dp_rank, d_rank)
            self.register_link(host_cluster_id, prefill_dp_rank, d_rank)
        else:
            raise RuntimeError("Unregistered host cluster id!!!")

    # search for the host_cluster_id in key using the prompt_cluster_id in value
    def _get_host_cluster_id(self, prompt_cluster_id, prefill_dp_rank, d_rank):
        """ search for the host_cluster_id in key using the prompt_cluster_id in value """
        prompt_p_metas = [
            key for key, values in self.registered_link_infos.items()
            if (isinstance(values, list) and
                prompt_cluster_id in values and
                len(key) >= 3 and
                key[1] == prefill_dp_rank and
                key[2] == d_rank)
        ]
        if not prompt_p_metas:
            return None
        else:
            return prompt_p_metas[0]

    def _get_cluster_id_list(self, host_cluster_ids, prefill_dp_rank, d_rank, tp_rank):
        """ compute the cluster id that should be linked with the target dp rank """
        if isinstance(host_cluster_ids, int):
            host_cluster_ids = [host_cluster_ids]
        ip_ports = []
        for host_cluster_id in host_cluster_ids:
            ip_port, prefill_tp_size, _ = cluster_id_to_ip_port(host_cluster_id)
            ip_ports.append(ip_port)
        decode_tp_size = self.data_dist_config.kv_parallel_size
        decode_id = 0
        decode_num = DECODE_POD_NUM

        p_rank_start = get_p_start_rank(prefill_tp_size, 1, decode_tp_size, self.dp_size,
                                        decode_num, decode_id, d_rank)
        p_rank_list = [p_rank_start + dp_idx * prefill_tp_size for dp_idx in range(self.prefill_dp_size)]
        cluster_id_list = []
        for p_rank in p_rank_list:
            ip_port = ip_ports[p_rank // NUM_DIE_PER_MACH]
            ip, port_str = ip_port.split(':')
            port = int(port_str) + (p_rank % NUM_DIE_PER_MACH)
            cluster_id = ip_port_to_int(f"{ip}:{port}", prefill_tp_size)
            cluster_id_list.append(cluster_id)
        return cluster_id_list

    def _get_local_ip(self):
        return self.data_dist_config.local_host_ip  # harness: was a UDP socket "connected" to 8.8.8.8

    # reuse the existing code
    def register_memory(self, kv_caches: dict[str, torch.Tensor]):
        if len(self.registered_kv_caches) > 0:
            raise ValueError("Attr `registered_kv_caches` must be empty before register kv_caches.")
        if isinstance(kv_caches, dict):
            flatten_kv_caches = unzip_kv_cache_dict(kv_caches)
        else:
            flatten_kv_caches = unzip_kv_cache_list(kv_caches)

        # dense model.
        flatten_kv_caches = maybe_merge_kv_caches(flatten_kv_caches)
        # spec model.
        flatten_kv_caches = maybe_split_kv_caches_for_spec_layers(flatten_kv_caches)

        for model_id, sub_kv_caches in enumerate(flatten_kv_caches):
            cache_desc = CacheDesc(num_tensors=len(sub_kv_caches), shape=tuple(sub_kv_caches[0].shape),
                                   data_type=TORCH_DTYPE_TO_NPU_DTYPE[sub_kv_caches[0].dtype])

            cache_addrs = [int(item.data_ptr()) for item in sub_kv_caches]

            if self.data_dist_config.is_prefill:
                cache_key = BlocksCacheKey(self.data_dist_engine.cluster_id, model_id=model_id)
            else:
                cache_key = None

            cache = self.data_dist_engine.cache_manager.register_blocks_cache(cache_desc, cache_addrs, cache_key)
            self.registered_kv_caches.append(cache)


# reuse the existing code
def unzip_kv_cache_dict(kv_caches: dict[str, torch.Tensor], ):
    # Convert kv_caches dict to a list of tensors in the order of layer_index.
    _, first_kv_cache = next(iter(kv_caches.items()))
    if isinstance(first_kv_cache, tuple):
        cache_num = len(first_kv_cache)
    else:
        cache_num = 1

    flatten_kv_caches = [[] for _ in range(cache_num)]

    index2name = defaultdict(list)
    for layer_name in kv_caches:
        index2name[extract_layer_index(layer_name)].append(layer_name)

    for layer_index in sorted(index2name.keys()):
        layer_names = index2name[layer_index]
        if len(layer_names) > 1:
            # One typical case is encoder-decoder model, e.g., bart.
            # The cross attention and self attention in the same decoder layer
            # has different layer_name but the same layer_index.
            raise NotImplementedError
        layer_name = layer_names[0]
        kv_cache = kv_caches[layer_name]
        if isinstance(kv_cache, tuple):
            for index, sub_cache in enumerate(kv_cache):
                flatten_kv_caches[index].append(sub_cache)
        else:
            flatten_kv_caches[0].append(kv_cache)
    return flatten_kv_caches


# reuse the existing code
def unzip_kv_cache_list(kv_caches: list[torch.Tensor], ):
    first_kv_cache = kv_caches[0]
    if isinstance(first_kv_cache, tuple):
        cache_num = len(first_kv_cache)
    else:
        cache_num = 1

    flatten_kv_caches = [[] for _ in range(cache_num)]

    for kv_cache in kv_caches:
        if isinstance(kv_cache, tuple):
            for index, sub_cache in enumerate(kv_cache):
                flatten_kv_caches[index].append(sub_cache)
        else:
            flatten_kv_caches[0].append(kv_cache)
    return flatten_kv_caches


# reuse the existing code
def maybe_merge_kv_caches(flatten_kv_caches):
    # only 1 kvcache tensor with shape (2, b, s, n, d)
    if (len(flatten_kv_caches) == 1 and len(flatten_kv_caches[0][0].shape) == 5
            and flatten_kv_caches[0][0].shape[0] == 2):
        merged_kv_caches = [[]]
        for sub_kv_caches in flatten_kv_caches[0]:
            merged_kv_caches[0].append(sub_kv_caches[0])
            merged_kv_caches[1].append(sub_kv_caches[1])
        return merged_kv_caches
    return flatten_kv_caches


# reuse the existing code
def maybe_split_kv_caches_for_spec_layers(flatten_kv_caches):
    flatten_kv_caches_split = []
    need_split = False
    for caches in flatten_kv_caches:
        shape_dict = {}
        for cache in caches:
            if str(cache.shape) not in shape_dict:
                shape_dict[str(cache.shape)] = []
            shape_dict[str(cache.shape)].append(cache)

        flatten_kv_caches_split.extend(shape_dict.values())
        if len(shape_dict) > 1 or need_split:
            need_split = True

    if not need_split:
        return flatten_kv_caches
    else:
        return flatten_kv_caches_split


def ip_port_to_int(ip_port, tp_size, tp_rank=0):
    """ convert ip_port to int64 cluster id

    layout:
    [ ip (32 bits) | port (16 bits) | tp_size (16 bits) ]
    """
    ip, port_str = ip_port.split(':')
    port = int(port_str)
    if not (0 <= port <= 65535):
        raise ValueError(" port must be in 0-65535 ")
    # convert IP to 4 byte boolean
    ip_bytes = socket.inet_aton(ip)
    # convert 4 byte IP to 32 bit int
    ip_int = struct.unpack('!I', ip_bytes)[0]
    # now we only contain ip, port, tp_size, tp_rank is ignored for simplification
    # result = (ip_int << 48) | (port << 32) | (tp_size << 16) | (tp_rank)
    result = (ip_int << 32) | (port << 16) | (tp_size & 0xFFFF)
    return result


def cluster_id_to_ip_port(cluster_id):
    """Extract ip_port from int64 cluster id (inverse of ip_port_to_int)."""
    if not isinstance(cluster_id, int):
        raise TypeError("cluster_id must be int type")

    # Extract fields (reverse order of packing)
    tp_size = cluster_id & 0xFFFF              # Lower 16 bits
    port = (cluster_id >> 16) & 0xFFFF         # Next 16 bits
    ip_int = (cluster_id >> 32) & 0xFFFFFFFF   # Upper 32 bits

    ip = socket.inet_ntoa(struct.pack('!I', ip_int))

    return f"{ip}:{port}", tp_size, 0  # tp_rank always 0


# -- omni/accelerators/pd/llmdatadist_connector_v2.py (the parts that reach the manager) ----

@dataclass
class ReqMeta:
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_cluster_id: str
    spec_token_ids: Optional[list[int]]
    remote_dp_rank: Optional[int]
    remote_request_id: Optional[str]


class DatadistConnectorMetadata:
    """Metadata for datadist connector."""

    def __init__(self):
        self.requests: dict[str, ReqMeta] = {}

    def add_new_req(
        self,
        request_id: str,
        local_block_ids: list[int],
        kv_transfer_params: dict[str, Any],
    ):
        self.requests[request_id] = ReqMeta(
            local_block_ids=local_block_ids,
            remote_block_ids=kv_transfer_params["remote_block_ids"],
            remote_host=kv_transfer_params["remote_host_ip"],
            remote_cluster_id=kv_transfer_params["remote_cluster_id"],
            spec_token_ids=kv_transfer_params["spec_token_ids"],
            remote_dp_rank=kv_transfer_params.get("remote_dp_rank", 0),
            remote_request_id=kv_transfer_params.get("remote_request_id", None),
        )


class LLMDataDistConnector:
    """``LLMDataDistConnector.__init__``: one connector per role, here scheduler and worker in one process."""

    def __init__(self, peer, vllm_config, local_host_ip: str, base_port: int):
        local_host_port = base_port  # was LLMDATADIST_BASE_PORT
        self.datadist_config = LLMDataDistConfig(vllm_config, local_host_ip, local_host_port, ignore_load_rank=True)
        self.host_cluster_id = self.datadist_config.host_cluster_id
        self.host_ip = local_host_ip
        self.host_port = KV_PORT  # was get_config_from_dict_or_env(..., "kv_port", ...)
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        self.host_port += dp_rank
        self.is_prefill = vllm_config.kv_transfer_config.kv_role == "kv_producer"
        if self.is_prefill:
            self.connector_scheduler = PrefillConnectorScheduler(vllm_config, self.host_cluster_id, self.host_ip,
                                                                 str(self.host_port))
            self.connector_worker = PrefillConnectorWorker(vllm_config, str(self.host_ip), str(self.host_port),
                                                           base_port)
        else:
            self.connector_scheduler = None  # (the decode scheduler makes no llm_datadist call)
            self.connector_worker = DecodeConnectorWorker(peer, vllm_config, str(self.host_ip),
                                                          self.host_cluster_id)


class PrefillConnectorScheduler:
    """Implementation of Scheduler side methods"""

    def __init__(self, vllm_config, host_cluster_id: str, host_ip: str, host_port: str):
        self.vllm_config = vllm_config
        self.host_cluster_id = host_cluster_id
        self.host_ip = host_ip
        self.host_port = host_port
        # initialize the dict to save requests finish time
        self.requests_finish_time = dict()

    def request_finished(self, request, block_ids: list[int], spec_token_ids: Optional[list[int]] = []):
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None

        delay_free_blocks = len(block_ids) > 0
        # record the finish time of the request
        if delay_free_blocks:
            self.requests_finish_time[request.request_id] = time.monotonic()

        return delay_free_blocks, dict(
            remote_block_ids=block_ids,
            remote_cluster_id=self.host_cluster_id,
            remote_host_ip=f"tcp://{self.host_ip}:{self.host_port}",
            spec_token_ids=spec_token_ids,
            remote_dp_rank=self.vllm_config.parallel_config.data_parallel_rank,
            remote_request_id=request.request_id
        )


class PrefillConnectorWorker:
    """Implementation of Worker side methods"""

    def __init__(self, vllm_config, host_ip: str, host_port: str, base_port: int):
        # Metadata.
        self.host_ip = host_ip
        self.host_port = host_port
        self.rank = get_tensor_model_parallel_rank()
        if self.rank == 0:
            # harness: the ZMQ PULL socket and its thread -> on_pulled_message, fed from the Peer
            self._transfer_lock = threading.Lock()
            self.receive_req_list = []
        manager_cls = LLMDataDistManager
        local_host_port = base_port  # was LLMDATADIST_BASE_PORT
        self.datadist_manager = manager_cls(vllm_config, self.host_ip, local_host_port)

        # initialize the dict to save requests finish time
        self.requests_finish_time = dict()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.datadist_manager.register_memory(kv_caches)

    def on_pulled_message(self, message: str):
        """The body of ``get_pulled_kv_req_list`` for one message."""
        id_list = json.loads(message)  # Parse the received JSON string into a list
        with self._transfer_lock:
            self.receive_req_list.extend(id_list)

    def get_finished(self, metadata) -> tuple[set[str], set[str]]:
        """
        Get requests that are done sending or recving.
        """
        all_done_sending: set[str] = set()
        all_done_recving: set[str] = set()
        if self.rank == 0:
            # Update requests_finish_time with new finish times from metadata
            with self._transfer_lock:
                self.requests_finish_time.update(
                    {req_id: meta.finish_time for req_id, meta in metadata.requests.items()}
                )
                current_time = time.monotonic()
                # Identify requests whose finish time exceeds BLOCK_RELEASE_DELAY
                out_date_reqs = []
                for req_id, finish_time in self.requests_finish_time.items():
                    if current_time - finish_time > BLOCK_RELEASE_DELAY:
                        out_date_reqs.append(req_id)
                    else:
                        # Since the dict is ordered by finish_time, we can break early
                        break
                for req_id in out_date_reqs:
                    all_done_sending.add(req_id)
                    del self.requests_finish_time[req_id]

            if len(self.receive_req_list) == 0:
                return all_done_sending, all_done_recving

            with self._transfer_lock:
                for req_id in self.receive_req_list:
                    all_done_sending.add(req_id)
                    # if the request's kv has been received, remove it from requests_finish_time
                    if req_id in self.requests_finish_time:
                        del self.requests_finish_time[req_id]
                self.receive_req_list.clear()

        return all_done_sending, all_done_recving


class DecodeConnectorWorker:
    """Worker implementation for datadist."""

    def __init__(self, peer, vllm_config, host_ip: str, host_cluster_id: int):
        self.peer = peer  # harness: stands in for the ZMQ PUSH sockets
        self.vllm_config = vllm_config
        self.host_cluster_id = host_cluster_id
        self.dp_rank = vllm_config.parallel_config.data_parallel_rank_local
        self.tp_rank = get_tensor_model_parallel_rank()
        self.async_pull_kv = False
        self.multi_thread_pull_kv = False
        self.multi_rank_pull_kv = False

        manager_cls = LLMDataDistManager
        self.datadist_manager = manager_cls(vllm_config, host_ip, 0)

        self._recving_transfers: list = []
        self._done_recving_count: defaultdict[str, int] = defaultdict(lambda: 0)

        self._pull_kv_lock = threading.Lock()
        self.queues = {}  # cluster_id -> queue.Queue
        self.threads = {}  # cluster_id -> threading.Thread

        self._transfer_lock = threading.Lock()
        self.host_ip = host_ip

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.datadist_manager.register_memory(kv_caches)
        max_concurrents = 1
        self.executor = ThreadPoolExecutor(max_workers=max_concurrents)

    # Now go asynchronous pull_kv
    def start_load_kv(self, metadata: DatadistConnectorMetadata):
        futures = []
        for req_id, meta in metadata.requests.items():
            # if the local_block_ids is empty, skip pulling kv for the request
            if len(meta.local_block_ids) == 0:
                continue
            # If local_block_ids is a flat list of int, omni-attention is not used
            # and we can directly use the local_block_ids and remote_block_ids
            if isinstance(meta.local_block_ids[0], int):
                # local_block_ids (kv blocks in D) is more than remote_block_ids (kv blocks in P)
                # leaded by lookahead num, which is used by eagle and multi step
                if len(meta.remote_block_ids) < len(meta.local_block_ids):
                    meta.local_block_ids = meta.local_block_ids[:len(meta.remote_block_ids)]
                # If remote_block_ids is more than local_block_ids, we only need the last N remote blocks
                # where N is the number of local blocks
                elif len(meta.remote_block_ids) > len(meta.local_block_ids):
                    meta.remote_block_ids = meta.remote_block_ids[-len(meta.local_block_ids):]
            else:  # (the omni-attention list-of-lists branch is not ported)
                raise RuntimeError(f"Unexpected type for meta.local_block_ids[0]: {type(meta.local_block_ids[0])}")
            cluster_ids = self.datadist_manager.get_real_remote_cluster_ids(meta)
            # Use ThreadPoolExecutor to handle the task
            future = self.executor.submit(
                self._read_blocks,
                local_block_ids=meta.local_block_ids,
                remote_block_ids=meta.remote_block_ids,
                dst_cluster_id=cluster_ids[0],
                request_id=req_id,
                remote_request_id=meta.remote_request_id,
                remote_host_ip=meta.remote_host,
                prefill_dp_rank=meta.remote_dp_rank,
            )
            futures.append(future)

        if not self.multi_thread_pull_kv:
            for future in futures:
                future.add_done_callback(handle_exception)
        return futures  # harness: vLLM only logs their exceptions; the run waits on them

    def _read_blocks(
        self,
        local_block_ids: list[int],
        remote_block_ids: list[int],
        dst_cluster_id: str,
        request_id: str,
        remote_request_id: str,
        remote_host_ip: str,
        prefill_dp_rank: int,
    ):
        self.datadist_manager.pull_kv(remote_block_ids, local_block_ids, dst_cluster_id, prefill_dp_rank)

        # tp=1, send to prefill tp rank0 directly.
        self._send_pulled_kv_req_list(remote_host_ip, [remote_request_id])
        with self._transfer_lock:
            self._recving_transfers.append(request_id)

    def _send_pulled_kv_req_list(self, path, data):
        json_data = json.dumps(data)
        self.peer.send(("pulled", path, json_data))  # was a ZMQ PUSH socket connected to `path`

    def get_finished(self, metadata) -> tuple[set[str], set[str]]:
        # for decode size, done_sending is no need
        all_done_sending: set[str] = set()
        with self._transfer_lock:
            all_done_recving = self._pop_done_transfers(self._recving_transfers)
        return all_done_sending, all_done_recving

    def _pop_done_transfers(self, transfers: list) -> set[str]:
        done_req_ids: set[str] = set()
        for req_id in transfers:
            done_req_ids.add(req_id)
        self._recving_transfers.clear()
        return done_req_ids


def handle_exception(future):
    if future.exception():
        raise future.exception()


# -- harness -------------------------------------------------------------------------

def _vllm_config(kv_role: str):
    return SimpleNamespace(
        additional_config=None,
        kv_transfer_config=SimpleNamespace(kv_role=kv_role, kv_parallel_size=1, kv_connector_extra_config={}),
        parallel_config=SimpleNamespace(data_parallel_rank_local=0, data_parallel_rank=0, tensor_parallel_size=1,
                                        data_parallel_size=1),
        model_config=SimpleNamespace(is_deepseek_mla=False),
    )


def _seed(generation: int, layer: int, kv: int) -> int:
    return 100 * generation + 10 * layer + kv


def _kv_caches(generation: int | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's ``kv_caches`` dict: per layer a (K, V) tuple of ``(num_blocks, block_size, heads, head_dim)``."""
    shape = (NUM_BLOCKS, *BLOCK_SHAPE)
    out = {}
    for layer in range(NUM_LAYERS):
        pair = []
        for kv in range(2):
            t = harness.aligned(shape, torch.float16)
            if generation is not None:
                t.copy_(harness.pattern(shape, torch.float16, seed=_seed(generation, layer, kv)))
            pair.append(t)
        out[f"model.layers.{layer}.self_attn.attn"] = tuple(pair)
    return out


def _prefill(peer, base_port, restart):
    finished_metadata = SimpleNamespace(requests={})
    connector = kv_caches = None
    for generation, (req_id, remote_blocks, _local) in enumerate(REQUESTS):
        if connector is None or restart:
            # with ``restart`` generation 1 is a restarted prefill instance: the first one's LLMDataDist was
            # finalized (the process exited), the new one has the same ip, port and cluster id, a new timestamp
            connector = LLMDataDistConnector(peer, _vllm_config("kv_producer"), harness.LOCALHOST, base_port)
            worker = connector.connector_worker
            kv_caches = _kv_caches(generation)
            worker.register_kv_caches(kv_caches)
        else:  # the same instance computed the next request's KV into the same blocks
            for layer, pair in enumerate(kv_caches.values()):
                for kv, t in enumerate(pair):
                    t.copy_(harness.pattern(t.shape, torch.float16, seed=_seed(generation, layer, kv)))
        peer.note(f"cluster_id_{generation}", worker.datadist_manager.data_dist_engine.cluster_id)
        request = SimpleNamespace(request_id=req_id, status=RequestStatus.FINISHED_LENGTH_CAPPED)
        delay_free, params = connector.connector_scheduler.request_finished(request, remote_blocks)
        peer.check(f"{req_id}_delay_free_blocks", delay_free)
        peer.send(("kv_transfer_params", req_id, json.dumps(params)))  # was the proxy, which JSON-encodes
        kind, path, message = peer.recv()  # was the PULL socket's thread
        peer.check(f"{req_id}_pulled_message", kind == "pulled" and path == params["remote_host_ip"])
        worker.on_pulled_message(message)
        done_sending, _ = worker.get_finished(finished_metadata)
        peer.check(f"{req_id}_done_sending", done_sending == {req_id})
        peer.barrier()  # the decoder checked the bytes
        if restart or generation == len(REQUESTS) - 1:
            worker.datadist_manager.data_dist_engine.finalize()  # harness: the prefill instance exits


def _decode(peer, base_port, restart):
    connector = LLMDataDistConnector(peer, _vllm_config("kv_consumer"), harness.OTHER_LOCALHOST, base_port)
    worker = connector.connector_worker
    manager = worker.datadist_manager
    kv_caches = _kv_caches(None)
    worker.register_kv_caches(kv_caches)
    expected = {}  # local block -> (generation, remote block)
    for generation, (req_id, remote_blocks, local_blocks) in enumerate(REQUESTS):
        kind, got_req_id, params_json = peer.recv()
        peer.check(f"{req_id}_params_received", kind == "kv_transfer_params" and got_req_id == req_id)
        kv_transfer_params = json.loads(params_json)
        metadata = DatadistConnectorMetadata()
        metadata.add_new_req(request_id=req_id, local_block_ids=list(local_blocks),
                             kv_transfer_params=kv_transfer_params)
        meta = metadata.requests[req_id]
        futures = worker.start_load_kv(metadata)
        for future in futures:
            future.result(timeout=60)
        peer.check(f"{req_id}_done_recving", worker.get_finished(metadata)[1] == {req_id})
        peer.note(f"events_{generation}", list(manager.events))
        for local, remote in zip(meta.local_block_ids, meta.remote_block_ids, strict=True):
            expected[local] = (generation, remote)
        peer.check(f"{req_id}_blocks_trimmed", len(meta.local_block_ids) == min(len(remote_blocks), len(local_blocks)))
        for layer, (k, v) in enumerate(kv_caches.values()):
            for kv, t in enumerate((k, v)):
                ok = True
                for block in range(NUM_BLOCKS):
                    if block in expected:
                        gen, remote = expected[block]
                        src = harness.pattern((NUM_BLOCKS, *BLOCK_SHAPE), torch.float16, seed=_seed(gen, layer, kv))
                        ok = ok and torch.equal(t[block], src[remote])
                    else:
                        ok = ok and bool((t[block] == 0).all())
                peer.check(f"{req_id}_layer{layer}_{'kv'[kv]}_blocks", ok)
        peer.barrier()
    kinds = [e[0] for e in manager.events]
    if restart:
        peer.check("linked_then_force_unlinked_then_relinked",
                   kinds == ["linked", "unlinked", "closed_old_link", "linked"])
    else:
        peer.check("linked_once", kinds == ["linked"])
    manager.data_dist_engine.finalize()  # harness


def run(tmp_path=None, options=None, *, restart: bool = True, limit_s: float = 60.0) -> dict:
    """A prefill and a decoder on loopback; the decoder pulls two requests' blocks.

    :param restart: the prefill instance restarts between the requests (the upstream path that force-unlinks
        the stale link and links again); False: one instance serves both over one link.
    """
    (base_port,) = harness.free_ports(1)  # was VLLM_LLMDATADIST_BASE_PORT (15567)
    return harness.run_pair(_prefill, _decode, prefill_args=(base_port, restart), decode_args=(base_port, restart),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
