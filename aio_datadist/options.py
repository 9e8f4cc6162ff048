"""``parse_options``: the options dict given to ``LLMDataDist.init``, validated and typed as :class:`Settings`
(what ``LLMConfig.generate_options()`` emits, LLM-DataDist's keys and ours under ``aio.``; ``config.py``
describes them)."""

from __future__ import annotations

import logging
import ssl
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aio_datadist.option_checks import (
    DEFAULT_DATA_CHANNELS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_LINK_PORT,
    DEFAULT_MAX_PENDING_HANDSHAKES,
    DEFAULT_REGISTERED_MEMORY_CAP,
    DEFAULT_STAGING_BUFFERS,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    ROLES,
    DeviceIpc,
    DeviceType,
    RequiredTransport,
    TransportKind,
    check_buf_pool_cfg,
    check_copy_threads,
    check_data_channels,
    check_device_ipc,
    check_device_type,
    check_heartbeat,
    check_json,
    check_link_port,
    check_link_retry_count,
    check_link_total_time,
    check_mem_pool_cfg,
    check_mem_utilization,
    check_memory_cap,
    check_output_max_size,
    check_pending_handshakes,
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
    flag_text,
    int_from_text,
    int_text,
    parse_listen,
    rank_addresses_text,
)

from ._checks import (
    INT32_MAX,
    check_int,
    param_invalid,
    param_type_error,
)

log = logging.getLogger("aio_datadist.tls")

__all__ = ["Settings", "cache_manager_mode", "parse_options"]


