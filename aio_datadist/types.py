"""Plain, validated values of the public API.

Everything here is checked when it is built: a bad argument raises
``LLMException(LLM_PARAM_INVALID)`` whose message names the argument. The
values are immutable (``__slots__``, no attribute assignment), hashable and
compare by value; the two exceptions are ``LLMClusterInfo``, mutable like
LLM-DataDist's, and ``TransferConfig.dst_layer_range``, a validated mutable
attribute as in the original.
"""

from __future__ import annotations

import math
import socket
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ._checks import (
    INT32_MAX,
    INT64_MAX,
    UINT64_MAX,
    check_instance,
    check_int,
    check_ipv4,
    check_range,
    check_sint,
    check_str,
    check_uint,
    param_invalid,
    param_type_error,
    shown,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "LLMRole",
    "Placement",
    "DataType",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "CacheIndex",
    "KvCacheExtParam",
    "LLMClusterInfo",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "LayerSynchronizer",
    "RegisterMemStatus",
    "Memtype",
    "MemInfo",
    "INVALID_ID",
    "ALL_LAYERS",
    "check_layer_pair",
    "MAX_NUM_TENSORS",
    "MAX_DIMS",
]

INVALID_ID = UINT64_MAX
"""``2**64 - 1``: the "no id" value of ``CacheKey.req_id``/``prefix_id``."""

MAX_NUM_TENSORS = 4096
"""Largest ``CacheDesc.num_tensors`` accepted."""

MAX_DIMS = 32
"""Largest number of dimensions of ``CacheDesc.shape`` (C++ ``kMaxDimNum``)."""

_E = TypeVar("_E", bound=Enum)


class LLMRole(IntEnum):
    """Role of an ``LLMDataDist`` instance."""

    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Placement(IntEnum):
    """Where a cache's memory lives."""

    HOST = 0
    DEVICE = 1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class DataType(Enum):
    """Element type of a cache, with ``ge::DataType``'s values."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27

    @property
    def itemsize(self) -> int:
        """Bytes per element.

        :raises LLMException: ``LLM_PARAM_INVALID`` for ``DT_STRING``, which
            has no fixed size.
        """
        size = _ITEMSIZE.get(self)
        if size is None:
            raise param_invalid("data_type", f"{self} has no fixed item size")
        return size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching ``torch.dtype``.

        :raises LLMException: ``LLM_PARAM_INVALID`` for ``DT_STRING``.
        """
        dtype = _torch_dtypes().get(self)
        if dtype is None:
            raise param_invalid("data_type", f"{self} has no torch dtype")
        return dtype

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DataType:
        """The ``DataType`` of a ``torch.dtype``.

        :param dtype: e.g. ``torch.bfloat16``.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``dtype`` if it is
            not a torch dtype or has no LLM-DataDist counterpart.
        """
        import torch

        check_instance("dtype", dtype, torch.dtype)
        for member, candidate in _torch_dtypes().items():
            if candidate == dtype:
                return member
        raise param_invalid("dtype", f"{dtype} has no DataType counterpart")


_ITEMSIZE: dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_BF16: 2,
}

_TORCH_NAMES: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT32: "int32",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT32: "uint32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT64: "uint64",
    DataType.DT_DOUBLE: "float64",
    DataType.DT_BOOL: "bool",
    DataType.DT_BF16: "bfloat16",
}

_torch_dtype_map: dict[DataType, torch.dtype] | None = None


def _torch_dtypes() -> dict[DataType, torch.dtype]:
    global _torch_dtype_map
    if _torch_dtype_map is None:
        import torch

        _torch_dtype_map = {
            member: getattr(torch, name) for member, name in _TORCH_NAMES.items() if hasattr(torch, name)
        }
    return _torch_dtype_map


class RegisterMemStatus(Enum):
    """State of a bilateral link's memory registration."""

    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    """Kind of memory in a ``MemInfo``."""

    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


