"""Status codes, LLMException and the validated values of aio_datadist.types."""

from __future__ import annotations

import asyncio
import copy
import pickle
import socket
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist._checks import check_indices, check_int, check_range, check_uint, param_invalid
from aio_datadist.status import LLMException, LLMStatusCode, Status, code_to_status
from aio_datadist.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

U64 = 2**64 - 1


@contextmanager
def param_invalid_naming(name: str) -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert f"'{name}" in str(info.value), str(info.value)


# ---- status ------------------------------------------------------------------

STATUS_VALUES = {
    "LLM_SUCCESS": 0,
    "LLM_FAILED": 4294967295,
    "LLM_WAIT_PROCESS_TIMEOUT": 1343270913,
    "LLM_KV_CACHE_NOT_EXIST": 1343270914,
    "LLM_REPEAT_REQUEST": 1343270915,
    "LLM_REQUEST_ALREADY_COMPLETED": 1343270916,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_ENGINE_FINALIZED": 1343270918,
    "LLM_NOT_YET_LINK": 1343270919,
    "LLM_ALREADY_LINK": 1343270920,
    "LLM_LINK_FAILED": 1343270921,
    "LLM_UNLINK_FAILED": 1343270922,
    "LLM_NOTIFY_PROMPT_UNLINK_FAILED": 1343270923,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 1343270924,
    "LLM_PROCESSING_LINK": 1343270925,
    "LLM_DEVICE_OUT_OF_MEMORY": 1343270926,
    "LLM_PREFIX_ALREADY_EXIST": 1343270927,
    "LLM_PREFIX_NOT_EXIST": 1343270928,
    "LLM_SEQ_LENOVERLIMIT": 1343270929,
    "LLM_NO_FREE_BLOCK": 1343270930,
    "LLM_BLOCKS_OUT_OF_MEMORY": 1343270931,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_FEATURE_NOT_ENABLED": 1343270937,
    "LLM_TIMEOUT": 1343270938,
    "LLM_LINK_BUSY": 1343270939,
    "LLM_OUT_OF_MEMORY": 1343270940,
    "LLM_DEVICE_MEM_ERROR": 507053,
    "LLM_SUSPECT_REMOTE_ERROR": 507057,
    "LLM_UNKNOWN_ERROR": -1,
}


def test_status_codes_have_llm_datadist_values() -> None:
    assert {m.name: m.value for m in LLMStatusCode} == STATUS_VALUES
    assert str(LLMStatusCode.LLM_TIMEOUT) == "LLMStatusCode.LLM_TIMEOUT"
    assert f"{LLMStatusCode.LLM_SUCCESS}" == "LLMStatusCode.LLM_SUCCESS"
    assert LLMStatusCode.LLM_OUT_OF_MEMORY == 0x5010B01C


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (0, LLMStatusCode.LLM_SUCCESS),
        (0x5010B005, LLMStatusCode.LLM_PARAM_INVALID),
        (507057, LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR),
        (-1, LLMStatusCode.LLM_UNKNOWN_ERROR),
        (0x5010B014, LLMStatusCode.LLM_FAILED),  # ge-only code, no Python member
        (12345, LLMStatusCode.LLM_FAILED),
        (LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_TIMEOUT),
    ],
)
def test_code_to_status(code: int, expected: LLMStatusCode) -> None:
    assert code_to_status(code) is expected
    assert code_to_status(np.int64(code)) is expected and code_to_status(torch.tensor(code)) is expected


@pytest.mark.parametrize("bad", ["5", 1.0, None, True, torch.tensor([0]), torch.tensor(True), torch.tensor([[-1]]),
                                 np.array([0]), np.bool_(True)])
def test_code_to_status_rejects_non_ints(bad: object) -> None:
    """Tensors and arrays of one element (whose ``__index__`` reads them as an int) and bool tensors are no ints,
    as ``_checks.check_int`` has it (they were read as codes; found by a hunt, 2026-12-07)."""
    with param_invalid_naming("code"):
        code_to_status(bad)  # type: ignore[arg-type]


