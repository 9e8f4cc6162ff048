"""The public llm_datadist names the real clients in this directory use, looked up in ``aio_datadist.compat``.

Not a port of one file: the union of what the ported clients import from
``llm_datadist``, read as module attributes (``llm_datadist.DataType``,
``llm_datadist.RegisterMemStatus``), the enum members they compare against, and
the methods and ``LLMConfig`` properties they call, plus the rest of the
package's export list (reference section 1: ``Status``, ``CacheTask``,
``TransferConfig``, ``Memtype``, ``MemInfo``, ``TensorDesc``, ``Tensor``,
``KvCacheManager``, ``KvCache``, ``LlmConfig``). Runs in one process.
"""

from __future__ import annotations

import importlib

#: name -> the clients that import or read it
MODULE_NAMES = {
    "LLMDataDist": "all", "LLMRole": "all", "LLMConfig": "all", "CacheDesc": "all", "DataType": "all",
    "BlocksCacheKey": "hixl, vllm-ascend, mindie, sglang", "Placement": "hixl, mindie",
    "LLMClusterInfo": "hixl, vllm-ascend v0, sglang", "LLMStatusCode": "hixl, mindie, sglang",
    "CacheKeyByIdAndIndex": "hixl push_cache, vllm-ascend v0", "CacheKey": "hixl pull samples, vllm-ascend v0",
    "Cache": "hixl pull samples, sglang", "RegisterMemStatus": "hixl pull samples, vllm-ascend cmgr, mindie",
    "TransferWithCacheKeyConfig": "hixl transfer_cache_async", "LayerSynchronizer": "hixl transfer_cache_async",
    "LLMException": "vllm-ascend cmgr, mindie",
    # the rest of the reference's export list
    "LlmConfig": "reference", "Status": "reference", "KvCache": "reference", "TransferConfig": "reference",
    "CacheTask": "reference", "Memtype": "reference", "MemInfo": "reference", "TensorDesc": "reference",
    "Tensor": "reference", "KvCacheManager": "reference",
}

ENUM_MEMBERS = {
    "LLMStatusCode": ["LLM_SUCCESS", "LLM_ALREADY_LINK", "LLM_NOT_YET_LINK", "LLM_LINK_FAILED", "LLM_TIMEOUT",
                      "LLM_KV_CACHE_NOT_EXIST", "LLM_EXIST_LINK", "LLM_FEATURE_NOT_ENABLED", "LLM_PARAM_INVALID"],
    "RegisterMemStatus": ["OK", "PREPARING", "FAILED"],
    "LLMRole": ["PROMPT", "DECODER", "MIX"],
    "Placement": ["HOST", "DEVICE"],
    "DataType": ["DT_FLOAT16", "DT_BF16", "DT_FLOAT", "DT_INT8", "DT_INT32", "DT_INT64"],
}

DATADIST_METHODS = ["init", "finalize", "link", "unlink", "query_register_mem_status", "link_clusters",
                    "unlink_clusters", "switch_role", "cache_manager", "kv_cache_manager", "cluster_id"]

CACHE_MANAGER_METHODS = ["register_cache", "register_blocks_cache", "unregister_cache", "allocate_cache",
                         "deallocate_cache", "allocate_blocks_cache", "deallocate_blocks_cache", "remove_cache_key",
                         "pull_cache", "pull_blocks", "push_cache", "push_blocks", "transfer_cache_async",
                         "swap_blocks", "copy_cache", "copy_blocks", "remap_registered_memory"]

CONFIG_PROPERTIES = ["device_id", "sync_kv_timeout", "enable_switch_role", "enable_cache_manager",
                     "enable_remote_cache_accessible", "link_total_time", "link_retry_count", "local_comm_res",
                     "listen_ip_info", "transfer_backend", "mem_pool_cfg", "host_mem_pool_cfg",
                     "rdma_traffic_class", "rdma_service_level", "generate_options"]


def run(tmp_path=None) -> dict:
    """``{"ok", "missing": [...], "checks": {name: found}}`` for the names above."""
    compat = importlib.import_module("aio_datadist.compat")  # was: import llm_datadist
    checks: dict[str, bool] = {}
    for name in MODULE_NAMES:
        checks[name] = hasattr(compat, name)
    for enum_name, members in ENUM_MEMBERS.items():
        enum = getattr(compat, enum_name, None)
        for member in members:
            checks[f"{enum_name}.{member}"] = enum is not None and hasattr(enum, member)
    dd_cls = getattr(compat, "LLMDataDist", None)
    for method in DATADIST_METHODS:
        checks[f"LLMDataDist.{method}"] = dd_cls is not None and hasattr(dd_cls, method)
    manager_cls = getattr(compat, "CacheManager", None) or getattr(compat, "KvCacheManager", None)
    for method in CACHE_MANAGER_METHODS:
        checks[f"CacheManager.{method}"] = manager_cls is not None and hasattr(manager_cls, method)
    cache_cls = getattr(compat, "Cache", None)
    for prop in ("cache_id", "cache_desc", "tensor_addrs", "is_blocks_cache", "create_cpu_cache"):
        checks[f"Cache.{prop}"] = cache_cls is not None and hasattr(cache_cls, prop)
    config_cls = getattr(compat, "LLMConfig", None)
    for prop in CONFIG_PROPERTIES:
        checks[f"LLMConfig.{prop}"] = config_cls is not None and hasattr(config_cls, prop)
    missing = sorted(k for k, v in checks.items() if not v)
    return {"ok": not missing, "missing": missing, "checks": checks}


if __name__ == "__main__":
    import pprint

    outcome = run()
    pprint.pprint({"ok": outcome["ok"], "missing": outcome["missing"]}, width=120)