# ---- parse_options -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """Typed view of a validated options dict (see ``parse_options``).

    :ivar device_id: the device, or None when no device key was given.
    :ivar sync_kv_timeout_ms: default transfer timeout in ms.
    :ivar enable_switch_role: ``llm.EnableSwitchRole``.
    :ivar listen: ``(ip, port)`` to listen on, or None.
    :ivar shared_secret: the link-authentication key (UTF-8), or None.
    :ivar device_type: ``auto``, ``cpu``, ``cuda``, ``npu`` or ``host``.
    :ivar device_ipc: ``auto``, ``on`` or ``off`` (``aio.DeviceIpc``).
    :ivar registered_memory_cap: bytes of cache memory allowed.
    :ivar transport: ``auto``, ``tcp``, ``local`` or ``nixl``.
    :ivar require_transport: ``tcp``, ``local``, ``nixl``, or ``""`` (none required).
    :ivar copy_threads: host copy worker threads.
    :ivar data_channels: data connections per link direction.
    :ivar heartbeat_interval_ms: link heartbeat period in ms.
    :ivar max_pending_handshakes: incoming connections allowed in their
        handshake at once.
    :ivar staging_buffers: chunk buffers of the staging pool (device caches on
        data channels).
    :ivar tls_server_context: TLS for accepted links, or None.
    :ivar tls_client_context: TLS for dialled links, or None.
    :ivar remote_cache_accessible: whether peers may read and write this
        endpoint's caches (``llm.EnableRemoteCacheAccessible``; absent: on).
    :ivar link_total_time_s: ``llm.LinkTotalTime``: how long ``link()`` may
        take, in s (0: ``HCCL_CONNECT_TIMEOUT``, else :data:`DEFAULT_LINK_TOTAL_TIME_S`).
    :ivar link_port: ``aio.LinkPort``, the base of the rank address rule.
    :ivar rank_addresses: ``aio.RankAddresses``: rank id or device ip ->
        ``(host, port)``.
    :ivar raw: a copy of the options dict, unknown keys included.
    """

    device_id: int | None = None
    sync_kv_timeout_ms: int = DEFAULT_SYNC_KV_TIMEOUT_MS
    enable_switch_role: bool = False
    listen: tuple[str, int] | None = None
    shared_secret: bytes | None = field(default=None, repr=False)
    device_type: DeviceType = "auto"
    device_ipc: DeviceIpc = "auto"
    registered_memory_cap: int = DEFAULT_REGISTERED_MEMORY_CAP
    transport: TransportKind = "auto"
    require_transport: RequiredTransport = ""
    copy_threads: int = field(default_factory=default_copy_threads)
    data_channels: int = DEFAULT_DATA_CHANNELS
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    max_pending_handshakes: int = DEFAULT_MAX_PENDING_HANDSHAKES
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    tls_server_context: ssl.SSLContext | None = field(default=None, repr=False)
    tls_client_context: ssl.SSLContext | None = field(default=None, repr=False)
    remote_cache_accessible: bool = True
    link_total_time_s: int = 0
    link_port: int = DEFAULT_LINK_PORT
    rank_addresses: dict[str, tuple[str, int]] = field(default_factory=dict, hash=False)
    raw: dict[str, Any] = field(default_factory=dict, hash=False, repr=False)

    @property
    def tls(self) -> bool:
        """Whether links of this endpoint use TLS (either context is set)."""
        return self.tls_server_context is not None or self.tls_client_context is not None


def _device_ids_text(key: str, raw: str) -> int:
    ids = [int_from_text(key, part) for part in raw.split(";")]
    if len(ids) != 1:
        raise param_invalid(key, f"one device per process is supported, got {raw!r}")
    return check_int(key, ids[0], lo=0, hi=INT32_MAX)


def _float_text(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise param_invalid(key, f"expected a number, got {raw!r}") from None
    return check_mem_utilization(key, value)


def _digits_text(key: str, raw: str) -> str:
    if not raw.isdigit() or not raw.isascii():
        raise param_invalid(key, f"must be a single all-digit string, got {raw!r}")
    return raw


def _role_text(key: str, raw: str) -> str:
    if raw not in ROLES:
        raise param_invalid(key, f"must be one of {', '.join(ROLES)}, got {raw!r}")
    return raw


def _listen_text(key: str, raw: str) -> tuple[str, int]:
    return parse_listen(raw, key)


def _secret_text(key: str, raw: str) -> bytes:
    return check_secret(key, raw).encode("utf-8")


# Maps an option key to (Settings field or None, parser(key, raw) -> value).
_KNOWN_KEYS: dict[str, tuple[str | None, Callable[[str, str], Any]]] = {
    "ge.exec.deviceId": ("device_id", _device_ids_text),
    "ge.session_device_id": ("device_id", _device_ids_text),
    "llm.DeviceId": ("device_id", _device_ids_text),
    "llm.SyncKvCacheWaitTime": ("sync_kv_timeout_ms", check_sync_kv_timeout),
    "llm.EnableSwitchRole": ("enable_switch_role", flag_text),
    "llm.listenIpInfo": ("listen", _listen_text),
    "llm.ListenIpInfo": ("listen", _listen_text),
    "llm.MemoryUtilization": (None, _float_text),
    "llm.BufPoolCfg": (None, check_buf_pool_cfg),
    "llm.EnableCacheManager": (None, flag_text),
    "llm.EnableRemoteCacheAccessible": ("remote_cache_accessible", flag_text),
    "llm.MemPoolConfig": (None, check_mem_pool_cfg),
    "llm.HostMemPoolConfig": (None, check_mem_pool_cfg),
    "llm.RdmaTrafficClass": (None, int_text(check_traffic_class)),
    "llm.RdmaServiceLevel": (None, int_text(check_service_level)),
    "llm.LocalCommRes": (None, check_json),
    "llm.LinkTotalTime": ("link_total_time_s", int_text(check_link_total_time)),
    "llm.LinkRetryCount": (None, int_text(check_link_retry_count)),
    "llm.TransferBackend": (None, check_transfer_backend),
    "llm.GlobalResourceConfig": (None, check_json),
    "llm.ClusterInfo": (None, check_json),
    "llm.OutputMaxSize": (None, int_text(check_output_max_size)),
    "llm.Role": (None, _role_text),
    "ge.flowGraphMemMaxSize": (None, _digits_text),
    "aio.SharedSecret": ("shared_secret", _secret_text),
    "aio.DeviceType": ("device_type", check_device_type),
    "aio.DeviceIpc": ("device_ipc", check_device_ipc),
    "aio.RegisteredMemoryCap": ("registered_memory_cap", int_text(check_memory_cap)),
    "aio.Transport": ("transport", check_transport),
    "aio.RequireTransport": ("require_transport", check_require_transport),
    "aio.CopyThreads": ("copy_threads", int_text(check_copy_threads)),
    "aio.DataChannels": ("data_channels", int_text(check_data_channels)),
    "aio.HeartbeatIntervalMs": ("heartbeat_interval_ms", int_text(check_heartbeat)),
    "aio.MaxPendingHandshakes": ("max_pending_handshakes", int_text(check_pending_handshakes)),
    "aio.StagingBuffers": ("staging_buffers", int_text(check_staging_buffers)),
    "aio.TlsServerContext": ("tls_server_context", check_tls_server),
    "aio.TlsClientContext": ("tls_client_context", check_tls_client),
    "aio.LinkPort": ("link_port", int_text(check_link_port)),
    "aio.RankAddresses": ("rank_addresses", rank_addresses_text),
}

# Keys whose values are objects, not text.
_OBJECT_KEYS = frozenset({"aio.TlsServerContext", "aio.TlsClientContext"})


_AIO_KEYS = tuple(key for key in _KNOWN_KEYS if key.startswith("aio."))


def _guarded(key: str) -> str:
    """``key`` as the typo guard reads it: lower case, without spaces or characters that show as nothing
    (format characters: a byte-order mark, a zero-width space, a soft hyphen)."""
    return "".join(ch for ch in key if not ch.isspace() and unicodedata.category(ch) != "Cf").lower()


def parse_options(options: Mapping[str, Any]) -> Settings:
    """Validate the options given to ``LLMDataDist.init`` and type them.

    :param options: a dict of str to str (the TLS keys map to
        ``ssl.SSLContext`` objects), usually from
        ``LLMConfig.generate_options()``.
    :returns: the typed ``Settings``; keys that are absent take their
        defaults.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``options`` when it is
        not such a dict, or naming the option key when a known key has a bad
        value, an ``aio.`` key is unknown (a typo guard; unknown
        ``llm.``/``ge.`` keys pass through to ``raw``), two keys for the same
        setting disagree (e.g. ``ge.exec.deviceId`` and
        ``ge.session_device_id``), or TLS is combined with
        ``aio.Transport=nixl`` (NIXL moves bytes outside TLS).
    """
    if not isinstance(options, Mapping):
        raise param_type_error("options", f"expected a dict of str to str, got {type(options).__name__}")
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, raw in options.items():
        if not isinstance(key, str):
            raise param_invalid("options", f"keys must be str, got {key!r}")
        if not isinstance(raw, str) and key not in _OBJECT_KEYS:
            raise param_invalid(key, f"value must be a str, got {type(raw).__name__}")
        known = _KNOWN_KEYS.get(key)
        if known is None:
            # Spelled in any case, with spaces anywhere: a mistyped aio.SharedSecret is never a listener
            # without a secret.
            if _guarded(key).startswith("aio."):
                raise param_invalid(key, f"unknown aio option; known: {', '.join(_AIO_KEYS)}")
            continue
        field_name, parse = known
        value = parse(key, raw)
        if field_name is None:
            continue
        if field_name in values and values[field_name] != value:
            raise param_invalid(key, f"disagrees with {source[field_name]} ({options[source[field_name]]!r})")
        values[field_name] = value
        source[field_name] = key
    settings = Settings(**values, raw=dict(options))
    if settings.tls and settings.transport == "nixl":
        raise param_invalid("aio.Transport", "'nixl' moves cache bytes outside TLS; with aio.TlsServerContext or "
                            "aio.TlsClientContext set use 'auto', 'local' or 'tcp'")
    required = settings.require_transport
    if required == "nixl" and settings.transport != "nixl":
        raise param_invalid("aio.RequireTransport", f"'nixl' needs aio.Transport=nixl, not {settings.transport!r}")
    if required == "local" and settings.transport not in ("auto", "local"):
        raise param_invalid("aio.RequireTransport",
                            f"'local' needs aio.Transport 'auto' or 'local', not {settings.transport!r}")
    client = settings.tls_client_context
    if client is not None and not client.check_hostname:  # taken, once the options are (once per init)
        log.warning("aio.TlsClientContext: this context checks that the server's certificate comes from a CA it "
                    "trusts, not that it names the address dialled (check_hostname is off): any peer holding a "
                    "certificate of that CA, for any address, is taken for the one dialled")
    return settings


def cache_manager_mode(options: Mapping[str, Any]) -> bool:
    """Whether ``options`` (already checked by :func:`parse_options`) select CacheManager mode (v2).

    As LLM-DataDist decides it: ``llm.EnableCacheManager == "1"``, which
    defaults to ``"1"`` when ``llm.LocalCommRes`` is present (any value, ``""``
    included). Otherwise the endpoint runs in KvCacheManager mode (v1).

    :raises LLMException: ``LLM_PARAM_INVALID`` naming the option when
        ``llm.LocalCommRes`` is combined with ``llm.EnableCacheManager = "0"``,
        or ``llm.TransferBackend`` is set without CacheManager mode, with
        ``llm.EnableRemoteCacheAccessible = "0"`` or without a listen address.
    """
    local_comm_res = "llm.LocalCommRes" in options
    enabled = options.get("llm.EnableCacheManager", "1" if local_comm_res else "0") == "1"
    if local_comm_res and not enabled:
        raise param_invalid("llm.LocalCommRes", "is not supported when llm.EnableCacheManager is not configured")
    if "llm.TransferBackend" in options:
        if not enabled:
            raise param_invalid("llm.TransferBackend", "is not supported when llm.EnableCacheManager is not configured")
        if options.get("llm.EnableRemoteCacheAccessible", "1") != "1":
            raise param_invalid("llm.TransferBackend",
                                "is not supported when llm.EnableRemoteCacheAccessible is not enabled")
        if "llm.listenIpInfo" not in options and "llm.ListenIpInfo" not in options:
            raise param_invalid("llm.TransferBackend", "is not supported when llm.listenIpInfo is not configured")
    return enabled
