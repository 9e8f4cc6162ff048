"""``LLMConfig``: the options builder (``options.parse_options`` reads what it emits).

``LLMConfig`` has LLM-DataDist's properties and emits the same option keys
from ``generate_options()``. Options of ours live under ``aio.``:

=========================  ========================  ==========================================
property                   option key                meaning (default)
=========================  ========================  ==========================================
``shared_secret``          ``aio.SharedSecret``      HMAC key both ends of a link must share
                                                     (unset: links are not authenticated)
``device_type``            ``aio.DeviceType``        ``auto`` | ``cpu`` | ``cuda`` | ``npu`` | ``host`` (auto)
``device_ipc``             ``aio.DeviceIpc``         ``auto`` | ``on`` | ``off``: device caches between
                                                     processes of one host by device IPC (auto:
                                                     where the peer cannot write what it maps)
``registered_memory_cap``  ``aio.RegisteredMemoryCap``  bytes of cache memory per process (50 GiB)
``transport``              ``aio.Transport``         ``auto`` | ``tcp`` | ``local`` | ``nixl`` (auto)
``require_transport``      ``aio.RequireTransport``  ``tcp`` | ``local`` | ``nixl``: refuse a link or a
                                                     transfer that would take a slower transport
                                                     (unset: none required)
``copy_threads``           ``aio.CopyThreads``       host copy worker threads, 1..64
                                                     (``min(4, cpu_count)``)
``data_channels``          ``aio.DataChannels``      parallel data connections per link
                                                     direction, 1..16 (2)
``heartbeat_interval``     ``aio.HeartbeatIntervalMs``  link heartbeat period in ms (1000)
``max_pending_handshakes`` ``aio.MaxPendingHandshakes``  incoming connections allowed in their
                                                     handshake at once, 1..65535 (64); more
                                                     wait in the listen backlog
``staging_buffers``        ``aio.StagingBuffers``    chunk buffers (16 MiB each) that device caches
                                                     move through on data channels, 4..1024 (4)
``tls_server_context``     ``aio.TlsServerContext``  ``ssl.SSLContext`` (``PROTOCOL_TLS_SERVER``)
                                                     for links this endpoint accepts
``tls_client_context``     ``aio.TlsClientContext``  ``ssl.SSLContext`` (``PROTOCOL_TLS_CLIENT``)
                                                     for links this endpoint dials
``link_port``              ``aio.LinkPort``          ``link()``: rank ``r`` of a rank table is
                                                     ``device_ip:LinkPort + r`` (26000)
``rank_addresses``         ``aio.RankAddresses``     ``link()``: JSON object, rank id or device
                                                     ip -> ``"ipv4:port"``, overriding the rule
=========================  ========================  ==========================================

``aio.`` keys are emitted only when set explicitly. ``parse_options`` checks
the dict that ``LLMDataDist.init`` receives and returns typed ``Settings``.
Option values are strings, except the two TLS keys, whose values are the
``ssl.SSLContext`` objects themselves (a context cannot be written as text).
Setting either turns TLS on for every link of the endpoint: it then neither
accepts nor dials a link without TLS. A listening endpoint needs the server
context, one that calls ``link_clusters`` the client context; an endpoint
that does both (MIX, or a prompt that also dials) sets both. The client
context must check the server's certificate (``verify_mode`` is
``CERT_REQUIRED``, as ``PROTOCOL_TLS_CLIENT`` makes it); a server context may
ask for no client certificate or require one (mutual TLS), not make it
optional. The check sets ``ssl.OP_NO_RENEGOTIATION`` on the given contexts and
raises their ``minimum_version`` to TLS 1.2 where it was lower.

``enable_remote_cache_accessible`` (``llm.EnableRemoteCacheAccessible``)
decides whether peers may read or write this endpoint's caches at all. As
in LLM-DataDist's CacheManager engine, which forces it on, an options dict
without the key means on; setting the property to False (``"0"``) makes
every peer request fail with ``LLM_FEATURE_NOT_ENABLED`` and keeps the
caches out of same-host sharing.
"""

