"""aio_datadist: asyncio-native KV-cache transfer with the LLM-DataDist API.

Every call that can wait on a peer, a copy or a timeout is a coroutine; see
``docs/`` for the API and its differences from LLM-DataDist.
"""

from typing import TYPE_CHECKING

# Names are imported on first use (PEP 562), so that importing the package, or
# its pytest plugin (``aio_datadist.testing``, loaded into every pytest run of an
# environment that has the package), does not import torch.
_EXPORTS = {
    "PushWatch": "arrivals",
    "KvCache": "cache",
    "Cache": "cache_manager",
    "CacheManager": "cache_manager",
    "LLMConfig": "config",
    "LlmConfig": "config",
    "LLMDataDist": "datadist",
    "KvCacheManager": "manager",
    "EventLayerSynchronizer": "synchronizers",
    "EndpointStats": "stats",
    "LinkLogFields": "logfields",
    "LinkStats": "stats",
    "TransferStats": "stats",
    "CacheTask": "task",
    "LLMException": "status",
    "LLMStatusCode": "status",
    "Status": "status",
    "code_to_status": "status",
    "code_2_status": "status",
    "Tensor": "tensors",
    "TensorDesc": "tensors",
    **{name: "types" for name in (
        "BlocksCacheKey", "CacheDesc", "CacheIndex", "CacheKey", "CacheKeyByIdAndIndex", "DataType",
        "KvCacheExtParam", "LayerSynchronizer", "LLMClusterInfo", "LLMRole", "MemInfo", "Memtype", "Placement",
        "RegisterMemStatus", "TransferConfig", "TransferWithCacheKeyConfig")},
}

if TYPE_CHECKING:
    from aio_datadist.arrivals import PushWatch
    from aio_datadist.cache import KvCache
    from aio_datadist.cache_manager import Cache, CacheManager
    from aio_datadist.config import LLMConfig, LlmConfig
    from aio_datadist.datadist import LLMDataDist
    from aio_datadist.logfields import LinkLogFields
    from aio_datadist.manager import KvCacheManager
    from aio_datadist.stats import EndpointStats, LinkStats, TransferStats
    from aio_datadist.status import LLMException, LLMStatusCode, Status, code_2_status, code_to_status
    from aio_datadist.synchronizers import EventLayerSynchronizer
    from aio_datadist.task import CacheTask
    from aio_datadist.tensors import Tensor, TensorDesc
    from aio_datadist.types import (
        BlocksCacheKey,
        CacheDesc,
        CacheIndex,
        CacheKey,
        CacheKeyByIdAndIndex,
        DataType,
        KvCacheExtParam,
        LayerSynchronizer,
        LLMClusterInfo,
        LLMRole,
        MemInfo,
        Memtype,
        Placement,
        RegisterMemStatus,
        TransferConfig,
        TransferWithCacheKeyConfig,
    )


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aio_datadist' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"aio_datadist.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "EndpointStats",
    "EventLayerSynchronizer",
    "KvCache",
    "KvCacheExtParam",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LinkLogFields",
    "LinkStats",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "PushWatch",
    "RegisterMemStatus",
    "Status",
    "Tensor",
    "TensorDesc",
    "TransferConfig",
    "TransferStats",
    "TransferWithCacheKeyConfig",
    "code_2_status",
    "code_to_status",
]
