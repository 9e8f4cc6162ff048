"""One NIXL agent and the thread that drives it, feeding the core's CompletionQueue.

NIXL's calls may block (with UCX shared memory a posted transfer is copied
inside the posting call) and its transfer states and notifications have to be
asked for. So the agent is driven by one worker thread owned by
:class:`NixlEngine`: registrations, descriptor-list preparation, remote
metadata, posting, state checks and notification reads, strictly in
submission order. The worker reports each piece of work as a ``(token,
status, aux)`` record on the runtime's CompletionQueue, so asyncio waits on
the same single fd as for every other transport.

One call may come from the loop's thread instead: posting a transfer of at
most ``INLINE_MAX`` bytes (:meth:`NixlEngine.try_post`), when the worker is
not inside the agent at that moment (never waited for: the agent lock is only
tried). A transfer NIXL finishes within the posting call then costs no
hand-off at all; one still in progress is handed to the worker
(:meth:`NixlEngine.adopt`), which checks it as if it had posted it. Each
hand-off costs a thread wake-up, about 100 us on the hosts measured; the
posting call holds the loop for as long as NIXL copies inside it (UCX shared
memory: about 1 ms for 8 MiB; an RDMA post returns at once). The agent lock
keeps the two threads out of the agent at the same time.

The agent runs without NIXL's own progress thread, which spins a whole core
for as long as the agent lives (measured here: 3.0 s of CPU in 3 s idle), on
2-core hosts half the machine. Progress is made by the worker instead, and
only while something needs it: transfers in flight, notifications awaited, or
a peer's transfer against our memory under way (:meth:`hold`). Then it checks
with a backoff of 10 us growing to 500 us between rounds (100 us while one of
our transfers or an awaited notification is outstanding, which bounds how late
a request learns that it is over), which is the cheapest way to learn of NIXL
completions: the Python API has no completion fd. Otherwise it sleeps on a
condition variable.

A transfer larger than ``CHUNK_BYTES`` is posted as a sequence of pieces of
at most that many bytes, each posted once the one before it finished (a
WRITE's notification goes with the last): UCX shared memory copies a whole
transfer inside the posting call, which cannot be interrupted, so a piece
bounds how long a cancelled transfer goes on moving bytes. A transfer that is
cancelled (or timed out) posts no further piece; the piece in progress is not
forgotten: its handle is kept and checked until NIXL reports it settled, and
only then released and reported ``-ECANCELED``. Descriptor lists and
registrations still used by a transfer in flight are released after it
settles.
"""

from __future__ import annotations

import collections
import errno
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aio_datadist import _trace
from aio_datadist._core import CompletionQueue
from aio_datadist._env import env_int
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["CHUNK_BYTES", "INLINE_MAX", "NIXL_MODULES", "NixlEngine", "load_nixl", "row_descs"]

log = logging.getLogger("aio_datadist.nixl")

NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
INSTALL_HINT = "pip install 'aio_datadist[nixl]' (or the nixl / nixl-cu12 package)"
#: The largest transfer posted from the loop's thread (bytes; ``$AIO_DATADIST_NIXL_INLINE_MAX``, 0: every
#: transfer is posted by the worker). 16 MiB, as the loop's own socket jobs (``link_channels.LOOP_IO_MAX``).
INLINE_MAX = env_int("AIO_DATADIST_NIXL_INLINE_MAX", 16 << 20)
#: The largest piece of a transfer posted at once (bytes; ``$AIO_DATADIST_NIXL_CHUNK``, 0: no pieces, a cancelled
#: transfer then moves to its end). A cancelled transfer stops at the end of the piece in progress, which over
#: UCX shared memory is copied inside the posting call.
CHUNK_BYTES = env_int("AIO_DATADIST_NIXL_CHUNK", 64 << 20) or 1 << 62
_MIN_WAIT_S = 10e-6
_MAX_WAIT_S = 500e-6
#: The longest wait while the worker awaits something that ends a request (a transfer it posted that
#: NIXL did not finish in the posting call, or a peer's WRITE notification): each round checks it,
#: so this bounds how late the request learns of it. Holding alone (a peer's READ of our memory)
#: needs progress only, and backs off to _MAX_WAIT_S.
_AWAITED_MAX_WAIT_S = 100e-6
#: How long close waits for in-flight transfers before it lets go of their peers' agents, and after that: as a
#: cut call does (``base.NIXL_SETTLE_S``, ``base.NIXL_FORCE_S``), but off the event loop (``NixlAgent.aclose``).
_CLOSE_SETTLE_S = 1.0
_CLOSE_FORCE_S = 2.0
#: The longest ``close`` waits for the worker: those two and a piece in NIXL's posting call (UCX shared memory
#: copies it there, ``CHUNK_BYTES``).
CLOSE_LIMIT_S = _CLOSE_SETTLE_S + _CLOSE_FORCE_S + 5.0


