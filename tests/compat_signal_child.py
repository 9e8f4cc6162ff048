"""A blocking-facade program, for ``test_compat_interrupts.py``: its SIGUSR1 handler (a graceful-shutdown or
stats-dump handler) calls the facade while the main thread, in a loop, either makes facade calls (argv MODE
``calls``: the signal often lands inside one) or runs what the exit's hook runs first, which holds the facade's
lock outside any call (MODE ``refuse``: ``compat._RUNNER.refuse_calls()``); MODE ``cancel``: the handler cancels
a layer-wise ``CacheTask`` (a graceful shutdown stopping the transfer in flight) while the main thread makes
facade calls. argv: SECONDS MODE. Prints one JSON
line: the main thread's rounds, the handler's calls that ran and those refused (``LLM_FAILED``: made inside
another call of the same thread). A hang is the defect: the handler's call waited for good on the locks and the
event of what it interrupted."""

import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.dump_traceback_later(20, exit=True)  # a hang ends the process with every thread's stack

from _own_sockets import facade_options  # noqa: E402

from aio_datadist import compat  # noqa: E402
from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

dd = LLMDataDist(LLMRole.PROMPT, 1)
dd.init(facade_options())
counts = {"rounds": 0, "ran": 0, "refused": 0, "other": 0}
busy = False
task = None
if sys.argv[2] == "cancel":
    from aio_datadist.compat import BlocksCacheKey, CacheDesc, DataType, LayerSynchronizer, LLMClusterInfo, Placement
    from aio_datadist.compat import TransferWithCacheKeyConfig

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int) -> bool:
            return True

    blocks = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)
    peer = LLMDataDist(LLMRole.DECODER, 2)
    peer.init(facade_options())
    src = dd.kv_cache_manager.allocate_blocks_cache(blocks, BlocksCacheKey(1, 0))
    peer.kv_cache_manager.allocate_blocks_cache(blocks, BlocksCacheKey(2, 0))
    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = 1
    cluster.append_remote_ip_info(*dd.listen_address)
    assert peer.link_clusters([cluster], 5000)[0] == 0
    task = dd.kv_cache_manager.transfer_cache_async(
        src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 2))])


def handler(*_: object) -> None:
    global busy
    if busy:  # a signal inside the handler's own call: not taken (no handler runs inside itself)
        return
    busy = True
    try:
        if task is not None:
            task.cancel()  # takes no lock of the facade's: never refused, never left waiting
        else:
            dd.stats()
        counts["ran"] += 1
    except LLMException as exc:
        counts["refused" if "signal handler" in str(exc) else "other"] += 1
    finally:
        busy = False


signal.signal(signal.SIGUSR1, handler)
print(json.dumps({"ready": os.getpid()}), flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    if sys.argv[2] == "refuse":
        compat._RUNNER.refuse_calls()  # (the main thread's own calls still run)
    else:
        dd.stats()
    counts["rounds"] += 1
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
faulthandler.cancel_dump_traceback_later()
if sys.argv[2] == "refuse":
    print(json.dumps(counts), flush=True)
    os._exit(0)  # (the exit's finalize is another test's)
if task is not None:
    peer.finalize()
dd.finalize()
print(json.dumps(counts), flush=True)