from __future__ import annotations

import copy
import copyreg
import ssl
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from aio_datadist.option_checks import (
    DEFAULT_DATA_CHANNELS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_LINK_PORT,
    DEFAULT_MAX_PENDING_HANDSHAKES,
    DEFAULT_MEM_UTILIZATION,
    DEFAULT_REGISTERED_MEMORY_CAP,
    DEFAULT_STAGING_BUFFERS,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    DeviceType,
    TransportKind,
    any_str,
    as_bool,
    check_buf_pool_cfg,
    check_copy_threads,
    check_data_channels,
    check_device_id,
    check_device_ipc,
    check_device_type,
    check_ge_options,
    check_heartbeat,
    check_json,
    check_link_port,
    check_link_retry_count,
    check_link_total_time,
    check_listen,
    check_mem_pool_cfg,
    check_mem_utilization,
    check_memory_cap,
    check_output_max_size,
    check_pending_handshakes,
    check_rank_addresses,
    check_require_transport,
    check_secret,
    check_service_level,
    check_staging_buffers,
    check_sync_kv_timeout,
    check_tls_client,
    check_tls_server,
    check_traffic_class,
    check_transfer_backend,
    check_transport,
    default_copy_threads,
    parse_listen,
)
from aio_datadist.options import Settings, cache_manager_mode, parse_options

# With what this module held before parse_options and the checks moved out (options.py, option_checks.py): imports
# of them from here keep working.
__all__ = ["LLMConfig", "LlmConfig", "Settings", "parse_options", "parse_listen", "cache_manager_mode", "DeviceType",
           "TransportKind", "DEFAULT_SYNC_KV_TIMEOUT_MS", "DEFAULT_REGISTERED_MEMORY_CAP"]

_T = TypeVar("_T")


# ---- LLMConfig -------------------------------------------------------------


class _Setting(Generic[_T]):
    """A validated ``LLMConfig`` property; only explicitly set values are stored."""

    def __init__(self, check: Callable[[str, Any], _T], default: _T, doc: str, *, own: bool = False) -> None:
        """``own``: reading returns the stored value itself (a mutable one, made from ``default`` by
        ``check`` on first read), not a copy; for ``ge_options``, which clients fill in place."""
        self.check = check
        self.default = default
        self.own = own
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _Setting[_T]: ...
    @overload
    def __get__(self, obj: LLMConfig, owner: type | None = None) -> _T: ...
    def __get__(self, obj: LLMConfig | None, owner: type | None = None) -> _T | _Setting[_T]:
        if obj is None:
            return self
        if self.own:  # the config's own dict, made on first read: filling it in place adds to it
            return obj._explicit.setdefault(self.name, self.check(self.name, self.default))
        value = obj._explicit.get(self.name, self.default)
        if isinstance(value, (dict, list)):
            return type(value)(value)  # type: ignore[return-value]  # a copy: the config keeps its own
        return value

    def __set__(self, obj: LLMConfig, value: _T) -> None:
        obj._explicit[self.name] = self.check(self.name, value)


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _non_empty(value: str) -> str | None:
    return value or None