def load_nixl() -> Any:
    """The ``_api`` module of whichever NIXL wheel is installed.

    Raises ``LLM_FEATURE_NOT_ENABLED`` naming what to install when none is.
    """
    missing = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name}: {exc}")
    raise LLMException("option 'aio.Transport': the nixl transport needs the NIXL Python package, which is not "
                       f"installed ({'; '.join(missing)}); {INSTALL_HINT}",
                       status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)


def row_descs(bases: Any, rows: int, row_bytes: int, device: int = 0) -> np.ndarray:
    """An ``N x 3`` descriptor array, one ``(address, row_bytes, device)`` row per (tensor, row):
    entry ``t * rows + r`` is row ``r`` of tensor ``t`` (``device``: the GPU of VRAM, 0 for DRAM)."""
    base = np.asarray(bases, dtype=np.uint64).reshape(-1, 1)
    starts = (base + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)).reshape(-1)
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0] = starts
    out[:, 1] = row_bytes
    out[:, 2] = device
    return out


class _Recent(collections.OrderedDict):
    """A dict of at most ``limit`` entries; the oldest go first."""

    limit = 1024

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)


class _Xfer:
    __slots__ = ("token", "handle", "aux", "uses", "cancelled", "pieces", "counted", "posted")

    def __init__(self, token: int, handle: Any, aux: int, uses: tuple,
                 pieces: collections.deque | None = None, counted: bool = False) -> None:
        self.token = token
        self.handle = handle  # the piece in progress (None between pieces)
        self.aux = aux
        self.uses = uses
        self.cancelled = False
        self.pieces: collections.deque = pieces if pieces is not None else collections.deque()
        self.counted = counted  # counted in ``posted`` once its first piece is posted, its bytes piece by piece
        self.posted = False


