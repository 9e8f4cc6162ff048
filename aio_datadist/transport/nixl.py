"""NIXL data plane: caches registered with a NIXL agent, blocks moved by NIXL READ/WRITE.

Selected per instance by ``aio.Transport=nixl``. Links, requests, validation
and status codes stay ours; only the bytes move differently:

- Every registered cache is registered with this endpoint's NIXL agent
  (:class:`~aio_datadist.transport.nixl_agent.NixlAgent`), and a
  descriptor list with one entry per (tensor, row) is prepared for it once.
  Host caches are registered as ``DRAM``; CUDA device caches as ``VRAM`` with
  their GPU's id, where the agent's backend lists VRAM among its memory types
  (``nixl_agent.vram_off``). Other device caches (the host backend's, NPU memory, or
  a backend without VRAM) are not registered: their transfers take the
  staging plane, and the link says why (``LinkStats.nixl_vram_off``).
- Peers learn each other's agent metadata and per-cache geometry (and, for
  VRAM, the memory type and GPU id: ``OFFER_VRAM``) over our control
  connection (``Msg.NIXL`` records carrying NIXL's serialized metadata as an
  opaque, length-checked field; no pickle). Each side prepares one remote
  descriptor list per peer cache, once.
- A request is validated by the owner exactly as over TCP. The owner answers
  with the cache it resolved; the requester then selects descriptors by index
  from the prepared lists (no list is rebuilt per request) and posts a NIXL
  READ (pulls) or WRITE (pushes). A push carries a notification that the
  owner turns into its arrival record and its confirmation; a pull is
  confirmed by the requester over the control connection.
- A pull of a blocks cache by its blocks key does not ask when the owner
  granted it (``GRANT``, sent with the cache's ``OFFER``): it reads the
  owner's ledger word for the cache (offered as ``LEDGER``) and the rows
  one-sidedly, and the owner keeps a cache it revoked registered until the
  peer no longer reads it (``transport/nixl_grants.py`` describes how).
- Requests NIXL cannot express as whole rows of registered caches (raw
  addresses, partial rows, rows of different sizes on the two ends) take the
  TCP data channels of the same link.
- A link whose NIXL set-up fails (the peer's metadata does not load) or does
  not finish within its share of ``link_clusters``' timeout is declined: that
  end sends ``DECLINE`` and both ends use TCP for the link's life, whatever
  NIXL finishes later.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aio_datadist._settle import Settling
from aio_datadist.refusal_log import RefusalLog
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.transport.fit import Geometry
from aio_datadist.transport.ledger import SLOTS
from aio_datadist.transport.nixl_agent import SCRATCH_WORDS, LocalCache, NixlAgent
from aio_datadist.transport.nixl_engine import INLINE_MAX, NixlEngine, row_descs
from aio_datadist.transport.nixl_grants import (
    GRANT,
    LEDGER,
    NUDGE,
    READS,
    REVOKE,
    REVOKED,
    ReadGrants,
    Revocations,
)
from aio_datadist.transport.nixl_offers import MAX_INDICES, OurOffers, PeerOffers, too_many_descriptors
from aio_datadist.wire import NixlRecord, peer_text

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache

__all__ = ["CUT_WAIT_S", "Halting", "NixlPeer", "link_tag", "HELLO", "OFFER", "WITHDRAW", "READY",
           "PREPARED", "DECLINE", "OFFER_VRAM", "SETUP_SHARE"]

log = logging.getLogger("aio_datadist.nixl")
#: Peers' offers whose NIXL metadata does not load: a linked peer can send them at will (paced loads, not lines).
_UNUSABLE_OFFERS = RefusalLog(log, "more not usable")

#: How long releasing a registered cache waits, blocking, for a NIXL transfer of ours that moves it to stop (the
#: piece in progress: ``nixl_engine.CHUNK_BYTES``), and as long again once its peer's agent was let go
#: (:meth:`Halting.halt`).
CUT_WAIT_S = 1.0
#: What each WRITE still in flight gets at least when ``NixlPeer.halt_writes`` stops them all in one ``CUT_WAIT_S``.
HALT_LEAST_S = 0.05

HELLO, OFFER, WITHDRAW, READY, PREPARED, DECLINE, OFFER_VRAM = 1, 2, 3, 4, 5, 6, 7
#: ... and those of reads without asking (``transport/nixl_grants.py``), numbered after them.
KINDS = (HELLO, OFFER, WITHDRAW, READY, PREPARED, DECLINE, OFFER_VRAM, LEDGER, GRANT, REVOKE, REVOKED, READS, NUDGE)
#: The share of the time ``link_clusters`` has left that the NIXL exchange may use; the link falls
#: back to TCP when it is spent, and the rest is the caller's margin.
SETUP_SHARE = 0.5
MAX_REASON = 512
MAX_TENSORS = 4096
#: A push's WRITE notification: magic, the link's tag (:func:`link_tag`), request id.
NOTIF = struct.Struct("!4s8sQ")
NOTIF_MAGIC = b"AIDN"
#: The GPU id an ``OFFER_VRAM`` record's blob starts with (NIXL's metadata follows).
VRAM_DEVICE = struct.Struct("!I")


def link_tag(token: bytes) -> bytes:
    """Eight bytes that name one link, derived from its token by both ends. Request ids start again on every
    link, and a WRITE cut by its link's end can stay in flight until the owner's agent progresses on the next
    link to the same peer: its late notification must not confirm that link's push of the same id."""
    return hashlib.blake2b(token, digest_size=8, person=b"aio-dd-notif").digest()


