"""LLMConfig -> options dict -> parse_options -> Settings."""

from __future__ import annotations

import json
import os
import ssl
from contextlib import contextmanager
from typing import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist.config import LLMConfig, LlmConfig
from aio_datadist.option_checks import parse_listen
from aio_datadist.options import Settings, parse_options
from aio_datadist.status import LLMException, LLMStatusCode

MIB2 = 2 * 2**20


@contextmanager
def param_invalid_naming(name: str) -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert f"'{name}" in str(info.value), str(info.value)


def buf_pool(*tiers: tuple[int, int, int], **extra: int) -> str:
    return json.dumps(
        {"buf_cfg": [{"total_size": t, "blk_size": b, "max_buf_size": m} for t, b, m in tiers], **extra}
    )


GOOD_BUF_POOL = buf_pool((MIB2 * 4, 256, 8192), (MIB2 * 8, 8192, 65536), buf_pool_size=2**30)


def test_alias() -> None:
    assert LlmConfig is LLMConfig


def test_defaults() -> None:
    config = LLMConfig()
    assert config.device_id is None
    assert config.sync_kv_timeout == 1000
    assert config.enable_switch_role is False
    assert config.ge_options == {}
    assert config.listen_ip_info == ""
    assert config.mem_utilization == 0.95
    assert config.buf_pool_cfg == ""
    assert config.enable_cache_manager is False
    assert config.enable_remote_cache_accessible is False
    assert config.mem_pool_cfg == config.host_mem_pool_cfg == ""
    assert config.rdma_traffic_class is None and config.rdma_service_level is None
    assert config.local_comm_res == ""
    assert config.link_total_time == 0
    assert config.link_retry_count == 1
    assert config.transfer_backend == ""
    config.transfer_backend = config.transfer_backend  # "" is no backend: nothing emitted, init goes on
    assert "llm.TransferBackend" not in config.generate_options()
    assert config.shared_secret is None
    assert config.device_type == "auto"
    assert config.registered_memory_cap == 50 * 2**30
    assert config.transport == "auto"
    assert config.copy_threads == min(4, os.cpu_count() or 1)
    assert config.data_channels == 2
    assert config.heartbeat_interval == 1000
    assert config.max_pending_handshakes == 64
    assert config.staging_buffers == 4
    assert config.tls_server_context is None and config.tls_client_context is None
    assert config.generate_options() == {"llm.MemoryUtilization": "0.95"}


