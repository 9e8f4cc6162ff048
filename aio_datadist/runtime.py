"""What an initialised LLMDataDist owns: the core engines, completions, caches.

Built by ``LLMDataDist.init`` and torn down by ``finalize``; the manager and
the link layer reach their engines through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import torch

from aio_datadist import _core
from aio_datadist._completion import Completions
from aio_datadist.arrivals import Arrivals
from aio_datadist.cache import CacheRegistry
from aio_datadist.devices import select_device
from aio_datadist.options import Settings
from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist.devices.staging import DeviceStaging
    from aio_datadist.stats import Observer

__all__ = ["Runtime", "select_device"]

log = logging.getLogger(__name__)
#: How long ``finalize`` waits, without blocking the loop, for native work (device copies above all) to end.
QUIESCE_S = 30.0
QUIESCE_POLL_S = 0.005
#: Device memory whose work never ended (a device stuck past QUIESCE_S): kept for the process's life,
#: since freeing it would let the device write memory handed out again.
ABANDONED: list[Any] = []


class Runtime:
    """Engines and registries of one initialised LLMDataDist."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = CacheRegistry(settings.registered_memory_cap)
        self.arrivals = Arrivals()
        #: Who hears of transfers and links (``stats.Observer``); the endpoint replaces it with its own list.
        self.observers: list[Observer] = []
        #: The event loop the endpoint was initialised on (set by ``LLMDataDist.init``).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.links_up = 0  # links that came up, and went down, since init (LLMDataDist.stats)
        self.links_down = 0
        self.queue = _core.CompletionQueue()
        self._staging: DeviceStaging | None = None
        #: Bytes of peers' same-host pushes copied on the loop's thread in the loop's current pass
        #: (``transport.same_host``: at most ``INLINE_COPY_MAX`` a pass, the rest go to the copy threads).
        self.inline_spent = 0
        #: What the last :meth:`quiesce` found: True idle, False the device still busy at its bound, None none ran.
        self._quiesced: bool | None = None
        try:
            self.devices = select_device(settings.device_type, settings.device_id, self.queue)
            if self.devices is not None:
                self.devices.ipc_policy = settings.device_ipc
            self.device = torch.device("cpu") if self.devices is None else self.devices.device
            # Device caches reach peers through the staging plane (transport/staging.py).
            self.registry.peers_see_device_caches = self.devices is not None
            self.completions = Completions(self.queue)
            self.copier = _core.HostCopyEngine(self.queue, threads=settings.copy_threads)
            try:
                self.sockets = _core.SocketEngine(self.queue)
            except BaseException:
                self.copier.close()
                raise
        except BaseException:
            devices = getattr(self, "devices", None)  # unset when select_device raised
            if devices is not None:
                devices.close()
            self.queue.close()
            raise

    def default_timeout_ms(self) -> int:
        return self.settings.sync_kv_timeout_ms

    @property
    def staging(self) -> DeviceStaging:
        """The page-locked chunk buffers device caches stage through (made on first use)."""
        if self.devices is None:
            raise AssertionError("host caches need no staging")
        if self._staging is None:
            from aio_datadist.devices.staging import DeviceStaging

            self._staging = DeviceStaging(self.completions, self.devices, buffers=self.settings.staging_buffers)
        return self._staging

    def idle(self) -> bool:
        """Whether no device work may still run (host copy and socket jobs are stopped by ``close`` itself,
        at once: they are not waited for)."""
        return self.devices is None or not self.devices.busy()

    def on_home_thread(self, call: str) -> None:
        """Refuse ``call`` (``LLM_FAILED``, nothing changed) while :attr:`loop` runs and this is not it: the
        registry's changes reach that loop's objects (push watches, the transfers a release cuts, the same-host
        offers a new cache sends), which only its own thread may touch; from another, the loop is not woken and a
        waiter sleeps on. With that loop not running (before it, between runs, closed) any thread may call."""
        home = self.loop
        if home is None or not home.is_running():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not home:
            raise LLMException(f"{call} runs on the event loop the LLMDataDist was initialised on while that loop "
                               "runs (its push watches, transfers and links live there); call it from that loop",
                               status_code=LLMStatusCode.LLM_FAILED)

    async def quiesce(self, bound_s: float | None = None) -> bool:
        """Wait, without blocking the loop, until :meth:`idle` (at most ``bound_s``, ``QUIESCE_S`` by default);
        whether it is.

        ``finalize`` runs this before :meth:`close`, whose waits block: so they find nothing left to wait
        for, and a slow device (a long kernel ahead of our copies) holds up only this endpoint."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (QUIESCE_S if bound_s is None else bound_s)
        while not self.idle():
            if loop.time() >= deadline:
                self._quiesced = False
                return False
            await asyncio.sleep(QUIESCE_POLL_S)
        self._quiesced = True
        return True

    def close(self) -> None:
        """Stop the engines, fail what still waits, release every cache."""
        self.arrivals.close()
        self.sockets.close()
        self.copier.close()
        stuck = False
        if self.devices is not None:
            # Every record the device still owes arrives before the queue goes, unless the device is stuck:
            # after quiesce, there is nothing to wait for here unless it was stuck past QUIESCE_S already.
            # A device found idle by quiesce is not stuck: a call still running (a staged transfer's next chunk)
            # may have enqueued work since, which it gets through like any other.
            stuck = not self.devices.close(0.0 if self.devices.busy() and self._quiesced is not True else 30.0)
        if stuck:
            # What the queued work may still touch: the device caches, what its completions keep (chunk
            # buffers, peers' mappings) and what failed submissions' copies touch (the backend holds it); the
            # completions are failed below, but nothing is freed.
            kept = self.registry.device_memory()
            ABANDONED.append((kept, self.completions.keepalives(), self.devices))  # the backend: its held memory
            log.error("device work enqueued by this endpoint did not end; its %d device caches and the buffers "
                      "that work uses are kept for the life of the process instead of freed under it", len(kept))
        if self._staging is not None:
            self._staging.close()
        self.completions.close()
        self.queue.close()
        self.registry.clear()
