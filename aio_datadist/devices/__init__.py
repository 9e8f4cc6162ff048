"""Device backends: where cache memory lives and how it is copied.

This module is the factory: :func:`select_device` and :func:`open_backend`
pick a backend by its ``aio.DeviceType`` name and import its module
(``devices/cuda.py``, ``devices/npu.py``) on first use, so ``torch_npu`` or
the CUDA pieces load only when chosen. The interface both implement is
:class:`~aio_datadist.devices.backend.DeviceBackend`.

Kept light: every ``import aio_datadist.cache`` runs it (through
``devices/host.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from aio_datadist._checks import param_invalid

if TYPE_CHECKING:
    from aio_datadist import _core
    from aio_datadist.devices.backend import DeviceBackend

__all__ = ["DEVICE_KINDS", "HOST_KINDS", "open_backend", "select_device"]

# ``aio.DeviceType`` -> the module and class of its backend.
_BACKENDS = {
    "cuda": ("aio_datadist.devices.cuda", "CudaBackend"),
    "npu": ("aio_datadist.devices.npu", "NpuBackend"),
}
DEVICE_KINDS = tuple(_BACKENDS)
# The device types that keep ``Placement.DEVICE`` caches in host memory (no backend).
HOST_KINDS = ("auto", "cpu")


def open_backend(kind: str, device_id: int | None, queue: _core.CompletionQueue) -> DeviceBackend:
    """The backend for ``aio.DeviceType`` ``cuda`` or ``npu``.

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` naming what is missing
        (driver, device, torch build or torch_npu); ``LLM_PARAM_INVALID`` for a
        device id the machine does not have.
    """
    found = _BACKENDS.get(kind)
    if found is None:
        raise param_invalid("aio.DeviceType", f"expected one of {DEVICE_KINDS}, got {kind!r}")
    module, name = found
    backend: type[DeviceBackend] = getattr(importlib.import_module(module), name)
    return backend.open(device_id, queue)


def select_device(device_type: str, device_id: int | None, queue: _core.CompletionQueue) -> DeviceBackend | None:
    """The backend ``Placement.DEVICE`` caches live on, or None for host memory.

    ``auto`` and ``cpu`` keep device caches in host memory. ``cuda`` and
    ``npu`` open that device (``devices/cuda.py``, ``devices/npu.py``).

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` naming what is missing
        (driver, torch build, torch_npu, device); ``LLM_PARAM_INVALID`` for a
        device id the machine does not have.
    """
    if device_type in HOST_KINDS:
        return None
    return open_backend(device_type, device_id, queue)