@pytest.mark.parametrize(
    ("name", "value", "emitted"),
    [
        ("device_id", 3, {"ge.exec.deviceId": "3", "ge.session_device_id": "3"}),
        ("device_id", [5], {"ge.exec.deviceId": "5", "ge.session_device_id": "5"}),
        ("sync_kv_timeout", 5000, {"llm.SyncKvCacheWaitTime": "5000"}),
        ("sync_kv_timeout", "250", {"llm.SyncKvCacheWaitTime": "250"}),
        ("enable_switch_role", True, {"llm.EnableSwitchRole": "1"}),
        ("enable_switch_role", False, {}),
        ("ge_options", {"ge.flowGraphMemMaxSize": "1024"}, {"ge.flowGraphMemMaxSize": "1024"}),
        ("listen_ip_info", "10.1.2.3:26000", {"llm.listenIpInfo": "10.1.2.3:26000"}),
        ("listen_ip_info", "", {}),
        ("mem_utilization", 0.5, {"llm.MemoryUtilization": "0.5"}),
        ("mem_utilization", 1, {"llm.MemoryUtilization": "1.0"}),
        ("buf_pool_cfg", GOOD_BUF_POOL, {"llm.BufPoolCfg": GOOD_BUF_POOL}),
        ("enable_cache_manager", True, {"llm.EnableCacheManager": "1"}),
        ("enable_cache_manager", False, {"llm.EnableCacheManager": "0"}),
        ("enable_remote_cache_accessible", True, {"llm.EnableRemoteCacheAccessible": "1"}),
        ("mem_pool_cfg", '{"memory_size": 1073741824}', {"llm.MemPoolConfig": '{"memory_size": 1073741824}'}),
        (
            "host_mem_pool_cfg",
            '{"memory_size": 4096, "page_shift": 30}',
            {"llm.HostMemPoolConfig": '{"memory_size": 4096, "page_shift": 30}'},
        ),
        ("rdma_traffic_class", 132, {"llm.RdmaTrafficClass": "132"}),
        ("rdma_service_level", 4, {"llm.RdmaServiceLevel": "4"}),
        ("local_comm_res", "", {"llm.LocalCommRes": ""}),
        ("local_comm_res", '{"version": "1.3"}', {"llm.LocalCommRes": '{"version": "1.3"}'}),
        ("link_total_time", 0, {"llm.LinkTotalTime": "0"}),
        ("link_total_time", 2**32 - 1, {"llm.LinkTotalTime": "4294967295"}),
        ("link_retry_count", 80, {"llm.LinkRetryCount": "80"}),
        ("transfer_backend", "hixl", {"llm.TransferBackend": "hixl"}),
        ("global_resource_config", "{}", {"llm.GlobalResourceConfig": "{}"}),
        ("shared_secret", "s3cret", {"aio.SharedSecret": "s3cret"}),
        ("device_type", "cuda", {"aio.DeviceType": "cuda"}),
        ("device_type", "auto", {"aio.DeviceType": "auto"}),
        ("registered_memory_cap", 2**20, {"aio.RegisteredMemoryCap": "1048576"}),
        ("transport", "local", {"aio.Transport": "local"}),
        ("copy_threads", 64, {"aio.CopyThreads": "64"}),
        ("data_channels", 16, {"aio.DataChannels": "16"}),
        ("heartbeat_interval", 250, {"aio.HeartbeatIntervalMs": "250"}),
        ("max_pending_handshakes", 8, {"aio.MaxPendingHandshakes": "8"}),
        ("staging_buffers", 16, {"aio.StagingBuffers": "16"}),
        ("staging_buffers", 4, {"aio.StagingBuffers": "4"}),  # the bounds are taken
        ("staging_buffers", 1024, {"aio.StagingBuffers": "1024"}),
        ("enable_remote_cache_accessible", False, {"llm.EnableRemoteCacheAccessible": "0"}),
    ],
)
def test_property_emits_its_key(name: str, value: object, emitted: dict[str, str]) -> None:
    config = LLMConfig()
    setattr(config, name, value)
    expected = {"llm.MemoryUtilization": "0.95", **emitted}
    assert config.generate_options() == expected
    parse_options(expected)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("device_id", -1),
        ("device_id", 2**31),
        ("device_id", "0"),
        ("device_id", []),
        ("device_id", [0, -1]),
        ("device_id", True),
        ("sync_kv_timeout", 0),
        ("sync_kv_timeout", "abc"),
        ("sync_kv_timeout", "-5"),
        ("sync_kv_timeout", 2**31),
        ("sync_kv_timeout", 1.5),
        ("enable_switch_role", 1),
        ("ge_options", [("a", "b")]),
        ("ge_options", {"a": 1}),
        ("listen_ip_info", "127.0.0.1"),
        ("listen_ip_info", "host:80"),
        ("listen_ip_info", "1.2.3.4:65536"),
        ("listen_ip_info", 80),
        ("mem_utilization", 1.5),
        ("mem_utilization", -0.1),
        ("mem_utilization", float("nan")),
        ("mem_utilization", "0.9"),
        ("buf_pool_cfg", "not json"),
        ("buf_pool_cfg", "[]"),
        ("buf_pool_cfg", '{"buf_cfg": []}'),
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 256, 8192)).replace("buf_cfg", "buf_cgf")),
        ("buf_pool_cfg", buf_pool((MIB2 + 1, 256, 8192))),  # total not a multiple of 2 MiB
        ("buf_pool_cfg", buf_pool((2**32, 256, 8192))),  # total > 0xFFFFFFFF
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 300, 8192))),  # blk not a power of two
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 2 * MIB2, 3 * MIB2))),  # blk > 2 MiB
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 8192, 4096))),  # blk > max_buf
        ("buf_pool_cfg", buf_pool((MIB2, 256, MIB2))),  # max_buf not < total
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 256, 8192), (MIB2 * 4, 256, 8192))),  # not increasing
        ("buf_pool_cfg", buf_pool((MIB2 * 4, 256, 8192), buf_pool_size=0)),
        ("buf_pool_cfg", '{"buf_cfg": [{"total_size": 4194304, "blk_size": 256}]}'),
        ("buf_pool_cfg", '{"buf_cfg": [{"total_size": "4194304", "blk_size": 256, "max_buf_size": 8192}]}'),
        ("enable_cache_manager", "1"),
        ("enable_remote_cache_accessible", None),
        ("mem_pool_cfg", '{"memory_size": 0}'),
        ("mem_pool_cfg", '{"page_shift": 16}'),
        ("mem_pool_cfg", '{"memory_size": 1024, "page_shift": 31}'),
        ("mem_pool_cfg", '{"memory_size": 1024, "page_shift": 9}'),
        ("mem_pool_cfg", '{"memory_size": 1024, "page_shfit": 16}'),
        ("host_mem_pool_cfg", '{"memory_size": true}'),
        ("host_mem_pool_cfg", 1024),
        ("rdma_traffic_class", 130),
        ("rdma_traffic_class", 256),
        ("rdma_service_level", 8),
        ("rdma_service_level", -1),
        ("local_comm_res", "{"),
        ("local_comm_res", None),
        ("link_total_time", -1),
        ("link_total_time", 2**32),
        ("link_retry_count", 0),
        ("link_retry_count", 101),
        ("transfer_backend", "nixl"),
        ("global_resource_config", "[1]"),
        ("shared_secret", ""),
        ("shared_secret", b"bytes"),
        ("device_type", "gpu"),
        ("device_type", None),
        ("registered_memory_cap", 0),
        ("registered_memory_cap", "1G"),
        ("transport", "rdma"),
        ("copy_threads", 0),
        ("copy_threads", 65),
        ("data_channels", 0),
        ("data_channels", 17),
        ("heartbeat_interval", 0),
        ("heartbeat_interval", 2**31),
        ("max_pending_handshakes", 0),
        ("max_pending_handshakes", 65536),
        ("max_pending_handshakes", "64"),
        ("staging_buffers", 0),
        ("staging_buffers", 3),
        ("staging_buffers", 1025),
        ("staging_buffers", True),
        ("tls_server_context", "/etc/ssl/server.pem"),
        ("tls_server_context", ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)),  # cannot take the server side
        ("tls_client_context", b"context"),
        ("tls_client_context", ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)),  # cannot take the client side
    ],
)
def test_property_rejects(name: str, value: object) -> None:
    config = LLMConfig()
    before = getattr(config, name)
    with param_invalid_naming(name):
        setattr(config, name, value)
    assert getattr(config, name) == before