def _check_enum(arg_name: str, value: object, enum_cls: type[_E]) -> _E:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and issubclass(enum_cls, IntEnum):
        try:
            return enum_cls(value)
        except ValueError:
            pass
    choices = ", ".join(str(m) for m in enum_cls)
    raise param_type_error(arg_name, f"expected one of {choices}, got {shown(value)}")


def _show(value: object) -> str:
    return str(value) if isinstance(value, Enum) else repr(value)


class _Value:
    """Immutable value: equality, hash, repr and pickling from ``_fields``.

    ``_fields`` lists the constructor's parameters in positional order; each
    is readable as an attribute of the same name.
    """

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={_show(getattr(self, name))}" for name in self._fields)
        return f"{type(self).__name__}({body})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._values())

    def __copy__(self) -> _Value:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Value:
        return self


def _check_shape(shape: object) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)):
        raise param_type_error("shape", f"expected a list or tuple of ints, got {type(shape).__name__}")
    if not 1 <= len(shape) <= MAX_DIMS:
        raise param_invalid("shape", f"must have 1 to {MAX_DIMS} dimensions, got {len(shape)}")
    dims = []
    for axis, dim in enumerate(shape):
        size = check_int(f"shape[{axis}]", dim)
        if not 1 <= size <= INT64_MAX:
            raise param_invalid("shape", f"dimension {axis} must be a positive int64, got {shown(size)}")
        dims.append(size)
    return tuple(dims)


class CacheDesc(_Value):
    """Describes a KV cache: ``num_tensors`` tensors of one shape and type.

    :param num_tensors: number of tensors (e.g. 2 per layer: K, V), 1 to 4096.
    :param shape: shape of every tensor, 1 to 32 positive dimensions.
    :param data_type: element type; ``DT_STRING`` is not accepted.
    :param placement: ``Placement.HOST`` or ``Placement.DEVICE`` (default).
    :param batch_dim_index: the batch dimension, in ``[0, len(shape))``. For
        a blocks cache ``shape[0]`` is the number of blocks.
    :param seq_len_dim_index: -1, or the sequence-length dimension.
    :param kv_tensor_format: an optional layout label (e.g. ``"BSH"``).
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "num_tensors": "Number of tensors.",
        "shape": "Shape of every tensor (tuple of ints).",
        "data_type": "Element type (DataType).",
        "placement": "Placement.HOST or Placement.DEVICE.",
        "batch_dim_index": "Index of the batch dimension in shape.",
        "seq_len_dim_index": "Index of the sequence dimension, or -1.",
        "kv_tensor_format": "Optional layout label, or None.",
    }
    _fields = (
        "num_tensors",
        "shape",
        "data_type",
        "placement",
        "batch_dim_index",
        "seq_len_dim_index",
        "kv_tensor_format",
    )

    num_tensors: int
    shape: tuple[int, ...]
    data_type: DataType
    placement: Placement
    batch_dim_index: int
    seq_len_dim_index: int
    kv_tensor_format: str | None

    def __init__(
        self,
        num_tensors: int,
        shape: tuple[int, ...] | list[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        num_tensors = check_uint("num_tensors", num_tensors, 32)  # ValueError outside a uint32, as LLM-DataDist
        if not 1 <= num_tensors <= MAX_NUM_TENSORS:
            raise param_invalid("num_tensors", f"must be in [1, {MAX_NUM_TENSORS}], got {num_tensors}")
        dims = _check_shape(shape)
        check_instance("data_type", data_type, DataType)
        if data_type not in _ITEMSIZE:
            raise param_invalid("data_type", f"{data_type} has no fixed item size; caches need a numeric type")
        placement = _check_enum("placement", placement, Placement)
        batch_dim_index = check_int("batch_dim_index", batch_dim_index)
        if not 0 <= batch_dim_index < len(dims):
            raise param_invalid("batch_dim_index", f"must be in [0, {len(dims)}), got {shown(batch_dim_index)}")
        seq_len_dim_index = check_sint("seq_len_dim_index", seq_len_dim_index, 32)
        if seq_len_dim_index != -1 and not 0 <= seq_len_dim_index < len(dims):
            raise param_invalid("seq_len_dim_index", f"must be -1 or in [0, {len(dims)}), got {seq_len_dim_index}")
        if kv_tensor_format is not None:
            check_str("kv_tensor_format", kv_tensor_format)
        self._set("num_tensors", num_tensors)
        self._set("shape", dims)
        self._set("data_type", data_type)
        self._set("placement", placement)
        self._set("batch_dim_index", batch_dim_index)
        self._set("seq_len_dim_index", seq_len_dim_index)
        self._set("kv_tensor_format", kv_tensor_format)

    @property
    def batch_dim(self) -> int:
        """Alias of ``batch_dim_index``."""
        return self.batch_dim_index

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim_index]`` (the number of blocks of a blocks cache)."""
        return self.shape[self.batch_dim_index]

    @property
    def size(self) -> int:
        """Bytes per tensor: ``prod(shape) * data_type.itemsize``."""
        return math.prod(self.shape) * self.data_type.itemsize


