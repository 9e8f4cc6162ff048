"""What the transfer benchmarks share: endpoint options, the blocks-cache desc, block lists.

Imports the library lazily, like the rest of the harness, so peer processes
that only need sockets start quickly.
"""

from __future__ import annotations

from typing import Any

from benchmarks._workload import KvGeometry, random_blocks


def endpoint_options(transport: str, *, listen: bool, timeout_ms: int,
                     data_channels: int | None = None) -> dict[str, str]:
    """``LLMConfig`` options of a loopback endpoint (port 0 when it listens)."""
    from aio_datadist import LLMConfig

    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = timeout_ms
    config.transport = transport
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    if data_channels is not None:
        config.data_channels = data_channels
    return config.generate_options()


def blocks_desc(geometry: KvGeometry, num_blocks: int) -> Any:
    """The ``CacheDesc`` of a host blocks cache of ``num_blocks`` blocks of ``geometry``."""
    from aio_datadist import CacheDesc, DataType, Placement

    return CacheDesc(geometry.num_tensors, geometry.tensor_shape(num_blocks), DataType.DT_FLOAT16, Placement.HOST)


def block_lists(cache_blocks: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """Random distinct source and destination blocks of one request, the same in every process."""
    return random_blocks(cache_blocks, count, seed), random_blocks(cache_blocks, count, seed + 1)