def test_llm_exception_carries_its_code() -> None:
    exc = LLMException("pull failed", status_code=LLMStatusCode.LLM_TIMEOUT)
    assert isinstance(exc, RuntimeError)
    assert exc.status_code is LLMStatusCode.LLM_TIMEOUT
    assert exc.args == ("pull failed",)
    assert str(exc) == "pull failed [LLM_TIMEOUT]"
    assert "LLM_TIMEOUT" in repr(exc)
    with pytest.raises(AttributeError):
        exc.status_code = LLMStatusCode.LLM_SUCCESS  # type: ignore[misc]
    assert LLMException("x").status_code is LLMStatusCode.LLM_FAILED
    assert LLMException("x", status_code=0x5010B007).status_code is LLMStatusCode.LLM_NOT_YET_LINK
    assert str(LLMException()) == "LLM_FAILED"


def test_llm_exception_pickles_with_its_code() -> None:
    exc = LLMException("gone", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is LLMException
    assert back.args == ("gone",)
    assert back.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_status() -> None:
    assert Status().is_ok()
    failed = Status(LLMStatusCode.LLM_LINK_FAILED)
    assert not failed.is_ok()
    assert failed.status_code is LLMStatusCode.LLM_LINK_FAILED
    assert failed == Status(0x5010B009)
    assert Status(999) == Status(LLMStatusCode.LLM_FAILED)
    assert repr(failed) == "Status(LLMStatusCode.LLM_LINK_FAILED)"


def test_param_invalid_message() -> None:
    exc = param_invalid("src_blocks", "block index 70 out of range [0, 64)")
    assert exc.status_code is LLMStatusCode.LLM_PARAM_INVALID
    assert exc.args[0] == "invalid argument 'src_blocks': block index 70 out of range [0, 64)"


def test_check_helpers_accept_good_values() -> None:
    assert check_int("n", 5, lo=0, hi=5) == 5
    assert check_int("n", torch.tensor(3)) == 3
    assert check_uint("port", 65535, 16) == 65535
    assert check_indices("src_blocks", [3, 1, 2], 4) == (3, 1, 2)
    assert check_indices("src_blocks", torch.tensor([0, 63]), 64) == (0, 63)
    assert check_indices("src_blocks", range(2), 4) == (0, 1)
    assert check_indices("src_blocks", (), 4) == ()
    assert check_range("r", range(1, 3)) == range(1, 3)
    assert check_range("r", None) is None


@pytest.mark.parametrize(
    ("call", "name", "fragment"),
    [
        (lambda: check_int("n", "1"), "n", "expected an int"),
        (lambda: check_int("n", True), "n", "bool"),
        (lambda: check_int("n", 1.0), "n", "expected an int"),
        (lambda: check_int("n", 7, lo=0, hi=5), "n", "[0, 5]"),
        (lambda: check_uint("port", 65536, 16), "port", "uint16"),
        (lambda: check_uint("id", -1), "id", "uint64"),
        (
            lambda: check_indices("src_blocks", [1, 70], 64, what="block index"),
            "src_blocks",
            "block index 70 out of range [0, 64)",
        ),
        (lambda: check_indices("src_blocks", [-1], 64), "src_blocks", "index -1 out of range"),
        (lambda: check_indices("src_blocks", [1, "2"], 64), "src_blocks", "expected an int"),
        (lambda: check_indices("src_blocks", [True], 64), "src_blocks", "bool"),
        (lambda: check_indices("src_blocks", "12", 64), "src_blocks", "expected a list"),
        (lambda: check_indices("src_blocks", {1, 2}, 64), "src_blocks", "expected a list"),
        (lambda: check_indices("src_blocks", torch.tensor(1), 64), "src_blocks", "1-D"),
        (lambda: check_indices("dst_blocks", [], 64, allow_empty=False), "dst_blocks", "empty"),
        (lambda: check_range("r", range(0, 4, 2)), "r", "step"),
        (lambda: check_range("r", range(3, 3)), "r", "empty"),
        (lambda: check_range("r", range(-1, 3)), "r", "start"),
        (lambda: check_range("r", (0, 2)), "r", "expected a range"),
        (lambda: check_range("r", None, allow_none=False), "r", "required"),
    ],
)
def test_check_helpers_reject_bad_values(call, name: str, fragment: str) -> None:
    with param_invalid_naming(name):
        try:
            call()
        except LLMException as exc:
            assert fragment in str(exc), str(exc)
            raise


# ---- enums -------------------------------------------------------------------


def test_role_and_placement() -> None:
    assert [(m.name, m.value) for m in LLMRole] == [("PROMPT", 1), ("DECODER", 2), ("MIX", 3)]
    assert [(m.name, m.value) for m in Placement] == [("HOST", 0), ("DEVICE", 1)]
    assert str(LLMRole.DECODER) == "LLMRole.DECODER"
    assert str(Placement.HOST) == "Placement.HOST"
    assert [(m.name, m.value) for m in RegisterMemStatus] == [("OK", 0), ("PREPARING", 1), ("FAILED", 2)]
    assert [(m.name, m.value) for m in Memtype] == [("MEM_TYPE_DEVICE", 0), ("MEM_TYPE_HOST", 1)]


DATA_TYPES = [
    ("DT_FLOAT", 0, torch.float32, 4),
    ("DT_FLOAT16", 1, torch.float16, 2),
    ("DT_INT8", 2, torch.int8, 1),
    ("DT_INT32", 3, torch.int32, 4),
    ("DT_UINT8", 4, torch.uint8, 1),
    ("DT_INT16", 6, torch.int16, 2),
    ("DT_UINT16", 7, torch.uint16, 2),
    ("DT_UINT32", 8, torch.uint32, 4),
    ("DT_INT64", 9, torch.int64, 8),
    ("DT_UINT64", 10, torch.uint64, 8),
    ("DT_DOUBLE", 11, torch.float64, 8),
    ("DT_BOOL", 12, torch.bool, 1),
    ("DT_BF16", 27, torch.bfloat16, 2),
]


@pytest.mark.parametrize(("name", "value", "dtype", "itemsize"), DATA_TYPES)
def test_data_type_maps_to_torch(name: str, value: int, dtype: torch.dtype, itemsize: int) -> None:
    member = DataType[name]
    assert member.value == value
    assert DataType(value) is member
    assert member.itemsize == itemsize == dtype.itemsize
    assert member.torch_dtype == dtype
    assert DataType.from_torch(dtype) is member


def test_data_type_members_are_complete() -> None:
    assert len(DataType) == len(DATA_TYPES) + 1
    assert DataType.DT_STRING.value == 13


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: DataType.DT_STRING.itemsize, "data_type"),
        (lambda: DataType.DT_STRING.torch_dtype, "data_type"),
        (lambda: DataType.from_torch(torch.complex64), "dtype"),
        (lambda: DataType.from_torch("float32"), "dtype"),
    ],
)
def test_data_type_errors(call, name: str) -> None:
    with param_invalid_naming(name):
        call()


