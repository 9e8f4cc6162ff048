"""A blocking-facade program whose daemon threads make, init and finalize endpoints in a loop (a worker that
reconnects) when its main thread returns, for ``test_compat_processes.py``. Its own hook, registered before the
facade was imported, runs after the facade's exit hook and prints the TCP ports this process still listens on:
an ``init`` that ended as the exit began must have been finalized by it too."""

import atexit
import sys
import threading
import time

from _own_sockets import facade_options, listening_ports

atexit.register(lambda: print(f"listening after the exit: {listening_ports()}", flush=True))

from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

INITS = [0]



def churn(k: int) -> None:
    while True:
        dd = LLMDataDist(LLMRole.PROMPT, 100 + k)
        try:
            dd.init(facade_options())
            INITS[0] += 1
            dd.finalize()
        except LLMException:
            pass


for k in range(4):
    threading.Thread(target=churn, args=(k,), daemon=True).start()
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
print(f"main returns after {INITS[0]} inits", flush=True)