def test_several_device_ids_are_emitted_but_not_accepted_by_init() -> None:
    config = LLMConfig()
    config.device_id = (1, 0)
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "1;0"
    assert options["ge.session_device_id"] == "1"
    with param_invalid_naming("ge.exec.deviceId"):
        parse_options(options)


def test_unknown_attribute_is_refused() -> None:
    config = LLMConfig()
    with pytest.raises(AttributeError):
        config.sync_kv_timout = 10  # type: ignore[attr-defined]


def test_generate_options_is_fresh_and_ge_options_come_first() -> None:
    config = LLMConfig()
    config.ge_options = {"ge.exec.deviceId": "9", "ge.graphRunMode": "0"}
    config.device_id = 1
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "1"
    assert options["ge.graphRunMode"] == "0"
    options["junk"] = "x"
    assert "junk" not in config.generate_options()
    config.ge_options["ge.other"] = "y"  # the config's own dict, as LLM-DataDist's: filled in place, emitted
    assert config.generate_options()["ge.other"] == "y"


def test_secret_must_be_utf8_encodable() -> None:
    with param_invalid_naming("shared_secret"):
        LLMConfig().shared_secret = "\ud800"
    with param_invalid_naming("aio.SharedSecret"):
        parse_options({"aio.SharedSecret": "\ud800"})


def test_repr_hides_the_secret() -> None:
    config = LLMConfig()
    config.shared_secret = "hunter2"
    assert "hunter2" not in repr(config)


# ---- parse_listen / parse_options -----------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:26000", ("127.0.0.1", 26000)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("10.0.0.1:65535", ("10.0.0.1", 65535))],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1",
        ":80",
        "127.0.0.1:",
        "127.0.0.1:-1",
        "127.0.0.1:70000",
        "localhost:80",
        "[::1]:80",
        "1.2.3:4",
        "1.2.3.4:８０",
        5,
    ],
)
def test_parse_listen_rejects(text: object) -> None:
    with param_invalid_naming("llm.listenIpInfo"):
        parse_listen(text)
    with param_invalid_naming("switch_options"):
        parse_listen(text, "switch_options")


