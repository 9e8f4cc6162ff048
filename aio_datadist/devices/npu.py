"""The Ascend NPU backend: torch_npu streams and ACL callbacks.

It differs from CUDA only in how streams are made and named and in the
driver the core's notifier loads (``libascendcl.so``: ``aclrtLaunchCallback``
served by one report thread per notifier). Copies take the shared torch path
(no Triton, no batched driver copies); host caches are not page-locked.

NOT RUN: no Ascend device or CANN runtime exists where this was written.
Only the absent-runtime errors were exercised (see docs/devices.md).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch

from aio_datadist import _core
from aio_datadist._checks import param_invalid
from aio_datadist.devices.backend import DeviceBackend, feature_not_enabled

__all__ = ["NpuBackend", "load_torch_npu"]


def load_torch_npu() -> Any:
    """``torch_npu``, imported on demand; ``LLM_FEATURE_NOT_ENABLED`` when it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise feature_not_enabled("option 'aio.DeviceType' is 'npu', but torch_npu is not installed "
                                  "(pip install 'aio_datadist[npu]' with a CANN toolkit)") from exc


class NpuBackend(DeviceBackend):
    """Device caches on ``npu:N``; completions through ``aclrtLaunchCallback``."""

    kind = "npu"

    @classmethod
    def open(cls, device_id: int | None, queue: _core.CompletionQueue) -> NpuBackend:
        load_torch_npu()
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise feature_not_enabled("option 'aio.DeviceType' is 'npu', but torch_npu sees no NPU device")
        index = 0 if device_id is None else device_id
        count = npu.device_count()
        if not 0 <= index < count:
            raise param_invalid("device_id", f"NPU device {index} does not exist ({count} visible)")
        # The notifier takes the calling thread's ACL context: make it this device's.
        npu.set_device(index)
        return cls(torch.device("npu", index), queue)

    def _new_stream(self) -> Any:
        return torch.npu.Stream(self.device)  # type: ignore[attr-defined]

    def _handle(self, stream: Any) -> int:
        return int(stream.npu_stream)

    def current_stream(self) -> Any:
        return torch.npu.current_stream(self.device)  # type: ignore[attr-defined]

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.npu.stream(stream)  # type: ignore[attr-defined]
