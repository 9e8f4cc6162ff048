"""A blocking-facade program, for ``test_compat_processes.py``: a daemon thread's ``init`` is on the facade's loop
as the exit begins (the exit's first wait for the calls on the loop sees it) and lingers there LINGER seconds
(argv) once its endpoint listens, a machine under load. Its own hook, registered before the facade was imported,
runs after the facade's exit hook and prints the TCP ports this process still listens on."""

import asyncio
import atexit
import sys
import threading

from _own_sockets import facade_options, listening_ports

atexit.register(lambda: print(f"listening after the exit: {listening_ports()}", flush=True))

from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

LINGER = float(sys.argv[1])
listening = threading.Event()
original_init = LLMDataDist._init


async def slow_init(self: LLMDataDist, options: object) -> None:
    listen = self._dd.init

    async def listen_then_linger(opts: object) -> None:
        await listen(opts)  # type: ignore[arg-type]
        listening.set()
        await asyncio.sleep(LINGER)

    self._dd.init = listen_then_linger  # type: ignore[method-assign]
    await original_init(self, options)  # type: ignore[arg-type]


LLMDataDist._init = slow_init  # type: ignore[method-assign]


def worker() -> None:
    try:
        LLMDataDist(LLMRole.PROMPT, 7).init(facade_options())
        print("worker init returned", flush=True)
    except LLMException as exc:
        print(f"worker init raised {exc}", flush=True)


threading.Thread(target=worker, name="worker", daemon=True).start()
listening.wait(10)
print("main returns", flush=True)
