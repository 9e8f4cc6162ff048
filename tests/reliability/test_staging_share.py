"""One linked peer cannot take the whole staging pool from the other links (found by audit).

The pool of chunk buffers that device caches move through on TCP/TLS links (``devices/staging.py``, 4 x 16
MiB by default) is the endpoint's, shared by every link. A peer that sends one posted pull of a device cache
asking for 600 s and never reads its data channel (``_control_attacker.py rows``, its own process and a
hand-made link that answers probes) had the owner stage chunks into every buffer and hold them for the
request's whole time: an honest decoder's 1 KiB staged pull on another link then failed ``LLM_TIMEOUT``. A
link now holds at most ``StagingPool.share`` buffers (``buffers - 1``), so another link always gets one.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
import torch
from _harness import endpoint
from peers import cluster_info, fill, port_of

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMRole, LLMStatusCode, Placement
from aio_datadist.testing import link_to, runtime_of

S = LLMStatusCode
PROMPT, ATTACKER, HONEST = 1, 2, 3
ATTACKER_PROGRAM = os.path.join(os.path.dirname(__file__), "_control_attacker.py")
#: 8 tensors of 2 blocks of 256 bytes on the device: block 0 named 65,536 times is 128 MiB, 8 chunks.
DEV_DESC = CacheDesc(8, (2, 128), DataType.DT_FLOAT16, Placement.DEVICE)
HOST_DESC = CacheDesc(8, (2, 128), DataType.DT_FLOAT16, Placement.HOST)


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
async def test_a_peer_that_never_reads_its_staged_pull_leaves_the_other_links_a_buffer():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", device_type="host") as dd, \
            endpoint(LLMRole.DECODER, HONEST, transport="tcp") as honest:
        src = dd.kv_cache_manager.allocate_blocks_cache(DEV_DESC, BlocksCacheKey(PROMPT))
        assert src.on_device
        values = fill(src, 5)
        assert (await honest.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        mine = honest.kv_cache_manager.allocate_blocks_cache(HOST_DESC)
        pool = runtime_of(dd).staging.pool
        host, port = port_of(dd)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, ATTACKER_PROGRAM, "rows", host, str(port), str(ATTACKER), str(PROMPT),
            str(DEV_DESC.num_tensors), str(src.layout.row_bytes), str(DEV_DESC.data_type.value), "1", "12",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line.strip() == b"sent", line
            link = None
            deadline = time.monotonic() + 5
            most = pool.share - 1  # a send leaves one of its link's share to that link's receives
            while time.monotonic() < deadline:  # until the attacker's request holds all it may
                link = link_to(dd, ATTACKER)
                if link is not None and pool.held(link) >= most:
                    break
                await asyncio.sleep(0.01)
            assert link is not None and link.broken is None and pool.held(link) == most < pool.buffers
            await honest.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT), mine, [0, 1], [1, 0], timeout=3000)
            assert all(torch.equal(m[1], v[0]) for m, v in zip(mine.tensors, values, strict=True))
            assert pool.held(link) == most  # the attacker's request still holds what it took, no more
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
