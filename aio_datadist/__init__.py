"""aio_datadist: asyncio-native KV-cache transfer with the LLM-DataDist API.

Every call that can wait on a peer, a copy or a timeout is a coroutine; see
``docs/`` for the API and its differences from LLM-DataDist.
"""

from aio_datadist.arrivals import PushWatch
from aio_datadist.cache import KvCache
from aio_datadist.config import LLMConfig, LlmConfig
from aio_datadist.datadist import LLMDataDist
from aio_datadist.manager import KvCacheManager
from aio_datadist.synchronizers import EventLayerSynchronizer
from aio_datadist.task import CacheTask
from aio_datadist.status import LLMException, LLMStatusCode, Status, code_to_status
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

__version__ = "0.1.0"

__all__ = [
    "BlocksCacheKey",
    "CacheDesc",
    "CacheIndex",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheTask",
    "DataType",
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
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "PushWatch",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "code_to_status",
]
