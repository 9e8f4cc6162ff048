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
import importlib.util
from typing import TYPE_CHECKING

from aio_datadist._checks import param_invalid

if TYPE_CHECKING:
    from aio_datadist import _core
    from aio_datadist.devices.backend import DeviceBackend

__all__ = ["DEVICE_KINDS", "HOST_KINDS", "auto_device", "open_backend", "select_device"]

# ``aio.DeviceType`` -> the module and class of its backend.
_BACKENDS = {
    "cuda": ("aio_datadist.devices.cuda", "CudaBackend"),
    "npu": ("aio_datadist.devices.npu", "NpuBackend"),
    "host": ("aio_datadist.devices.host_backend", "HostBackend"),
}
DEVICE_KINDS = tuple(_BACKENDS)
# The device type that keeps ``Placement.DEVICE`` caches in host memory (no backend).
HOST_KINDS = ("cpu",)


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


def auto_device() -> str:
    """What ``aio.DeviceType=auto`` means here: ``cuda`` where torch sees a CUDA device, else ``npu``
    where torch_npu is installed and sees an NPU, else ``cpu``."""
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            importlib.import_module("torch_npu")
        except Exception:  # a broken torch_npu install picks no NPU, as a missing one does
            return "cpu"
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return "npu"
    return "cpu"


def select_device(device_type: str, device_id: int | None, queue: _core.CompletionQueue) -> DeviceBackend | None:
    """The backend ``Placement.DEVICE`` caches live on, or None for host memory.

    ``cpu`` keeps device caches in host memory; ``auto`` is :func:`auto_device`.
    ``cuda`` and ``npu`` open that device (``devices/cuda.py``,
    ``devices/npu.py``); ``host`` opens the host backend
    (``devices/host_backend.py``), which CI runs the device paths on.

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` naming what is missing
        (driver, torch build, torch_npu, device); ``LLM_PARAM_INVALID`` for a
        device id the machine does not have.
    """
    if device_type == "auto":
        device_type = auto_device()
    if device_type in HOST_KINDS:
        return None
    return open_backend(device_type, device_id, queue)
