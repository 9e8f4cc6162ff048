"""A KvCacheManager (v1) peer for ``test_compat_timeouts.py``, written against llm_datadist's blocking API.

argv: ``prompt`` (listens on a free loopback port) or ``decoder PORT`` (links to the prompt at PORT). Prints
one line, ``ready`` and its state (the prompt: its cache id and port; the decoder: its cache's tensor
addresses), then waits for a line on stdin and finalizes. The test stalls it with SIGSTOP.
"""
import sys

from aio_datadist.compat import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)

DESC = CacheDesc(2, [2, 4], DataType.DT_FLOAT)


def main() -> None:
    role = sys.argv[1]
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 300
    if role == "prompt":
        config.listen_ip_info = "127.0.0.1:0"
        datadist = LLMDataDist(LLMRole.PROMPT, 1)
        datadist.init(config.generate_options())
        cache = datadist.kv_cache_manager.allocate_cache(DESC, [CacheKey(prompt_cluster_id=1, req_id=0),
                                                                CacheKey(prompt_cluster_id=1, req_id=1)])
        address = datadist.listen_address
        assert address is not None
        print("ready", cache.cache_id, address[1], flush=True)
    else:
        datadist = LLMDataDist(LLMRole.DECODER, 2)
        datadist.init(config.generate_options())
        cache = datadist.kv_cache_manager.allocate_cache(DESC)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", int(sys.argv[2]))
        ret, _ = datadist.link_clusters([cluster], 3000)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
        print("ready", " ".join(str(a) for a in cache.per_device_tensor_addrs[0]), flush=True)
    sys.stdin.readline()
    datadist.finalize()


if __name__ == "__main__":
    main()
