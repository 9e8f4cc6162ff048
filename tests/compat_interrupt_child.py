"""A program of the blocking facade (``aio_datadist.compat``) that is interrupted; run by
``test_compat_interrupts.py`` in a process of its own, it prints one JSON line of what happened.

``synchronizer {sync,async} {KeyboardInterrupt,SystemExit}``: a layer synchronizer raises it in the middle
of a v2 ``transfer_cache_async``; then the program carries on and exits normally (its ``atexit``
finalize included). ``task``: a facade call whose own code raises KeyboardInterrupt. ``sigint``: SIGINT
arrives while ``link_clusters`` waits on a listener that never answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time

import torch

from aio_datadist import compat
from aio_datadist.compat import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    TransferWithCacheKeyConfig,
)

BLOCKS = CacheDesc(4, [8, 4, 16], DataType.DT_FLOAT16, Placement.DEVICE)


def endpoint(role: LLMRole, cluster_id: int, listen: bool = False) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cpu"
    cfg.transport = "tcp"
    cfg.local_comm_res = ""
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    return dd


def cluster(cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


def facade_alive() -> bool:
    thread = compat._RUNNER._thread
    return thread is not None and thread.is_alive()


def synchronizer(kind: str, raised: type[BaseException]) -> dict:
    class Raising(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            raise raised("in the synchronizer")

    class AsyncRaising(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            raise raised("in the synchronizer")

    prompt, decoder = endpoint(LLMRole.PROMPT, 1, listen=True), endpoint(LLMRole.DECODER, 2)
    memory = [torch.zeros(8, 4, 16, dtype=torch.float16) for _ in range(8)]
    src = prompt.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[:4]], BlocksCacheKey(1, 0))
    decoder.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[4:]], BlocksCacheKey(2, 0))
    out: dict = {"link": int(decoder.link_clusters([cluster(1, prompt.listen_address)], 5000)[0])}
    started = time.monotonic()
    task = prompt.cache_manager.transfer_cache_async(
        src, AsyncRaising() if kind == "async" else Raising(),
        [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))])
    out["synchronize"] = int(task.synchronize(2000))
    out["seconds"] = round(time.monotonic() - started, 2)
    out["facade_alive"] = facade_alive()
    out["links"] = list(decoder.stats().links)
    prompt.finalize()
    out["facade_alive_after"] = facade_alive()
    return out  # the decoder is finalized by the facade's atexit handler


def task() -> dict:
    def interrupted() -> None:
        raise KeyboardInterrupt("in a facade call")

    out: dict = {}
    try:
        compat._RUNNER.call(interrupted)
    except KeyboardInterrupt as exc:
        out["raised"] = str(exc)
    out["facade_alive"] = facade_alive()
    dd = endpoint(LLMRole.PROMPT, 1, listen=True)
    out["stats"] = dd.stats().cluster_id
    return out


def sigint() -> dict:
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])  # accepted, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    dd = endpoint(LLMRole.DECODER, 2)
    target = cluster(1, silent.getsockname())
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    out: dict = {}
    started = time.monotonic()
    try:
        out["returned"] = str(dd.link_clusters([target], 8000))
    except KeyboardInterrupt:
        out["interrupted_after"] = round(time.monotonic() - started, 2)
    loop = compat._RUNNER.loop()
    out["tasks_left"] = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks(loop))
    status, per_cluster = dd.link_clusters([target], 300)  # the same cluster again: no attempt holds it
    out["again"] = [int(status), [int(c) for c in per_cluster]]
    dd.finalize()
    silent.close()
    return out


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "synchronizer":
        result = synchronizer(sys.argv[2], {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[
            sys.argv[3]])
    else:
        result = {"task": task, "sigint": sigint}[case]()
    print(json.dumps(result), flush=True)