# ---- CacheDesc -----------------------------------------------------------------


def test_cache_desc_properties() -> None:
    desc = CacheDesc(
        80, [4, 128, 8, 64], DataType.DT_BF16, Placement.HOST, seq_len_dim_index=1, kv_tensor_format="BSND"
    )
    assert desc.num_tensors == 80
    assert desc.shape == (4, 128, 8, 64)
    assert desc.data_type is DataType.DT_BF16
    assert desc.placement is Placement.HOST
    assert desc.batch_dim_index == desc.batch_dim == 0
    assert desc.seq_len_dim_index == 1
    assert desc.kv_tensor_format == "BSND"
    assert desc.batch_size == 4
    assert desc.size == 4 * 128 * 8 * 64 * 2
    assert CacheDesc(2, (3, 5), DataType.DT_FLOAT, batch_dim_index=1).batch_size == 5
    assert CacheDesc(1, torch.Size([2, 2]), DataType.DT_INT8, placement=0).placement is Placement.HOST


def test_cache_desc_is_an_immutable_value() -> None:
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT16)
    same = CacheDesc(2, (4, 16), DataType.DT_FLOAT16, Placement.DEVICE)
    assert desc == same and hash(desc) == hash(same)
    assert desc != CacheDesc(2, [4, 16], DataType.DT_FLOAT16, Placement.HOST)
    assert len({desc, same}) == 1
    with pytest.raises(AttributeError):
        desc.num_tensors = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        desc.extra = 1  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(desc)) == desc
    assert copy.deepcopy(desc) == desc
    assert repr(desc).startswith("CacheDesc(num_tensors=2, shape=(4, 16), data_type=DataType.DT_FLOAT16")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_tensors": 0}, "num_tensors"),
        ({"num_tensors": 4097}, "num_tensors"),
        ({"num_tensors": "2"}, "num_tensors"),
        ({"num_tensors": 2.0}, "num_tensors"),
        ({"shape": []}, "shape"),
        ({"shape": [1] * 33}, "shape"),
        ({"shape": [4, 0]}, "shape"),
        ({"shape": [4, -1]}, "shape"),
        ({"shape": [4, 2.5]}, "shape"),
        ({"shape": "44"}, "shape"),
        ({"shape": 4}, "shape"),
        ({"data_type": "DT_FLOAT"}, "data_type"),
        ({"data_type": torch.float32}, "data_type"),
        ({"data_type": DataType.DT_STRING}, "data_type"),
        ({"placement": 2}, "placement"),
        ({"placement": "HOST"}, "placement"),
        ({"batch_dim_index": 2}, "batch_dim_index"),
        ({"batch_dim_index": -1}, "batch_dim_index"),
        ({"seq_len_dim_index": 2}, "seq_len_dim_index"),
        ({"seq_len_dim_index": -2}, "seq_len_dim_index"),
        ({"kv_tensor_format": 1}, "kv_tensor_format"),
    ],
)
def test_cache_desc_rejects(kwargs: dict[str, object], name: str) -> None:
    args: dict[str, object] = {"num_tensors": 2, "shape": [4, 16], "data_type": DataType.DT_FLOAT16}
    args.update(kwargs)
    with param_invalid_naming(name):
        CacheDesc(**args)  # type: ignore[arg-type]