def notif_for(tag: bytes, req_id: int) -> bytes:
    """The notification a push request's WRITE carries on the link ``tag`` names."""
    return NOTIF.pack(NOTIF_MAGIC, tag, req_id)


class Halting(Settling):
    """The settling of a transfer posted to our worker, which can also be stopped at once (:meth:`halt`): a
    release of the registered cache it moves must not return while a byte of it can still land."""

    def __init__(self, engine: NixlEngine, tokens: list[int], what: str, *, loop: asyncio.AbstractEventLoop,
                 force: Callable[[], None], forcing: Callable[[], bool]) -> None:
        super().__init__(lambda: bool(tokens) and engine.working(tokens[0]), loop=loop, force=force, forcing=forcing)
        self._engine, self._tokens, self._what = engine, tokens, what

    def halt(self, bound_s: float = CUT_WAIT_S) -> bool:
        """Cancel the transfer and block (the loop's thread too: our worker moves it, not the loop) until no piece
        of it is in NIXL's hands, ``bound_s`` at most; still there then (the peer makes no progress on it), its
        peer's agent is let go (the link goes with it, ``NixlAgent._let_go``) and it gets ``bound_s`` more. Whether
        it stopped (logged as an error when it did not)."""
        if self.done() or not self._tokens:
            return True
        token = self._tokens[0]
        if self._engine.halt(token, bound_s):
            return True
        if self._engine.in_nixl(token):  # (not while our worker is busy with another call: nothing to let go)
            self._engine.force_off(token)
        if self._engine.halt(token, bound_s):
            return True
        log.error("%s: the NIXL transfer of a released cache did not stop within %.1f s", self._what, 2 * bound_s)
        return False


class _RemoteCache:
    __slots__ = ("cache_id", "rows", "tensors", "row_bytes", "dlist")

    def __init__(self, cache_id: int, rows: int, tensors: int, row_bytes: int, dlist: Any) -> None:
        self.cache_id = cache_id
        self.rows = rows
        self.tensors = tensors
        self.row_bytes = row_bytes
        self.dlist = dlist


def indices(first: int, count: int, rows: Any, per_tensor: int) -> np.ndarray:
    """Descriptor indices of ``rows`` of tensors ``[first, first + count)``, tensor-major (the
    order both ends agree on)."""
    return np.add(_tensor_starts(first, count, per_tensor), np.asarray(rows, dtype=np.int32)).ravel()


@functools.lru_cache(maxsize=SLOTS + SCRATCH_WORDS)
def _single(index: int) -> np.ndarray:
    """A one-entry descriptor index array (read-only): a ledger slot or one of our scratch words."""
    out = np.array([index], dtype=np.int32)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=256)
