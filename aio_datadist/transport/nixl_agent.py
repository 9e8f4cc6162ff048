"""The NIXL agent of one endpoint: its caches registered with NIXL, its read ledger, its peers.

:class:`NixlAgent` owns the endpoint's :class:`~aio_datadist.transport.nixl_engine.NixlEngine` (the agent
and the worker thread that makes every NIXL call). It registers each cache of the endpoint with the agent
once (host caches as ``DRAM``, CUDA device caches as ``VRAM`` where a backend lists it: :func:`vram_off`),
keeps a registration while a peer's READ or WRITE against it may run, and offers registrations to the
per-link planes (``transport/nixl.py``), which it knows only through :class:`Peer`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from aio_datadist._settle import settle
from aio_datadist.status import LLMException
from aio_datadist.transport.ledger import LEDGER_BYTES, Ledger
from aio_datadist.transport.nixl_engine import NixlEngine, agent_name, row_descs
from aio_datadist.transport.nixl_grants import CALLER_MEMORY, REGISTRATION_MASK
from aio_datadist.transport.nixl_offers import too_many_descriptors

if TYPE_CHECKING:
    from aio_datadist.cache import KvCache
    from aio_datadist.runtime import Runtime

__all__ = ["SCRATCH_WORDS", "LocalCache", "NixlAgent", "Peer", "registration", "vram_off"]

log = logging.getLogger("aio_datadist.nixl")

#: How NIXL backends name device memory among their memory types (``get_backend_mem_types``).
VRAM_TYPES = frozenset({"VRAM", "VRAM_SEG"})
#: Words of our own that peers' ledger words are read into, one per read being confirmed at once.
SCRATCH_WORDS = 256


class Peer(Protocol):
    """What the agent needs of one link's NIXL plane (``nixl.NixlPeer``)."""

    name: bytes | None
    agent_loaded: bool

    def offer(self, entry: LocalCache) -> None: ...
    def withdraw(self, cache_id: int) -> None: ...
    def let_go_later(self) -> None: ...
    def close(self) -> None: ...


def vram_off(device_kind: str | None, mem_types: Mapping[str, Sequence[str]]) -> str | None:
    """Why this endpoint's device caches cannot be registered with NIXL as VRAM (None: they can).

    ``device_kind`` is the endpoint's device backend (``"cuda"``, ``"npu"``, ``"host"``; None without
    one); ``mem_types`` the memory types each of the agent's backends reports.
    """
    if device_kind is None:
        return None
    if device_kind != "cuda":
        return (f"the device caches are {device_kind} memory; NIXL registers CUDA device memory (VRAM) only")
    if not any(VRAM_TYPES.intersection(types) for types in mem_types.values()):
        listed = "; ".join(f"{b}: {', '.join(t) or 'none'}" for b, t in mem_types.items()) or "no backend"
        return f"no NIXL backend of this agent lists VRAM among its memory types ({listed})"
    return None


def registration(cache: KvCache, off: str | None) -> tuple[str, int, Callable[[Any], tuple]] | None:
    """How ``cache`` is registered with NIXL: its memory type, device id and the worker's work (given the
    NIXL agent: register the memory, prepare the local descriptor list over its rows; returns both and the
    agent's new metadata). Host caches are ``DRAM``; device caches ``VRAM`` on their GPU, or None (not
    registered) when ``off`` (:func:`vram_off`) says why they cannot be."""
    if cache.on_device and off is not None:
        return None
    mem, device = ("VRAM", cache.device.index or 0) if cache.on_device else ("DRAM", 0)
    lay = cache.layout
    extents = _extents(cache)

    def work(agent: Any) -> tuple[Any, Any, bytes]:
        descs = row_descs(lay.bases, lay.rows, lay.row_bytes, device)  # on the worker: up to MAX_DESCRIPTORS
        regs = agent.register_memory([(a, n, device, "") for a, n in extents], mem)
        try:
            dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        except Exception:
            agent.deregister_memory(regs)
            raise
        return regs, dlist, agent.get_agent_metadata()

    return mem, device, work


def _extents(cache: KvCache) -> list[tuple[int, int]]:
    """Memory to register for ``cache``: its region, or its tensors with neighbours merged."""
    region = cache.region
    if region is not None:
        return [(region.address, region.nbytes)]
    lay = cache.layout
    out: list[list[int]] = []
    for base in sorted(lay.bases):
        if out and out[-1][0] + out[-1][1] == base:
            out[-1][1] += lay.tensor_bytes
        else:
            out.append([base, lay.tensor_bytes])
    return [(a, n) for a, n in out]