# ---- keys ----------------------------------------------------------------------


def test_cache_key_forms() -> None:
    key = CacheKey(7, 42)
    assert (key.cluster_id, key.prompt_cluster_id, key.req_id, key.model_id, key.prefix_id) == (7, 7, 42, 0, U64)
    assert CacheKey(cluster_id=7, req_id=42) == key
    assert CacheKey(prompt_cluster_id=7, req_id=42) == key
    assert CacheKey(7, 42, 3, 9) == CacheKey(7, req_id=42, model_id=3, prefix_id=9)
    assert not key.is_placeholder
    assert CacheKey(1, U64).is_placeholder
    assert not CacheKey(1, U64, prefix_id=5).is_placeholder
    assert key.lookup_key() == (42, U64, 0)
    assert CacheKey(8, 42).lookup_key() == key.lookup_key()
    assert CacheKey(8, 42) != key
    assert pickle.loads(pickle.dumps(key)) == key
    assert repr(key) == f"CacheKey(prompt_cluster_id=7, req_id=42, model_id=0, prefix_id={U64})"


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: CacheKey(1), "req_id"),
        (lambda: CacheKey(req_id=1), "prompt_cluster_id"),
        (lambda: CacheKey(1, 2, cluster_id=1), "cluster_id"),
        (lambda: CacheKey(-1, 2), "prompt_cluster_id"),
        (lambda: CacheKey(cluster_id=2**64, req_id=2), "prompt_cluster_id"),
        (lambda: CacheKey(1, -2), "req_id"),
        (lambda: CacheKey(1, "2"), "req_id"),
        (lambda: CacheKey(1, 2, 2**64), "model_id"),
        (lambda: CacheKey(1, 2, 0, -1), "prefix_id"),
        (lambda: CacheKey(1, 2, 0, 1.5), "prefix_id"),
    ],
)
def test_cache_key_rejects(build, name: str) -> None:
    with param_invalid_naming(name):
        build()


@given(st.integers(0, U64), st.integers(0, U64), st.integers(0, U64), st.integers(0, U64))
def test_cache_key_round_trips(cluster: int, req: int, model: int, prefix: int) -> None:
    key = CacheKey(cluster, req, model, prefix)
    assert CacheKey(*key._values()) == key
    assert key.lookup_key() == (req, prefix, model)
    assert hash(key) == hash(CacheKey(cluster_id=cluster, req_id=req, model_id=model, prefix_id=prefix))