def _check_cluster_alias(first_name: str, first: object, alias: object) -> object:
    if first is not None and alias is not None:
        raise param_invalid("cluster_id", f"give either cluster_id or {first_name}, not both")
    value = first if first is not None else alias
    if value is None:
        raise param_invalid(first_name, "is required (or give cluster_id)")
    return value


class CacheKey(_Value):
    """Names one batch row of a cache so that peers can pull it.

    :param prompt_cluster_id: cluster that holds the cache (uint64); used to
        pick the link on the puller's side, not part of the key's identity.
        ``cluster_id=`` is accepted as a keyword alias.
    :param req_id: request id (uint64), required; ``2**64 - 1`` = none.
    :param model_id: model id (uint64), default 0.
    :param prefix_id: prefix id (uint64), default ``2**64 - 1`` = none.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "prompt_cluster_id": "Cluster that holds the cache (uint64).",
        "req_id": "Request id (uint64); 2**64-1 means none.",
        "model_id": "Model id (uint64).",
        "prefix_id": "Prefix id (uint64); 2**64-1 means none.",
    }
    _fields = ("prompt_cluster_id", "req_id", "model_id", "prefix_id")

    prompt_cluster_id: int
    req_id: int
    model_id: int
    prefix_id: int

    def __init__(
        self,
        prompt_cluster_id: int | None = None,
        req_id: int | None = None,
        model_id: int = 0,
        prefix_id: int = INVALID_ID,
        *,
        cluster_id: int | None = None,
    ) -> None:
        cluster = _check_cluster_alias("prompt_cluster_id", prompt_cluster_id, cluster_id)
        if req_id is None:
            raise param_invalid("req_id", "is required")
        self._set("prompt_cluster_id", check_uint("prompt_cluster_id", cluster))
        self._set("req_id", check_uint("req_id", req_id))
        self._set("model_id", check_uint("model_id", model_id))
        self._set("prefix_id", check_uint("prefix_id", prefix_id))

    @property
    def cluster_id(self) -> int:
        """Alias of ``prompt_cluster_id``."""
        return self.prompt_cluster_id

    @property
    def is_placeholder(self) -> bool:
        """True when neither ``req_id`` nor ``prefix_id`` is set (an unused batch slot)."""
        return self.req_id == INVALID_ID and self.prefix_id == INVALID_ID

    def lookup_key(self) -> tuple[int, int, int]:
        """The identity used to find the cache: ``(req_id, prefix_id, model_id)``.

        The cluster id is deliberately left out: it only selects the link.
        """
        return (self.req_id, self.prefix_id, self.model_id)


class _CacheAddress(_Value):
    __slots__ = {
        "cluster_id": "Cluster that holds the cache (uint64).",
        "cache_id": "Id of the cache in that cluster (int64; one that names no cache fails the transfer).",
        "batch_index": "Batch row (uint32).",
    }
    _fields = ("cluster_id", "cache_id", "batch_index")

    cluster_id: int
    cache_id: int
    batch_index: int

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._set("cluster_id", check_uint("cluster_id", cluster_id))
        # Any int64, as LLM-DataDist's (ValueError outside it): an id that names no cache (ids start at 1;
        # a CPU cache's is -1) is the owner's LLM_KV_CACHE_NOT_EXIST at transfer time, not an error here.
        self._set("cache_id", check_sint("cache_id", cache_id))
        self._set("batch_index", check_uint("batch_index", batch_index, 32))


class CacheKeyByIdAndIndex(_CacheAddress):
    """Addresses batch row ``batch_index`` of cache ``cache_id`` held by ``cluster_id``.

    :param cluster_id: the remote cluster (uint64).
    :param cache_id: the remote cache's id (int64; ids start at 1, and one that names no
        cache fails the transfer with ``LLM_KV_CACHE_NOT_EXIST``).
    :param batch_index: the row (uint32), default 0.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = ()


