"""A blocking-facade program, for ``test_compat_processes.py``: a daemon thread's ``init`` is let through just
before the exit refuses calls and is held (a thread switch, made here by a pause in ``compat._Call``) until the
exit's first wait for the calls running on the loop ended (or 1 s passed), before it is sent to the loop. With the
argument ``slow`` that init also lingers 0.3 s on the loop once its endpoint listens (a machine under load), so it
ends after the exit's last finalizes. Its own hook, registered before the facade was imported, runs after the
facade's exit hook and prints the TCP ports this process still listens on."""

import asyncio
import atexit
import sys
import threading

from _own_sockets import facade_options, listening_ports

atexit.register(lambda: print(f"listening after the exit: {listening_ports()}", flush=True))

from aio_datadist import compat  # noqa: E402
from aio_datadist.compat import LLMDataDist, LLMException, LLMRole  # noqa: E402

let_through, waited = threading.Event(), threading.Event()
original, end_calls = compat._Call.__init__, compat._end_calls


async def end_calls_noted(limit: float, skip: frozenset = frozenset()) -> set:
    seen = await (end_calls(limit, skip) if skip else end_calls(limit))
    waited.set()
    return seen


compat._end_calls = end_calls_noted


def held(self: compat._Call, coro: object, undo: object) -> None:
    original(self, coro, undo)  # type: ignore[arg-type]
    if threading.current_thread().name == "worker":
        let_through.set()
        waited.wait(1.0)


compat._Call.__init__ = held  # type: ignore[method-assign]



if sys.argv[1:] == ["slow"]:
    original_init = LLMDataDist._init

    async def slow_init(self: LLMDataDist, options: object) -> None:  # the worker's (the main one's ran already)
        listen = self._dd._open  # what the facade's init awaits

        async def listen_then_linger(opts: object) -> object:  # listening already, the init not returned yet
            started = await listen(opts)  # type: ignore[arg-type]
            await asyncio.sleep(0.3)
            return started

        self._dd._open = listen_then_linger  # type: ignore[method-assign]
        await original_init(self, options)  # type: ignore[arg-type]


def worker() -> None:
    if sys.argv[1:] == ["slow"]:
        LLMDataDist._init = slow_init  # type: ignore[method-assign]
    try:
        LLMDataDist(LLMRole.PROMPT, 7).init(facade_options())
        print("worker init returned", flush=True)
    except LLMException as exc:
        print(f"worker init raised {exc}", flush=True)


LLMDataDist(LLMRole.PROMPT, 1).init(facade_options())  # a live endpoint: the loop runs
threading.Thread(target=worker, name="worker", daemon=True).start()
let_through.wait(5)
print("main returns", flush=True)
