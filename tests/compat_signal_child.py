"""A blocking-facade program, for ``test_compat_interrupts.py``: its SIGUSR1 handler (a graceful-shutdown or
stats-dump handler) calls the facade while the main thread makes facade calls in a loop, so the signal often
lands inside one. argv: SECONDS. Prints one JSON line: the main thread's calls, the handler's calls that ran and
those refused (``LLM_FAILED``: made inside another call of the same thread). A hang is the defect: the handler's
call waited for good on the locks and the event of the call it interrupted."""

import faulthandler
import json
import os
import signal
import sys
import time

faulthandler.dump_traceback_later(20, exit=True)  # a hang ends the process with every thread's stack

from _own_sockets import facade_options  # noqa: E402

from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

dd = LLMDataDist(LLMRole.PROMPT, 1)
dd.init(facade_options())
counts = {"calls": 0, "ran": 0, "refused": 0, "other": 0}


busy = False


def handler(*_: object) -> None:
    global busy
    if busy:  # a signal inside the handler's own call: not taken (no handler runs inside itself)
        return
    busy = True
    try:
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
    dd.stats()
    counts["calls"] += 1
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
dd.finalize()
print(json.dumps(counts), flush=True)
