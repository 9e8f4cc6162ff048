"""``TensorDesc`` and ``Tensor``: LLM-DataDist's host tensor wrappers, kept for code that names them.

In LLM-DataDist they exist for ``KvCacheManager.get_cache_tensors``; here
that call returns torch tensors, which these wrap when a port still wants
``Tensor(...).numpy()``. A ``Tensor`` holds a numpy array or a torch tensor
(no copy) and its ``TensorDesc``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aio_datadist._checks import check_bool, check_instance, check_int, param_invalid
from aio_datadist.status import LLMException
from aio_datadist.types import DataType

__all__ = ["Tensor", "TensorDesc"]


class TensorDesc:
    """Data type and shape of a :class:`Tensor`.

    :param dtype: a :class:`DataType`.
    :param shape: a list or tuple of ints >= 0.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the argument (a
        ``TypeError`` too for a wrong type, as in LLM-DataDist).
    """

    __slots__ = ("_dtype", "_shape")

    def __init__(self, dtype: DataType, shape: Sequence[int]) -> None:
        self._dtype = check_instance("dtype", dtype, DataType)
        check_instance("shape", shape, (list, tuple))
        self._shape = [check_int(f"shape[{i}]", dim, lo=0) for i, dim in enumerate(shape)]

    @property
    def dtype(self) -> DataType:
        """The :class:`DataType`."""
        return self._dtype

    @property
    def shape(self) -> list[int]:
        """The shape, as a list."""
        return list(self._shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorDesc):
            return NotImplemented
        return (self._dtype, self._shape) == (other._dtype, other._shape)

    def __hash__(self) -> int:
        return hash((self._dtype, tuple(self._shape)))

    def __repr__(self) -> str:
        return f"TensorDesc(dtype={self._dtype}, shape={self._shape})"


def _is_text(array: np.ndarray) -> bool:
    return bool(np.issubdtype(array.dtype, np.str_) or np.issubdtype(array.dtype, np.bytes_))


class Tensor:
    """A host array with its :class:`TensorDesc` (LLM-DataDist's ``Tensor``).

    :param data: a C-contiguous ``numpy.ndarray`` (text arrays are ``DT_STRING``),
        a torch tensor, or another :class:`Tensor` (shares its data).
    :param tensor_desc: checked against ``data`` when given; derived from it otherwise.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the argument for an
        unsupported or non-contiguous array, or one that does not match
        ``tensor_desc``.
    """

    __slots__ = ("_data", "_desc")

    def __init__(self, data: Any, tensor_desc: TensorDesc | None = None) -> None:
        check_instance("data", data, (np.ndarray, torch.Tensor, Tensor))
        if tensor_desc is not None:
            check_instance("tensor_desc", tensor_desc, TensorDesc)
        if isinstance(data, Tensor):
            self._data: np.ndarray | torch.Tensor = data._data
            self._desc: TensorDesc = data._desc
            return
        if isinstance(data, torch.Tensor):
            try:
                dtype = DataType.from_torch(data.dtype)
            except LLMException:  # (which names its own argument, 'dtype')
                raise param_invalid("data", f"torch dtype {data.dtype} has no DataType") from None
            own = TensorDesc(dtype, list(data.shape))
            contiguous = data.is_contiguous()
        elif _is_text(data):
            own = TensorDesc(DataType.DT_STRING, list(data.shape))
            contiguous = data.flags.c_contiguous
        else:
            if not data.dtype.isnative:  # (big-endian data: read as ours, its bytes would mean other numbers)
                raise param_invalid("data", f"numpy dtype {data.dtype} is not in this machine's byte order")
            try:
                dtype = DataType.from_torch(torch.from_numpy(np.empty((0,), dtype=data.dtype)).dtype)
            except (TypeError, LLMException):
                raise param_invalid("data", f"numpy dtype {data.dtype} has no DataType") from None
            own = TensorDesc(dtype, list(data.shape))
            contiguous = data.flags.c_contiguous
        if not contiguous:
            raise param_invalid("data", "is not C-contiguous")
        if tensor_desc is not None and tensor_desc != own:
            raise param_invalid("tensor_desc", f"says {tensor_desc!r}, the data is {own!r}")
        self._data = data
        self._desc = own

    @property
    def tensor_desc(self) -> TensorDesc:
        """The :class:`TensorDesc`."""
        return self._desc

    def numpy(self, copy: bool = False) -> np.ndarray:
        """The data as a numpy array: a view unless ``copy`` (a ``DT_STRING`` tensor needs ``copy=True``).

        As in LLM-DataDist, ``DT_BF16`` comes back widened to float32 (numpy has no bfloat16).

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``copy``.
        """
        check_bool("copy", copy)
        data = self._data
        if isinstance(data, np.ndarray):
            if _is_text(data) and not copy:
                raise param_invalid("copy", "a DT_STRING tensor is returned as a copy only; pass copy=True")
            return data.copy() if copy else data
        if data.device.type != "cpu":
            return data.detach().cpu().float().numpy() if data.dtype == torch.bfloat16 else data.detach().cpu().numpy()
        if data.dtype == torch.bfloat16:
            return data.detach().float().numpy()
        array = data.detach().numpy()
        return array.copy() if copy else array

    def __repr__(self) -> str:
        return f"Tensor(tensor_desc={self._desc!r})"
