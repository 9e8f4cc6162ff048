"""A blocking-facade program, for ``test_compat_processes.py``: a daemon thread's ``init`` is on the facade's loop
as the exit begins (the exit's first wait for the calls on the loop sees it) and lingers there LINGER seconds
(argv) once its endpoint listens, a machine under load; ``late``: until 0.8 s into the exit's late wait for the calls
(``compat.LATE_CALLS_S``). Its own hook, registered before the facade was imported, runs after the facade's exit
hook and prints the TCP ports this process still listens on."""

import asyncio
import atexit
import sys
import threading

from _own_sockets import facade_options, listening_ports

atexit.register(lambda: print(f"listening after the exit: {listening_ports()}", flush=True))

from aio_datadist import compat  # noqa: E402
from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

LATE = sys.argv[1] == "late"
LINGER = 0.8 if LATE else float(sys.argv[1])
listening = threading.Event()
original_init = LLMDataDist._init
waits: list[asyncio.Future] = []  # the exit's waits for the calls on the loop, done as each begins: the first, the late
end_calls = compat._end_calls


async def end_calls_noted(*args: object) -> set:
    begun = next((wait for wait in waits if not wait.done()), None)
    if begun is not None:
        begun.set_result(None)
    return await end_calls(*args)  # type: ignore[arg-type]


if LATE:
    compat._end_calls = end_calls_noted


async def slow_init(self: LLMDataDist, options: object) -> None:
    listen = self._dd._open  # what the facade's init awaits

    async def listen_then_linger(opts: object) -> object:
        started = await listen(opts)  # type: ignore[arg-type]
        waits.extend(asyncio.get_running_loop().create_future() for _ in range(2))
        listening.set()
        if LATE:
            await asyncio.wait_for(waits[1], 5)  # the late wait began
        await asyncio.sleep(LINGER)
        return started

    self._dd._open = listen_then_linger  # type: ignore[method-assign]
    await original_init(self, options)  # type: ignore[arg-type]


LLMDataDist._init = slow_init  # type: ignore[method-assign]


def worker() -> None:
    try:
        LLMDataDist(LLMRole.PROMPT, 7).init(facade_options())
        print("worker init returned", flush=True)
    except LLMException as exc:
        print(f"worker init raised {exc}", flush=True)


threading.Thread(target=worker, name="worker", daemon=True).start()
if not listening.wait(10):
    sys.exit("the worker's init never listened (its linger is not where the facade's init goes)")
print("main returns", flush=True)
