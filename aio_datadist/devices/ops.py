"""Local copies that involve a device cache: what ``copy_blocks``, ``copy_cache`` and ``swap_blocks`` run.

The manager validates the request and calls :func:`copy_rows` when either
cache is on the device. Device<->device rows go through one batched copy
(the Triton kernel on CUDA); host<->device rows through one driver batch
copy, or the staging pipeline where the driver has none. Either way the
coroutine resumes from the core's completion fd; nothing blocks or polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from aio_datadist._checks import param_invalid
from aio_datadist.cache import KvCache
from aio_datadist.devices.copies import DeviceCopy, cache_side, choose_method, kernel_side
from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist import _core
    from aio_datadist._completion import Completions
    from aio_datadist.devices.backend import DeviceBackend
    from aio_datadist.devices.staging import DeviceStaging

__all__ = ["DeviceRuntime", "copy_rows", "involves_device"]


class DeviceRuntime(Protocol):
    """What device copies use of an endpoint's engines (``runtime.Runtime`` is one).

    A protocol, so that the devices package stays below the runtime that builds it.
    """

    devices: DeviceBackend | None
    completions: Completions
    copier: _core.HostCopyEngine

    @property
    def staging(self) -> DeviceStaging: ...


def involves_device(*caches: KvCache) -> bool:
    return any(c.on_device for c in caches)


async def copy_rows(rt: DeviceRuntime, dst: KvCache, dst_rows: Sequence[int], src: KvCache, src_rows: Sequence[int],
                    offset: int, nbytes: int, timeout_ms: int, what: str, method: str | None = None,
                    host_jobs: set[int] | None = None, queued: list[bool] | None = None) -> int:
    """Copy ``nbytes`` at ``offset`` of every tensor's row pairs; returns the bytes moved.

    :param method: ``kernel``, ``torch``, ``batch`` or ``staged`` (default:
        the best the backend has, see ``devices/copies.py``).
    :param host_jobs: the tokens of the staged method's host copies running now (see ``swap_staged``).
    :param queued: gets ``True`` once the whole copy is queued on the device (one ``DeviceCopy``; not the staged
        method, which queues chunk after chunk): nothing more of it is queued afterwards.
    :raises LLMException: ``LLM_TIMEOUT`` after ``timeout_ms``; ``LLM_FAILED``
        when the device refuses the work.
    """
    backend = rt.devices
    if backend is None:
        raise AssertionError("device caches exist only with a device backend")
    for arg, cache in (("dst", dst), ("src", src)):
        if cache.on_device and cache.device != backend.device:
            raise param_invalid(arg, f"cache is on {cache.device}, this LLMDataDist uses {backend.device}")
    dst_side = cache_side(dst, dst_rows, offset, nbytes)
    src_side = cache_side(src, src_rows, offset, nbytes)
    method = method or choose_method(backend, dst_side, src_side,
                                     host_pinned=all(c.on_device or c._pin is not None for c in (dst, src)))
    if method == "kernel":
        if any(not c.on_device and c._pin is None for c in (dst, src)):
            # A kernel can reach host memory only where the driver mapped it; anything else is a device fault.
            raise param_invalid("method", "the copy kernel reaches host caches only when they are page-locked")
        if not dst.on_device:
            dst_side = kernel_side(dst_side, dst._pin)
        if not src.on_device:
            src_side = kernel_side(src_side, src._pin)
    if method == "staged":
        from aio_datadist.devices.staging import swap_staged

        try:
            async with asyncio.timeout(timeout_ms / 1000):
                return await swap_staged(rt.staging, rt.copier, dst, dst_rows, src, src_rows, offset, nbytes, what,
                                         host_jobs)
        except TimeoutError:
            raise LLMException(f"{what} timed out after {timeout_ms} ms",
                               status_code=LLMStatusCode.LLM_TIMEOUT) from None
    job = DeviceCopy(backend, dst_side, src_side, nbytes, method, keepalive=(dst, src))
    if queued is not None:
        queued.append(True)  # submitted by the run below, before it first waits
    # Queued device work cannot be recalled: a copy given up (timeout, cancel) still runs when the stream gets
    # there. Return only once it reported over (no bound: the stream does get there), so no byte lands afterwards.
    return await rt.completions.run(job.submit, job.cancel, timeout_ms=timeout_ms, what=what, keepalive=job)
