"""Asyncio programs that leave their endpoints to the loop's shutdown, for ``reliability/test_orphan_links.py``:
argv ``CASE asyncio|uvloop``. ``pull``/``push``: ``main`` returns with a TCP transfer in flight and no
``finalize``; ``owned``: the endpoints are held by a serving task only, which the run cancels (its frame freed,
the owners' finalize starts as the shutdown does); ``generator``: an application's async generator, closed by the
shutdown, still uses its endpoint in its cleanup; ``closed``: the loop is closed without its shutdown step, and the
endpoints finalized on another loop; ``finalizing-N``: ``main`` starts both endpoints' ``finalize`` in tasks and
returns N loop turns later, so that the run's cancel of every task cuts the finalizes short (``unlinking-N``,
``peer-unlinking-N``: with the DECODER's, or the PROMPT's, ``unlink_clusters`` five turns under way;
``cut-closed``: the loop closed without its generators' shutdown, so that only a later ``finalize`` on another
loop can finish them; ``refinalized-N``: ``main`` itself cancels every other task N turns after the finalizes
started, the loop running on, and finalizes both again, 5 s at most each). It prints how long
the run took and, per endpoint, whether it was finalized and released, then whether the PROMPT's port could be
listened on again and whether the links were closed (``finalizing-N`` only)."""

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

BIG = CacheDesc(2, (64, 1 << 20), DataType.DT_INT8, Placement.HOST)  # 128 MiB: still moving when main returns
KEEP: list[object] = []


def options(listen: bool, v2: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.transport = "tcp"
    config.enable_cache_manager = v2
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


async def main(case: str) -> None:
    v2 = case == "push"
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    KEEP.extend([prompt, decoder])  # kept to the end: only the loop's shutdown can finalize them
    await prompt.init(options(True, v2))
    await decoder.init(options(False, v2))
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info(*prompt.listen_address)
    assert (await decoder.link_clusters([cluster], 3000))[0] == 0
    blocks = list(range(64))
    if case == "pull":
        prompt.kv_cache_manager.allocate_blocks_cache(BIG, BlocksCacheKey(1, 0))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(BIG)
        moving = decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks, blocks, timeout=20000)
    else:
        memory = [torch.zeros(64, 1 << 20, dtype=torch.int8) for _ in range(4)]
        KEEP.append(memory)
        prompt.cache_manager.register_blocks_cache(BIG, [t.data_ptr() for t in memory[:2]], BlocksCacheKey(1, 0),
                                                   remote_accessible=True)
        src = decoder.cache_manager.register_blocks_cache(BIG, [t.data_ptr() for t in memory[2:]])
        moving = decoder.cache_manager.push_blocks(BlocksCacheKey(1, 0), src, blocks, blocks, timeout=20000)
    KEEP.append(asyncio.ensure_future(moving))
    await asyncio.sleep(0.01)


async def linked_pair() -> tuple[LLMDataDist, LLMDataDist]:
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    await prompt.init(options(True, False))
    await decoder.init(options(False, False))
    ENDPOINTS.extend([prompt._endpoint, decoder._endpoint])
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info(*prompt.listen_address)
    assert (await decoder.link_clusters([cluster], 3000))[0] == 0
    return prompt, decoder


async def serve(ready: asyncio.Event) -> None:
    pair = await linked_pair()  # noqa: F841  # held by this task's frame only
    ready.set()
    await asyncio.sleep(3600)


async def owned() -> None:
    ready = asyncio.Event()
    KEEP.append(asyncio.get_running_loop().create_task(serve(ready)))
    await ready.wait()


async def requests(dd: LLMDataDist, cache: object) -> AsyncIterator[None]:
    try:
        while True:
            yield
    finally:
        await asyncio.sleep(0)  # any await: a log flushed, a metric pushed
        dd.kv_cache_manager.deallocate_cache(cache)
        CLEANUP.append("ok")