def _tensor_starts(first: int, count: int, per_tensor: int) -> np.ndarray:
    """The first descriptor of each tensor as a column (read-only; a request adds its rows to it)."""
    if (first + count) * per_tensor > MAX_INDICES:
        raise LLMException(f"a NIXL descriptor list of {(first + count) * per_tensor} entries is beyond its "
                           "32-bit indices", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    out = (np.arange(first, first + count, dtype=np.int32) * np.int32(per_tensor)).reshape(-1, 1)
    out.flags.writeable = False
    return out


def _discard(agent: Any, value: Any) -> None:
    """On the worker: a remote list prepared for work that was cancelled meanwhile is never used."""
    if isinstance(value, _RemoteCache):
        value.dlist.release()


def prepare_remote(agent: Any, name: str, cache_id: int, rows: int, row_bytes: int, bases: Sequence[int],
                   mem: str, device: int) -> _RemoteCache:
    """On the worker: the descriptor list of a peer's offered cache (``mem`` ``DRAM`` or ``VRAM`` on GPU
    ``device`` of the peer's), one entry per (tensor, row); ``on_message`` refused more than ``MAX_DESCRIPTORS``."""
    too_many = too_many_descriptors(len(bases), rows)
    if too_many is not None:
        raise ValueError(too_many)
    dlist = agent.prep_xfer_dlist(name, row_descs(bases, rows, row_bytes, device), mem)
    return _RemoteCache(cache_id, rows, len(bases), row_bytes, dlist)


class NixlPeer:
    """One link's NIXL state: the peer's agent and its caches' prepared lists; its grants of reads without
    asking are held by ``granted`` (ours of the peer's caches) and ``revocations`` (the peer's of ours)."""

    def __init__(self, agent: NixlAgent, send: Any, cluster_id: int, tag: bytes,
                 on_read: Callable[[int, int, float], None] | None = None,
                 lost: Callable[[LLMException], None] | None = None) -> None:
        self.agent = agent
        self._lost = lost  # fails the link: a transfer with the peer was forced off (``_force_off``)
        self.tag = tag  # the link's, in its pushes' notifications (link_tag)
        # Reads without asking (transport/nixl_grants.py): the peer's ledger, prepared for NIXL, and what the peer
        # granted us; what we granted the peer.
        self.ledger: _RemoteCache | None = None
        self._ledger_said = False  # the peer sent its LEDGER (loaded or still loading): a second one is an error
        loop = self._loop = asyncio.get_running_loop()
        self.granted = ReadGrants(send, loop)
        self.revocations = Revocations(send, loop, agent.engine, cluster_id, agent.serve_begin, agent.serve_end,
                                       on_read)
        self.engine = agent.engine
        self._send = send
        self.cluster_id = cluster_id
        self.name: bytes | None = None
        self.caches: dict[int, _RemoteCache] = {}
        self.offers_sent: set[int] = set()
        self.offers_out = OurOffers()  # the link's budget (transport/nixl_offers.py): what we offered ...
        self.offers_in = PeerOffers()  # ... and what the peer offered us, its loads paced
        self.prepared: set[int] = set()  # our caches the peer has prepared a descriptor list for
        self._initial: set[int] | None = None  # caches offered at link time, not yet prepared by the peer
        self._peer_ready = False  # the peer's link-time offers are all prepared here
        self._hello_loaded = False  # we loaded the peer's agent metadata (or it keeps its memory to itself)
        self._peer_loaded = False  # the peer said READY: it loaded ours
        self.agent_loaded = False  # set on the worker: the agent holds the peer's metadata, to remove at close
        self._pending: set[asyncio.Future] = set()  # engine work for this peer, cancelled when we decline
        # Every transfer of ours with the peer in flight (its settling -> its future and op: halt_writes stops the
        # WRITEs), and why none may start any more: an unlink cuts them all before the peer hears of it (cut_ours).
        self._ours: dict[Halting, tuple[asyncio.Future, str]] = {}
        self._cut: LLMException | None = None
        self.declined: str | None = None  # why this link uses TCP only, once NIXL was given up
        self._said: set[str] = set()  # why device caches took the staging plane, as logged once per link
        self.ready = loop.create_future()
        self.closed = False
        agent.peers.add(self)

    # -- what we send ----------------------------------------------------------

    def hello(self) -> None:
        """Our agent's name and metadata; without remote access, the name only: NIXL metadata carries
        the keys to all registered memory, so a peer that never gets it cannot touch ours (we can still
        read and write its caches)."""
        metadata = self.agent.metadata if self.agent.exposed else b""
        self._send(HELLO, 0, 0, 0, (), self.agent.name + b"\0" + metadata)

    def offer_all(self) -> None:
        """Offer every cache registered so far, then READY. The link is ready once the peer has
        prepared all of them and we have prepared all of its (both directions can use NIXL then)."""
        ledger = self.agent.ledger
        if ledger is not None and self.agent.exposed:
            self._send(LEDGER, 0, SLOTS, 8, (ledger.address,), self.agent.metadata)
        for entry in list(self.agent.local.values()):
            self.offer(entry)
        self._initial = set(self.offers_sent) - self.prepared
        self._send(READY, 0, 0, 0, (), b"")
        self._check_ready()

    def _check_ready(self) -> None:
        if self._peer_ready and self._initial is not None and not self._initial and not self.ready.done():
            self.ready.set_result(True)

    def offer(self, entry: LocalCache) -> None:
        cache = entry.cache
        if (self.closed or self.declined is not None or self.name is None or cache is None
                or cache.cache_id in self.offers_sent or not self.agent.exposed):
            return
        over = self.offers_out.take(cache.cache_id, entry.rows * len(cache.layout.bases))
        if over is not None:  # the peer would refuse it: not offered, its transfers on this link take TCP
            if not self.offers_out.refused_before:
                self.offers_out.refused_before = True
                log.info("link to cluster %s: cache %s is not offered over NIXL (%s); its transfers take TCP "
                         "(said once per link)", self.cluster_id, cache.cache_id, over)
            return
        self.offers_sent.add(cache.cache_id)
        if entry.mem == "VRAM":
            self._send(OFFER_VRAM, cache.cache_id, entry.rows, entry.row_bytes, tuple(cache.layout.bases),
                       VRAM_DEVICE.pack(entry.device) + self.agent.metadata)
            return
        self._send(OFFER, cache.cache_id, entry.rows, entry.row_bytes, tuple(cache.layout.bases),
                   self.agent.metadata)
        listed = self.agent.granted(cache.cache_id)
        if listed is not None:
            self.revocations.grant(cache, *listed)

    def withdraw(self, cache_id: int) -> None:
        self.prepared.discard(cache_id)
        if self._initial is not None and cache_id in self._initial:  # the set-up waits for it no longer
            self._initial.discard(cache_id)
            self._check_ready()
        self.revocations.revoke(cache_id)  # before WITHDRAW: its ledger word is clear already
        if cache_id in self.offers_sent and not self.closed and self.declined is None:
            self.offers_sent.discard(cache_id)
            self.offers_out.withdrawn(cache_id)
            self._send(WITHDRAW, cache_id, 0, 0, (), b"")

    def say_staged(self, why: str) -> None:
        """Device caches on this link take the staging plane because of ``why``: say so once (INFO)."""
        if why not in self._said:
            self._said.add(why)
            log.info("link to cluster %s: device caches take the staging plane, not NIXL: %s", self.cluster_id, why)

    def serves(self, cache: Any) -> bool:
        """Whether the peer may move whole rows of our ``cache`` with NIXL: it is registered and the
        peer said it prepared the list for it."""
        return self.usable() and cache.cache_id in self.prepared and self.agent.offered(cache)

    # -- set-up and giving up ---------------------------------------------------

    async def set_up(self, deadline: float | None, limit: float) -> None:
        """Wait for the exchange (the dialling end, before ``link_clusters`` returns).

        It may take ``SETUP_SHARE`` of the time left until ``deadline`` (loop
        time; ``limit`` seconds at most). A plane not set up by then is
        declined: this link uses TCP. If both agents did load each other's
        metadata and only cache lists are still being prepared, NIXL stays on
        and those caches move over TCP until they are prepared.
        """
        loop = asyncio.get_running_loop()
        budget = limit if deadline is None else min(limit, max(deadline - loop.time(), 0.0) * SETUP_SHARE)
        if not self.ready.done():
            await asyncio.wait([self.ready], timeout=budget)
        if self.ready.done():
            if not self.usable() and self.declined is None and not self.closed:
                log.info("link to cluster %s: the peer does not use NIXL; using TCP", self.cluster_id)
            return
        if self._hello_loaded and self._peer_loaded and self.usable():
            log.info("link to cluster %s: NIXL is set up; caches whose lists are still being prepared move "
                     "over TCP until they are", self.cluster_id)
            return
        self.decline(f"NIXL set-up did not finish within {budget * 1000:.0f} ms "
                     f"({SETUP_SHARE:.0%} of the time link_clusters had left)")

    def decline(self, reason: str, *, tell: bool = True) -> None:
        """Give NIXL up for this link, for good: TCP from now on, on both ends.

        The peer is told (``DECLINE``), so neither end asks for or serves a
        NIXL transfer any more; engine work still queued for this peer is
        cancelled and what it prepared is dropped. Work that finishes later
        changes nothing.
        """
        if self.declined is not None or self.closed:
            return
        self.declined = reason
        log.warning("link to cluster %s: NIXL is not usable (%s); this link moves caches over TCP",
                    self.cluster_id, reason)
        if tell:
            self._send(DECLINE, 0, 0, 0, (), reason.encode()[:MAX_REASON])
        for fut in list(self._pending):
            fut.cancel()
        self.granted.decline()
        self._drop_ledger()
        caches, self.caches = self.caches, {}
        for remote in caches.values():
            self._drop(remote)
        self.prepared.clear()
        if not self.ready.done():
            self.ready.set_result(False)

    def _start(self, work: Any, what: str, done: Any) -> asyncio.Future:
        """Engine work for this peer: cancelled if we decline; ``done(fut)`` runs unless we did or closed."""
        fut = self.agent.start(work, what, discard=_discard)
        self._pending.add(fut)

        def finished(f: asyncio.Future) -> None:
            self._pending.discard(f)
            if self.declined is not None or self.closed:
                if not f.cancelled() and f.exception() is None and isinstance(f.result(), _RemoteCache):
                    self._drop(f.result())  # finished late: never used
                return
            done(f)

        fut.add_done_callback(finished)
        return fut

    # -- what we receive -------------------------------------------------------

    def on_message(self, fields: NixlRecord) -> None:
        """One ``Msg.NIXL`` record from the peer (validated here; a bad one is a ProtocolError)."""
        from aio_datadist.wire import ProtocolError

        kind, cache_id, rows, row_bytes = fields.kind, fields.cache_id, fields.count, fields.row_bytes
        blob = fields.blob
        if self.declined is not None and kind in KINDS and kind not in (REVOKE, REVOKED):
            return  # TCP for good: whatever the peer sent before it heard so changes nothing (but reads without
            # asking started before may still be in flight: their revocations are still answered and heard)
        if kind == HELLO:
            name, sep, metadata = blob.partition(b"\0")
            if not sep or not name or self.name is not None:
                raise ProtocolError("bad NIXL hello")
            self._load(metadata, name, None)
        elif kind in (OFFER, OFFER_VRAM):
            bases = fields.rows
            if (self.name is None or cache_id <= 0 or not 0 < len(bases) <= MAX_TENSORS or rows <= 0
                    or row_bytes <= 0 or rows * row_bytes >= 1 << 48
                    or too_many_descriptors(len(bases), rows) is not None  # we never offer such a cache
                    or (kind == OFFER_VRAM and len(blob) < VRAM_DEVICE.size)):
                raise ProtocolError("bad NIXL offer")
            wait = self.offers_in.accept(cache_id, len(bases) * rows)  # re-offered or beyond the budget: raises
            mem, device = "DRAM", 0
            if kind == OFFER_VRAM:
                mem, (device,) = "VRAM", VRAM_DEVICE.unpack_from(blob)
                blob = blob[VRAM_DEVICE.size:]
            cache = (cache_id, rows, row_bytes, bases, mem, device)
            if wait <= 0:
                self.offers_in.track(cache_id, self._load(blob, self.name, cache))
            else:
                self.offers_in.track(cache_id, self._load_later(wait, blob, cache),
                                     delayed=self.offers_in.cost(len(bases) * rows))
        elif kind == WITHDRAW:
            self.offers_in.withdraw(cache_id)  # a load of it not ended yet is cancelled (nor kept)
            self.granted.withdrawn(cache_id)  # an honest peer revoked it first: a grant left is dropped
            gone = self.caches.pop(cache_id, None)
            if gone is not None:
                self._drop(gone)
        elif kind == PREPARED:
            if cache_id in self.offers_sent:
                self.prepared.add(cache_id)
                if self._initial is not None:
                    self._initial.discard(cache_id)
                    self._check_ready()
        elif kind == READY and self.name is None:  # the peer does not use NIXL: TCP it is
            if not self.ready.done():
                self.ready.set_result(False)
        elif kind == READY:
            if self._peer_loaded:  # an honest peer says it once; each one queued work on our NIXL worker
                raise ProtocolError("a second NIXL READY")
            self._peer_loaded = True
            # Queued behind every offer before it whose load started; a load the pace delays (nixl_offers) comes
            # later, and the link may be ready before it: that cache's transfers take TCP until it is prepared.
            self._start(lambda agent: None, "NIXL link set-up", self._set_ready)
        elif kind == DECLINE:
            text = peer_text(blob[:MAX_REASON])  # a peer's text: shown escaped (row 182)
            self.decline(f"cluster {self.cluster_id} gave it up: {text}", tell=False)
        elif kind == LEDGER:
            if (self.name is None or self._ledger_said or rows != SLOTS or row_bytes != 8
                    or len(fields.rows) != 1):
                raise ProtocolError("bad NIXL ledger")
            self._ledger_said = True
            self._load(blob, self.name, (0, SLOTS, 8, fields.rows, "DRAM", 0))
        elif kind == GRANT:
            if cache_id not in self.offers_in.declared:  # an honest peer grants a cache right after offering it
                raise ProtocolError("NIXL grant of a cache not offered")
            self.granted.on_grant(cache_id, rows, blob)
        elif kind == REVOKE:
            self.granted.on_revoke(cache_id)
        elif kind == REVOKED:
            self.revocations.on_revoked(cache_id)
        elif kind == NUDGE:
            self.revocations.on_nudge()
        elif kind == READS:
            self.revocations.on_reads(rows, row_bytes, fields.rows)
        else:
            raise ProtocolError(f"unknown NIXL record kind {kind}")

    def _set_ready(self, fut: asyncio.Future) -> None:
        if self.ready.done():
            return
        if fut.cancelled() or fut.exception() is not None:
            self.ready.set_result(False)
            return
        self._peer_ready = True
        self._check_ready()

    def _load_later(self, wait: float, metadata: bytes, cache: tuple) -> asyncio.Future:
        """:meth:`_load` of an offered cache after ``wait`` seconds (paced, ``PeerOffers``; cancelled with the
        peer's other work, or by its WITHDRAW)."""
        assert self.name is not None, "OFFER checked it"
        name = self.name

        async def later() -> None:
            await asyncio.sleep(wait)
            self.offers_in.started(task)  # loaded from here on: its entries stay spent
            with contextlib.suppress(Exception):  # a failed load is _loaded's to report; a cancel reaches it
                await self._load(metadata, name, cache)

        task = asyncio.get_running_loop().create_task(later())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    def _load(self, metadata: bytes, name: bytes, cache: tuple | None) -> asyncio.Future:
        def work(agent: Any) -> Any:
            if not metadata and cache is None:
                return None  # the peer keeps its memory to itself; it may still use ours
            loaded = agent.add_remote_agent(metadata)
            loaded = loaded if isinstance(loaded, bytes) else str(loaded).encode()
            if loaded != name:
                # NIXL loaded it under that name: unload it, or it stays (sections, a UCX endpoint) for good,
                # unless it is the agent of another of our links (NIXL refused new content for it then).
                if loaded not in [peer.name for peer in list(self.agent.peers) if peer is not self]:
                    agent.remove_remote_agent(loaded.decode())
                raise ValueError(f"metadata names agent {loaded!r}, not {name!r}")
            self.agent_loaded = True
            if cache is None:
                return None
            return prepare_remote(agent, name.decode(), *cache)

        if cache is None:
            self.name = name
        return self._start(work, f"loading NIXL metadata of cluster {self.cluster_id}",
                           lambda f: self._loaded(f, cache is None))

    def _loaded(self, fut: asyncio.Future, hello: bool) -> None:
        if fut.cancelled() and not hello:
            return  # the peer withdrew the cache before it was loaded
        if fut.cancelled() or fut.exception() is not None:
            exc = None if fut.cancelled() else fut.exception()
            if hello:  # we cannot reach the peer's memory: tell it, so that neither end tries
                self.decline(f"{exc or 'loading its NIXL metadata was cancelled'}")
            else:
                _UNUSABLE_OFFERS.note("cluster %s: NIXL metadata not usable (%s); its caches move over TCP",
                                      self.cluster_id, exc)
            return
        remote = fut.result()
        if hello:
            self._hello_loaded = True
            self.offer_all()
            return
        if remote.cache_id == 0:  # the peer's ledger (LEDGER)
            self.ledger = remote
            return
        old = self.caches.pop(remote.cache_id, None)
        if old is not None:
            self._drop(old)
        self.caches[remote.cache_id] = remote
        self._send(PREPARED, remote.cache_id, 0, 0, (), b"")

    def _drop(self, remote: _RemoteCache) -> None:
        try:
            self.engine.release_when_idle((id(remote.dlist),), lambda agent: remote.dlist.release())
        except LLMException:
            pass

    # -- transfers -------------------------------------------------------------

    def usable(self) -> bool:
        return not self.closed and self.declined is None and self.name is not None

    def transfer(self, op: str, local: KvCache, local_first: int, local_rows: Any, remote_id: int,
                 remote_first: int, remote_rows: Any, count: int, notif: bytes,
                 what: str) -> tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]]:
        """Post ``op`` between whole rows of ``local`` and the peer's cache ``remote_id``.

        Returns the transfer's future (the completion's own, resolved by the
        record: no future in between, one loop step less per transfer; its
        result is the bytes moved, cancelling it cancels the transfer), one that
        completes once NIXL has let go of it (also after a cancel), and a
        function giving NIXL's own words for a failure of the first. Raises
        ``LLM_LINK_FAILED`` when either end is not (or no longer) prepared for it.
        """
        posted = self._rows(op, local, local_first, local_rows, remote_id, remote_first, remote_rows, count, notif,
                            what, inline=False)
        assert posted is not None, "inline=False"
        return posted

    def read_rows(self, local: KvCache, local_first: int, local_rows: Any, remote_id: int, remote_first: int,
                  remote_rows: Any, count: int,
                  what: str) -> tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]] | None:
        """A READ as :meth:`transfer`'s, but None when NIXL moved the bytes inside the posting call (no future is
        made then: a read without asking of a few MiB mostly ends so)."""
        return self._rows("READ", local, local_first, local_rows, remote_id, remote_first, remote_rows, count, b"",
                          what, inline=True)

    def _rows(self, op: str, local: KvCache, local_first: int, local_rows: Any, remote_id: int, remote_first: int,
              remote_rows: Any, count: int, notif: bytes, what: str, *,
              inline: bool) -> tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]] | None:
        entry = self.agent.local.get(local.cache_id)
        remote = self.caches.get(remote_id)
        if entry is None or entry.cache is not local or remote is None or not self.usable():
            raise LLMException(f"cluster {self.cluster_id}: cache {remote_id} is not prepared for NIXL",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        remote_rows = list(remote_rows)
        if (remote.row_bytes != entry.row_bytes or len(remote_rows) != len(local_rows)
                or remote_first + count > remote.tensors or min(remote_rows) < 0 or max(remote_rows) >= remote.rows):
            raise LLMException(f"cluster {self.cluster_id} resolved a cache that does not fit the request",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        local_idx = indices(local_first, count, local_rows, entry.rows)
        remote_idx = indices(remote_first, count, remote_rows, remote.rows)
        nbytes = local_idx.size * entry.row_bytes
        return self._post(op, entry.dlist, local_idx, remote.dlist, remote_idx, notif, nbytes, what,
                          (local, entry, remote), inline=inline)

    def _post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray, notif: bytes,
              nbytes: int, what: str, keepalive: Any, counted: bool = True, *, inline: bool
              ) -> tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]] | None:
        """Post ``op`` between two prepared lists (:meth:`transfer`'s three results, or None if ``inline`` and
        NIXL moved it inside the posting call; ``counted`` in the engine's ``posted`` unless it is a ledger
        word)."""
        engine, name = self.engine, self.name
        assert name is not None  # usable() was checked
        if self._cut is not None:  # our unlink cut what was in flight: nothing new starts
            raise LLMException(f"{what}: {self._cut}", status_code=self._cut.status_code)
        posted = self._post_now(op, local, local_idx, remote, remote_idx, notif, nbytes, what, counted)
        loop = asyncio.get_running_loop()
        if posted is not None and posted[0] != "PROC":  # NIXL moved it inside the posting call
            if inline:
                return None
            settled = loop.create_future()
            moved = loop.create_future()
            moved.set_result(nbytes)
            settled.set_result(True)
            return moved, settled, str
        handle = None if posted is None else posted[1]
        tokens: list[int] = []
        settled = Halting(engine, tokens, what, loop=loop, force=lambda: self._force_off(tokens, what),
                          forcing=lambda: bool(tokens) and engine.forcing(tokens[0]))

        def submit(token: int) -> None:
            tokens.append(token)
            if handle is not None:
                engine.adopt(token, handle, nbytes, (id(local), id(remote), name))
            else:
                engine.xfer(token, op, local, local_idx, remote, remote_idx, name, notif, nbytes, counted)

        words: list[str | None] = []
        settled.add_done_callback(lambda _: words.append(engine.error(tokens[0]) if tokens else None))

        def failure(exc: BaseException) -> str:
            text = next((w for w in words if w), None)
            return text or (engine.error(tokens[0]) if tokens else None) or str(exc)

        moved = self.agent.runtime.completions.start(submit, engine.cancel, timeout_ms=None, what=what,
                                                     keepalive=keepalive, settled=settled)
        if not settled.done():
            self._ours[settled] = (moved, op)
            settled.add_done_callback(self._forget_ours)
        return moved, settled, failure

    def _forget_ours(self, settled: Any) -> None:
        self._ours.pop(settled, None)

    def cut_ours(self, exc: LLMException, *, for_good: bool = False) -> list[tuple[Halting, str]]:
        """Fail every transfer of ours with the peer still in flight with ``exc``'s words and code, as a timeout
        fails one: NIXL is told to stop it, and its caller gives it up and returns once it settled (``nixl_settle``).
        ``for_good``: no transfer starts on this link any more. The settlings of those not over yet, each with its
        op (``READ`` or ``WRITE``)."""
        if for_good and self._cut is None:
            self._cut = exc
        left = []
        for settled, (moved, op) in list(self._ours.items()):
            if not moved.done():
                moved.set_exception(LLMException(str(exc), status_code=exc.status_code))
            if not settled.done():
                left.append((settled, op))
        return left

    # -- reads without asking (the requester's side: transport/nixl_grants.py) ------

    def grant_for(self, model_id: int) -> tuple[_RemoteCache, Geometry, int, int] | None:
        """The peer's cache bound to blocks key ``model_id`` that it lets us read without asking: its prepared
        list, its geometry (for ``fit``), its ledger slot and what the word there holds while the grant stands;
        None when we must ask."""
        if self.ledger is None or not self.usable():
            return None
        return self.granted.grant_for(model_id, self.caches)

    def report_reads(self) -> None:
        """Send our reads without asking that are not reported yet now (the link is about to go)."""
        self.granted.report_reads()

    def read_started(self, cache_id: int) -> bool:
        """A read of ``cache_id`` without asking starts, if the peer still grants it (``granted.read_ended``
        ends it)."""
        return self.usable() and self.granted.read_started(cache_id)

    def read_word(self, index: int, slot: int,
                  what: str) -> tuple[asyncio.Future, asyncio.Future, Callable[[BaseException], str]] | None:
        """READ the peer's ledger word ``slot`` into our scratch word ``index`` (:meth:`read_rows`' results)."""
        ledger, scratch = self.ledger, self.agent.scratch_list
        if ledger is None or scratch is None or not self.usable():
            raise LLMException(f"cluster {self.cluster_id}: its NIXL ledger is not prepared",
                               status_code=LLMStatusCode.LLM_LINK_FAILED)
        return self._post("READ", scratch, _single(index), ledger.dlist, _single(slot), b"", 8, what,
                          (ledger, self.agent.scratch), False, inline=True)

    def _drop_ledger(self) -> None:
        ledger, self.ledger = self.ledger, None
        if ledger is not None:
            self._drop(ledger)

    def _post_now(self, op: str, local: Any, local_idx: np.ndarray, remote: Any,
                  remote_idx: np.ndarray, notif: bytes, nbytes: int, what: str,
                  counted: bool = True) -> tuple[str, Any] | None:
        """Post from the loop's thread when that is allowed (``INLINE_MAX``) and the worker is not inside the
        agent: ``(state, handle)``, ``DONE`` or ``PROC``; None to hand the post to the worker. A transfer NIXL
        refuses to post, or reports failed, raises ``LLM_LINK_FAILED`` with NIXL's words, as one the worker
        posted does (``NixlPlane.carry``)."""
        if nbytes > INLINE_MAX:
            return None
        try:
            posted = self.engine.try_post(op, local, local_idx, remote, remote_idx, notif, nbytes, counted)
        except Exception as exc:  # NIXL raises its own exception types for every failure
            words = f"{type(exc).__name__}: {exc}"
        else:
            if posted is None or posted[0] in ("DONE", "PROC"):
                return posted
            words = "NIXL reported the transfer failed (ERR)"
        raise self.failed(what, words)

    def halt_writes(self) -> bool:
        """Stop our WRITEs into the peer's caches still in flight and block until none can land (``Halting.halt``),
        before we answer the peer's ``UNLINK``, on which its unlink returns: the peer cannot stop them itself, and
        their bytes would land in memory it has back. One ``CUT_WAIT_S`` for all of them (then each one still in
        NIXL's hands has the peer's agent let go and a little more), not one each. Whether every one stopped."""
        deadline = time.monotonic() + CUT_WAIT_S
        stopped = True
        for write in [settled for settled, (_, op) in self._ours.items() if op == "WRITE"]:
            stopped = write.halt(max(HALT_LEAST_S, deadline - time.monotonic())) and stopped
        return stopped

    def _force_off(self, tokens: list[int], what: str) -> None:
        """A transfer of ours given up, still in NIXL's hands past its settle bounds (``base.nixl_settle``): the
        peer makes no progress on it (a READ or WRITE over UCX's TCP transport needs it for every byte), and it
        could move bytes of the caller's memory whenever the peer runs again. Its peer's agent is let go (NIXL
        disconnects, which is meant to end every transfer with the peer in flight; over UCX's TCP transport one
        can still land later: the known gap in ``docs/nixl.md``) and the link fails with it, unless its unlink
        cut the transfer (``cut_ours``): that link goes anyway, and the unlink goes on."""
        if not tokens or not self.engine.force_off(tokens[0]):
            return  # not in NIXL's hands (queued, or settled meanwhile): nothing to force
        if self._cut is not None:
            # Cut by the link's unlink (cut_ours): the link goes anyway, and what the unlink says to the peer (our
            # UNLINK, or our answer to its own) still goes out once NIXL let go of the transfer.
            log.warning("%s: cut by the unlink of the link to cluster %s, its NIXL transfer did not stop within its "
                        "settle bound; the peer's NIXL agent was let go", what, self.cluster_id)
            return
        if self._lost is not None:
            self._lost(LLMException(f"{what}: cluster {self.cluster_id} made no progress on a given-up NIXL transfer "
                                    f"in its settle bound; its NIXL agent was let go, and the link with it",
                                    status_code=LLMStatusCode.LLM_LINK_FAILED))
        # Another link to that endpoint that loaded its agent before the worker lets go of it fails then
        # (NixlAgent._let_go), not here: the force may let nothing go (the transfer settles first), and a link
        # named meanwhile may load it only after.

    def let_go_later(self) -> None:
        """From the worker: NIXL let go of this link's peer agent (``NixlAgent._let_go``); the link fails on the
        loop."""
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the link went with it
            self._loop.call_soon_threadsafe(self._let_go)

    def _let_go(self) -> None:
        if not self.closed and self._lost is not None and self._cut is None:  # (a link being unlinked goes anyway)
            self._lost(LLMException(f"cluster {self.cluster_id}: its NIXL agent was let go for a given-up transfer "
                                    f"of a link to it, and this link with it",
                                    status_code=LLMStatusCode.LLM_LINK_FAILED))

    def failed(self, what: str, words: str) -> LLMException:
        """A NIXL transfer with this peer failed, in NIXL's ``words``: the peer's agent went away or the fabric
        failed, which the caller sees as the link's failure."""
        return LLMException(f"{what}: NIXL transfer with cluster {self.cluster_id} failed ({words})",
                            status_code=LLMStatusCode.LLM_LINK_FAILED)

    def expect_push(self, req_id: int, what: str) -> asyncio.Future:
        """The future of the peer's WRITE notification for push ``req_id``."""
        engine, name = self.engine, self.name
        assert name is not None, "expect_push is for a usable peer (serves() checked it)"
        message = notif_for(self.tag, req_id)
        return self.agent.run(lambda t: engine.expect_notif(t, name, message), what)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.agent.peers.discard(self)
        for fut in list(self._pending):
            fut.cancel()
        self.granted.close()
        self._drop_ledger()
        self.revocations.close()  # the peer is gone: nothing of it reads through this link
        caches, self.caches = self.caches, {}
        for remote in caches.values():
            self._drop(remote)
        if not self.ready.done():
            self.ready.set_result(False)
        name = self.name
        if name is not None:
            def remove(agent: Any) -> None:
                # Read on the worker, after any load of it already queued. Not while a newer link to the same
                # endpoint uses its agent: that link's load found it still loaded (a transfer of ours deferred this).
                if self.agent_loaded and name not in [peer.name for peer in list(self.agent.peers)]:
                    with contextlib.suppress(Exception):  # let go already (NixlEngine.force_off)
                        agent.remove_remote_agent(name.decode())

            try:
                self.engine.release_when_idle((name,), remove)
            except LLMException:
                pass
