"""The vLLM connector's bookkeeping, free of vLLM and of I/O: what a prefill holds, what a decode pulls.

Both tables are touched from vLLM's thread (metadata, ``get_finished``) and
from the connector's event-loop thread (side channel, pulls), so each method
takes the table's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from aio_datadist.integrations.vllm_wire import blocks_digest

__all__ = ["Held", "PrefillHolds", "DecodePulls"]


@dataclass
class Held:
    """A finished prefill request whose blocks wait for a decoder."""

    deadline: float
    owner: Hashable | None = None  # the side-channel connection that claimed it
    blocks: str = ""  # vllm_wire.blocks_digest of its block ids ("" if not known)


class PrefillHolds:
    """Prefill side: blocks held per request until pulled, given up, or timed out.

    A request is freed (reported once by :meth:`take_released`) when its
    claimer says ``done``, when the claimer's connection closes, when a claim
    runs past ``hold_s``, or, unclaimed, when its lease runs out.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._released: set[str] = set()
        self._expired: list[str] = []  # freed past their deadline, not yet taken (take_expired)
        #: Called with each request :meth:`add` holds, outside the lock (the agent wakes the claims waiting).
        self.on_added: Callable[[str], None] | None = None

    def add(self, req_id: str, lease_s: float, blocks: Sequence[int] = ()) -> None:
        """vLLM delayed freeing ``req_id``'s blocks (``blocks``, the ids its ``kv_transfer_params`` name): hold
        them for at most ``lease_s`` unclaimed; :attr:`on_added` hears of it (from the caller's thread)."""
        with self._lock:
            if req_id in self._held:
                return
            self._held[req_id] = Held(self._clock() + lease_s, blocks=blocks_digest(blocks) if blocks else "")
        if self.on_added is not None:
            self.on_added(req_id)

    def known(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._held

    def claim(self, req_id: str, owner: Hashable, hold_s: float, max_owned: int | None = None) -> bool:
        """Keep ``req_id`` for ``owner`` (at most ``hold_s`` from now); False if not held (any more: a request
        past its lease or its claim's hold is freed here, as by :meth:`expire`), held by another owner, or if
        ``owner`` holds ``max_owned`` other requests already."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None:
                return False
            if self._clock() >= held.deadline:  # its lease or hold ran out, the next expire() pass not yet run
                self._release(req_id)
                self._expired.append(req_id)
                return False
            if held.owner is not None and held.owner != owner:
                return False
            if (max_owned is not None and held.owner is None
                    and sum(1 for h in self._held.values() if h.owner == owner) >= max_owned):
                return False
            held.owner = owner
            held.deadline = self._clock() + hold_s
            return True

    def blocks(self, req_id: str) -> str:
        """The digest of the block ids ``req_id`` holds; "" if not known (or not held)."""
        with self._lock:
            held = self._held.get(req_id)
            return held.blocks if held is not None else ""

    def held_by(self, req_id: str, owner: Hashable) -> bool:
        """Whether ``req_id`` is held, claimed by ``owner``: then it was since ``owner`` claimed it (a request
        freed is never held for the same claim again)."""
        with self._lock:
            held = self._held.get(req_id)
            return held is not None and held.owner == owner

    def done(self, req_id: str, owner: Hashable) -> bool:
        """The claimer is finished with ``req_id``: free it. False if it did not hold it."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None or held.owner != owner:
                return False
            self._release(req_id)
            return True

    def owners(self) -> set[Hashable]:
        """The owners holding a claim now."""
        with self._lock:
            return {h.owner for h in self._held.values() if h.owner is not None}

    def drop_owner(self, owner: Hashable) -> list[str]:
        """A claimer's connection is gone: nothing it pulls can still be used, free its requests."""
        with self._lock:
            gone = [r for r, h in self._held.items() if h.owner == owner]
            for req_id in gone:
                self._release(req_id)
            return gone

    def expire(self) -> None:
        """Free every request past its deadline; they are kept for :meth:`take_expired` (whoever runs this)."""
        now = self._clock()
        with self._lock:
            gone = [r for r, h in self._held.items() if now >= h.deadline]
            for req_id in gone:
                self._release(req_id)
            self._expired.extend(gone)

    def take_expired(self) -> list[str]:
        """Requests freed past their deadline since the last call, by whichever call found them (the owner's
        periodic check, or vLLM's :meth:`take_released`): each logged and recorded once."""
        with self._lock:
            expired, self._expired = self._expired, []
            return expired

    def take_released(self) -> set[str]:
        """Requests freed since the last call (vLLM's ``finished_sending``)."""
        self.expire()
        with self._lock:
            released, self._released = self._released, set()
            return released

    @property
    def held(self) -> dict[str, Held]:
        with self._lock:
            return dict(self._held)

    def _release(self, req_id: str) -> None:
        del self._held[req_id]
        self._released.add(req_id)


@dataclass
class Pull:
    """A decode request's load: local blocks, and what became of it."""

    local_blocks: tuple[int, ...]
    cancel: Callable[[], object] | None = None
    ok: bool | None = None  # None while the pull may still write
    aborted: bool = False  # vLLM aborted it (perhaps before its cancel was set)
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0


class DecodePulls:
    """Decode side: pulls in flight, reported finished only once nothing can write their blocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pulls: dict[str, Pull] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._bad_blocks: set[int] = set()

    def start(self, req_id: str, local_blocks: tuple[int, ...]) -> Pull:
        with self._lock:
            if req_id in self._pulls:
                raise ValueError(f"request {req_id!r} is already being pulled")
            pull = self._pulls[req_id] = Pull(tuple(local_blocks))
            return pull

    def set_cancel(self, req_id: str, cancel: Callable[[], object]) -> None:
        with self._lock:
            pull = self._pulls.get(req_id)
            if pull is None or pull.ok is not None:
                return
            pull.cancel = cancel
            aborted = pull.aborted
        if aborted:  # the abort came before the pull could be cancelled
            cancel()

    def end(self, req_id: str, ok: bool, error: str = "") -> None:
        """The pull stopped (its task ended: no byte can land any more); ``ok`` if all its bytes are in."""
        with self._lock:
            pull = self._pulls.pop(req_id)
            pull.ok, pull.error = ok, error
            pull.seconds = time.monotonic() - pull.started
            self._finished.add(req_id)
            if not ok:
                self._failed.add(req_id)
                self._bad_blocks.update(pull.local_blocks)

    def abort(self, req_ids: set[str]) -> None:
        """vLLM finished these requests (aborted): cancel their pulls; they are reported once stopped."""
        with self._lock:
            cancels = []
            for req_id in req_ids & self._pulls.keys():
                pull = self._pulls[req_id]
                pull.aborted = True
                if pull.cancel is not None:
                    cancels.append(pull.cancel)
        for cancel in cancels:
            cancel()

    def pending(self) -> set[str]:
        with self._lock:
            return set(self._pulls)

    def take_finished(self) -> tuple[set[str], set[str], set[int]]:
        """(finished_recving, failed_recving, block ids that failed to load) since the last call."""
        with self._lock:
            out = (self._finished, self._failed, self._bad_blocks)
            self._finished, self._failed, self._bad_blocks = set(), set(), set()
            return out
