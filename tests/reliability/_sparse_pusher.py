"""A linked same-host PROMPT whose blocks cache is a sparse memfd (run as a separate program).

It is a real endpoint (``aio.Transport=local``) with one change: its cache's memfd is never populated nor
written (``MAP_POPULATE`` off once its ledger exists), so the region costs it nothing, and it says it has
plenty of memory. It listens, prints its port, waits for ``go`` on stdin, then pushes PUSHES times ROWS
distinct blocks of its sparse cache into the peer's blocks cache bound to ``BlocksCacheKey(PEER, 0)``, each
time other source blocks, and prints one JSON line with each push's outcome; then waits for stdin to close.

Arguments: PEER BLOCKS BLOCK_BYTES ROWS PUSHES
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import aio_datadist.devices.host as host
from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

_sysconf = os.sysconf
os.sysconf = lambda name: (1 << 40) // 4096 if name == "SC_AVPHYS_PAGES" else _sysconf(name)  # "plenty"


async def main(peer: int, blocks: int, block_bytes: int, rows: int, pushes: int) -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.transport = "local"
    cfg.listen_ip_info = "127.0.0.1:0"
    async with LLMDataDist(LLMRole.PROMPT, 77) as dd:
        await dd.init(cfg.generate_options())
        host._POPULATE = 0  # from here on: the cache's region is all holes
        src = dd.kv_cache_manager.allocate_blocks_cache(
            CacheDesc(2, (blocks, block_bytes), DataType.DT_UINT8, Placement.HOST))
        assert dd.listen_address is not None
        print(json.dumps({"port": dd.listen_address[1]}), flush=True)
        loop = asyncio.get_running_loop()
        line = await loop.run_in_executor(None, sys.stdin.readline)
        assert line.strip() == "go", line
        results = []
        for i in range(pushes):
            try:
                await dd.kv_cache_manager.push_blocks(BlocksCacheKey(peer, 0), src,
                                                      list(range(i * rows, (i + 1) * rows)), list(range(rows)),
                                                      timeout=20_000)
                results.append("ok")
            except Exception as exc:  # noqa: BLE001 - reported to the test
                results.append(repr(exc))
        print(json.dumps({"results": results}), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main(*map(int, sys.argv[1:])))
