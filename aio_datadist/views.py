"""Views of futures handed to callers who may poll them: a view costs nothing once dropped.

``PushWatch.layer(i)`` and ``CacheTask.layer(i)`` return a fresh future per
call that settles as the underlying one does; cancelling a view never touches
the underlying future. A scheduler that polls (``view.done()``, or
``asyncio.wait({view}, timeout=0)`` on the endpoint's loop: another running
loop is refused) and drops its views must not pile them
up: a view is held only while something waits on it (an ``await``, a
done-callback) and until it is done, weakly otherwise.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["HeldFuture", "Views", "fail_quietly", "mark_retrieved", "refuse_other_loop"]


def refuse_other_loop(what: str, fut: asyncio.Future) -> None:
    """Refuse (``LLM_FAILED``) a wait for ``fut``, still pending, from an event loop other than its own running
    in this thread (a helper loop under ``asyncio.run`` in a worker thread): asyncio would raise a bare
    ``RuntimeError`` or ``ValueError`` there, and that loop would not be woken when ``fut`` settles. A done
    ``fut`` answers any loop; with no loop running (a thread polling ``done()``) nothing is refused."""
    if fut.done():
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if loop is not asyncio.Future.get_loop(fut):  # (its own loop, whatever a subclass's get_loop says)
        raise LLMException(f"{what} lives on the event loop the LLMDataDist was initialised on; wait for it "
                           "from that loop", status_code=LLMStatusCode.LLM_FAILED)


def mark_retrieved(fut: asyncio.Future) -> None:
    """A done-callback for a future nobody may await: its error (if any) is read here, not logged by asyncio
    as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def fail_quietly(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail ``fut``, its error marked retrieved: nobody has to await every layer's future."""
    fut.set_exception(exc)
    fut.exception()


class HeldFuture(asyncio.Future):
    """A view: held in ``held`` while a callback waits on it (an ``await`` adds one) and until it is done,
    only weakly otherwise, so a view polled and dropped is gone while one given a callback and dropped still
    calls it."""

    held: set[asyncio.Future] | None = None
    what = "the future"  # named in a refusal to wait for it from another loop

    # Refused where it is waited for, not where it was asked for: a helper loop may hand the wait to the
    # endpoint's loop (run_coroutine_threadsafe), as the refusal tells it to. ``await`` goes through __await__;
    # asyncio's helpers through get_loop (wait_for, ensure_future) or add_done_callback (gather, wait).

    def __await__(self) -> Any:
        refuse_other_loop(self.what, self)
        return super().__await__()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        refuse_other_loop(self.what, self)
        return super().get_loop()

    def add_done_callback(self, fn: Callable[..., object], *, context: Any = None) -> None:
        refuse_other_loop(self.what, self)
        held = self.held
        if held is not None and not self.done() and self not in held:
            held.add(self)
            super().add_done_callback(held.discard)
        super().add_done_callback(fn, context=context)

    def remove_done_callback(self, fn: Callable[..., object]) -> int:
        removed = super().remove_done_callback(fn)
        held = self.held
        # nothing waits on it any more (an asyncio.wait that timed out took its callback back): let it go
        # (``_callbacks``: asyncio.Future's own list of (callback, context), in its C and Python forms)
        if held is not None and self in held and all(cb == held.discard for cb, _ in self._callbacks or ()):
            held.discard(self)
            super().remove_done_callback(held.discard)
        return removed


class Views:
    """The views handed out of several underlying futures (one per key: a layer): one done-callback per
    underlying future settles its pending views."""

    def __init__(self) -> None:
        self._views: dict[Hashable, weakref.WeakSet[asyncio.Future]] = {}
        self._held: set[asyncio.Future] = set()  # views something waits on until they are done

    def holding(self) -> int:
        """Views kept alive now (something waits on them and they are not done)."""
        return len(self._held)

    def view(self, key: Hashable, fut: asyncio.Future) -> asyncio.Future:
        """A new view of ``fut`` (``fut`` itself once it is done: a done future cannot change); awaiting it from
        another running loop is refused (:func:`refuse_other_loop`)."""
        if fut.done():
            return fut
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = weakref.WeakSet()
            fut.add_done_callback(_settle(views))
        view = HeldFuture(loop=fut.get_loop())
        view.held = self._held
        view.what = f"the future of layer {key}"
        views.add(view)
        return view


def _settle(views: weakref.WeakSet[asyncio.Future]) -> Callable[[asyncio.Future], None]:
    """The done-callback of an underlying future: settle its views still pending as it settled (an error
    quietly: whoever owns the underlying future reports it)."""
    def settled(fut: asyncio.Future) -> None:
        for view in list(views):
            if view.done():  # its caller cancelled it
                continue
            if fut.cancelled():
                view.cancel()
                continue
            exc = fut.exception()
            if exc is None:
                view.set_result(None)
            else:
                fail_quietly(view, exc)
    return settled
