"""A blocking-facade program whose daemon threads are still calling when its main thread returns, for
``test_compat_processes.py``: 8 threads pull blocks in a loop over a TCP link between two endpoints of this
process; the exit's finalize fails their calls and refuses the next ones. Its own cleanup hook, registered before
the facade was imported (a framework that imports the connector lazily), runs after the facade's exit hook and
finalizes an endpoint again (which returns). argv ``3.12``: that hook can start no thread, as on Python 3.12."""

import atexit
import random
import sys
import threading
import time


refused = [0]  # calls refused because the facade is shutting down


def late_cleanup() -> None:
    if sys.argv[1:] == ["3.12"]:  # as Python 3.12 does in an atexit hook (3.11 and 3.13 start threads there)
        def no_thread(self: threading.Thread) -> None:
            raise RuntimeError("can't create new thread at interpreter shutdown")

        threading.Thread.start = no_thread  # type: ignore[method-assign]
    try:
        decoder.finalize()
        print("late finalize: ok", flush=True)
    except Exception as exc:
        print(f"late finalize raised {type(exc).__name__}: {exc}", flush=True)
    try:  # a call that needs the loop, on an endpoint the exit finalized: its own error, not "shutting down"
        decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS)
        print("late call: ran", flush=True)
    except LLMException as exc:
        print(f"late call: {exc.status_code.name} {'shutting down' in str(exc)}", flush=True)
    deadline = time.monotonic() + 2
    while not refused[0] and time.monotonic() < deadline:  # the threads' next calls, after the facade's hook
        time.sleep(0.01)
    print(f"refused while shutting down: {refused[0]}", flush=True)


atexit.register(late_cleanup)

from aio_datadist.compat import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
)

BLOCKS = CacheDesc(4, [64, 8192], DataType.DT_FLOAT)


def options(listen: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.transport = "tcp"
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
prompt.init(options(True))
decoder.init(options(False))
prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
cluster = LLMClusterInfo()
cluster.remote_cluster_id = 1
cluster.append_remote_ip_info(*prompt.listen_address)
assert decoder.link_clusters([cluster], 3000)[0] == 0
dst = decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS)


def pulls(k: int) -> None:
    rnd = random.Random(k)
    while True:
        try:
            decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, rnd.sample(range(64), 4),
                                                 [k * 4 + j for j in range(4)])
        except LLMException as exc:
            if exc.status_code == LLMStatusCode.LLM_FAILED and "shutting down" in str(exc):
                refused[0] += 1


for k in range(8):
    threading.Thread(target=pulls, args=(k,), daemon=True).start()
time.sleep(0.5)
print("main returns", flush=True)