@pytest.mark.parametrize("cls", [CacheKeyByIdAndIndex, CacheIndex])
def test_cache_address_keys(cls: type) -> None:
    key = cls(3, 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (3, 1, 0)
    assert cls(3, 2**63 - 1, 2**32 - 1).batch_index == 2**32 - 1
    assert key == cls(cluster_id=3, cache_id=1, batch_index=0)
    assert hash(key) == hash(cls(3, 1, 0))
    with param_invalid_naming("cluster_id"):
        cls(-1, 1)
    assert cls(1, 0).cache_id == 0 and cls(1, -1).cache_id == -1  # int64: naming no cache fails at transfer time
    with param_invalid_naming("cache_id"):
        cls(1, 2**63)
    with param_invalid_naming("batch_index"):
        cls(1, 1, 2**32)
    with param_invalid_naming("batch_index"):
        cls(1, 1, -1)


def test_cache_index_and_key_by_id_are_distinct_types() -> None:
    assert CacheIndex(1, 1) != CacheKeyByIdAndIndex(1, 1)


def test_blocks_cache_key() -> None:
    key = BlocksCacheKey(5)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (5, 5, 0)
    assert BlocksCacheKey(cluster_id=5, model_id=1) == BlocksCacheKey(5, 1)
    assert BlocksCacheKey(prompt_cluster_id=5) == key
    assert len({key, BlocksCacheKey(5, 0), BlocksCacheKey(5, 1)}) == 2
    with param_invalid_naming("cluster_id"):
        BlocksCacheKey(5, cluster_id=5)
    with param_invalid_naming("prompt_cluster_id"):
        BlocksCacheKey()
    with param_invalid_naming("model_id"):
        BlocksCacheKey(5, -1)


# ---- KvCacheExtParam --------------------------------------------------------------


def test_kv_cache_ext_param_defaults() -> None:
    param = KvCacheExtParam()
    assert param.src_layer_range == (-1, -1)
    assert param.dst_layer_range == (-1, -1)
    assert param.tensor_num_per_layer == 2
    custom = KvCacheExtParam([0, 3], (4, 7), 1)
    assert custom.src_layer_range == (0, 3)
    assert custom == KvCacheExtParam((0, 3), (4, 7), 1)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"src_layer_range": (-2, 3)}, "src_layer_range"),
        ({"src_layer_range": (3, 2)}, "src_layer_range"),
        ({"src_layer_range": (-1, 3)}, "src_layer_range"),
        ({"src_layer_range": (0, 1, 2)}, "src_layer_range"),
        ({"src_layer_range": range(0, 2)}, "src_layer_range"),
        ({"dst_layer_range": (0, -2)}, "dst_layer_range"),
        ({"dst_layer_range": ("0", 1)}, "dst_layer_range"),
        ({"dst_layer_range": None}, "dst_layer_range"),
        ({"tensor_num_per_layer": 0}, "tensor_num_per_layer"),
        ({"tensor_num_per_layer": 256}, "tensor_num_per_layer"),
        ({"tensor_num_per_layer": 2.0}, "tensor_num_per_layer"),
    ],
)
def test_kv_cache_ext_param_rejects(kwargs: dict[str, object], name: str) -> None:
    with param_invalid_naming(name):
        KvCacheExtParam(**kwargs)  # type: ignore[arg-type]


# ---- LLMClusterInfo -----------------------------------------------------------------


def test_cluster_info_stores_ips_as_the_original_does() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    info.remote_cluster_id = 2**64 - 1
    info.remote_role_type = LLMRole.PROMPT
    info.append_local_ip_info("192.168.1.2", 0)
    info.append_remote_ip_info("10.0.0.1", 26000)
    info.append_remote_ip_info(int.from_bytes(bytes([127, 0, 0, 1]), "little"), 65535)
    assert info.local_ip_info_list == [(int.from_bytes(socket.inet_aton("192.168.1.2"), "little"), 0)]
    assert info.local_ip_info_list[0][0] == 0x0201A8C0
    assert info.local_endpoints == [("192.168.1.2", 0)]
    assert info.remote_endpoints == [("10.0.0.1", 26000), ("127.0.0.1", 65535)]
    assert info.remote_role_type is LLMRole.PROMPT
    info.remote_role_type = 2
    assert info.remote_role_type is LLMRole.DECODER
    info.local_ip_info_list.clear()
    assert len(info.local_ip_info_list) == 1
    assert "192.168.1.2" in repr(info)