class CacheIndex(_CacheAddress):
    """The C++ API's remote cache address: same fields as ``CacheKeyByIdAndIndex``.

    :param cluster_id: the remote cluster (uint64).
    :param cache_id: the remote cache's id (int64; ids start at 1, and one that names no
        cache fails the transfer with ``LLM_KV_CACHE_NOT_EXIST``).
    :param batch_index: the row (uint32), default 0.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = ()


class BlocksCacheKey(_Value):
    """Names a blocks (PagedAttention) cache of a cluster.

    :param prompt_cluster_id: cluster that holds the cache (uint64);
        ``cluster_id=`` is accepted as a keyword alias.
    :param model_id: tells several blocks caches of one process apart
        (uint64), default 0.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "prompt_cluster_id": "Cluster that holds the cache (uint64).",
        "model_id": "Model id (uint64).",
    }
    _fields = ("prompt_cluster_id", "model_id")

    prompt_cluster_id: int
    model_id: int

    def __init__(
        self,
        prompt_cluster_id: int | None = None,
        model_id: int = 0,
        *,
        cluster_id: int | None = None,
    ) -> None:
        cluster = _check_cluster_alias("prompt_cluster_id", prompt_cluster_id, cluster_id)
        self._set("prompt_cluster_id", check_uint("prompt_cluster_id", cluster))
        self._set("model_id", check_uint("model_id", model_id))

    @property
    def cluster_id(self) -> int:
        """Alias of ``prompt_cluster_id``."""
        return self.prompt_cluster_id


ALL_LAYERS = (-1, -1)
"""The inclusive layer pair that selects every layer."""


def check_layer_pair(arg_name: str, value: object) -> tuple[int, int]:
    """Check an inclusive ``(first, second)`` layer pair; ``(-1, -1)`` means all layers.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` unless the
        pair is ``(-1, -1)`` or two int32 layer indices with ``0 <= first <= second``.
    """
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise param_invalid(arg_name, f"expected an inclusive (first, second) pair, got {shown(value)}")
    first = check_int(arg_name, value[0], lo=-1, hi=INT32_MAX)
    second = check_int(arg_name, value[1], lo=-1, hi=INT32_MAX)
    if (first == -1) != (second == -1):
        raise param_invalid(
            arg_name, f"use (-1, -1) for all layers or two layer indices >= 0, got ({first}, {second})"
        )
    if first > second:
        raise param_invalid(arg_name, f"first must be <= second, got ({first}, {second})")
    return (first, second)