class LLMConfig:
    """Builds the options dict for ``LLMDataDist.init``.

    Set properties by assignment; each is validated at once and a bad value
    raises ``LLMException(LLM_PARAM_INVALID)`` naming the property. Then call
    ``generate_options()``. Unknown attribute names raise ``AttributeError``.
    """

    __slots__ = ("_explicit",)

    device_id = _Setting[Any](
        check_device_id, None, "Device id (int >= 0), or a list of them (only one is used). Required."
    )
    sync_kv_timeout = _Setting[int](
        check_sync_kv_timeout, DEFAULT_SYNC_KV_TIMEOUT_MS, "Default timeout of transfers in ms (> 0; 1000)."
    )
    enable_switch_role = _Setting[bool](as_bool, False, "Allow switch_role (bool, False).")
    ge_options = _Setting[dict[str, str]](
        check_ge_options, {}, "Extra options merged verbatim (dict of str to str). Reading it gives the config's "
        "own dict, as in LLM-DataDist: keys added to it in place are emitted too (checked by generate_options).",
        own=True,
    )
    listen_ip_info = _Setting[str](check_listen, "", "Listen address 'ip:port' (IPv4); '' = do not listen.")
    mem_utilization = _Setting[float](
        check_mem_utilization, DEFAULT_MEM_UTILIZATION, "Share of the memory pool to use, [0, 1] (0.95)."
    )
    buf_pool_cfg = _Setting[str](
        check_buf_pool_cfg,
        "",
        'Buffer tiers, JSON {"buf_cfg": [{"total_size", "blk_size", "max_buf_size"}, ...]}: total_size a '
        "multiple of 2 MiB and of blk_size, <= 0xFFFFFFFF; blk_size a power of two in (0, 2 MiB], "
        "<= max_buf_size; max_buf_size < total_size, increasing across tiers.",
    )
    enable_cache_manager = _Setting[bool](as_bool, False, "CacheManager mode (bool, False).")
    enable_remote_cache_accessible = _Setting[bool](
        as_bool, False, "Whether peers may read and write this endpoint's caches (bool, False as in LLM-DataDist; "
        "the option unset means on, set False to refuse every peer request with LLM_FEATURE_NOT_ENABLED)."
    )
    mem_pool_cfg = _Setting[str](
        check_mem_pool_cfg, "", 'Device pool, JSON {"memory_size": int > 0, "page_shift": 10..30 (16)}.'
    )
    host_mem_pool_cfg = _Setting[str](check_mem_pool_cfg, "", "Host pool, same JSON as mem_pool_cfg.")
    rdma_traffic_class = _Setting[Any](
        check_traffic_class, None, "RDMA traffic class, 0..255 and a multiple of 4 (unset: 132)."
    )
    rdma_service_level = _Setting[Any](check_service_level, None, "RDMA service level, 0..7 (unset: 4).")
    local_comm_res = _Setting[str](check_json, "", "Local communication resources, JSON ('' = automatic).")
    link_total_time = _Setting[int](
        check_link_total_time, 0, "Total link setup time in s, 0..2**32-1 (0 = HCCL_CONNECT_TIMEOUT, else 120 s)."
    )
    link_retry_count = _Setting[int](check_link_retry_count, 1, "Link attempts, 1..100 (1).")
    transfer_backend = _Setting[str](check_transfer_backend, "", "Transfer backend; only 'hixl' is accepted.")
    global_resource_config = _Setting[str](check_json, "", "Backend resource options, JSON, passed through.")
    deploy_res_path = _Setting[str](any_str, "", "Undocumented LLM-DataDist option, passed through.")
    cluster_info = _Setting[str](check_json, "", "Undocumented LLM-DataDist option (JSON), passed through.")
    output_max_size = _Setting[Any](check_output_max_size, None, "Undocumented LLM-DataDist option, passed through.")

    shared_secret = _Setting[Any](
        check_secret, None, "Secret (non-empty str) both ends prove with HMAC before a link is accepted."
    )
    device_type = _Setting[str](check_device_type, "auto", "'auto', 'cpu', 'cuda', 'npu' or 'host' ('auto').")
    device_ipc = _Setting[str](
        check_device_ipc, "auto", "'auto', 'on' or 'off': device caches between processes of one host by device "
        "IPC; 'auto' only where the peer cannot write what it maps (not CUDA), 'on' also there ('auto').",
    )
    registered_memory_cap = _Setting[int](
        check_memory_cap, DEFAULT_REGISTERED_MEMORY_CAP, "Cap on registered cache memory in bytes (50 GiB)."
    )
    transport = _Setting[str](check_transport, "auto", "'auto', 'tcp', 'local' or 'nixl' ('auto').")
    require_transport = _Setting[str](
        check_require_transport, "", "'tcp', 'local' or 'nixl': links and transfers that would take a slower "
        "transport are refused ('' = none required).",
    )
    copy_threads = _Setting[int](
        check_copy_threads, default_copy_threads(), "Host copy worker threads, 1..64 (min(4, cpu_count))."
    )
    data_channels = _Setting[int](
        check_data_channels, DEFAULT_DATA_CHANNELS, "Parallel data connections per link direction, 1..16 (2)."
    )
    heartbeat_interval = _Setting[int](
        check_heartbeat, DEFAULT_HEARTBEAT_INTERVAL_MS, "Link heartbeat period in ms (1000)."
    )
    max_pending_handshakes = _Setting[int](
        check_pending_handshakes, DEFAULT_MAX_PENDING_HANDSHAKES,
        "Incoming connections allowed in their handshake at once, 1..65535 (64); more wait in the listen backlog.",
    )
    staging_buffers = _Setting[int](
        check_staging_buffers, DEFAULT_STAGING_BUFFERS,
        "Chunk buffers (16 MiB each) of the pool that device caches move through on data channels, 4..1024 (4); "
        "one link holds at most 3 of them (its sends 2).",
    )
    tls_server_context = _Setting[Any](
        check_tls_server, None, "ssl.SSLContext for the links this endpoint accepts (None: no TLS); verify_mode "
        "CERT_NONE or CERT_REQUIRED (mutual TLS), not CERT_OPTIONAL. OP_NO_RENEGOTIATION and minimum_version "
        ">= TLS 1.2 are set on it.",
    )
    tls_client_context = _Setting[Any](
        check_tls_client, None, "ssl.SSLContext for the links this endpoint dials (None: no TLS); it must check "
        "the server certificate (verify_mode CERT_REQUIRED), and should check its name (check_hostname: off is "
        "taken with a warning at init). OP_NO_RENEGOTIATION and minimum_version >= TLS 1.2 are set on it.",
    )
    link_port = _Setting[int](
        check_link_port, DEFAULT_LINK_PORT, "link(): rank r of a rank table is device_ip:link_port + r (26000)."
    )
    rank_addresses = _Setting[str](
        check_rank_addresses, "", 'link(): JSON object (or dict) of rank id or device ip -> "ipv4:port", '
        "overriding the link_port rule for those ranks ('' = none).",
    )

    def __init__(self) -> None:
        self._explicit: dict[str, Any] = {}

    def __copy__(self) -> LLMConfig:
        """A config of its own (a base copied per endpoint), as a plain object's copy: settings assigned to
        either later stay there; the values themselves (``ge_options``' dict) are shared."""
        new = self._blank()
        new._explicit = dict(self._explicit)
        for name, value in self._own_attributes():
            setattr(new, name, value)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> LLMConfig:
        """Every value copied, except the TLS contexts, which cannot be (they are shared)."""
        new = self._blank()
        memo[id(self)] = new
        new._explicit = {name: value if isinstance(value, ssl.SSLContext) else copy.deepcopy(value, memo)
                         for name, value in self._explicit.items()}
        for name, value in self._own_attributes():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def _blank(self) -> LLMConfig:
        """A new config of this one's class (a subclass's copies keep its overrides), without its settings."""
        cls = type(self)
        new = cls.__new__(cls)
        new._explicit = {}
        return new

    def _own_attributes(self) -> list[tuple[str, Any]]:
        """A subclass's own attributes, in its ``__dict__`` or its ``__slots__`` (what a plain copy keeps)."""
        names = [*getattr(self, "__dict__", {}), *copyreg._slotnames(type(self))]  # type: ignore[attr-defined]
        return [(name, getattr(self, name)) for name in names if name != "_explicit" and hasattr(self, name)]

    def generate_options(self) -> dict[str, Any]:
        """The options dict for ``LLMDataDist.init``.

        ``ge_options`` come first, then one key per property that was set
        (``device_id`` gives both ``ge.exec.deviceId`` and
        ``ge.session_device_id``); ``llm.MemoryUtilization`` is always
        present. ``aio.`` keys appear only for properties set explicitly.
        Every value is a str except ``aio.TlsServerContext`` and
        ``aio.TlsClientContext``, which hold the ``ssl.SSLContext`` itself.

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``ge_options`` when
            what was put into it in place is not str to str.
        """
        explicit = self._explicit
        options = check_ge_options("ge_options", explicit.get("ge_options", {}))  # may have been filled in place
        if "device_id" in explicit:
            ids = explicit["device_id"]
            ids = ids if isinstance(ids, (list, tuple)) else (ids,)
            options["ge.exec.deviceId"] = ";".join(map(str, ids))
            options["ge.session_device_id"] = str(ids[0])
        for name, key, to_text in _EMITTED:
            if name in explicit:
                text = to_text(explicit[name])
                if text is not None:
                    options[key] = text
        if explicit.get("enable_switch_role"):
            options["llm.EnableSwitchRole"] = "1"
        options["llm.MemoryUtilization"] = str(self.mem_utilization)
        return options

    def __repr__(self) -> str:
        shown = {k: ("***" if k == "shared_secret" else v) for k, v in self._explicit.items()}
        body = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"LLMConfig({body})"