def _pieces(op: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes,
            nbytes: int) -> collections.deque:
    """A transfer cut into pieces of at most ``CHUNK_BYTES`` (one descriptor at least); the notification goes
    with the last piece, posted after every other one finished."""
    count = int(local_idx.size)
    row = nbytes // count if count else 0
    per = count if count == 0 or nbytes <= CHUNK_BYTES else max(CHUNK_BYTES // max(row, 1), 1)
    out: collections.deque = collections.deque()
    for at in range(0, max(count, 1), max(per, 1)):
        end = min(at + per, count)
        out.append((op, local, local_idx[at:end], remote, remote_idx[at:end], notif if end >= count else b"",
                    (end - at) * row if end < count else nbytes - at * row))
    return out


class NixlEngine:
    """A NIXL agent driven by one worker thread; results arrive on ``queue``.

    ``call(token, fn)`` runs ``fn(agent)`` on the worker and keeps its return
    value for :meth:`result`; ``xfer(token, ...)`` posts a transfer between
    prepared descriptor lists; ``expect_notif(token, peer, message)`` reports
    when the peer's notification ``message`` arrives. All three post exactly
    one record for their token, ``-ECANCELED`` once cancelled work settled.
    """

    def __init__(self, queue: CompletionQueue, name: str, backends: tuple[str, ...] = ("UCX",),
                 let_go: Callable[[bytes], None] | None = None) -> None:
        self._api = load_nixl()
        #: Called on the worker with a peer agent's name right after NIXL let go of it (``force_off``; at close
        #: too): what was prepared against that agent until then is invalid.
        self._let_go = let_go
        self.name = name
        self._queue = queue
        config = self._api.nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        self._quiet_nixl_logging()
        try:
            self.agent = self._api.nixl_agent(name, config)
        except Exception as exc:
            raise LLMException(f"option 'aio.Transport': could not start a NIXL agent: {exc}",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED) from exc
        if not self.agent.backends:
            raise LLMException(f"option 'aio.Transport': NIXL has none of the backends {list(backends)}",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        self.metadata: bytes = self.agent.get_agent_metadata()
        #: The memory types each backend reports it can register (``DRAM_SEG``, ``VRAM_SEG``, ...).
        self.mem_types: dict[str, list[str]] = {b: list(self.agent.get_backend_mem_types(b))
                                                for b in self.agent.backends}
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        # Woken whenever a token's work reports back (``_post``), for a thread that waits for one (``halt``); apart
        # from ``_cv``, whose single ``notify`` is meant for the worker.
        self._over = threading.Condition(lock)
        #: Held by whichever thread is inside the agent: the worker (blocking) or the loop (tried only).
        self._agent_lock = threading.Lock()
        self._commands: collections.deque = collections.deque()
        self._active: dict[int, _Xfer] = {}
        self._notifs: dict[tuple[bytes, bytes], int] = {}
        # Notifications read before their expect_notif reached the worker: a round's batch is taken before
        # the owner registers a push's expectation and answers, and the same round's progress may already
        # read the push's notification. Kept (the most recent only) for the expectation that follows.
        self._early: _Recent = _Recent()
        self._deferred: list[tuple[tuple, Callable[[Any], None]]] = []
        # Taken (popped) for each token once its record arrived, whether or not its waiter still waits
        # (``NixlAgent.run``, ``NixlPeer._post``): never capped, a value still to be taken is never dropped (a
        # cap of 1024 lost the registrations of a burst of allocations the loop had not caught up with).
        self._results: dict[int, Any] = {}
        self._errors: dict[int, str] = {}
        self._cancelled: set[int] = set()
        self._forced: set[int] = set()  # cancelled transfers whose peer's agent is to be let go (force_off)
        self._force_pending: set[int] = set()  # ... and such transfers not in ``_active`` yet (``_enter``)
        self._forcing: set[int] = set()  # forces asked and not applied yet (``forcing``)
        # Commands the worker took and has not run yet, the token of the one it runs, and the token whose piece
        # is inside NIXL's posting call: all in flight (in_flight), the last for :meth:`copying` too.
        self._taken: collections.deque = collections.deque()
        self._current = 0
        self._posting = 0  # the token whose transfer is past its cancel check (in NIXL's hands, or being posted)
        self._copying = 0
        self._closing = False
        self._stopped = False  # the worker is done (``_shutdown``): nothing is forced any more
        self._holds = 0
        self.posted = 0  # transfers posted to NIXL, and their bytes
        self.posted_bytes = 0
        self._thread = threading.Thread(target=self._main, name=f"aio_datadist-nixl-{name}", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no thread left (pthread_create failed), or the interpreter exits
            self.agent = None  # nothing ran on it: NIXL's agent goes with its last reference
            raise LLMException(f"cannot start the NIXL agent's worker thread: {exc}",
                               status_code=LLMStatusCode.LLM_FAILED) from exc

    @staticmethod
    def _quiet_nixl_logging() -> None:
        for name in ("nixl", "NIXL"):
            logging.getLogger(name).setLevel(logging.WARNING)

    # -- the loop's side -------------------------------------------------------

    def call(self, token: int, fn: Callable[[Any], Any], discard: Callable[[Any, Any], None] | None = None) -> None:
        """Run ``fn(agent)`` on the worker; its value is :meth:`result` ``(token)``.

        Cancelled before it ran, ``fn`` does not run; cancelled while it ran
        (a NIXL call cannot be interrupted), its value goes to
        ``discard(agent, value)`` on the worker instead, and the record says
        ``-ECANCELED``.
        """
        self._submit(("call", token, (fn, discard)))

    def xfer(self, token: int, op: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             peer: bytes, notif: bytes, nbytes: int, counted: bool = True) -> None:
        """Post ``op`` (READ or WRITE) between two prepared lists, selected by index (``counted`` in
        ``posted`` unless it is a word of our own bookkeeping)."""
        self._submit(("xfer", token, (op, local, local_idx, remote, remote_idx, peer, notif, nbytes, counted)))

    def try_post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                 notif: bytes, nbytes: int, counted: bool = True) -> tuple[str, Any] | None:
        """Post ``op`` from the calling (loop's) thread if the worker is not inside the agent now.

        Returns None when it is (or the engine is closing): :meth:`xfer` it
        instead. Otherwise NIXL's state and the handle: ``DONE`` (the handle is
        released, the bytes are in place) or ``PROC`` (still moving: hand the
        handle to :meth:`adopt`, which releases it once settled). NIXL's
        refusal to post raises its own exception, nothing posted.
        """
        if nbytes > CHUNK_BYTES or not self._agent_lock.acquire(blocking=False):
            return None
        try:
            if self._closing or self.agent is None:
                return None
            handle = self.agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
            try:
                state = self.agent.transfer(handle, notif)
            except BaseException:
                handle.release()
                raise
            if _trace.ON:
                _trace.mark("nixl: transfer() returned")
            self._count(nbytes, counted)
            if state != "PROC":
                try:
                    handle.release()
                except Exception as exc:  # the transfer's own state stands: DONE moved its bytes
                    log.warning("nixl: releasing a finished transfer failed: %r", exc)
            return state, handle
        finally:
            self._agent_lock.release()

    def call_now(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(agent)`` on the calling thread, waiting for the worker to leave the agent (set-up only,
        before any work is queued: it may wait as long as the worker's current call)."""
        with self._agent_lock:
            if self._closing or self.agent is None:
                raise LLMException("the NIXL engine is closed", status_code=LLMStatusCode.LLM_FAILED)
            return fn(self.agent)

    def adopt(self, token: int, handle: Any, nbytes: int, uses: tuple) -> None:
        """Check a transfer :meth:`try_post` left in progress until it settles; report it as ``token``."""
        self._submit(("adopt", token, (handle, nbytes, uses)))

    def expect_notif(self, token: int, peer: bytes, message: bytes) -> None:
        """Report ``token`` once ``peer`` sent notification ``message``."""
        self._submit(("notif", token, (peer, message)))

    def release_when_idle(self, uses: tuple, fn: Callable[[Any], None]) -> None:
        """Run ``fn(agent)`` on the worker once no transfer in flight uses any of ``uses``."""
        self._submit(("release", 0, (uses, fn)))

    def hold(self) -> None:
        """Keep making progress until :meth:`unhold`: a peer's transfer against our memory is under way."""
        with self._cv:
            self._holds += 1
            self._cv.notify()

    def unhold(self) -> None:
        with self._cv:
            self._holds -= 1
    def cancel(self, token: int) -> bool:
        """Cancel ``token``'s work; its record follows once NIXL has let go of it."""
        with self._cv:
            for i, cmd in enumerate(self._commands):
                if cmd[1] == token and cmd[0] != "adopt":  # an adopted transfer is in flight: settle it first
                    del self._commands[i]
                    self._queue.post(token, -errno.ECANCELED, 0)
                    return True
            self._cancelled.add(token)
            self._cv.notify()
        return True

    def halt(self, token: int, bound_s: float) -> bool:
        """Cancel ``token``'s work and block the calling thread (the GIL let go) until none of it is queued, being
        posted or in NIXL's hands: the piece in progress ends, no further piece is posted. Whether that came within
        ``bound_s``; the record follows as after :meth:`cancel`. The worker needs nothing of the waiting thread."""
        self.cancel(token)
        with self._cv:
            return self._over.wait_for(lambda: not self._unsettled(token), bound_s)

    def _unsettled(self, token: int) -> bool:
        """Whether ``token``'s work may still touch memory (``_cv`` held): it is being posted or copied, in NIXL's
        hands, or queued and not cancelled (a cancelled command the worker has taken but not reached is skipped
        unposted; an adopted transfer, posted from the loop's thread, is in flight whatever its command)."""
        if self._stopped:
            return False
        if token in self._active or token in (self._current, self._posting, self._copying):
            return True
        return self._queued(token, "adopt" if token in self._cancelled else None)

    def in_nixl(self, token: int) -> bool:
        """Whether ``token``'s transfer is in NIXL's hands or being posted (what letting go of its peer's agent
        can end)."""
        with self._cv:
            return token in self._active or token == self._posting

    def force_off(self, token: int) -> bool:
        """Let go of the peer agent of ``token``'s transfer, given up and still in NIXL's hands past its bounds (the
        owner makes no progress on it): NIXL disconnects from that agent, which ends every transfer in flight with
        it (each settles, reported failed or cancelled), so none writes our memory or reads it afterwards. Whether
        the transfer is in NIXL's hands (posted, not settled): only then is anything let go, and the caller loses
        the link to that peer with it; one still queued for the worker is skipped once cancelled (``working``)."""
        with self._cv:
            if self._stopped:
                return False  # the engine closed: what was in flight was let go there, and reported
            if token in self._active:
                self._forced.add(token)
            elif token == self._posting or self._queued(token, "adopt"):
                # Posted already (an adopt: posted from the loop's thread; or being posted now): forced once the
                # worker has it in ``_active`` (``_enter``), or dropped when it settles first (``_post``).
                self._force_pending.add(token)
            else:
                return False
            self._forcing.add(token)
            self._cancelled.add(token)
            self._cv.notify()
        return True

    def forcing(self, token: int) -> bool:
        """Whether a force asked for ``token`` (``force_off``) waits for the worker: it is inside a NIXL call
        that takes long (a registration, a metadata load), and the transfer may still move until it is out.
        Never once the engine closed."""
        with self._cv:
            return token in self._forcing and not self._stopped

    def _queued(self, token: int, kind: str | None = None) -> bool:
        """Whether ``token``'s command (of ``kind``, if given: an adopt is a transfer posted from the loop's
        thread) waits for the worker. ``_cv`` held: ``_commands`` is steady; the worker takes from ``_taken``
        without it, so a look there that the worker changed says yes (it is ``_current`` now, or was)."""
        def named(cmd: tuple) -> bool:
            return cmd[1] == token and (kind is None or cmd[0] == kind)

        if any(named(cmd) for cmd in self._commands):
            return True
        try:
            return any(named(cmd) for cmd in list(self._taken))
        except RuntimeError:
            return True

    def working(self, token: int) -> bool:
        """Whether ``token``'s command waits for the worker or is being run (not yet in NIXL's hands): it ends
        once the worker gets to it, at once if it was cancelled (a call or transfer queued behind slow work)."""
        if token == 0:
            return False
        if token in (self._current, self._copying):
            return True
        with self._cv:
            return self._queued(token)

    def result(self, token: int) -> Any:
        """``token``'s return value (``call``), taken: a second call returns None."""
        return self._results.pop(token, None)

    def error(self, token: int) -> str | None:
        """NIXL's own words for why ``token`` failed, if it did."""
        return self._errors.pop(token, None)

    def in_flight(self) -> int:
        """Work that has not reported back: queued, taken by the worker, being posted, in NIXL's hands, or
        awaiting a notification."""
        with self._cv:
            return (len(self._active) + len(self._commands) + len(self._notifs) + len(self._taken)
                    + (1 if self._current else 0))

    def copying(self, token: int) -> bool:
        """Whether the worker is inside NIXL's posting call for a piece of ``token``'s transfer now (UCX shared
        memory copies the piece there: it ends once the piece is copied)."""
        return token != 0 and self._copying == token

    def close(self) -> None:
        """Stop the worker after in-flight transfers settled (bounded); drop the agent. Blocks the calling thread
        for up to :data:`CLOSE_LIMIT_S`: from a loop, ``stop()`` and then ``join()`` in a thread."""
        self.stop()
        self.join()

    def stop(self) -> None:
        """Tell the worker to stop once in-flight transfers settled (``_CLOSE_SETTLE_S``, then ``_CLOSE_FORCE_S``
        after their peers' agents were let go); at once, without waiting for it."""
        with self._cv:
            self._closing = True
            self._cv.notify()

    def join(self) -> None:
        """Wait for the stopped worker (:data:`CLOSE_LIMIT_S` at most); drop the agent."""
        self._thread.join(CLOSE_LIMIT_S)
        self.agent = None

    def _submit(self, cmd: tuple) -> None:
        with self._cv:
            if self._closing:
                raise LLMException("the NIXL engine is closed", status_code=LLMStatusCode.LLM_FAILED)
            self._commands.append(cmd)
            self._cv.notify()

    # -- the worker ------------------------------------------------------------

    def _main(self) -> None:
        wait = _MIN_WAIT_S
        while True:
            with self._cv:
                busy = self._active or self._notifs or self._deferred or self._holds > 0
                if not self._commands and not self._closing:
                    if busy:
                        self._cv.wait(wait)
                    else:
                        self._cv.wait()
            with self._agent_lock:
                with self._cv:
                    self._taken, self._commands = self._commands, collections.deque()
                    cancelled, self._cancelled = self._cancelled, set()
                    forced, self._forced = self._forced, set()
                    closing = self._closing
                    holding = self._holds > 0
                taken = self._taken
                ran = progressed = bool(taken)
                while True:
                    # A force goes before whatever the worker does next: a metadata load queued behind it (a newer
                    # link to that endpoint) then loads the let-go agent afresh, its lists valid; and the next NIXL
                    # call may progress UCX, which moves the forced transfer.
                    if forced:
                        progressed |= self._apply_forces(forced)
                    if not taken:
                        break
                    cmd = taken[0]
                    with self._cv:
                        self._current = cmd[1]  # counted in flight before it leaves the queue
                        if cmd[0] == "adopt":
                            self._posting = cmd[1]
                    taken.popleft()
                    try:
                        self._run(cmd)
                    finally:
                        with self._cv:
                            self._current = self._posting = 0
                            forced, self._forced = self._forced, set()
                if ran:  # cancels asked while the commands ran go before the next progress
                    with self._cv:
                        cancelled |= self._cancelled
                        self._cancelled = set()
                progressed |= self._apply_cancels(cancelled)
                progressed |= self._check_active()
                progressed |= self._check_notifs(holding)
                progressed |= self._run_deferred()
                cap = _AWAITED_MAX_WAIT_S if self._active or self._notifs else _MAX_WAIT_S
                wait = _MIN_WAIT_S if progressed else min(wait * 2, cap)
                if closing:
                    self._shutdown()
                    return

    def _enter(self, xfer: _Xfer) -> None:
        """``xfer`` is in NIXL's hands, in progress: checked each round; forced off now if that was asked before
        it got here (``force_off``)."""
        self._active[xfer.token] = xfer
        with self._cv:
            forced = xfer.token in self._force_pending
            self._force_pending.discard(xfer.token)
        if forced:
            xfer.cancelled = True
            self._apply_forces({xfer.token})

    def _post(self, token: int, status: int, aux: int = 0) -> None:
        if token:
            with self._cv:
                self._force_pending.discard(token)  # over: nothing left to force
                self._forcing.discard(token)
                if token == self._current:  # over before its waiter can look at in_flight()
                    self._current = 0
                if token == self._posting:
                    self._posting = 0
                self._over.notify_all()
            self._queue.post(token, status, aux)

    def _fail(self, token: int, exc: BaseException) -> None:
        self._errors[token] = f"{type(exc).__name__}: {exc}"
        self._post(token, -errno.EIO)

    def _run(self, cmd: tuple) -> None:
        kind, token, args = cmd
        try:
            if kind == "call":
                fn, discard = args
                if self._was_cancelled(token):
                    self._post(token, -errno.ECANCELED)
                    return
                value = fn(self.agent)
                if self._was_cancelled(token):
                    if discard is not None:
                        discard(self.agent, value)
                    self._post(token, -errno.ECANCELED)
                    return
                self._results[token] = value
                self._post(token, 0)
            elif kind == "xfer":
                self._start(token, *args)
            elif kind == "adopt":
                handle, nbytes, uses = args
                self._enter(_Xfer(token, handle, nbytes, uses))
            elif kind == "notif":
                if self._early.pop(args, None) is not None:
                    self._post(token, 0)
                else:
                    self._notifs[args] = token
            elif kind == "release":
                self._deferred.append(args)
        except Exception as exc:  # NIXL raises its own exception types for every failure
            log.debug("nixl %s for token %s failed: %r", kind, token, exc)
            self._fail(token, exc)

    def _was_cancelled(self, token: int) -> bool:
        with self._cv:
            return token in self._cancelled

    def _start(self, token: int, op: str, local: Any, local_idx: np.ndarray, remote: Any,
               remote_idx: np.ndarray, peer: bytes, notif: bytes, nbytes: int, counted: bool = True) -> None:
        if _trace.ON:
            _trace.mark("nixl: worker took it")
        xfer = _Xfer(token, None, nbytes, (id(local), id(remote), peer),
                     _pieces(op, local, local_idx, remote, remote_idx, notif, nbytes), counted)
        self._advance(xfer)

    def _advance(self, xfer: _Xfer) -> None:
        """Post ``xfer``'s pieces in turn while NIXL finishes each inside the posting call; one left in progress
        goes to ``_active`` (checked, then the rest posted, by ``_check_active``). A cancelled transfer posts no
        further piece. NIXL's refusal to post raises, with nothing of that piece posted."""
        state = "DONE"
        while xfer.pieces:
            with self._cv:
                if xfer.cancelled or xfer.token in self._cancelled:
                    xfer.cancelled = True
                    break
                self._posting = xfer.token
            op, local, local_idx, remote, remote_idx, notif, piece_bytes = xfer.pieces.popleft()
            handle = self.agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx, notif)
            if _trace.ON:
                _trace.mark("nixl: handle made")
            self._copying = xfer.token
            try:
                state = self.agent.transfer(handle, notif)
            except BaseException:
                handle.release()
                raise
            finally:
                self._copying = 0
            if _trace.ON:
                _trace.mark("nixl: transfer() returned")
            self._count(piece_bytes, xfer.counted, new=not xfer.posted)  # a transfer once, its bytes piece by piece
            xfer.posted = True
            xfer.handle = handle
            if state == "PROC":
                self._enter(xfer)
                return
            if state != "DONE" or not xfer.pieces:
                break
            self._release(xfer)
        self._settle(xfer, state)

    @staticmethod
    def _release(xfer: _Xfer) -> None:
        handle, xfer.handle = xfer.handle, None
        if handle is None:
            return
        try:
            handle.release()
        except Exception as exc:
            log.warning("nixl: releasing a settled transfer failed: %r", exc)

    def _count(self, nbytes: int, counted: bool, *, new: bool = True) -> None:
        """``nbytes`` of a transfer were posted (under the agent lock): count them, and the transfer if ``new``,
        unless it is a word of our own bookkeeping."""
        if counted:
            self.posted += new
            self.posted_bytes += nbytes

    def _settle(self, xfer: _Xfer, state: str) -> None:
        if _trace.ON:
            _trace.mark("nixl: settled")
        self._release(xfer)
        if xfer.cancelled:
            self._post(xfer.token, -errno.ECANCELED)
        elif state == "DONE":
            self._post(xfer.token, 0, xfer.aux)
        else:
            self._errors[xfer.token] = "NIXL reported the transfer failed (ERR)"
            self._post(xfer.token, -errno.EIO)

    def _apply_cancels(self, tokens: set[int]) -> bool:
        hit = False
        for token in tokens:
            xfer = self._active.get(token)
            if xfer is not None:
                xfer.cancelled = True  # reported once NIXL says it settled
                hit = True
                continue
            for key, waiting in list(self._notifs.items()):
                if waiting == token:
                    del self._notifs[key]
                    self._post(token, -errno.ECANCELED)
                    hit = True
                    break
            else:
                with self._cv:
                    if self._queued(token, "adopt"):  # asked after the round began: kept for its adopt's round
                        self._cancelled.add(token)
        return hit

    def _apply_forces(self, tokens: set[int]) -> bool:
        peers = {xfer.uses[2] for token in tokens if (xfer := self._active.get(token)) is not None}
        for peer in peers:
            self._disconnect(peer)
        with self._cv:
            self._forcing -= tokens  # applied, or settled already (``_post``)
        return bool(peers)

    def _disconnect(self, peer: Any) -> None:
        """Let go of ``peer``'s agent now, transfers with it in flight or not (NIXL disconnects its endpoints)."""
        name = peer.decode() if isinstance(peer, bytes) else str(peer)
        log.warning("nixl: letting go of agent %s: a transfer with it given up did not settle", name)
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # NIXL raises its own exception types for every failure
            log.warning("nixl: letting go of agent %s failed: %r", name, exc)  # perhaps in part: said let go
        if self._let_go is not None:
            try:
                self._let_go(peer if isinstance(peer, bytes) else name.encode())
            except Exception as exc:
                log.warning("nixl: reporting agent %s let go failed: %r", name, exc)

    def _check_active(self) -> bool:
        progressed = False
        for token, xfer in list(self._active.items()):
            try:
                state = self.agent.check_xfer_state(xfer.handle)
            except Exception as exc:
                log.debug("nixl: state of transfer %s: %r", token, exc)
                state = "ERR"
            if state == "PROC":
                continue
            with self._cv:
                self._current = token  # in flight until it reports back or is in _active again (its next piece)
                del self._active[token]
            progressed = True
            try:
                if state == "DONE" and xfer.pieces and self._closing:
                    xfer.cancelled = True  # its pieces not posted never move: it did not complete
                if state != "DONE" or not xfer.pieces or xfer.cancelled:
                    self._settle(xfer, state)
                    continue
                self._release(xfer)
                try:
                    self._advance(xfer)  # the next pieces
                except Exception as exc:  # NIXL raises its own exception types for every failure
                    log.debug("nixl: posting a piece of transfer %s failed: %r", token, exc)
                    self._fail(token, exc)
            finally:
                with self._cv:
                    self._current = self._posting = 0
        return progressed

    def _check_notifs(self, holding: bool) -> bool:
        """Read notifications, which also progresses the agent; unexpected ones are kept (``_early``) for an
        expectation still on its way to the worker."""
        if not self._notifs and not holding:
            return False
        try:
            arrived = self.agent.get_new_notifs()
        except Exception as exc:
            log.warning("nixl: reading notifications failed: %r", exc)
            return False
        progressed = False
        for peer, messages in arrived.items():
            name = peer if isinstance(peer, bytes) else str(peer).encode()
            for message in messages:
                key = (name, bytes(message))
                token = self._notifs.pop(key, None)
                if token is not None:
                    self._post(token, 0)
                    progressed = True
                else:
                    self._early[key] = True
        return progressed

    def _run_deferred(self) -> bool:
        if not self._deferred:
            return False
        busy: set[Any] = set()
        for xfer in self._active.values():
            busy.update(xfer.uses)
        keep, ran = [], False
        for uses, fn in self._deferred:
            if busy.intersection(uses):
                keep.append((uses, fn))
                continue
            try:
                fn(self.agent)
            except Exception as exc:
                log.warning("nixl: release failed: %r", exc)
            ran = True
        self._deferred = keep
        return ran

    def _shutdown(self) -> None:
        with self._cv:
            commands, self._commands = self._commands, collections.deque()
        for kind, token, args in commands:
            if kind == "adopt":  # in flight: settled below with the others
                self._run((kind, token, args))
            else:
                self._post(token, -errno.ECANCELED)
        for xfer in self._active.values():
            xfer.cancelled = True
        # In-flight transfers get the settle bound a cut call gives them, then their peers' agents are let go (they
        # make no progress on them), and they get the bound a forced transfer gets.
        for bound, force in ((_CLOSE_SETTLE_S, True), (_CLOSE_FORCE_S, False)):
            deadline = time.monotonic() + bound
            while self._active and time.monotonic() < deadline:
                self._check_active()
                time.sleep(_MAX_WAIT_S)
            if force and self._active:
                self._apply_forces(set(self._active))
        for xfer in self._active.values():
            log.warning("nixl: transfer %s had not settled when the engine closed", xfer.token)
            self._post(xfer.token, -errno.ECANCELED)
        for token in self._notifs.values():
            self._post(token, -errno.ECANCELED)
        self._notifs.clear()
        for _uses, fn in self._deferred:
            try:
                fn(self.agent)
            except Exception as exc:
                log.debug("nixl: release at close failed: %r", exc)
        self._deferred = []
        with self._cv:
            self._stopped = True
            self._forcing.clear()
            self._force_pending.clear()
            self._over.notify_all()


def agent_name(cluster_id: int) -> str:
    """A NIXL agent name unique to this endpoint instance."""
    return f"aiod-{cluster_id}-{os.getpid()}-{os.urandom(4).hex()}"