class KvCacheExtParam(_Value):
    """Layer selection for push/pull calls, as in the C++ ``KvCacheExtParam``.

    Ranges are **inclusive** ``(first, second)`` layer-index pairs; ``(-1, -1)``
    means all layers. Layer ``L`` covers tensors ``[L*N, L*N+N)`` with
    ``N = tensor_num_per_layer``; see ``layers.resolve_ext_param``.

    :param src_layer_range: layers of the source cache, default ``(-1, -1)``.
    :param dst_layer_range: layers of the destination cache, default ``(-1, -1)``.
    :param tensor_num_per_layer: tensors per layer, 1 to 255, default 2.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "src_layer_range": "Inclusive (first, second) source layers; (-1, -1) = all.",
        "dst_layer_range": "Inclusive (first, second) destination layers; (-1, -1) = all.",
        "tensor_num_per_layer": "Tensors per layer (1 to 255).",
    }
    _fields = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")

    src_layer_range: tuple[int, int]
    dst_layer_range: tuple[int, int]
    tensor_num_per_layer: int

    def __init__(
        self,
        src_layer_range: tuple[int, int] = ALL_LAYERS,
        dst_layer_range: tuple[int, int] = ALL_LAYERS,
        tensor_num_per_layer: int = 2,
    ) -> None:
        self._set("src_layer_range", check_layer_pair("src_layer_range", src_layer_range))
        self._set("dst_layer_range", check_layer_pair("dst_layer_range", dst_layer_range))
        self._set("tensor_num_per_layer", check_int("tensor_num_per_layer", tensor_num_per_layer, lo=1, hi=255))


def _ip_to_int(arg_name: str, ip: object) -> int:
    if isinstance(ip, str):
        return int.from_bytes(socket.inet_aton(check_ipv4(arg_name, ip)), "little")
    if isinstance(ip, int) and not isinstance(ip, bool):
        return check_uint(arg_name, ip, 32)
    raise param_type_error(arg_name, f"expected an IPv4 str or int, got {type(ip).__name__}")


def _int_to_ip(ip: int) -> str:
    return socket.inet_ntoa(ip.to_bytes(4, "little"))


class LLMClusterInfo:
    """Endpoints of one peer for ``link_clusters``/``unlink_clusters``.

    Mutable, as in LLM-DataDist: set ``remote_cluster_id`` and append the
    local and remote ``(ip, port)`` pairs. IPs are stored the way the
    original stores them, as little-endian ints of ``socket.inet_aton``;
    ``local_endpoints``/``remote_endpoints`` give them back as dotted strings.
    Only IPv4 is supported.
    """

    __slots__ = ("_remote_cluster_id", "_remote_role_type", "_local", "_remote")

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local: list[tuple[int, int]] = []
        self._remote: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        """The peer's cluster id (uint64); None until set (``link_clusters`` then links to
        whichever cluster listens at the remote address, see ``docs/api.md``)."""
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        self._remote_cluster_id = check_uint("remote_cluster_id", value)

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        """The peer's role as the caller set it; None until set. Informational: links never read it.

        An int that is an ``LLMRole`` value reads back as that ``LLMRole``; any other int32 (the
        C++ ``ClusterInfo`` counts 0 = prompt, 1 = decoder) is kept as given, as llm_datadist does.
        """
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        number = check_int("remote_role_type", value, lo=-2**31, hi=INT32_MAX)
        self._remote_role_type = LLMRole(number) if number in LLMRole._value2member_map_ else number

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        """Add a local endpoint.

        :param ip: dotted IPv4 string, or the little-endian int form.
        :param port: uint16; 0 lets the system choose.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``ip`` or ``port``.
        """
        self._local.append((_ip_to_int("ip", ip), check_uint("port", port, 16)))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        """Add a remote endpoint (the peer's listening address).

        :param ip: dotted IPv4 string, or the little-endian int form.
        :param port: uint16.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``ip`` or ``port``.
        """
        self._remote.append((_ip_to_int("ip", ip), check_uint("port", port, 16)))

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        """Local endpoints as ``(int_ip, port)`` (a copy)."""
        return list(self._local)

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        """Remote endpoints as ``(int_ip, port)`` (a copy)."""
        return list(self._remote)

    @property
    def local_endpoints(self) -> list[tuple[str, int]]:
        """Local endpoints as ``(dotted_ip, port)``."""
        return [(_int_to_ip(ip), port) for ip, port in self._local]

    @property
    def remote_endpoints(self) -> list[tuple[str, int]]:
        """Remote endpoints as ``(dotted_ip, port)``."""
        return [(_int_to_ip(ip), port) for ip, port in self._remote]

    def __repr__(self) -> str:
        role = None if self._remote_role_type is None else str(self._remote_role_type)
        return (
            f"LLMClusterInfo(remote_cluster_id={self._remote_cluster_id!r}, remote_role_type={role}, "
            f"local={self.local_endpoints!r}, remote={self.remote_endpoints!r})"
        )


class TransferConfig(_Value):
    """One destination of ``transfer_cache_async`` given by raw addresses.

    :param dst_cluster_id: the destination cluster (uint64).
    :param dst_addrs: remote tensor addresses, exactly 2 per transferred
        layer (K, V); positive ints.
    :param src_layer_range: source layers (``range``, step 1, non-empty), or
        None for all layers; when given, ``len(dst_addrs)`` must be
        ``2 * len(src_layer_range)``.
    :param src_batch_index: source batch row (uint32), default 0.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.

    ``dst_layer_range`` (default None) may be assigned afterwards; it is
    validated the same way and must match the transferred layer count.
    Because of that attribute a ``TransferConfig`` is not hashable.
    """

    __slots__ = {
        "dst_cluster_id": "Destination cluster (uint64).",
        "dst_addrs": "Remote tensor addresses, 2 per layer (tuple of ints).",
        "src_layer_range": "Source layers (range) or None for all.",
        "src_batch_index": "Source batch row (uint32).",
        "_dst_layer_range": "",
    }
    _fields = ("dst_cluster_id", "dst_addrs", "src_layer_range", "src_batch_index")

    dst_cluster_id: int
    dst_addrs: tuple[int, ...]
    src_layer_range: range | None
    src_batch_index: int
    _dst_layer_range: range | None

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: list[int] | tuple[int, ...],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        dst_cluster_id = check_uint("dst_cluster_id", dst_cluster_id)
        if not isinstance(dst_addrs, (list, tuple)):
            raise param_type_error("dst_addrs", f"expected a list of ints, got {type(dst_addrs).__name__}")
        addrs = tuple(check_int("dst_addrs", a, lo=1, hi=UINT64_MAX) for a in dst_addrs)
        if not addrs or len(addrs) % 2:
            raise param_invalid("dst_addrs", f"needs 2 addresses per layer (K, V), got {len(addrs)}")
        src_layer_range = check_range("src_layer_range", src_layer_range)
        if src_layer_range is not None and len(addrs) != 2 * len(src_layer_range):
            raise param_invalid(
                "dst_addrs",
                f"holds {len(addrs)} addresses but src_layer_range has {len(src_layer_range)} layers "
                f"(2 per layer: {2 * len(src_layer_range)})",
            )
        self._set("dst_cluster_id", dst_cluster_id)
        self._set("dst_addrs", addrs)
        self._set("src_layer_range", src_layer_range)
        self._set("src_batch_index", check_uint("src_batch_index", src_batch_index, 32))
        self._set("_dst_layer_range", None)

    @property
    def dst_layer_range(self) -> range | None:
        """Destination layers (``range``, step 1) or None; assignable."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, value: range | None) -> None:
        checked = check_range("dst_layer_range", value)
        if checked is not None and len(self.dst_addrs) != 2 * len(checked):
            raise param_invalid(
                "dst_layer_range",
                f"has {len(checked)} layers but dst_addrs holds {len(self.dst_addrs)} addresses "
                f"({len(self.dst_addrs) // 2} layers)",
            )
        self._set("_dst_layer_range", checked)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "dst_layer_range":
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def _values(self) -> tuple[Any, ...]:
        return (*super()._values(), self._dst_layer_range)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self.dst_cluster_id!r}, dst_addrs={list(self.dst_addrs)!r}, "
            f"src_layer_range={self.src_layer_range!r}, src_batch_index={self.src_batch_index!r}, "
            f"dst_layer_range={self._dst_layer_range!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        values = super()._values()
        return (type(self), values, {"dst_layer_range": self._dst_layer_range})

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dst_layer_range = state["dst_layer_range"]

    def __copy__(self) -> TransferConfig:
        clone = TransferConfig(*super()._values())
        clone.dst_layer_range = self._dst_layer_range
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> TransferConfig:
        return self.__copy__()