def test_parse_options_defaults() -> None:
    settings = parse_options({})
    assert settings == Settings()
    assert settings.device_id is None
    assert settings.sync_kv_timeout_ms == 1000
    assert settings.listen is None
    assert settings.shared_secret is None
    assert settings.copy_threads == min(4, os.cpu_count() or 1)
    assert settings.raw == {}


def test_parse_options_round_trips_llm_config() -> None:
    config = LLMConfig()
    config.device_id = 2
    config.sync_kv_timeout = 3000
    config.enable_switch_role = True
    config.listen_ip_info = "127.0.0.1:26000"
    config.buf_pool_cfg = GOOD_BUF_POOL
    config.shared_secret = "päss"
    config.device_type = "cpu"
    config.registered_memory_cap = 2**30
    config.transport = "tcp"
    config.copy_threads = 2
    config.data_channels = 4
    config.heartbeat_interval = 500
    options = config.generate_options()
    options["llm.Role"] = "Prompt"
    options["llm.SomethingNew"] = "whatever"
    options["ge.flowGraphMemMaxSize"] = "2048"
    settings = parse_options(options)
    assert settings == Settings(
        device_id=2,
        sync_kv_timeout_ms=3000,
        enable_switch_role=True,
        listen=("127.0.0.1", 26000),
        shared_secret="päss".encode(),
        device_type="cpu",
        registered_memory_cap=2**30,
        transport="tcp",
        copy_threads=2,
        data_channels=4,
        heartbeat_interval_ms=500,
        raw=options,
    )
    assert settings.raw is not options
    assert "päss" not in repr(settings)
    with pytest.raises(AttributeError):
        settings.device_id = 3  # type: ignore[misc]


