"""CUDA device caches a same-host peer can map read-only: the driver's virtual memory management calls.

A library-allocated CUDA cache is one physical allocation made with
``cuMemCreate`` for POSIX fd handles, mapped into a reserved range here
(``cuMemAddressReserve``, ``cuMemMap``) and made read-write for our device
only (``cuMemSetAccess``). ``cuMemExportToShareableHandle`` gives the fd a
peer receives over the share socket. The peer imports it
(``cuMemImportFromShareableHandle``), maps it into a range of its own and
grants its device ``CU_MEM_ACCESS_FLAGS_PROT_READ`` only: a stray write from
the peer faults instead of landing in our cache. That is the importer's
choice; a peer running code of its own could grant itself more (see
``docs/security.md``).

Why IPC cannot be used is an :class:`~aio_datadist.devices.ipc.IpcUnavailable`
with the driver's words: no VMM or fd handles on the device
(``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``,
``..._HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``), the exporting GPU not
visible here or not peer-accessible from ours (``cuDeviceCanAccessPeer``), or
a driver that refuses the import or the mapping (as VMs without P2P do).
Every failure undoes what was done before it, in reverse order.

The calls go through ctypes on the same library the core's ``CudaDriver``
opened (``libcuda.so.1``, or a stand-in in tests: ``tests/fakes/fake_cuda.c``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

from aio_datadist.devices.host import give_back_peer_mapping, take_peer_mapping
from aio_datadist.devices.ipc import IDENTITY_BYTES, IpcUnavailable

__all__ = ["VmmAllocation", "VmmDriver", "VmmMapping"]

log = logging.getLogger("aio_datadist.devices")

_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_POSIX_FD_SUPPORTED = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
PROT_READ = 1  # CU_MEM_ACCESS_FLAGS_PROT_READ
PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetCount": (ctypes.POINTER(ctypes.c_int),),
    "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDeviceGetUuid": (ctypes.c_char_p, ctypes.c_int),
    "cuDeviceCanAccessPeer": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
    "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
    "cuCtxPushCurrent_v2": (ctypes.c_void_p,),
    "cuCtxPopCurrent_v2": (ctypes.POINTER(ctypes.c_void_p),),
    "cuMemGetAllocationGranularity": (ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_AllocationProp),
                                      ctypes.c_int),
    "cuMemCreate": (ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.POINTER(_AllocationProp), ctypes.c_ulonglong),
    "cuMemRelease": (_u64,),
    "cuMemAddressReserve": (ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, ctypes.c_ulonglong),
    "cuMemAddressFree": (_u64, ctypes.c_size_t),
    "cuMemMap": (_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, ctypes.c_ulonglong),
    "cuMemUnmap": (_u64, ctypes.c_size_t),
    "cuMemSetAccess": (_u64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t),
    "cuMemExportToShareableHandle": (ctypes.c_void_p, _u64, ctypes.c_int, ctypes.c_ulonglong),
    "cuMemImportFromShareableHandle": (ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int),
}


class DriverError(OSError):
    """A driver call failed: ``code`` is its CUresult."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name}")
        self.call = call
        self.code = code


