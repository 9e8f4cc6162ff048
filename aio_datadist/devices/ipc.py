"""Device cache exports for same-host peers: one fd per cache, mapped read-only by the peer.

A device backend that can share memory across processes allocates each
library-owned device cache as one exportable allocation
(:meth:`DeviceBackend.allocate_shared
<aio_datadist.devices.backend.DeviceBackend.allocate_shared>`) and hands a
same-host peer one file descriptor for it, over the link's authenticated
share socket (``transport/local.py``), as memfds are handed for host caches:

- the host backend: a sealed memfd of the cache, opened read-only; the peer
  maps it ``PROT_READ`` (the kernel refuses any writable mapping);
- CUDA: a driver allocation made with ``cuMemCreate`` for POSIX fd handles,
  exported with ``cuMemExportToShareableHandle``; the peer imports it and
  maps it with ``CU_MEM_ACCESS_FLAGS_PROT_READ`` only (``devices/cuda_vmm.py``).
  Unlike a sealed memfd this is our importer's choice, not the kernel's: a
  peer that runs code of its own could map the fd read-write. The
  allocation holds exactly the cache (never other tensors, as torch's CUDA
  IPC export of a whole allocator segment would).

The peer's side is a ``PeerDeviceCache`` (``devices/peer_cache.py``): the mapping plus the
geometry the owner declared, checked against the mapping's size before any
copy. A pull is then one batched device-to-device copy from it on the
puller's copy stream (``DeviceCopy``, ``devices/copies.py``).

Why a peer cannot map an export (no VMM or fd handles, the peer's GPU not
reachable from ours, a VM that refuses imports) is an
:class:`IpcUnavailable`: the link then moves device caches through the
staging plane and says why. An export that does not hold what its record
declares is an :class:`ExportInvalid`, which drops the share.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["IDENTITY_BYTES", "ExportInvalid", "IpcUnavailable", "PeerMapping", "SharedAllocation"]

#: The bytes that name the device an export lives on (a CUDA device's UUID).
IDENTITY_BYTES = 16


class IpcUnavailable(Exception):
    """This process cannot map a peer's device export; the reason says why (not the peer's fault)."""


class ExportInvalid(ValueError):
    """A device export that does not hold what its record declares (size, seals, kind)."""


class SharedAllocation(Protocol):
    """One exportable device allocation holding one cache (kept alive by the cache's tensors)."""

    #: Where the allocation starts in this process.
    address: int
    #: Its size, as a peer maps it (a multiple of the page or the driver's granularity).
    nbytes: int

    @property
    def fd(self) -> int:
        """What a same-host peer receives: a read-only memfd, or the driver's shareable handle."""
        ...


class PeerMapping(Protocol):
    """A peer's export mapped read-only into this process."""

    address: int
    nbytes: int

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` at ``offset`` as a uint8 tensor on our device (read it, never write it)."""
        ...

    def close(self) -> None:
        """Unmap (idempotent); a copy in flight keeps the mapping alive through its keepalive."""
        ...