def test_parse_options_accepts_the_cpp_listen_key() -> None:
    assert parse_options({"llm.ListenIpInfo": "1.2.3.4:5"}).listen == ("1.2.3.4", 5)
    assert parse_options({"llm.ListenIpInfo": "1.2.3.4:5", "llm.listenIpInfo": "1.2.3.4:5"}).listen == ("1.2.3.4", 5)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"ge.exec.deviceId": "x"}, "ge.exec.deviceId"),
        ({"ge.exec.deviceId": "-1"}, "ge.exec.deviceId"),
        ({"ge.exec.deviceId": "0;1", "ge.session_device_id": "0"}, "ge.exec.deviceId"),
        ({"ge.exec.deviceId": "0", "ge.session_device_id": "1"}, "ge.session_device_id"),
        ({"llm.DeviceId": ""}, "llm.DeviceId"),
        ({"llm.SyncKvCacheWaitTime": "0"}, "llm.SyncKvCacheWaitTime"),
        ({"llm.SyncKvCacheWaitTime": "1e3"}, "llm.SyncKvCacheWaitTime"),
        ({"llm.SyncKvCacheWaitTime": " 10"}, "llm.SyncKvCacheWaitTime"),
        ({"llm.EnableSwitchRole": "true"}, "llm.EnableSwitchRole"),
        ({"llm.listenIpInfo": "127.0.0.1"}, "llm.listenIpInfo"),
        ({"llm.listenIpInfo": "1.2.3.4:5", "llm.ListenIpInfo": "1.2.3.4:6"}, "llm.ListenIpInfo"),
        ({"llm.MemoryUtilization": "2"}, "llm.MemoryUtilization"),
        ({"llm.MemoryUtilization": "nan"}, "llm.MemoryUtilization"),
        ({"llm.MemoryUtilization": "most"}, "llm.MemoryUtilization"),
        ({"llm.BufPoolCfg": "{}"}, "llm.BufPoolCfg"),
        ({"llm.EnableCacheManager": "yes"}, "llm.EnableCacheManager"),
        ({"llm.EnableRemoteCacheAccessible": "2"}, "llm.EnableRemoteCacheAccessible"),
        ({"llm.MemPoolConfig": '{"memory_size": -1}'}, "llm.MemPoolConfig"),
        ({"llm.HostMemPoolConfig": "x"}, "llm.HostMemPoolConfig"),
        ({"llm.RdmaTrafficClass": "3"}, "llm.RdmaTrafficClass"),
        ({"llm.RdmaServiceLevel": "9"}, "llm.RdmaServiceLevel"),
        ({"llm.LocalCommRes": "{"}, "llm.LocalCommRes"),
        ({"llm.LinkTotalTime": "-1"}, "llm.LinkTotalTime"),
        ({"llm.LinkRetryCount": "0"}, "llm.LinkRetryCount"),
        ({"llm.TransferBackend": "ucx"}, "llm.TransferBackend"),
        ({"llm.GlobalResourceConfig": "1"}, "llm.GlobalResourceConfig"),
        ({"llm.Role": "prefill"}, "llm.Role"),
        ({"ge.flowGraphMemMaxSize": "1024;2048"}, "ge.flowGraphMemMaxSize"),
        ({"aio.SharedSecret": ""}, "aio.SharedSecret"),
        ({"aio.DeviceType": "tpu"}, "aio.DeviceType"),
        ({"aio.RegisteredMemoryCap": "0"}, "aio.RegisteredMemoryCap"),
        ({"aio.RegisteredMemoryCap": "50G"}, "aio.RegisteredMemoryCap"),
        ({"aio.Transport": "TCP"}, "aio.Transport"),
        ({"aio.CopyThreads": "65"}, "aio.CopyThreads"),
        ({"aio.DataChannels": "0"}, "aio.DataChannels"),
        ({"aio.HeartbeatIntervalMs": "0"}, "aio.HeartbeatIntervalMs"),
        ({"aio.Transprot": "tcp"}, "aio.Transprot"),
        ({"aio.MaxPendingHandshakes": "0"}, "aio.MaxPendingHandshakes"),
        ({"aio.StagingBuffers": "0"}, "aio.StagingBuffers"),
        ({"aio.StagingBuffers": "4 "}, "aio.StagingBuffers"),
        ({"aio.TlsServerContext": "server.pem"}, "aio.TlsServerContext"),
        ({"aio.TlsServerContext": ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)}, "aio.TlsServerContext"),
        ({"aio.TlsClientContext": ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)}, "aio.TlsClientContext"),
        ({"aio.TlsClientContext": ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), "aio.Transport": "nixl"}, "aio.Transport"),
        ({"aio.SharedSecret": ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)}, "aio.SharedSecret"),
        ({"llm.SyncKvCacheWaitTime": 1000}, "llm.SyncKvCacheWaitTime"),
        ({1: "x"}, "options"),
    ],
)
def test_parse_options_rejects(options: dict[object, object], name: str) -> None:
    with param_invalid_naming(name):
        parse_options(options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [None, [("llm.Role", "Prompt")], "llm.Role=Prompt"])
def test_parse_options_needs_a_mapping(options: object) -> None:
    with param_invalid_naming("options"):
        parse_options(options)  # type: ignore[arg-type]


@given(
    secret=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1),
    device_type=st.sampled_from(["auto", "cpu", "cuda", "npu"]),
    cap=st.integers(1, 2**63 - 1),
    transport=st.sampled_from(["auto", "tcp", "local", "nixl"]),
    threads=st.integers(1, 64),
    channels=st.integers(1, 16),
    heartbeat=st.integers(1, 2**31 - 1),
    timeout=st.integers(1, 2**31 - 1),
    port=st.integers(0, 65535),
)
def test_aio_options_round_trip(
    secret: str,
    device_type: str,
    cap: int,
    transport: str,
    threads: int,
    channels: int,
    heartbeat: int,
    timeout: int,
    port: int,
) -> None:
    config = LLMConfig()
    config.shared_secret = secret
    config.device_type = device_type
    config.registered_memory_cap = cap
    config.transport = transport
    config.copy_threads = threads
    config.data_channels = channels
    config.heartbeat_interval = heartbeat
    config.sync_kv_timeout = timeout
    config.listen_ip_info = f"127.0.0.1:{port}"
    settings = parse_options(config.generate_options())
    assert settings.shared_secret == secret.encode()
    assert (settings.device_type, settings.registered_memory_cap, settings.transport) == (device_type, cap, transport)
    assert settings.copy_threads == threads
    assert settings.data_channels == channels
    assert settings.heartbeat_interval_ms == heartbeat
    assert settings.sync_kv_timeout_ms == timeout
    assert settings.listen == ("127.0.0.1", port)