class LocalCache:
    """One cache of ours registered with the agent. ``memory`` (the cache's tensors, taken when its registration
    started) keeps the memory allocated until the agent deregistered it: a registered cache lets go of its
    tensors when it is released (``cache._released``), while a peer's transfer may still use the registration."""

    __slots__ = ("cache", "memory", "regs", "dlist", "rows", "tensors", "row_bytes", "mem", "device")

    def __init__(self, cache: KvCache, regs: Any, dlist: Any, mem: str = "DRAM", device: int = 0,
                 memory: Any = None) -> None:
        lay = cache.layout
        self.cache: KvCache | None = cache  # None once released
        self.memory = memory
        self.regs = regs
        self.dlist = dlist
        self.mem = mem
        self.device = device
        self.rows = lay.rows
        self.tensors = lay.num_tensors
        self.row_bytes = lay.row_bytes


class NixlAgent:
    """The NIXL side of one initialised LLMDataDist: its agent, its caches, its peers."""

    def __init__(self, runtime: Runtime, cluster_id: int) -> None:
        self.runtime = runtime
        self.peers: set[Peer] = set()
        self.engine = NixlEngine(runtime.queue, agent_name(cluster_id), let_go=self._let_go)
        self.name = self.engine.name.encode()
        self.metadata = self.engine.metadata
        self.exposed = runtime.settings.remote_cache_accessible  # llm.EnableRemoteCacheAccessible
        self.local: dict[int, LocalCache] = {}
        self.serving: collections.Counter[int] = collections.Counter()
        # Registrations withdrawn while served, by cache id: more than one once a cache was refreshed
        # (registry.refresh: the same id registered again) before its first registration was released.
        self._doomed: dict[int, list[LocalCache]] = {}
        self._registering: dict[int, asyncio.Future] = {}
        # numbers each registration in its ledger word (GRANT_INFO), 31 bits below CALLER_MEMORY
        self._registrations = itertools.count(1)
        devices = runtime.devices
        #: Why device caches are not registered with NIXL (they take the staging plane), or None.
        self.vram_off = vram_off(None if devices is None else devices.kind, self.engine.mem_types)
        #: Device caches whose VRAM registration failed, with NIXL's words (they take the staging plane).
        self.vram_failed: dict[int, str] = {}
        if self.vram_off is not None:
            log.info("device caches are not registered with NIXL (they take the staging plane): %s", self.vram_off)
        #: Reads without asking: our ledger (what peers may read), and our words that peers' ledger words are
        #: read into, with the list over them and the free ones. None each: every pull asks.
        self.ledger: Ledger | None = None
        self.scratch: np.ndarray | None = None
        self.scratch_list: Any = None
        self._scratch_free: list[int] = []
        self._reads_regs: Any = None
        self._set_up_reads()

    def _set_up_reads(self) -> None:
        try:
            ledger = Ledger()
        except (OSError, MemoryError) as exc:
            log.info("no NIXL read ledger (%s): peers ask for every pull", exc)
            return
        scratch = np.zeros(SCRATCH_WORDS, dtype=np.uint64)
        base = scratch.ctypes.data

        def work(agent: Any) -> tuple[Any, Any, bytes]:
            regs = agent.register_memory([(ledger.address, LEDGER_BYTES, 0, ""), (base, scratch.nbytes, 0, "")],
                                         "DRAM")
            try:
                dlist = agent.prep_xfer_dlist("NIXL_INIT_AGENT", row_descs([base], SCRATCH_WORDS, 8), "DRAM")
            except Exception:
                agent.deregister_memory(regs)
                raise
            return regs, dlist, agent.get_agent_metadata()

        try:
            self._reads_regs, self.scratch_list, self.metadata = self.engine.call_now(work)
        except Exception as exc:  # NIXL raises its own exception types
            ledger.close()
            log.info("no NIXL read ledger (registering it failed: %s): peers ask for every pull", exc)
            return
        self.ledger, self.scratch = ledger, scratch
        self._scratch_free = list(range(SCRATCH_WORDS - 1, -1, -1))

    def take_scratch(self) -> int | None:
        """A word of ours to read a peer's ledger word into, or None when all are in use (the pull asks)."""
        return self._scratch_free.pop() if self._scratch_free else None

    def give_scratch(self, index: int) -> None:
        """Hand back a word no NIXL READ may still write."""
        self._scratch_free.append(index)

    def granted(self, cache_id: int) -> tuple[int, int, int] | None:
        """``(slot, model_id, word)`` of a cache of ours that peers may read without asking now, or None."""
        if self.ledger is None or (listed := self.ledger.entry(cache_id)) is None:
            return None
        return listed[0], listed[1], self.ledger.word(cache_id)

    # -- our caches ------------------------------------------------------------

    def register(self, cache: KvCache) -> None:
        """Register ``cache`` with the agent (on its worker); offer it to peers once done."""
        too_many = too_many_descriptors(cache.layout.num_tensors, cache.layout.rows)
        if too_many is not None:  # peers would refuse its OFFER: not registered, not offered
            if cache.on_device:
                self.vram_failed[cache.cache_id] = f"device cache {cache.cache_id}: {too_many}"
            log.info("cache %s is not registered with NIXL (%s); its transfers take %s", cache.cache_id, too_many,
                     "the staging plane" if cache.on_device else "TCP")
            return
        how = registration(cache, self.vram_off)
        if how is None:
            return  # not registered: its transfers take the staging plane (device_staged says why)
        mem, device, work = how
        memory = cache.tensors  # what keeps the memory allocated, whatever becomes of the cache, until deregistered
        fut = self.start(work, f"registering cache {cache.cache_id} with NIXL as {mem}", keepalive=(cache, memory))
        fut.add_done_callback(lambda f: self._registered(cache, f, mem, device, memory))
        self._registering[cache.cache_id] = fut

    async def registered(self, cache: KvCache) -> None:
        """Until ``cache``'s registration (started when it was allocated) has finished, failed or not."""
        fut = self._registering.get(cache.cache_id)
        if fut is not None:
            await asyncio.wait([fut])

    def _registered(self, cache: KvCache, fut: asyncio.Future, mem: str, device: int, memory: Any) -> None:
        # Not the cache's current registration any more when it was unregistered meanwhile (freed, hidden:
        # remote_accessible=False, or refreshed and registered anew): then it is released, never offered.
        current = self._registering.get(cache.cache_id) is fut
        if current:
            del self._registering[cache.cache_id]
        if fut.cancelled() or fut.exception() is not None:
            exc = None if fut.cancelled() else fut.exception()
            if cache.on_device:
                self.vram_failed[cache.cache_id] = f"registering device cache {cache.cache_id} as VRAM failed: {exc}"
                log.warning("%s; it takes the staging plane", self.vram_failed[cache.cache_id])
            else:
                log.warning("cache %s is not registered with NIXL (%s); it moves over TCP", cache.cache_id, exc)
            return
        regs, dlist, metadata = fut.result()
        entry = LocalCache(cache, regs, dlist, mem, device, memory)
        if not current or not cache.alive:
            self._release(entry)
            return
        self.local[cache.cache_id] = entry
        self.metadata = metadata
        model_id = self.runtime.registry.blocks_key_of(cache.cache_id)
        if (self.ledger is not None and self.exposed and mem == "DRAM" and model_id is not None
                and 0 < cache.cache_id < 1 << 32):  # peers may read it without asking from now on
            self.ledger.publish(cache.cache_id, model_id, (0 if cache.owned else CALLER_MEMORY)
                                | (next(self._registrations) & REGISTRATION_MASK) << 32 | cache.cache_id)
        for peer in list(self.peers):
            peer.offer(entry)

    def device_staged(self, cache: KvCache) -> str | None:
        """Why device ``cache`` is not moved by NIXL (the staging plane moves it), or None: a host cache,
        or a device cache registered as VRAM (or still registering)."""
        if not cache.on_device:
            return None
        return self.vram_off or self.vram_failed.get(cache.cache_id)

    def unregister(self, cache: KvCache) -> None:
        """Withdraw ``cache`` from peers now; deregister once no transfer can touch it (and every peer that
        could read it without asking said it no longer does)."""
        self.vram_failed.pop(cache.cache_id, None)
        if self.ledger is not None:
            self.ledger.retract(cache.cache_id)  # before anything else: a read confirmed from now on fails
        self._registering.pop(cache.cache_id, None)  # a registration still running is released when it ends
        entry = self.local.pop(cache.cache_id, None)
        if entry is None:
            return
        for peer in list(self.peers):
            peer.withdraw(cache.cache_id)
        if self.serving[cache.cache_id]:
            self._doomed.setdefault(cache.cache_id, []).append(entry)
        else:
            self._release(entry)

    def serve_begin(self, cache_id: int) -> None:
        """A peer's READ or WRITE against ``cache_id`` may start: keep it registered, make progress."""
        self.serving[cache_id] += 1
        self.engine.hold()

    def serve_end(self, cache_id: int) -> None:
        """A peer's READ or WRITE against ``cache_id`` settled."""
        self.engine.unhold()
        self.serving[cache_id] -= 1
        if self.serving[cache_id] <= 0:
            del self.serving[cache_id]
            for entry in self._doomed.pop(cache_id, ()):
                self._release(entry)

    def _release(self, entry: LocalCache) -> None:
        def work(agent: Any, entry: LocalCache = entry) -> None:
            entry.dlist.release()
            agent.deregister_memory(entry.regs)
            entry.cache = entry.memory = None  # the memory may go now

        try:
            self.engine.release_when_idle((id(entry.dlist),), work)
        except LLMException:
            pass  # closing: the agent goes with everything registered to it

    def offered(self, cache: Any) -> bool:
        return cache.cache_id in self.local and self.local[cache.cache_id].cache is cache

    # -- plumbing --------------------------------------------------------------

    def start(self, work: Any, what: str, keepalive: Any = None, discard: Any = None) -> asyncio.Future:
        """Run ``work(agent)`` on the engine; the future's result is its return value (given to
        ``discard(agent, value)`` instead if the future was cancelled while the work ran)."""
        engine = self.engine
        return self.run(lambda token: engine.call(token, work, discard), what, keepalive=keepalive, value=True)

    def run(self, submit: Any, what: str, *, keepalive: Any = None, settled: asyncio.Future | None = None,
            value: bool = False) -> asyncio.Future:
        """Submit engine work (``submit(token)``) through the runtime's completions.

        The future gives the work's return value (``value``) or the record's
        aux, and fails with NIXL's own words for the failure; cancelling it
        cancels the work in the engine.
        """
        engine = self.engine
        tokens: list[int] = []
        loop = asyncio.get_running_loop()
        over = settled if settled is not None else loop.create_future()
        said: dict[str, Any] = {}

        def take() -> None:
            # The record came: the engine's value and words for the token are taken now, whether or not anyone
            # still waits for them (they are kept until taken).
            if not said:
                token = tokens[0] if tokens else 0
                said["result"], said["error"] = engine.result(token), engine.error(token)

        def submit_token(token: int) -> None:
            tokens.append(token)
            submit(token)

        over.add_done_callback(lambda _: take())
        fut = self.runtime.completions.start(submit_token, engine.cancel, timeout_ms=None, what=what,
                                             keepalive=keepalive, settled=over)
        out = loop.create_future()

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                take()  # its record came
            result, text = said.get("result"), said.get("error")
            if out.done():
                return
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                exc = f.exception()
                assert isinstance(exc, LLMException), "completions fail with LLMException only"
                out.set_exception(LLMException(f"{what}: {text or exc}", status_code=exc.status_code))
            else:
                out.set_result(result if value else f.result())

        fut.add_done_callback(done)
        out.add_done_callback(lambda o: o.cancelled() and fut.cancel())
        return out

    async def aclose(self) -> None:
        """Close every peer and the engine, waiting for the engine's worker (``nixl_engine.CLOSE_LIMIT_S`` at most:
        in-flight transfers get their settle bounds there) in a thread, through cancellations (re-raised after):
        the loop runs on meanwhile (it stood still for it, 10 s for a transfer the owner made no progress on)."""
        self._close_peers()
        self.engine.stop()
        loop = asyncio.get_running_loop()
        joined = loop.create_future()

        def join() -> None:
            try:
                self.engine.join()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                    loop.call_soon_threadsafe(_set_done, joined)

        try:
            try:  # a thread of its own: the default executor may be shut down, or busy with the caller's jobs
                threading.Thread(target=join, name="aio_datadist-closing-nixl", daemon=True).start()
            except RuntimeError:  # no new thread at interpreter exit (an atexit finalize): wait here
                self.engine.join()
            else:
                await settle(joined, None)
        finally:
            self._closed()

    def _let_go(self, name: bytes) -> None:
        """On the worker, right after NIXL let go of agent ``name`` (a given-up transfer with it was forced off:
        ``NixlPeer._force_off``). NIXL knows an agent by its name, which every link to that endpoint shares (a
        relink after an unlink whose transfer was still in flight): what a link that loaded it before now prepared
        against it is invalid, so that link fails, saying why (its transfers would fail ``NIXL_ERR_NOT_FOUND`` on a
        link that looks up). A link whose load comes after this loads the agent afresh and stays up; nothing is
        failed where nothing was let go (the forced transfer settled first)."""
        for peer in list(self.peers):
            if peer.name == name and peer.agent_loaded:  # set on this worker by its load, which ran before
                peer.let_go_later()

    def _close_peers(self) -> None:
        for peer in list(self.peers):
            peer.close()
        if self._reads_regs is not None:
            regs, dlist = self._reads_regs, self.scratch_list

            def release(agent: Any) -> None:
                dlist.release()
                agent.deregister_memory(regs)

            try:
                self.engine.release_when_idle((id(dlist),), release)  # before the ledger's memory goes
            except LLMException:
                pass

    def _closed(self) -> None:
        self.local.clear()
        self._doomed.clear()
        self.scratch_list = self._reads_regs = None  # NIXL's handles hold its agent
        if self.ledger is not None:
            self.ledger.close()  # deregistered with the rest when the engine closed


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
