"""A blocking-facade program whose daemon threads make, init and finalize endpoints in a loop (a worker that
reconnects) when its main thread returns, for ``test_compat_processes.py``. Its own hook, registered before the
facade was imported, runs after the facade's exit hook and prints the TCP ports this process still listens on:
an ``init`` that ended as the exit began must have been finalized by it too."""

import atexit
import os
import sys
import threading
import time


def listening() -> None:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and fields[3] == "0A":  # LISTEN
                ports.append(int(fields[1].split(":")[1], 16))
    print(f"listening after the exit: {sorted(ports)}", flush=True)


atexit.register(listening)

from aio_datadist.compat import LLMConfig, LLMDataDist, LLMException, LLMRole  # noqa: E402

INITS = [0]


def options() -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.transport = "tcp"
    config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


def churn(k: int) -> None:
    while True:
        dd = LLMDataDist(LLMRole.PROMPT, 100 + k)
        try:
            dd.init(options())
            INITS[0] += 1
            dd.finalize()
        except LLMException:
            pass


for k in range(4):
    threading.Thread(target=churn, args=(k,), daemon=True).start()
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
print(f"main returns after {INITS[0]} inits", flush=True)