def test_tls_contexts_pass_through_as_objects() -> None:
    server, client = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    config = LLMConfig()
    config.tls_server_context = server
    config.tls_client_context = client
    options = config.generate_options()
    assert options["aio.TlsServerContext"] is server and options["aio.TlsClientContext"] is client
    settings = parse_options(options)
    assert settings.tls_server_context is server and settings.tls_client_context is client and settings.tls
    assert not parse_options({}).tls
    both_ways = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert parse_options({"aio.TlsServerContext": both_ways}).tls_client_context is None


def test_remote_cache_access_unset_means_on() -> None:
    config = LLMConfig()
    assert config.enable_remote_cache_accessible is False  # LLM-DataDist's property default...
    assert parse_options(config.generate_options()).remote_cache_accessible  # ...and unset means on, as its engine
    config.enable_remote_cache_accessible = True
    assert parse_options(config.generate_options()).remote_cache_accessible
    config.enable_remote_cache_accessible = False
    assert not parse_options(config.generate_options()).remote_cache_accessible


def test_device_id_lists_read_back_as_given() -> None:
    """Reference §2.2: ``device_id`` is an int or a list/tuple of ints (``;``-joined in
    ``ge.exec.deviceId``, the first in ``ge.session_device_id``); the property reads back what was set.
    A wrong type raises ``TypeError`` as LLM-DataDist's check_isinstance does (and LLM_PARAM_INVALID)."""
    config = LLMConfig()
    config.device_id = [2, 3]
    assert config.device_id == [2, 3] and isinstance(config.device_id, list)
    config.device_id.append(9)  # a copy: the config is not changed behind its back
    assert config.device_id == [2, 3]
    assert config.generate_options()["ge.exec.deviceId"] == "2;3"
    assert config.generate_options()["ge.session_device_id"] == "2"
    config.device_id = (4,)
    assert config.device_id == (4,)
    config.device_id = [0]
    parse_options(config.generate_options())  # one device: accepted by init
    for bad in ("0", [0, "1"], 1.0):
        with pytest.raises(TypeError):
            config.device_id = bad
    assert config.device_id == [0]


@pytest.mark.parametrize(("name", "value", "kind"), [
    ("mem_utilization", "0.5", TypeError),  # LLM-DataDist: check_isinstance(float)
    ("ge_options", [("a", "b")], TypeError),  # check_isinstance(dict)
    ("ge_options", {"a": 1}, TypeError),
    ("device_id", 2**31, ValueError),  # check_int32
    ("device_id", [0, -2**31 - 1], ValueError),
    ("sync_kv_timeout", 2**31, ValueError),  # check_int32
    ("rdma_traffic_class", 2**32, ValueError),  # check_uint32
    ("rdma_service_level", -1, ValueError),  # check_uint32
])
def test_setters_raise_the_exception_types_of_llm_datadist(name: str, value: object, kind: type) -> None:
    """These raised a plain LLMException where LLM-DataDist's setters raise TypeError / ValueError; ours
    raise an LLMException (LLM_PARAM_INVALID, naming the setting) that is also of that type, and keep
    what was set before."""
    config = LLMConfig()
    before = getattr(config, name)
    with pytest.raises(LLMException) as caught:
        setattr(config, name, value)
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and caught.value.argument == name
    assert isinstance(caught.value, kind), f"{type(caught.value).__name__} is not a {kind.__name__}"
    assert getattr(config, name) == before
    # of the right type and width, but against the documented bounds: LLM_PARAM_INVALID, neither type
    inside = {"device_id": -1, "sync_kv_timeout": 0, "rdma_traffic_class": 256, "rdma_service_level": 8,
              "mem_utilization": 1.5}.get(name)
    if inside is not None:
        with pytest.raises(LLMException) as caught:
            setattr(config, name, inside)
        assert not isinstance(caught.value, (TypeError, ValueError)), name