class VmmDriver:
    """The driver's VMM entry points (one per library; ``cuInit`` already run or run here)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.library = library
        try:
            lib = ctypes.CDLL(library)
        except OSError as exc:
            raise IpcUnavailable(f"{library} cannot be loaded: {exc}") from None
        self._fn: dict[str, Callable[..., int]] = {}
        missing = []
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                missing.append(name)
                continue
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self._fn[name] = fn
        #: Why this driver cannot export or import at all, or None.
        self.missing = f"{library} has no {', '.join(missing)} (a CUDA 11.1 or newer driver is needed)" \
            if missing else None
        if self.missing is None:
            self._call("cuInit", 0)

    def _name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._fn["cuGetErrorName"](code, ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return f"CUresult {code}"

    def _call(self, name: str, *args: Any) -> None:
        code = self._fn[name](*args)
        if code != 0:
            raise DriverError(name, code, self._name(code))

    def _device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev.value

    def _attribute(self, attribute: int, ordinal: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), attribute, self._device(ordinal))
        return value.value

    def _in_context(self, ordinal: int, body: Callable[[], Any]) -> Any:
        """Run ``body`` with ``ordinal``'s primary context current (retained for the call)."""
        dev = self._device(ordinal)
        ctx = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        try:
            self._call("cuCtxPushCurrent_v2", ctx)
            try:
                return body()
            finally:
                popped = ctypes.c_void_p()
                self._fn["cuCtxPopCurrent_v2"](ctypes.byref(popped))
        finally:
            self._fn["cuDevicePrimaryCtxRelease_v2"](dev)

    # -- what a link decides on ---------------------------------------------------------

    def unavailable(self, ordinal: int) -> str | None:
        """Why device ``ordinal`` can neither export nor import caches, or None when it can."""
        if self.missing is not None:
            return self.missing
        try:
            if not self._attribute(_VMM_SUPPORTED, ordinal):
                return f"CUDA device {ordinal} has no virtual memory management"
            if not self._attribute(_POSIX_FD_SUPPORTED, ordinal):
                return f"CUDA device {ordinal} cannot export memory as POSIX file descriptors"
        except DriverError as exc:
            return str(exc)
        return None

    def identity(self, ordinal: int) -> bytes:
        """Device ``ordinal``'s UUID (what peers compare to find the GPU an export lives on)."""
        uuid = ctypes.create_string_buffer(IDENTITY_BYTES)
        self._call("cuDeviceGetUuid", uuid, self._device(ordinal))
        return uuid.raw

    def ordinal_of(self, identity: bytes) -> int | None:
        """The ordinal of the visible device with UUID ``identity``, or None."""
        count = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(count))
        for ordinal in range(count.value):
            if self.identity(ordinal) == identity:
                return ordinal
        return None

    def reachable(self, ordinal: int, identity: bytes) -> str | None:
        """Why memory on the GPU named ``identity`` cannot be read from device ``ordinal``, or None."""
        theirs = self.ordinal_of(identity)
        if theirs is None:
            # The identity is the peer's word, different in every record it likes: kept out of the reason, which
            # links keep and log (``LocalShare.say_ipc_off``), so a peer cannot grow either with it.
            log.debug("the peer's GPU %s is not visible in this process", identity.hex())
            return "the peer's GPU is not visible in this process"
        if theirs == ordinal:
            return None
        can = ctypes.c_int()
        self._call("cuDeviceCanAccessPeer", ctypes.byref(can), self._device(ordinal), self._device(theirs))
        if not can.value:
            return f"no P2P access from CUDA device {ordinal} to device {theirs}, where the peer's caches live"
        return None

    # -- exports --------------------------------------------------------------------------

    def _prop(self, ordinal: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _ALLOCATION_PINNED
        prop.requestedHandleTypes = _HANDLE_POSIX_FD
        prop.location = _Location(_LOCATION_DEVICE, ordinal)
        return prop

    def granularity(self, ordinal: int) -> int:
        value = ctypes.c_size_t()
        prop = self._prop(ordinal)
        self._call("cuMemGetAllocationGranularity", ctypes.byref(value), ctypes.byref(prop),
                   _GRANULARITY_RECOMMENDED)
        return value.value

    def allocate(self, ordinal: int, nbytes: int) -> VmmAllocation:
        """``nbytes`` (rounded up to the granularity) on device ``ordinal``, read-write here, exported as an fd."""
        def body() -> VmmAllocation:
            grain = self.granularity(ordinal)
            size = max(grain, (nbytes + grain - 1) // grain * grain)
            prop = self._prop(ordinal)
            handle = _u64()
            self._call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
            undo: list[Callable[[], Any]] = [lambda: self._fn["cuMemRelease"](handle)]
            try:
                fd = ctypes.c_int(-1)
                self._call("cuMemExportToShareableHandle", ctypes.byref(fd), handle, _HANDLE_POSIX_FD, 0)
                undo.append(lambda: os.close(fd.value))
                address = self._map(ordinal, handle, size, PROT_READWRITE, undo)
            except BaseException:
                for step in reversed(undo):
                    step()
                raise
            self._fn["cuMemRelease"](handle)  # the mapping holds the memory from here on
            return VmmAllocation(self, ordinal, address, size, fd.value)

        return self._in_context(ordinal, body)

    def _map(self, ordinal: int, handle: Any, size: int, flags: int, undo: list[Callable[[], Any]]) -> int:
        address = _u64()
        self._call("cuMemAddressReserve", ctypes.byref(address), size, 0, 0, 0)
        undo.append(lambda: self._fn["cuMemAddressFree"](address, size))
        self._call("cuMemMap", address, size, 0, handle, 0)
        undo.append(lambda: self._fn["cuMemUnmap"](address, size))
        access = _AccessDesc(_Location(_LOCATION_DEVICE, ordinal), flags)
        self._call("cuMemSetAccess", address, size, ctypes.byref(access), 1)
        return address.value

    def import_fd(self, ordinal: int, identity: bytes, fd: int, nbytes: int) -> VmmMapping:
        """Map a peer's exported fd of ``nbytes`` read-only for device ``ordinal``.

        The mapping counts against the peers' mapping budget of the process (``host.MAX_PEER_MAPPED_BYTES``,
        ``host.MAX_PEER_MAPPINGS``) as a host import does, from before the import until it is unmapped.

        :raises IpcUnavailable: with the reason (the GPU is not reachable, the driver refuses the import, the
            mapping or read access; the export may also be smaller than the peer declared).
        :raises OSError: ``ENOMEM``, nothing imported: peers' mappings would take more than the budget (the
            share that sent it is dropped, as for a host region past it).
        """
        why = self.unavailable(ordinal)
        if why is not None:
            raise IpcUnavailable(why)

        def body() -> VmmMapping:
            problem = self.reachable(ordinal, identity)
            if problem is not None:
                raise IpcUnavailable(problem)
            take_peer_mapping(nbytes)  # OSError past the budget, before the driver reserves anything
            undo: list[Callable[[], Any]] = [lambda: give_back_peer_mapping(nbytes, room=False)]
            try:
                handle = _u64()
                self._call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
                           _HANDLE_POSIX_FD)
                undo.append(lambda: self._fn["cuMemRelease"](handle))
                address = self._map(ordinal, handle, nbytes, PROT_READ, undo)
            except BaseException:
                for step in reversed(undo):
                    step()
                raise
            self._fn["cuMemRelease"](handle)
            return VmmMapping(self, address, nbytes)  # gives the budget back once unmapped

        try:
            return self._in_context(ordinal, body)
        except DriverError as exc:
            raise IpcUnavailable(f"the driver refused to map a peer's device cache: {exc}") from None

    def _unmap(self, address: int, size: int) -> None:
        self._fn["cuMemUnmap"](address, size)
        self._fn["cuMemAddressFree"](address, size)


class VmmAllocation:
    """One exported allocation, mapped read-write here; unmapped and its fd closed when collected."""

    __slots__ = ("_driver", "ordinal", "address", "nbytes", "_fd", "__weakref__")

    def __init__(self, driver: VmmDriver, ordinal: int, address: int, nbytes: int, fd: int) -> None:
        self._driver = driver
        self.ordinal = ordinal
        self.address = address
        self.nbytes = nbytes
        self._fd = fd

    @property
    def fd(self) -> int:
        return self._fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.address:
            self._driver._unmap(self.address, self.nbytes)
            self.address = 0

    def __del__(self) -> None:
        self.release()


class VmmMapping:
    """A peer's export mapped read-only here; unmapped at collection (copies keep it alive until done), when the
    peers' mapping budget it took (:meth:`VmmDriver.import_fd`) is given back."""

    __slots__ = ("_driver", "address", "nbytes", "_base", "view_maker", "__weakref__")

    def __init__(self, driver: VmmDriver, address: int, nbytes: int) -> None:
        self._driver = driver
        self.address = self._base = address
        self.nbytes = nbytes
        #: Builds a tensor view of device memory (set by the CUDA backend; torch is not needed here).
        self.view_maker: Callable[[int, int, Any], Any] | None = None

    def view(self, offset: int, nbytes: int) -> Any:
        if self.view_maker is None or not self.address or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError("no view of this mapping")
        return self.view_maker(self.address + offset, nbytes, self)

    def close(self) -> None:
        self.address = 0

    def __del__(self) -> None:
        if self._base:
            base, self._base = self._base, 0
            try:
                self._driver._unmap(base, self.nbytes)
            finally:
                give_back_peer_mapping(self.nbytes)