LlmConfig = LLMConfig

_EMITTED: tuple[tuple[str, str, Callable[[Any], str | None]], ...] = (
    ("sync_kv_timeout", "llm.SyncKvCacheWaitTime", str),
    ("deploy_res_path", "llm.deployResPath", _non_empty),
    ("buf_pool_cfg", "llm.BufPoolCfg", _non_empty),
    ("mem_pool_cfg", "llm.MemPoolConfig", _non_empty),
    ("host_mem_pool_cfg", "llm.HostMemPoolConfig", _non_empty),
    ("enable_cache_manager", "llm.EnableCacheManager", _flag),
    ("enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible", _flag),
    ("listen_ip_info", "llm.listenIpInfo", _non_empty),
    ("link_total_time", "llm.LinkTotalTime", str),
    ("link_retry_count", "llm.LinkRetryCount", str),
    ("rdma_traffic_class", "llm.RdmaTrafficClass", str),
    ("rdma_service_level", "llm.RdmaServiceLevel", str),
    ("local_comm_res", "llm.LocalCommRes", str),
    ("transfer_backend", "llm.TransferBackend", _non_empty),  # "" (its default) is no backend: not emitted
    ("global_resource_config", "llm.GlobalResourceConfig", str),
    ("cluster_info", "llm.ClusterInfo", _non_empty),
    ("output_max_size", "llm.OutputMaxSize", str),
    ("shared_secret", "aio.SharedSecret", str),
    ("device_type", "aio.DeviceType", str),
    ("device_ipc", "aio.DeviceIpc", str),
    ("registered_memory_cap", "aio.RegisteredMemoryCap", str),
    ("transport", "aio.Transport", str),
    ("require_transport", "aio.RequireTransport", _non_empty),
    ("copy_threads", "aio.CopyThreads", str),
    ("data_channels", "aio.DataChannels", str),
    ("heartbeat_interval", "aio.HeartbeatIntervalMs", str),
    ("max_pending_handshakes", "aio.MaxPendingHandshakes", str),
    ("staging_buffers", "aio.StagingBuffers", str),
    ("tls_server_context", "aio.TlsServerContext", lambda context: context),
    ("tls_client_context", "aio.TlsClientContext", lambda context: context),
    ("link_port", "aio.LinkPort", str),
    ("rank_addresses", "aio.RankAddresses", _non_empty),
)
