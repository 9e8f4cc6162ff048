"""What an initialised LLMDataDist owns: the core engines, completions, caches.

Built by ``LLMDataDist.init`` and torn down by ``finalize``; the manager and
the link layer reach their engines through it.
"""

from __future__ import annotations

import torch

from aio_datadist import _core
from aio_datadist._completion import Completions
from aio_datadist.arrivals import Arrivals
from aio_datadist.cache import CacheRegistry
from aio_datadist.config import Settings
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["Runtime", "select_device"]


def select_device(device_type: str, device_id: int | None) -> torch.device:
    """The torch device that ``Placement.DEVICE`` caches live on.

    ``auto`` and ``cpu`` give the CPU. CUDA and Ascend device caches are not
    built yet, so asking for them fails clearly instead of half-working.
    """
    if device_type in ("auto", "cpu"):
        return torch.device("cpu")
    raise LLMException(
        f"option 'aio.DeviceType': {device_type} device caches are not supported by this build yet; "
        "use 'cpu' (Placement.DEVICE caches then live in host memory)",
        status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)


class Runtime:
    """Engines and registries of one initialised LLMDataDist."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.device = select_device(settings.device_type, settings.device_id)
        self.registry = CacheRegistry(settings.registered_memory_cap)
        self.arrivals = Arrivals()
        self.queue = _core.CompletionQueue()
        try:
            self.completions = Completions(self.queue)
            self.copier = _core.HostCopyEngine(self.queue, threads=settings.copy_threads)
            try:
                self.sockets = _core.SocketEngine(self.queue)
            except BaseException:
                self.copier.close()
                raise
        except BaseException:
            self.queue.close()
            raise

    def default_timeout_ms(self) -> int:
        return self.settings.sync_kv_timeout_ms

    def close(self) -> None:
        """Stop the engines, fail what still waits, release every cache."""
        self.arrivals.close()
        self.sockets.close()
        self.copier.close()
        self.completions.close()
        self.queue.close()
        self.registry.clear()