@pytest.mark.parametrize(
    ("action", "name"),
    [
        (lambda i: i.append_local_ip_info("256.0.0.1", 1), "ip"),
        (lambda i: i.append_local_ip_info("localhost", 1), "ip"),
        (lambda i: i.append_local_ip_info("::1", 1), "ip"),
        (lambda i: i.append_local_ip_info("1.2.3", 1), "ip"),
        (lambda i: i.append_remote_ip_info(2**32, 1), "ip"),
        (lambda i: i.append_remote_ip_info(1.0, 1), "ip"),
        (lambda i: i.append_remote_ip_info(None, 1), "ip"),
        (lambda i: i.append_remote_ip_info("1.2.3.4", 65536), "port"),
        (lambda i: i.append_remote_ip_info("1.2.3.4", -1), "port"),
        (lambda i: i.append_remote_ip_info("1.2.3.4", "80"), "port"),
        (lambda i: setattr(i, "remote_cluster_id", -1), "remote_cluster_id"),
        (lambda i: setattr(i, "remote_cluster_id", "1"), "remote_cluster_id"),
        (lambda i: setattr(i, "remote_role_type", 2**31), "remote_role_type"),
        (lambda i: setattr(i, "remote_role_type", "PROMPT"), "remote_role_type"),
    ],
)
def test_cluster_info_rejects(action, name: str) -> None:
    info = LLMClusterInfo()
    with param_invalid_naming(name):
        action(info)
    assert info.local_ip_info_list == [] and info.remote_ip_info_list == []


def test_cluster_info_defaults_and_role_ints_as_the_original() -> None:
    """Reference §2.3 (and §3.2 ``ClusterInfo``: 0 = prompt, 1 = decoder): ``remote_role_type`` takes an
    ``LLMRole`` or an int and keeps it; ``remote_cluster_id`` and ``remote_role_type`` start as None."""
    info = LLMClusterInfo()
    assert (info.remote_cluster_id, info.remote_role_type) == (None, None)
    assert (info.local_ip_info_list, info.remote_ip_info_list) == ([], [])
    info.remote_role_type = 0  # the C++ prompt value
    assert info.remote_role_type == 0 and not isinstance(info.remote_role_type, LLMRole)
    info.remote_role_type = 7
    assert info.remote_role_type == 7
    info.remote_role_type = 3
    assert info.remote_role_type is LLMRole.MIX


@pytest.mark.parametrize(
    ("action", "kind"),
    [
        # configs.py LLMClusterInfo: check_isinstance -> TypeError, check_uint16 / check_uint64 range -> ValueError
        (lambda i: i.append_local_ip_info(1.0, 1), TypeError),
        (lambda i: i.append_local_ip_info("1.2.3.4", "80"), TypeError),
        (lambda i: i.append_local_ip_info("1.2.3.4", 65536), ValueError),
        (lambda i: i.append_remote_ip_info("1.2.3.4", -1), ValueError),
        (lambda i: setattr(i, "remote_cluster_id", "1"), TypeError),
        (lambda i: setattr(i, "remote_cluster_id", -1), ValueError),
        (lambda i: setattr(i, "remote_cluster_id", 2**64), ValueError),
        (lambda i: setattr(i, "remote_role_type", "PROMPT"), TypeError),
    ],
)
def test_cluster_info_raises_the_originals_exception_types(action, kind: type) -> None:
    """Reference §2.3 (port checked as uint16) and clients_gap item 38: wrong types raise TypeError,
    uints out of range ValueError; both stay LLMException(LLM_PARAM_INVALID) naming the argument."""
    info = LLMClusterInfo()
    with pytest.raises(kind) as raised:
        action(info)
    assert isinstance(raised.value, LLMException)
    assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@given(st.integers(0, 2**32 - 1), st.integers(0, 65535))
def test_cluster_info_ip_forms_agree(ip: int, port: int) -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info(ip, port)
    dotted, _ = info.local_endpoints[0]
    info.append_local_ip_info(dotted, port)
    assert info.local_ip_info_list[0] == info.local_ip_info_list[1] == (ip, port)


# ---- transfer configs -------------------------------------------------------------


