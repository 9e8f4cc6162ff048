"""Ints too long to print (more than ``sys.get_int_max_str_digits()``, 4300 digits) given to any int argument of
the public API are refused with ``LLMException(LLM_PARAM_INVALID)`` naming the argument. Before, the checks
refused them and then raised a bare ``ValueError`` ("Exceeds the limit (4300 digits) for integer string
conversion") while writing their own message, naming nothing (found by a hunt; ints given as text were fixed
before, ``test_config.py::test_integers_longer_than_python_converts_are_param_invalid``)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist._checks import shown
from aio_datadist.testing import loopback_options

H = 10**5000  # str(H) raises ValueError
DESC = CacheDesc(2, (4, 64), DataType.DT_FLOAT16, Placement.HOST)


def refused(call: Callable[[], Any]) -> LLMException:
    with pytest.raises(LLMException) as info:
        call()
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID, info.value
    str(info.value)  # and its message can be written
    return info.value


def test_shown_tells_an_int_too_long_to_print_by_its_size() -> None:
    assert shown(5) == "5" and shown("x") == "'x'"
    assert shown(H) == f"an int of {H.bit_length()} bits"
    assert "too long to print" in shown(range(H, H + 1)) and "too long to print" in shown((1, H))


def _setter(name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(LLMConfig(), name, value)


VALUES: list[tuple[str, Callable[[], Any]]] = [
    ("CacheKey cluster", lambda: CacheKey(H, 1)),
    ("CacheKey req_id", lambda: CacheKey(1, H)),
    ("CacheKey model_id", lambda: CacheKey(1, 1, -H)),
    ("BlocksCacheKey", lambda: BlocksCacheKey(H)),
    ("CacheKeyByIdAndIndex", lambda: CacheKeyByIdAndIndex(1, H, 0)),
    ("CacheIndex", lambda: CacheIndex(1, 1, -H)),
    ("CacheDesc num_tensors", lambda: CacheDesc(H, (1, 4), DataType.DT_FLOAT16, Placement.HOST)),
    ("CacheDesc shape", lambda: CacheDesc(1, (H, 4), DataType.DT_FLOAT16, Placement.HOST)),
    ("CacheDesc negative shape", lambda: CacheDesc(1, (-H, 4), DataType.DT_FLOAT16, Placement.HOST)),
    ("CacheDesc batch_dim_index", lambda: CacheDesc(1, (1, 4), DataType.DT_FLOAT16, Placement.HOST, H)),
    ("CacheDesc placement", lambda: CacheDesc(1, (1, 4), DataType.DT_FLOAT16, H)),
    ("KvCacheExtParam src pair", lambda: KvCacheExtParam((0, H))),
    ("KvCacheExtParam dst pair", lambda: KvCacheExtParam(dst_layer_range=(H, H))),
    ("KvCacheExtParam per layer", lambda: KvCacheExtParam(tensor_num_per_layer=H)),
    ("TransferConfig cluster", lambda: TransferConfig(H, [1, 2])),
    ("TransferConfig addrs", lambda: TransferConfig(1, [H, 2])),
    ("TransferConfig range", lambda: TransferConfig(1, [1, 2], range(H, H + 1))),
    ("TransferConfig batch", lambda: TransferConfig(1, [1, 2], src_batch_index=H)),
    ("TransferWithCacheKeyConfig range", lambda: TransferWithCacheKeyConfig(BlocksCacheKey(1), range(-H, 1))),
    ("MemInfo addr", lambda: MemInfo(Memtype.MEM_TYPE_DEVICE, H, 1)),
    ("MemInfo size", lambda: MemInfo(Memtype.MEM_TYPE_DEVICE, 1, H)),
    ("LLMClusterInfo cluster", lambda: setattr(LLMClusterInfo(), "remote_cluster_id", H)),
    ("LLMClusterInfo role", lambda: setattr(LLMClusterInfo(), "remote_role_type", H)),
    ("LLMClusterInfo ip", lambda: LLMClusterInfo().append_local_ip_info(H, 1)),
    ("LLMClusterInfo port", lambda: LLMClusterInfo().append_remote_ip_info("127.0.0.1", H)),
    ("LLMDataDist cluster", lambda: LLMDataDist(LLMRole.DECODER, H)),
    ("LLMConfig rank_addresses", _setter("rank_addresses", {H: "127.0.0.1:5"})),
    ("LLMConfig negative rank_addresses", _setter("rank_addresses", {-H: "127.0.0.1:5"})),
] + [(f"LLMConfig {name}", _setter(name, value)) for name in (
    "device_id", "link_port", "link_total_time", "link_retry_count", "sync_kv_timeout", "heartbeat_interval",
    "data_channels", "copy_threads", "max_pending_handshakes", "staging_buffers", "registered_memory_cap",
    "rdma_service_level", "rdma_traffic_class", "mem_utilization", "output_max_size") for value in (H, -H)]


@pytest.mark.parametrize("call", [c for _, c in VALUES], ids=[w for w, _ in VALUES])
def test_values_and_options(call: Callable[[], Any]) -> None:
    try:
        call()
    except LLMException as exc:
        assert exc.status_code == LLMStatusCode.LLM_PARAM_INVALID, exc
        str(exc)
        return
    except TypeError:  # a documented TypeError (a property that takes no int at all)
        return
    raise AssertionError("accepted")


def _v1_calls(dd: LLMDataDist, c: Any, b: Any) -> list[tuple[str, Callable[[], Any]]]:
    kv = dd.kv_cache_manager
    key = CacheKeyByIdAndIndex(2, 1, 0)
    return [
        ("pull_cache batch_index", lambda: kv.pull_cache(key, c, H)),
        ("pull_cache size", lambda: kv.pull_cache(key, c, 0, size=H)),
        ("pull_cache negative size", lambda: kv.pull_cache(key, c, 0, size=-H)),
        ("pull_cache offset", lambda: kv.pull_cache(key, c, 0, offset=H)),
        ("pull_cache src_layer_range", lambda: kv.pull_cache(key, c, 0, src_layer_range=range(H, H + 1))),
        ("pull_cache dst_layer_range", lambda: kv.pull_cache(key, c, 0, dst_layer_range=range(-H, 1))),
        ("pull_cache timeout", lambda: kv.pull_cache(key, c, 0, timeout=H)),
        ("pull_blocks src", lambda: kv.pull_blocks(BlocksCacheKey(2), b, [H], [0])),
        ("pull_blocks dst", lambda: kv.pull_blocks(BlocksCacheKey(2), b, [0], [-H])),
        ("push_blocks src", lambda: kv.push_blocks(BlocksCacheKey(2), b, [H], [0])),
        ("push_cache size", lambda: kv.push_cache(key, c, 0, size=H)),
        ("copy_cache dst_batch_index", lambda: kv.copy_cache(c, c, H, 0)),
        ("copy_cache offset", lambda: kv.copy_cache(c, c, 0, 1, offset=H)),
        ("copy_cache size", lambda: kv.copy_cache(c, c, 0, 1, size=H)),
        ("swap_blocks", lambda: kv.swap_blocks(b, b, {H: 1})),
        ("copy_blocks", lambda: kv.copy_blocks(b, {0: [H]})),
        ("get_cache_tensors", lambda: kv.get_cache_tensors(c, H)),
        ("register_cache addrs", lambda: kv.register_cache(DESC, [H, H])),
        ("register_blocks_cache addrs", lambda: kv.register_blocks_cache(DESC, [1, H], BlocksCacheKey(1))),
        ("check_link_status", lambda: dd.check_link_status(H)),
        ("link_clusters timeout", lambda: dd.link_clusters([LLMClusterInfo()], timeout=H)),
    ]


async def _not_refused(calls: list[tuple[str, Callable[[], Any]]]) -> list[str]:
    """The calls that did not raise ``LLM_PARAM_INVALID`` (awaited where they return an awaitable), and how."""
    bare = []
    for what, call in calls:
        try:
            result = call()
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, 5)
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_PARAM_INVALID, (what, exc)
            str(exc)
        except Exception as exc:  # noqa: BLE001 - what this test looks for
            bare.append(f"{what}: {type(exc).__name__}: {str(exc)[:60]}")
        else:
            bare.append(f"{what}: accepted")
    return bare


@pytest.mark.asyncio
async def test_calls_of_an_endpoint() -> None:
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(loopback_options())
        kv = dd.kv_cache_manager
        c, b = kv.allocate_cache(DESC), kv.allocate_blocks_cache(DESC)
        bare = await _not_refused(_v1_calls(dd, c, b))
        kv.deallocate_cache(c)
        kv.deallocate_cache(b)
    assert not bare, bare


@pytest.mark.asyncio
async def test_calls_of_a_cache_manager_endpoint() -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.transport = "tcp"
    async with LLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(cfg.generate_options())
        cm = dd.cache_manager
        bare = await _not_refused([
            ("link cluster id", lambda: dd.link("c", {H: 0, 2: 1}, "{}")),
            ("link rank id", lambda: dd.link("c", {1: 0, 2: H}, "{}")),
            ("unlink", lambda: dd.unlink(H)),
            ("query_register_mem_status", lambda: dd.query_register_mem_status(-H)),
            ("unregister_cache", lambda: cm.unregister_cache(H)),
            ("register_cache addrs", lambda: cm.register_cache(DESC, [H, 1])),
            ("allocate_cache desc", lambda: cm.allocate_cache(CacheDesc(1, (H,), DataType.DT_FLOAT16))),
        ])
    assert not bare, bare
