"""The host backend: the device backend interface with host memory and native copy queues as its "device".

``aio.DeviceType=host`` opens it. It is what CI runs every device path on:
``Placement.DEVICE`` caches live in host memory, but they are device caches
in every other respect. Their bytes move only through streams, each stream
is an ordered queue of native copies run by a thread of its own
(``_core.HostStream``), and completions come from the core's
:class:`~aio_datadist._core.StreamNotifier` (backend ``"host"``) through the
same completion records as CUDA's ``cuLaunchHostFunc`` and Ascend's
``aclrtLaunchCallback``. Staging, the staging plane, layer-wise transfers
with stream-recorded layers, failure paths and cancellation are therefore
the same code on a CPU as on a GPU; only the symbol tables and the stream
calls differ.

Same-host exports (``devices/ipc.py``) work as CUDA's do, with a sealed
memfd standing in for the driver's shareable handle: a library-allocated
device cache lives in a sealed memfd region, a peer receives it opened
read-only and maps it ``PROT_READ``, and a pull is one batched copy out of
that mapping on the puller's copy stream.

It is a test and development backend: it is slower than host caches (each
copy is staged through chunk buffers like device memory) and gives nothing
a host cache does not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from aio_datadist import _core
from aio_datadist.devices.backend import DeviceBackend, carve, shared_bytes
from aio_datadist.devices.host import PAGE_SIZE, HostRegion, ReadOnlyMapping, check_sealed, round_up
from aio_datadist.devices.ipc import ExportInvalid, IpcUnavailable
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import CacheDesc

__all__ = ["HostBackend"]


class HostBackend(DeviceBackend):
    """Device caches in host memory, moved by :class:`~aio_datadist._core.HostStream` queues."""

    kind = "host"
    ipc_read_only_enforced = True  # a sealed memfd handed over opened read-only: the kernel refuses PROT_WRITE

    def __init__(self, device: torch.device, queue: _core.CompletionQueue) -> None:
        self._current = threading.local()
        self._streams: list[_core.HostStream] = []
        #: The stream callers' work runs on unless they pick another (what torch calls the current stream).
        self.default_stream = self.new_stream()
        try:
            super().__init__(device, queue)
        except BaseException:
            for stream in self._streams:
                stream.close()
            raise

    @classmethod
    def open(cls, device_id: int | None, queue: _core.CompletionQueue) -> HostBackend:
        return cls(torch.device("cpu"), queue)

    def new_stream(self) -> _core.HostStream:
        """A new stream of this backend (closed with it)."""
        stream = _core.HostStream()
        self._streams.append(stream)
        return stream

    def _new_stream(self) -> _core.HostStream:
        return self.new_stream()

    def _handle(self, stream: _core.HostStream) -> int:
        return stream.handle

    def current_stream(self) -> _core.HostStream:
        return getattr(self._current, "stream", None) or self.default_stream

    @contextlib.contextmanager
    def _use(self, stream: _core.HostStream) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return self._use(stream)

    def allocate(self, desc: CacheDesc) -> list[torch.Tensor]:
        return self.allocate_shared(desc)[0]

    def allocation_bytes(self, desc: CacheDesc) -> int:
        return max(round_up(shared_bytes(desc)), PAGE_SIZE)  # a sealed memfd of whole pages (HostRegion)

    def allocate_shared(self, desc: CacheDesc) -> tuple[list[torch.Tensor], HostExport]:
        try:
            region = HostRegion(shared_bytes(desc), "aio_datadist.device")
        except (OSError, MemoryError) as exc:
            raise LLMException(f"allocating {shared_bytes(desc)} bytes for a host-backend device cache failed: "
                               f"{exc}", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY) from exc
        return carve(desc, region.tensor(0, torch.uint8, (region.nbytes,))), HostExport(region)

    def ipc_unavailable(self) -> str | None:
        return None

    def ipc_import(self, kind: str, identity: bytes, fd: int, nbytes: int, *, whole: bool = False) -> ReadOnlyMapping:
        if kind != self.kind:
            raise IpcUnavailable(f"the peer's device caches are {kind} memory, ours are {self.kind} memory")
        try:
            check_sealed(fd, nbytes, whole=whole)
        except ValueError as exc:
            raise ExportInvalid(str(exc)) from None
        return ReadOnlyMapping(fd, nbytes)

    @property
    def batch_copies(self) -> bool:
        return True

    def memcpy_batch(self, dsts: Any, srcs: Any, sizes: Any) -> int:
        # Like cuMemcpyBatchAsync: on the copy stream, in order after what is already there.
        return self.stream.enqueue_copies(dsts, srcs, sizes)

    def close(self, timeout_s: float = 30.0) -> bool:
        if self.closed:
            return True
        if not super().close(timeout_s):
            return False  # a stream is stuck (a test's gate): its thread runs the copies once it goes on
        for stream in self._streams:
            stream.close()
        self._streams.clear()
        return True


class HostExport:
    """A host-backend device cache's sealed memfd region; peers receive its read-only fd."""

    __slots__ = ("region", "address", "nbytes")

    def __init__(self, region: HostRegion) -> None:
        self.region = region
        self.address = region.address
        self.nbytes = region.nbytes

    @property
    def fd(self) -> int:
        return self.region.fd
