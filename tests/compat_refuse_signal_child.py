"""A blocking-facade program, for ``test_compat_interrupts.py``: its SIGUSR1 handler calls the facade while the
main thread runs what the exit's hook runs first (``compat._RUNNER.refuse_calls()``, in a loop), which holds the
facade's lock outside any call. argv: SECONDS. Prints one JSON line of counts; a hang is the defect."""

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
counts = {"iterations": 0, "ran": 0, "refused": 0}
busy = False


def handler(*_: object) -> None:
    global busy
    if busy:
        return
    busy = True
    try:
        dd.stats()
        counts["ran"] += 1
    except LLMException:
        counts["refused"] += 1
    finally:
        busy = False


signal.signal(signal.SIGUSR1, handler)
print(json.dumps({"ready": os.getpid()}), flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    compat._RUNNER.refuse_calls()  # the main thread's own calls still run
    counts["iterations"] += 1
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
faulthandler.cancel_dump_traceback_later()
print(json.dumps(counts), flush=True)
os._exit(0)  # (the exit's finalize is another test's)
