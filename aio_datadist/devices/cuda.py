"""The CUDA backend: torch CUDA streams, the driver's host functions, page-locked host caches.

Opening it checks, in order, that the NVIDIA driver loads (``libcuda.so.1``,
through the core), that torch is a CUDA build that sees a device, and that
the configured device exists; each missing piece is its own
``LLM_FEATURE_NOT_ENABLED`` message.

Library-allocated caches are driver VMM allocations a same-host peer can map
read-only (``devices/cuda_vmm.py``), wrapped as torch tensors through the CUDA
array interface; where the device or driver cannot export, they come from
torch's allocator and take the staging plane.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import warnings
from typing import Any

import torch

from aio_datadist import _core
from aio_datadist._checks import param_invalid
from aio_datadist.devices.backend import DeviceBackend, carve, feature_not_enabled, shared_bytes
from aio_datadist.devices.cuda_vmm import DriverError, VmmAllocation, VmmDriver, VmmMapping
from aio_datadist.devices.ipc import IpcUnavailable
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import CacheDesc

log = logging.getLogger("aio_datadist.devices")
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY

__all__ = ["CudaBackend", "HostPin", "load_driver"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and by kernels through UVA.
_REGISTER_FLAGS = 1 | 2


def load_driver() -> _core.CudaDriver:
    """The process's CUDA driver; ``LLM_FEATURE_NOT_ENABLED`` naming what is missing."""
    try:
        return _core.cuda_driver()
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            raise feature_not_enabled(f"option 'aio.DeviceType' is 'cuda', but {exc.strerror}") from exc
        raise