async def generator() -> None:
    prompt, decoder = await linked_pair()
    KEEP.extend((prompt, decoder))
    stream = requests(prompt, prompt.kv_cache_manager.allocate_cache(SMALL))
    KEEP.append(stream)  # held by the application: a registry of open streams
    await stream.__anext__()


async def finalizing(turns: int, unlinking: str = "") -> None:
    prompt, decoder = await linked_pair()
    PAIR.extend((prompt, decoder))
    LINKS.extend(link for dd in (prompt, decoder) for link in dd._endpoint.links.links.values())  # type: ignore
    PORTS.append(prompt.listen_address[1])  # type: ignore[index]
    loop = asyncio.get_running_loop()
    if unlinking:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 2 if unlinking == "peer" else 1
        cluster.append_remote_ip_info(*prompt.listen_address)  # type: ignore[misc]
        KEEP.append(loop.create_task((prompt if unlinking == "peer" else decoder).unlink_clusters([cluster], 3000)))
        for _ in range(5):
            await asyncio.sleep(0)
    KEEP.extend(loop.create_task(dd.finalize()) for dd in (prompt, decoder))
    for _ in range(turns):
        await asyncio.sleep(0)


async def refinalized(turns: int) -> None:
    await finalizing(turns)
    me = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not me:
            task.cancel()  # a shutdown handler's cancel of every other task: the finalizes are cut
    for dd in PAIR:
        await asyncio.wait_for(dd.finalize(), 5)  # (it waited for ever for the cut one)


def relisten() -> str:
    try:
        socket.create_server(("127.0.0.1", PORTS[0])).close()
    except OSError as exc:
        return str(exc)
    return "ok"


ENDPOINTS: list[object] = []
LINKS: list[object] = []
PAIR: list[LLMDataDist] = []
PORTS: list[int] = []
CLEANUP: list[str] = []
SMALL = CacheDesc(1, (4, 256), DataType.DT_FLOAT16, Placement.HOST)
case, loop = sys.argv[1], sys.argv[2]
run = asyncio.run
if loop == "uvloop":
    import uvloop

    run = uvloop.run
started = time.monotonic()
if case in ("pull", "push"):
    run(main(case))
    ENDPOINTS.extend(dd._endpoint for dd in KEEP[:2])  # type: ignore[attr-defined]
elif case == "owned":
    run(owned())
elif case == "generator":
    run(generator())
elif case.startswith(("finalizing-", "unlinking-", "peer-unlinking-")):
    run(finalizing(int(case.rsplit("-", 1)[1]), "" if case.startswith("finalizing") else case.split("-")[0]))
elif case.startswith("refinalized-"):
    run(refinalized(int(case.rsplit("-", 1)[1])))
elif case == "cut-closed":
    closing = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
    closing.run_until_complete(finalizing(0))
    running = asyncio.all_tasks(closing)
    for task in running:  # the shutdown of old, without its generators' shutdown step
        task.cancel()
    closing.run_until_complete(asyncio.gather(*running, return_exceptions=True))
    closing.close()

    async def finalize_again() -> None:
        for dd in PAIR:
            await dd.finalize()

    run(finalize_again())
else:  # closed
    closing = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
    KEEP.extend(closing.run_until_complete(linked_pair()))
    closing.close()

    async def finalize_elsewhere() -> None:
        for dd in KEEP:
            await dd.finalize()  # type: ignore[attr-defined]

    run(finalize_elsewhere())
print(json.dumps({"run_s": round(time.monotonic() - started, 2),
                  "finalized": [e.finalized for e in ENDPOINTS],  # type: ignore[attr-defined]
                  "released": [e.released is not None and e.released.done() for e in ENDPOINTS],  # type: ignore
                  "cleanup": CLEANUP,
                  "relisten": relisten() if PORTS else None,
                  "links_closed": [link.closed for link in LINKS]}), flush=True)  # type: ignore[attr-defined]