def test_transfer_config() -> None:
    config = TransferConfig(9, [0x1000, 0x2000, 0x3000, 0x4000], range(2, 4), 1)
    assert config.dst_cluster_id == 9
    assert config.dst_addrs == (0x1000, 0x2000, 0x3000, 0x4000)
    assert config.src_layer_range == range(2, 4)
    assert config.src_batch_index == 1
    assert config.dst_layer_range is None
    config.dst_layer_range = range(0, 2)
    assert config.dst_layer_range == range(0, 2)
    assert config != TransferConfig(9, [0x1000, 0x2000, 0x3000, 0x4000], range(2, 4), 1)
    back = pickle.loads(pickle.dumps(config))
    assert back == config and back.dst_layer_range == range(0, 2)
    assert copy.copy(config) == config
    with pytest.raises(TypeError):
        hash(config)
    with pytest.raises(AttributeError):
        config.dst_cluster_id = 3  # type: ignore[misc]
    assert TransferConfig(1, (1, 2)).src_layer_range is None


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((-1, [1, 2]), "dst_cluster_id"),
        ((1, []), "dst_addrs"),
        ((1, [1, 2, 3]), "dst_addrs"),
        ((1, [1, 0]), "dst_addrs"),
        ((1, [1, -5]), "dst_addrs"),
        ((1, [1, "2"]), "dst_addrs"),
        ((1, 12), "dst_addrs"),
        ((1, [1, 2], range(0, 2)), "dst_addrs"),
        ((1, [1, 2], range(0, 1, 2)), "src_layer_range"),
        ((1, [1, 2], range(1, 1)), "src_layer_range"),
        ((1, [1, 2], (0, 1)), "src_layer_range"),
        ((1, [1, 2], None, -1), "src_batch_index"),
        ((1, [1, 2], None, 2**32), "src_batch_index"),
    ],
)
def test_transfer_config_rejects(args: tuple[object, ...], name: str) -> None:
    with param_invalid_naming(name):
        TransferConfig(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [range(0, 2), range(0, 1, 1), (0, 1), range(-1, 0)])
def test_transfer_config_dst_layer_range_is_validated(value: object) -> None:
    config = TransferConfig(1, [1, 2, 3, 4])
    if value == range(0, 2):
        config.dst_layer_range = value  # type: ignore[assignment]
        return
    with param_invalid_naming("dst_layer_range"):
        config.dst_layer_range = value  # type: ignore[assignment]
    assert config.dst_layer_range is None


def test_transfer_with_cache_key_config() -> None:
    by_id = CacheKeyByIdAndIndex(2, 1, 3)
    config = TransferWithCacheKeyConfig(by_id, range(0, 2), range(4, 6), 1)
    assert (config.cache_key, config.src_layer_range, config.dst_layer_range, config.src_batch_index) == (
        by_id,
        range(0, 2),
        range(4, 6),
        1,
    )
    assert hash(config) == hash(TransferWithCacheKeyConfig(by_id, range(0, 2), range(4, 6), 1))
    blocks = TransferWithCacheKeyConfig(BlocksCacheKey(2))
    assert blocks.src_layer_range is None and blocks.dst_layer_range is None


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((CacheKey(1, 2),), "cache_key"),
        ((None,), "cache_key"),
        ((BlocksCacheKey(1), range(0, 2), range(0, 3)), "dst_layer_range"),
        ((BlocksCacheKey(1), range(0, 4, 2)), "src_layer_range"),
        ((BlocksCacheKey(1), None, range(2, 2)), "dst_layer_range"),
        ((BlocksCacheKey(1), None, None, 1), "src_batch_index"),
        ((CacheKeyByIdAndIndex(1, 1), None, None, -1), "src_batch_index"),
    ],
)
def test_transfer_with_cache_key_config_rejects(args: tuple[object, ...], name: str) -> None:
    with param_invalid_naming(name):
        TransferWithCacheKeyConfig(*args)  # type: ignore[arg-type]


# ---- the rest ------------------------------------------------------------------


def test_mem_info() -> None:
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 0x1000, 4096)
    with param_invalid_naming("mem_type"):
        MemInfo(0, 0x1000, 1)  # type: ignore[arg-type]
    with param_invalid_naming("addr"):
        MemInfo(Memtype.MEM_TYPE_HOST, 0, 1)
    with param_invalid_naming("size"):
        MemInfo(Memtype.MEM_TYPE_HOST, 1, 0)


