"""A linked same-host peer that asks for in-place pulls and never says it is done (run as a separate program).

It is a real endpoint (``aio.Transport`` local), so it links, shares memory
and answers heartbeats as any peer; only its requests are its own: it sends
pulls offering the same-host plane straight over the link and never sends the
``DONE`` that ends each one. It prints one JSON object with the statuses of
the owner's ``RESP``s (and how many named a cache, i.e. chose the in-place
plane), then keeps the link up, still silent, until its stdin closes or
SECONDS pass. Arguments::

    HOST PORT OWNER_ID CLUSTER_ID TENSORS ROW_BYTES DATA_TYPE COUNT ROWS SECONDS

COUNT pulls of block 0 of every tensor of the blocks cache the owner bound to
model 0, each naming it ROWS times (at most ``wire.MAX_ROWS``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from aio_datadist import LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole, wire
from aio_datadist.testing import usable_link
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Msg, ReqFlag, Target


def options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.transport = "local"
    return cfg.generate_options()


async def stdin_closed() -> None:
    loop, fd = asyncio.get_running_loop(), sys.stdin.fileno()
    closed = loop.create_future()

    def readable() -> None:
        if not os.read(fd, 4096) and not closed.done():
            closed.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await closed
    finally:
        loop.remove_reader(fd)


async def attack(host: str, port: int, owner_id: int, cluster_id: int, tensors: int, row_bytes: int,
                 data_type: int, count: int, rows: int, seconds: float) -> None:
    async with LLMDataDist(LLMRole.DECODER, cluster_id) as dd:
        await dd.init(options())
        info = LLMClusterInfo()
        info.remote_cluster_id = owner_id
        info.append_remote_ip_info(host, port)
        status, _ = await dd.link_clusters([info], timeout=5000)
        link = usable_link(dd, owner_id)
        deadline = time.monotonic() + 5
        while (link.local is None or not link.local.regions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the owner's caches arrive on the share socket
        assert link.local is not None and link.local.regions, "the owner shared no cache"
        answers = []
        for _ in range(count):
            req_id = link.new_req_id()
            answers.append(link.expect(req_id))
            link.send(Msg.PULL_REQ, req_id, channel=link.own[0], target_kind=Target.BLOCKS_KEY, cluster_id=owner_id,
                      cache_id=0, key_req_id=UINT64_MAX, prefix_id=UINT64_MAX, model_id=0, batch_index=0,
                      layer_first=-1, layer_last=-1, tensor_num_per_layer=1, tensor_count=tensors,
                      data_type=data_type, offset=0, nbytes=row_bytes, flags=ReqFlag.BLOCKS | ReqFlag.LOCAL,
                      timeout_ms=600_000, rows=(0,) * min(rows, wire.MAX_ROWS))
            if len(answers) % 64 == 0:
                await asyncio.sleep(0)  # let the link write
        statuses: dict[str, int] = {}
        in_place = 0
        for resp in await asyncio.wait_for(asyncio.gather(*answers), 30):
            statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
            in_place += resp.status == 0 and resp.cache_id >= 0
        print(json.dumps({"linked": int(status), "statuses": statuses, "in_place": in_place}), flush=True)
        # No DONE, ever: hold the link (the endpoint answers heartbeats) until told to go.
        try:
            await asyncio.wait_for(stdin_closed(), seconds)
        except TimeoutError:
            pass


def main() -> None:
    host, port, *numbers = sys.argv[1:]
    owner_id, cluster_id, tensors, row_bytes, data_type, count, rows = (int(a) for a in numbers[:7])
    asyncio.run(attack(host, int(port), owner_id, cluster_id, tensors, row_bytes, data_type, count, rows,
                       float(numbers[7])))


if __name__ == "__main__":
    main()