class TransferWithCacheKeyConfig(_Value):
    """One destination of ``transfer_cache_async`` given by a cache key.

    :param cache_key: a ``BlocksCacheKey`` (destination blocks cache) or a
        ``CacheKeyByIdAndIndex`` (destination cache and row).
    :param src_layer_range: source layers (``range``, step 1,
        ``0 <= start < stop``) or None for all.
    :param dst_layer_range: destination layers, same rules; when both are
        given they have the same length.
    :param src_batch_index: source batch row (uint32); must be 0 with a
        ``BlocksCacheKey``.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "cache_key": "BlocksCacheKey or CacheKeyByIdAndIndex of the destination.",
        "src_layer_range": "Source layers (range) or None for all.",
        "dst_layer_range": "Destination layers (range) or None for all.",
        "src_batch_index": "Source batch row (uint32).",
    }
    _fields = ("cache_key", "src_layer_range", "dst_layer_range", "src_batch_index")

    cache_key: BlocksCacheKey | CacheKeyByIdAndIndex
    src_layer_range: range | None
    dst_layer_range: range | None
    src_batch_index: int

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_instance("cache_key", cache_key, (BlocksCacheKey, CacheKeyByIdAndIndex))
        src_layer_range = check_range("src_layer_range", src_layer_range)
        dst_layer_range = check_range("dst_layer_range", dst_layer_range)
        if src_layer_range is not None and dst_layer_range is not None and len(src_layer_range) != len(dst_layer_range):
            raise param_invalid(
                "dst_layer_range",
                f"has {len(dst_layer_range)} layers but src_layer_range has {len(src_layer_range)}",
            )
        src_batch_index = check_uint("src_batch_index", src_batch_index, 32)
        if isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0:
            raise param_invalid("src_batch_index", f"must be 0 with a BlocksCacheKey, got {src_batch_index}")
        self._set("cache_key", cache_key)
        self._set("src_layer_range", src_layer_range)
        self._set("dst_layer_range", dst_layer_range)
        self._set("src_batch_index", src_batch_index)


class MemInfo(_Value):
    """A registered memory region, for ``remap_registered_memory``.

    :param mem_type: ``Memtype.MEM_TYPE_DEVICE`` or ``MEM_TYPE_HOST``.
    :param addr: start address (non-zero uint64).
    :param size: length in bytes (> 0).
    :raises LLMException: ``LLM_PARAM_INVALID`` naming the bad argument.
    """

    __slots__ = {
        "mem_type": "Memtype of the region.",
        "addr": "Start address.",
        "size": "Length in bytes.",
    }
    _fields = ("mem_type", "addr", "size")

    mem_type: Memtype
    addr: int
    size: int

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        self._set("mem_type", check_instance("mem_type", mem_type, Memtype))
        self._set("addr", check_int("addr", addr, lo=1, hi=UINT64_MAX))
        self._set("size", check_int("size", size, lo=1, hi=UINT64_MAX))


class LayerSynchronizer(ABC):
    """Tells a layer-wise transfer when a layer's KV cache is ready to send.

    Implement ``synchronize_layer``. It may be a plain method or an
    ``async def`` coroutine; aio_datadist awaits the latter on the event
    loop, so a coroutine should wait on something awaitable (e.g. a device
    event turned into a future) rather than block.
    """

    __slots__ = ()

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool | Awaitable[bool]:
        """Wait until layer ``layer_index`` has been computed.

        :param layer_index: the layer about to be sent (0-based).
        :param timeout_in_millis: how long to wait at most, or None (what
            LLM-DataDist always passes).
        :returns: True to send the layer; False stops the transfer, and the
            affected configs report ``LLM_PARAM_INVALID``.
        """
