"""Owners: what holds an endpoint for its caller, and what ends an endpoint the caller left.

An initialised endpoint lives on in its event loop's tasks (its listener,
links, heartbeats) whether or not anything of the caller's still refers to
it. When the ``LLMDataDist`` and both of its managers are collected without
``finalize`` while that loop runs, nothing the caller holds could end it any
more: it would go on listening, linking and serving for the life of the
process. :class:`Owners` notices that moment, logs a warning and finalizes the
endpoint on its loop, as a file object closes itself when collected (work the
caller started, a layer-wise transfer or a lease, holds it meanwhile). And
when that loop shuts down with the endpoint initialised,
:func:`finalize_at_loop_shutdown` finalizes it there first.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast

from aio_datadist._forks import forks

if TYPE_CHECKING:
    from aio_datadist.endpoint import Endpoint

__all__ = ["Owners", "end_shutdown_guard", "finalize_at_loop_shutdown"]

log = logging.getLogger("aio_datadist")

#: How long a loop's shutdown lets the application's other async generators finish their cleanup before it
#: finalizes the endpoints still initialised.
OTHER_GENERATORS_S = 1.0
#: The tasks closing our shutdown generators (not waited for by each other).
_GUARDS: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
#: Finalizes started for endpoints whose owners were collected (kept until done: a task nothing refers to
#: may be collected before it ran).
_FINALIZING: set[asyncio.Task] = set()


class Owners:
    """Counts what holds ``endpoint`` for the caller; when the last goes, finalizes it.

    Owners are objects (:meth:`watch`: the ``LLMDataDist`` and its managers, until collected) and work the
    caller started and need not wait for (:meth:`hold`: a layer-wise transfer until it ends, a lease while it
    runs). ``finalize`` is the coroutine function that finalizes an endpoint (``LLMDataDist``'s, passed down).
    The endpoint is referred to weakly: its loop's tasks keep it, and one nothing keeps has nothing to end.
    """

    def __init__(self, endpoint: Endpoint, finalize: Callable[[Endpoint], Coroutine[Any, Any, None]]) -> None:
        self._endpoint = weakref.ref(endpoint)
        self._finalize = finalize
        self._left = 0
        self._lock = threading.Lock()  # collection may run on any thread

    def watch(self, owner: object) -> None:
        """Count ``owner`` until it is collected."""
        with self._lock:
            self._left += 1
        weakref.finalize(owner, self._gone).atexit = False  # at exit, the exit's own finalize runs (if any)

    def hold(self) -> Callable[[], None]:
        """Count one owner more until the function returned is called (the first call counts; later ones
        do nothing)."""
        with self._lock:
            self._left += 1
        held = [True]

        def let_go() -> None:
            with self._lock:
                if not held:
                    return
                held.clear()
            self._gone()

        return let_go

    def _gone(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        endpoint = self._endpoint()
        runtime = None if endpoint is None else endpoint.runtime
        if endpoint is None or runtime is None or endpoint.forks != forks():
            return  # gone, never initialised, finalized, or a parent's endpoint seen in a forked child
        loop = runtime.loop
        if loop is None or loop.is_closed():
            return  # its loop ended: what the loop held goes with it
        log.warning("the LLMDataDist of cluster %s was collected without finalize (nothing of it is held, no "
                    "layer-wise transfer or lease runs); it is finalized on its event loop (call finalize, or use "
                    "it as an async context manager)", endpoint.cluster_id)

        def start() -> None:
            task = loop.create_task(self._finalize(endpoint))
            _FINALIZING.add(task)
            task.add_done_callback(_FINALIZING.discard)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # closed meanwhile
            pass


def finalize_at_loop_shutdown(endpoint: Endpoint, finalize: Callable[[Endpoint], Coroutine[Any, Any, None]]) -> None:
    """Finalize ``endpoint`` when the running loop shuts down (``asyncio.run``, ``uvloop.run``, an ``asyncio.Runner``
    closing) with the endpoint still initialised.

    Those cancel every task, then close the loop's async generators, then the loop. The tasks the cancelled
    transfers start meanwhile (a data channel's redial after its reset) were not among those cancelled, and the
    loop closed under them ("Task was destroyed but it is pending!", on uvloop a resolver's callback into the
    closed loop). A generator of ours that the loop knows of is closed in the second step, with the loop still
    running: its ``finally`` finalizes the endpoint there, as ``async with`` would have (the peers are told, the
    tasks end, the sockets close). A loop closed without that step (``loop.close()`` alone) runs nothing. Once a
    ``finalize`` has run, :func:`end_shutdown_guard` closes the generator at once (``Endpoint.shutdown_guard``).
    Call it on the running loop."""
    loop = asyncio.get_running_loop()
    if getattr(sys.get_asyncgen_hooks().firstiter, "__self__", None) is not loop:
        return  # the thread's hooks were replaced: no loop would close the generator, the collector would
    guard = _until_shutdown(endpoint, finalize)
    step = cast(Coroutine[Any, Any, None], guard.__anext__())  # the loop's first-iteration hook takes note of it
    try:
        step.send(None)
    except StopIteration:
        pass
    endpoint.shutdown_guard = guard  # the loop keeps a weak reference only


async def _until_shutdown(endpoint: Endpoint,
                          finalize: Callable[[Endpoint], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        # Not when a finalize has run (it ended the guard: end_shutdown_guard). A finalize already running (one
        # started as the run cancelled the task that held the endpoint) is waited for: the loop closes after.
        runtime, loop = endpoint.runtime, _running_loop()
        if (endpoint.shutdown_guard is not None and loop is not None and endpoint.forks == forks()
                and (runtime is None or runtime.loop is loop)):
            # The loop closes the other generators at the same time (the application's, whose cleanup may still
            # use the endpoint): theirs first, a second at most. Every close has started after one turn.
            me = asyncio.current_task()
            if me is not None:
                _GUARDS.add(me)
            await asyncio.sleep(0)
            others = [task for task in asyncio.all_tasks(loop) if task not in _GUARDS
                      and type(task.get_coro()).__name__ == "async_generator_athrow"]
            if others:
                await asyncio.wait(others, timeout=OTHER_GENERATORS_S)
            await finalize(endpoint)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def end_shutdown_guard(endpoint: Endpoint) -> None:
    """A finalize of ``endpoint`` has run: close its shutdown generator now, which then does nothing (no task is
    left for the loop to close it with)."""
    guard, endpoint.shutdown_guard = endpoint.shutdown_guard, None
    if guard is None:
        return
    closing = guard.aclose()
    try:
        closing.send(None)
    except StopIteration:
        pass
    except RuntimeError:  # already closing: this finalize is the one its ``finally`` runs (the loop's shutdown)
        closing.close()