def test_layer_synchronizer_may_be_sync_or_async() -> None:
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Ready(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return layer_index < 2

    class AsyncReady(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    assert Ready().synchronize_layer(1, None) is True
    assert Ready().synchronize_layer(2, None) is False
    assert asyncio.run(AsyncReady().synchronize_layer(0, None)) is True


# ---- exception types where llm_datadist documents them -----------------------------------


@pytest.mark.parametrize(
    ("what", "call", "kind", "name"),
    [
        # reference §2.1: role must be an LLMRole, cluster_id a uint64 "otherwise TypeError/ValueError"
        ("LLMDataDist role", lambda: _datadist(1, 5), TypeError, "role"),
        ("LLMDataDist cluster_id str", lambda: _datadist(LLMRole.PROMPT, "5"), TypeError, "cluster_id"),
        ("LLMDataDist cluster_id < 0", lambda: _datadist(LLMRole.PROMPT, -1), ValueError, "cluster_id"),
        ("LLMDataDist cluster_id > uint64", lambda: _datadist(LLMRole.PROMPT, 2**64), ValueError, "cluster_id"),
        # reference §2.8: all CacheKey / BlocksCacheKey values are uint64; CacheKeyByIdAndIndex batch_index uint32
        ("CacheKey req_id", lambda: CacheKey(1, -1), ValueError, "req_id"),
        ("CacheKey model_id type", lambda: CacheKey(1, 1, "0"), TypeError, "model_id"),
        ("BlocksCacheKey cluster", lambda: BlocksCacheKey(2**64), ValueError, "prompt_cluster_id"),
        ("CacheKeyByIdAndIndex batch_index", lambda: CacheKeyByIdAndIndex(1, 1, 2**32), ValueError, "batch_index"),
        ("CacheKeyByIdAndIndex cache_id > int64", lambda: CacheKeyByIdAndIndex(1, 2**63), ValueError, "cache_id"),
        # reference §2.9 / §2.10: descriptors and configs check their types
        ("CacheDesc shape type", lambda: CacheDesc(1, "4,4", DataType.DT_FLOAT), TypeError, "shape"),
        ("CacheDesc data_type", lambda: CacheDesc(1, [4], 1), TypeError, "data_type"),
        ("CacheDesc placement", lambda: CacheDesc(1, [4], DataType.DT_FLOAT, "HOST"), TypeError, "placement"),
        ("TransferConfig dst_addrs", lambda: TransferConfig(1, "0x10"), TypeError, "dst_addrs"),
        ("TransferWithCacheKeyConfig range", lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), [0, 1]),
         TypeError, "src_layer_range"),
    ],
)
def test_wrong_types_and_out_of_range_uints_raise_the_originals_exceptions(what, call, kind, name) -> None:
    """clients_gap item 38: llm_datadist's check_isinstance raises TypeError and its check_uint* ValueError,
    which vllm-ascend turns into "unexpected parameter" errors; here both are also
    LLMException(LLM_PARAM_INVALID) naming the argument."""
    with pytest.raises(kind) as raised:
        call()
    assert isinstance(raised.value, LLMException), what
    assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, what
    assert f"'{name}'" in str(raised.value), (what, str(raised.value))


def test_semantic_checks_stay_plain_llm_exceptions() -> None:
    """Reference §2.11: validation beyond types and integer widths raises LLMException (raise_if_*),
    which vllm-ascend must not mistake for a bad parameter type."""
    for call in (lambda: CacheDesc(1, [4], DataType.DT_FLOAT, batch_dim_index=1),
                 lambda: KvCacheExtParam((3, 1)),
                 lambda: TransferConfig(1, [1, 2, 3]),
                 lambda: check_range("src_layer_range", range(0, 4, 2))):
        with pytest.raises(LLMException) as raised:
            call()
        assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert not isinstance(raised.value, (TypeError, ValueError)), raised.value


def test_index_and_range_bounds_stay_plain_llm_exceptions() -> None:
    """An index outside a cache's rows, or an empty or negative layer range, is a range check
    (raise_if_*), not an integer width: LLMException only, never TypeError or ValueError."""
    for call in (lambda: check_indices("src_blocks", [0, 8], 8, what="block index"),
                 lambda: check_indices("dst_blocks", [-1], 8, what="block index"),
                 lambda: check_range("src_layer_range", range(2, 2)),
                 lambda: check_range("src_layer_range", range(-1, 2))):
        with pytest.raises(LLMException) as raised:
            call()
        assert raised.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert not isinstance(raised.value, (TypeError, ValueError)), raised.value


def _datadist(role, cluster_id):
    from aio_datadist import LLMDataDist

    return LLMDataDist(role, cluster_id)