class HostPin:
    """Keeps a host mapping page-locked (``cudaHostRegister``) until collected.

    It holds the mapping itself, so the memory cannot be unmapped before it
    is unregistered; a cache holds its pin as long as the cache object (and
    so every copy in flight that keeps the cache alive) exists.
    """

    __slots__ = ("_mapping", "address", "nbytes", "device_address")

    def __init__(self, mapping: Any, address: int, nbytes: int, driver: _core.CudaDriver | None = None,
                 device: int = 0) -> None:
        self._mapping = None
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_FLAGS)
        if int(err) != 0:
            raise LLMException(f"page-locking {nbytes} bytes of host cache memory failed (cudaError {int(err)})",
                               status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
        self._mapping = mapping
        self.address = address
        self.nbytes = nbytes
        #: Where kernels on the device reach this memory: the host address itself where the device can
        #: use host pointers for registered memory, else the mapped device pointer the driver gives.
        self.device_address = address
        if driver is not None and not driver.can_map_host(device):
            try:
                self.device_address = driver.host_device_pointer(device, address)
            except OSError as exc:
                torch.cuda.cudart().cudaHostUnregister(address)
                self._mapping = None
                raise LLMException(f"mapping the page-locked host cache for the device failed: {exc.strerror}",
                                   status_code=LLMStatusCode.LLM_FAILED) from exc

    def __del__(self) -> None:
        if self._mapping is not None:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._mapping = None


class CudaBackend(DeviceBackend):
    """Device caches on ``cuda:N``; completions through ``cuLaunchHostFunc``."""

    kind = "cuda"
    pins_tables = True

    def __init__(self, device: torch.device, queue: _core.CompletionQueue, driver: _core.CudaDriver) -> None:
        self.driver = driver
        self._vmm: VmmDriver | None = None
        self._ipc_off: str | None = ""
        super().__init__(device, queue)

    # -- same-host exports (devices/ipc.py, devices/cuda_vmm.py) --------------------------

    @property
    def vmm(self) -> VmmDriver:
        if self._vmm is None:
            self._vmm = VmmDriver(self.driver.library)
        return self._vmm

    def ipc_unavailable(self) -> str | None:
        if self._ipc_off == "":
            try:
                self._ipc_off = self.vmm.unavailable(self.device.index or 0)
            except IpcUnavailable as exc:
                self._ipc_off = str(exc)
        return self._ipc_off

    def ipc_identity(self) -> bytes:
        return self.vmm.identity(self.device.index or 0)

    def allocation_bytes(self, desc: CacheDesc) -> int:
        if self.ipc_export_refused() is not None or self.ipc_unavailable() is not None:
            return super().allocation_bytes(desc)
        try:
            grain = self.vmm.granularity(self.device.index or 0)  # what vmm.allocate rounds up to
        except DriverError:  # allocate_shared then falls back to torch's allocator too
            return super().allocation_bytes(desc)
        return max(grain, -(-shared_bytes(desc) // grain) * grain)

    def allocate_shared(self, desc: CacheDesc) -> tuple[list[torch.Tensor], VmmAllocation | None]:
        if self.ipc_export_refused() is not None or self.ipc_unavailable() is not None:
            return self.allocate(desc), None
        try:
            alloc = self.vmm.allocate(self.device.index or 0, shared_bytes(desc))
        except DriverError as exc:
            if exc.code == _OUT_OF_MEMORY:
                raise torch.OutOfMemoryError(str(exc)) from None
            log.warning("exportable device allocation failed (%s); this cache comes from torch's allocator and "
                        "takes the staging plane between same-host processes", exc)
            return self.allocate(desc), None
        return carve(desc, _device_tensor(alloc.address, alloc.nbytes, alloc, self.device)), alloc

    def ipc_import(self, kind: str, identity: bytes, fd: int, nbytes: int, *, whole: bool = False) -> VmmMapping:
        if kind != self.kind:
            raise IpcUnavailable(f"the peer's device caches are {kind} memory, ours are on {self.device}")
        mapping = self.vmm.import_fd(self.device.index or 0, identity, fd, nbytes)
        device = self.device
        mapping.view_maker = lambda address, n, owner: _device_tensor(address, n, owner, device)
        return mapping

    @classmethod
    def open(cls, device_id: int | None, queue: _core.CompletionQueue) -> CudaBackend:
        driver = load_driver()
        if torch.version.cuda is None:
            raise feature_not_enabled(f"option 'aio.DeviceType' is 'cuda', but torch {torch.__version__} is a "
                                      "CPU-only build: install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise feature_not_enabled("option 'aio.DeviceType' is 'cuda', but torch sees no CUDA device "
                                      f"(the driver reports {driver.device_count()})")
        index = 0 if device_id is None else device_id
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise param_invalid("device_id", f"CUDA device {index} does not exist ({count} visible)")
        device = torch.device("cuda", index)
        torch.cuda.init()
        return cls(device, queue, driver)

    def _new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def _handle(self, stream: torch.cuda.Stream) -> int:
        return int(stream.cuda_stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def pin_host(self, region: Any) -> HostPin | None:
        try:
            # the region's base tensor, not its mapping object: a tensor's storage keeps the mapping out of
            # cyclic garbage, so it cannot be unmapped (its finalizer) before the pin is unregistered
            return HostPin(region.base, region.address, region.nbytes, self.driver, self.device.index or 0)
        except LLMException as exc:
            # Still correct unpinned (batched copies take pageable memory, staging copies through pinned
            # chunks), only slower: say so rather than refuse the cache.
            warnings.warn(f"{exc}; this host cache stays pageable", RuntimeWarning, stacklevel=3)
            return None

    @property
    def batch_copies(self) -> bool:
        return self.driver.has_batch_copy

    def memcpy_batch(self, dsts: Any, srcs: Any, sizes: Any) -> int:
        try:
            return self.driver.memcpy_batch(self.device.index, self.stream_handle, dsts, srcs, sizes)
        except OSError as exc:
            raise LLMException(f"batched host<->device copy failed: {exc.strerror}",
                               status_code=LLMStatusCode.LLM_FAILED) from exc


class _DeviceMemory:
    """Device memory torch does not own, handed to ``torch.as_tensor`` through the CUDA array interface;
    the tensor keeps this object, and so ``owner`` (the allocation or mapping), alive."""

    def __init__(self, address: int, nbytes: int, owner: Any) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}
        self.owner = owner


def _device_tensor(address: int, nbytes: int, owner: Any, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``address`` that keeps ``owner`` alive."""
    return torch.as_tensor(_DeviceMemory(address, nbytes, owner), device=device)