def test_option_device_ipc_is_checked():
    from aio_datadist.options import parse_options

    cfg = LLMConfig()
    cfg.device_ipc = "on"
    assert cfg.generate_options()["aio.DeviceIpc"] == "on"
    assert parse_options(cfg.generate_options()).device_ipc == "on"
    with pytest.raises(LLMException) as caught:
        cfg.device_ipc = "always"
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "device_ipc" in str(caught.value)
    with pytest.raises(LLMException) as caught:
        parse_options({"aio.DeviceIpc": "yes"})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "aio.DeviceIpc" in str(caught.value)


@pytest.mark.parametrize("addresses", [{"01": "127.0.0.1:5"}, {"4294967296": "127.0.0.1:5"},
                                       {"9" * 5000: "127.0.0.1:5"}, {1: "127.0.0.1:5", "1": "127.0.0.2:6"}])
def test_rank_address_keys_that_no_rank_would_match_are_refused(addresses: dict[object, str]) -> None:
    """aio.RankAddresses maps a rank id (``str(rank_id)``, a uint32) or a device ip: a key such as ``"01"`` or
    one above the uint32 range is never looked up (``ranktable.rank_address`` asks for ``str(rank_id)``), and a
    property dict naming rank 1 twice (``1`` and ``"1"``) would keep only one of them; each was accepted and
    silently ignored."""
    with param_invalid_naming("rank_addresses"):
        LLMConfig().rank_addresses = addresses
    if all(isinstance(key, str) for key in addresses):
        with param_invalid_naming("aio.RankAddresses"):
            parse_options({"aio.RankAddresses": json.dumps(addresses)})
    config = LLMConfig()
    config.rank_addresses = {1: "127.0.0.1:5", "4294967295": "127.0.0.1:6"}
    assert set(parse_options(config.generate_options()).rank_addresses) == {"1", "4294967295"}


@pytest.mark.parametrize(("options", "name"), [
    ({"llm.SyncKvCacheWaitTime": "9" * 5000}, "llm.SyncKvCacheWaitTime"),
    ({"aio.DataChannels": "1" + "0" * 5000}, "aio.DataChannels"),
    ({"llm.LinkTotalTime": "9" * 5000}, "llm.LinkTotalTime"),
    ({"ge.exec.deviceId": "9" * 5000}, "ge.exec.deviceId"),
    ({"llm.listenIpInfo": "127.0.0.1:" + "9" * 5000}, "llm.listenIpInfo"),
])
def test_integers_longer_than_python_converts_are_param_invalid(options: dict[str, str], name: str) -> None:
    """A numeric option of more than 4300 digits (sys.get_int_max_str_digits) raised a bare ValueError
    from int() that named nothing, not LLM_PARAM_INVALID naming the option."""
    with param_invalid_naming(name):
        parse_options(options)
    with param_invalid_naming("sync_kv_timeout"):
        LLMConfig().sync_kv_timeout = "9" * 5000


DEEP_JSON = "[" * 100000

JSON_OPTIONS = [
    ("llm.LocalCommRes", "local_comm_res"),
    ("llm.MemPoolConfig", "mem_pool_cfg"),
    ("llm.HostMemPoolConfig", "host_mem_pool_cfg"),
    ("llm.BufPoolCfg", "buf_pool_cfg"),
    ("llm.ClusterInfo", "cluster_info"),
    ("llm.GlobalResourceConfig", "global_resource_config"),
    ("aio.RankAddresses", "rank_addresses"),
]


@pytest.mark.parametrize(("key", "name"), JSON_OPTIONS)
def test_json_nested_deeper_than_the_parser_goes_is_param_invalid(key: str, name: str) -> None:
    """Deeply nested JSON in a JSON-valued option or property raised a bare RecursionError from
    json.loads, not LLM_PARAM_INVALID naming the option."""
    with pytest.raises(LLMException) as info:
        parse_options({key: DEEP_JSON})
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and info.value.argument == key
    config = LLMConfig()
    before = getattr(config, name)
    with param_invalid_naming(name):
        setattr(config, name, DEEP_JSON)
    assert getattr(config, name) == before


@pytest.mark.asyncio
async def test_init_refuses_deeply_nested_json_naming_the_option() -> None:
    from aio_datadist import LLMDataDist, LLMRole

    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        with pytest.raises(LLMException) as info:
            await dd.init({"ge.exec.deviceId": "0", "llm.LocalCommRes": DEEP_JSON})
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert info.value.argument == "llm.LocalCommRes"
