"""Waiting for work to finish after its caller gave up, without giving up again."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

__all__ = ["Settling", "gather_own_cancel", "settle"]

T = TypeVar("T")


class Settling(asyncio.Future):
    """The future of work ending after its caller gave up, which can tell whether the work is ``busy()`` now in a
    step that is certain to end (a NIXL transfer's piece being copied by our own worker, or its command still
    waiting for the worker, which skips it once cancelled): waiting for it past a usual bound is then waiting for
    something that ends."""

    def __init__(self, busy: Callable[[], bool], *, loop: asyncio.AbstractEventLoop,
                 force: Callable[[], None] | None = None, forcing: Callable[[], bool] | None = None) -> None:
        super().__init__(loop=loop)
        self.busy = busy
        #: Makes the work end now at a cost (a NIXL transfer's peer agent is let go, and the link with it), for
        #: work still not over past its usual bound; None where there is no such way.
        self.force = force
        #: Whether a force asked is still to be applied (the one who applies it is held up meanwhile); the work
        #: may go on until it is.
        self.forcing = forcing


async def settle(future: asyncio.Future, bound_s: float | None) -> bool:
    """Wait up to ``bound_s`` (None: however long it takes) for ``future`` to be done, without cancelling it.

    Cancellations that arrive meanwhile (anyio cancels again at every await)
    are held back and re-raised once the wait is over, so cleanup that must
    finish before a call returns does finish. Returns whether ``future`` is done.
    """
    loop = asyncio.get_running_loop()
    deadline = None if bound_s is None else loop.time() + bound_s
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            break
        try:
            await asyncio.wait([future], timeout=left)
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        raise cancelled  # the one that came, message included: anyio knows its own cancellations by it
    return future.done()


async def gather_own_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` of ``aws`` (run as tasks), except when the caller is cancelled: the tasks are cancelled
    at once, as ``gather`` does, and waited for (cancellations arriving meanwhile held back, as in
    :func:`settle`), and the caller's own ``CancelledError`` is raised, message included. A task's failure is
    raised once every task ended (every failure retrieved), not as soon as it happens.

    ``gather`` raises the ``CancelledError`` one of its tasks ended with. A task that was cancelled already (its
    own time-out cut the task it awaited) keeps its first cancellation's empty message, so anyio's cancellation
    of the caller came out as one anyio does not know for its own: it escaped ``move_on_after``, and
    ``fail_after`` raised ``CancelledError`` instead of ``TimeoutError``."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        await _AllDone(tasks)
    except asyncio.CancelledError as own:  # the tasks were cancelled with the waiter, once
        try:
            await settle(asyncio.gather(*tasks, return_exceptions=True), None)
        except asyncio.CancelledError:
            pass  # the same caller cancelled again meanwhile: its first cancellation goes out
        raise own from None
    for task in tasks:  # each failure retrieved (asyncio logs one that never was), the first raised below
        if not task.cancelled():
            task.exception()
    return [task.result() for task in tasks]


class _AllDone(asyncio.Future):
    """Done once every task is. Cancelling it (the caller's cancel reaches the future it awaits) cancels the
    tasks in the same call, as ``gather``'s future does: a cancel while a task's last step is queued cuts that
    step, so no link a task was setting up is left behind by a call that raises. (``asyncio.wait`` cancelled the
    tasks only once the caller ran again, a step later.)"""

    def __init__(self, tasks: Sequence[asyncio.Future]) -> None:
        super().__init__(loop=tasks[0].get_loop())
        self._tasks = tasks
        self._left = len(tasks)
        for task in tasks:
            task.add_done_callback(self._one)

    def _one(self, _task: asyncio.Future) -> None:
        self._left -= 1
        if not self._left and not self.done():
            self.set_result(None)

    def cancel(self, msg: object = None) -> bool:
        if self.done():
            return False
        for task in self._tasks:
            task.cancel()
        return super().cancel(msg=msg)
