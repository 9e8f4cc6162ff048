"""``LLMConfig`` (options builder) and ``parse_options`` (options reader).

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
``tls_server_context``     ``aio.TlsServerContext``  ``ssl.SSLContext`` (``PROTOCOL_TLS_SERVER``)
                                                     for links this endpoint accepts
``tls_client_context``     ``aio.TlsClientContext``  ``ssl.SSLContext`` (``PROTOCOL_TLS_CLIENT``)
                                                     for links this endpoint dials
``link_port``              ``aio.LinkPort``          ``link()``: rank ``r`` of a rank table is
                                                     ``device_ip:LinkPort + r`` (26000)
``rank_addresses``         ``aio.RankAddresses``     ``link()``: JSON object, rank id or device
                                                     ip -> ``"host:port"``, overriding the rule
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
import json
import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from ._checks import (
    INT32_MAX,
    INT64_MAX,
    UINT32_MAX,
    check_bool,
    check_int,
    check_ipv4,
    check_json_object,
    check_sint,
    check_str,
    check_uint,
    param_invalid,
    param_type_error,
)

__all__ = [
    "LLMConfig",
    "LlmConfig",
    "Settings",
    "parse_options",
    "parse_listen",
    "cache_manager_mode",
    "DeviceType",
    "TransportKind",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "DEFAULT_REGISTERED_MEMORY_CAP",
]

DeviceType = Literal["auto", "cpu", "cuda", "npu", "host"]
TransportKind = Literal["auto", "tcp", "local", "nixl"]
RequiredTransport = Literal["", "tcp", "local", "nixl"]
DeviceIpc = Literal["auto", "on", "off"]

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
DEFAULT_REGISTERED_MEMORY_CAP = 50 * 2**30
DEFAULT_MEM_UTILIZATION = 0.95
DEFAULT_DATA_CHANNELS = 2
DEFAULT_HEARTBEAT_INTERVAL_MS = 1000
DEFAULT_MAX_PENDING_HANDSHAKES = 64
DEFAULT_LINK_PORT = 26000
#: ``link()``'s time when ``llm.LinkTotalTime`` is 0 and ``HCCL_CONNECT_TIMEOUT`` is unset (its default).
DEFAULT_LINK_TOTAL_TIME_S = 120
DEVICE_TYPES: tuple[str, ...] = ("auto", "cpu", "cuda", "npu", "host")
TRANSPORTS: tuple[str, ...] = ("auto", "tcp", "local", "nixl")
#: What ``aio.RequireTransport`` may name ("" = nothing required).
REQUIRED_TRANSPORTS: tuple[str, ...] = ("", "tcp", "local", "nixl")
#: What ``aio.DeviceIpc`` may be.
DEVICE_IPC: tuple[str, ...] = ("auto", "on", "off")
_ROLES = ("Prompt", "Decoder", "Mix")

_MIB2 = 2 * 2**20
_INT_TEXT = re.compile(r"-?[0-9]+")

_T = TypeVar("_T")


def _default_copy_threads() -> int:
    return min(4, os.cpu_count() or 1)


# ---- value checks shared by LLMConfig setters and parse_options ----------


def parse_listen(value: object, arg_name: str = "llm.listenIpInfo") -> tuple[str, int]:
    """Split an ``"ip:port"`` listen address.

    :param value: e.g. ``"127.0.0.1:26000"``; IPv4 only; port 0 (any free
        port) is allowed.
    :param arg_name: the name used in error messages.
    :returns: ``(ip, port)``.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    text = check_str(arg_name, value)
    ip, sep, port_text = text.rpartition(":")
    if not sep or not ip:
        raise param_invalid(arg_name, f"expected 'ip:port', got {text!r}")
    check_ipv4(arg_name, ip)
    if not port_text.isdigit() or not port_text.isascii():
        raise param_invalid(arg_name, f"port must be an int in [0, 65535], got {port_text!r}")
    port = _int_from_text(arg_name, port_text)
    if port > 65535:
        raise param_invalid(arg_name, f"port must be an int in [0, 65535], got {port}")
    return ip, port


def _int_from_text(arg_name: str, raw: str) -> int:
    if not _INT_TEXT.fullmatch(raw):
        raise param_invalid(arg_name, f"expected an integer, got {raw!r}")
    try:
        return int(raw)
    except ValueError:  # more digits than sys.get_int_max_str_digits() allows
        raise param_invalid(arg_name, f"integer out of range ({len(raw)} digits)") from None


def _int_check(lo: int, hi: int, *, multiple_of: int = 1, uint32: bool = False) -> Callable[[str, object], int]:
    """``uint32``: a value outside uint32 is also a ``ValueError``, as LLM-DataDist's ``check_uint32``."""
    def check(arg_name: str, value: object) -> int:
        number = check_int(arg_name, check_uint(arg_name, value, 32) if uint32 else value, lo=lo, hi=hi)
        if number % multiple_of:
            raise param_invalid(arg_name, f"must be a multiple of {multiple_of}, got {number}")
        return number

    return check


def _int_text(check: Callable[[str, object], int]) -> Callable[[str, str], int]:
    return lambda key, raw: check(key, _int_from_text(key, raw))


def _choice_check(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    def check(arg_name: str, value: object) -> str:
        text = check_str(arg_name, value)
        if text not in choices:
            raise param_invalid(arg_name, f"must be one of {', '.join(map(repr, choices))}, got {text!r}")
        return text

    return check


def _flag_text(key: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise param_invalid(key, f"must be '0' or '1', got {raw!r}")
    return raw == "1"


def _json_int(arg_name: str, obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise param_invalid(arg_name, f"{name!r} must be an integer, got {value!r}")
    return value


def _check_json(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text:
        check_json_object(arg_name, text)
    return text


def _check_buf_pool_cfg(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if not text:
        return text
    obj = check_json_object(arg_name, text)
    unknown = set(obj) - {"buf_cfg", "buf_pool_size"}
    if unknown:
        raise param_invalid(arg_name, f"unknown field(s) {sorted(unknown)}")
    if "buf_pool_size" in obj and _json_int(arg_name, obj, "buf_pool_size") <= 0:
        raise param_invalid(arg_name, "'buf_pool_size' must be > 0")
    tiers = obj.get("buf_cfg")
    if not isinstance(tiers, list) or not tiers:
        raise param_invalid(arg_name, "'buf_cfg' must be a non-empty list of tiers")
    previous_max = 0
    for i, tier in enumerate(tiers):
        if not isinstance(tier, dict) or set(tier) != {"total_size", "blk_size", "max_buf_size"}:
            raise param_invalid(arg_name, f"tier {i} must have exactly total_size, blk_size and max_buf_size")
        total = _json_int(arg_name, tier, "total_size")
        blk = _json_int(arg_name, tier, "blk_size")
        max_buf = _json_int(arg_name, tier, "max_buf_size")
        if not 0 < total <= UINT32_MAX or total % _MIB2:
            raise param_invalid(
                arg_name, f"tier {i}: total_size must be a multiple of 2 MiB and <= 0xFFFFFFFF, got {total}"
            )
        if not 0 < blk <= _MIB2 or blk & (blk - 1):
            raise param_invalid(arg_name, f"tier {i}: blk_size must be a power of two in (0, 2 MiB], got {blk}")
        if total % blk:
            raise param_invalid(arg_name, f"tier {i}: total_size {total} is not a multiple of blk_size {blk}")
        if not blk <= max_buf < total:
            raise param_invalid(
                arg_name, f"tier {i}: need blk_size <= max_buf_size < total_size, got max_buf_size {max_buf}"
            )
        if max_buf <= previous_max:
            raise param_invalid(arg_name, f"tier {i}: max_buf_size must increase from tier to tier, got {max_buf}")
        previous_max = max_buf
    return text


def _check_mem_pool_cfg(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if not text:
        return text
    obj = check_json_object(arg_name, text)
    unknown = set(obj) - {"memory_size", "page_shift"}
    if unknown:
        raise param_invalid(arg_name, f"unknown field(s) {sorted(unknown)}")
    if _json_int(arg_name, obj, "memory_size") <= 0:
        raise param_invalid(arg_name, "'memory_size' must be > 0")
    if "page_shift" in obj and not 10 <= _json_int(arg_name, obj, "page_shift") < 31:
        raise param_invalid(arg_name, f"'page_shift' must be in [10, 31), got {obj['page_shift']}")
    return text


def _int32(arg_name: str, value: object, lo: int) -> int:
    """An int32 (``ValueError`` too outside it, as LLM-DataDist's ``check_int32``) of at least ``lo``."""
    return check_int(arg_name, check_sint(arg_name, value, 32), lo=lo)


def _check_device_id(arg_name: str, value: object) -> int | list[int] | tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise param_invalid(arg_name, "must not be empty")
        ids = [_int32(arg_name, v, 0) for v in value]
        return ids if isinstance(value, list) else tuple(ids)  # read back as given, as LLM-DataDist's
    return _int32(arg_name, value, 0)


def _check_sync_kv_timeout(arg_name: str, value: object) -> int:
    if isinstance(value, str):
        value = _int_from_text(arg_name, value)
    return _int32(arg_name, value, 1)


def _check_mem_utilization(arg_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise param_type_error(arg_name, f"expected a float, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise param_invalid(arg_name, f"must be in [0, 1], got {value}")
    return float(value)


def _check_ge_options(arg_name: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise param_type_error(arg_name, f"expected a dict of str to str, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise param_type_error(arg_name, f"expected a dict of str to str, got {key!r}: {item!r}")
    return dict(value)


def _check_listen(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text:
        parse_listen(text, arg_name)
    return text


def _check_transfer_backend(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text not in ("", "hixl"):
        raise param_invalid(arg_name, f"only 'hixl' is supported, got {text!r}")
    return text


def _check_secret(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value, allow_empty=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise param_invalid(arg_name, "must be encodable as UTF-8") from None
    return text


def _any_str(arg_name: str, value: object) -> str:
    return check_str(arg_name, value)


def _bool(arg_name: str, value: object) -> bool:
    return check_bool(arg_name, value)


_check_link_total_time = _int_check(0, UINT32_MAX)
_check_link_retry_count = _int_check(1, 100)
_check_traffic_class = _int_check(0, 255, multiple_of=4, uint32=True)
_check_service_level = _int_check(0, 7, uint32=True)
_check_output_max_size = _int_check(0, INT64_MAX)
_check_device_type = _choice_check(DEVICE_TYPES)
_check_transport = _choice_check(TRANSPORTS)
_check_require_transport = _choice_check(REQUIRED_TRANSPORTS)
_check_device_ipc = _choice_check(DEVICE_IPC)
_check_memory_cap = _int_check(1, INT64_MAX)
_check_copy_threads = _int_check(1, 64)
_check_data_channels = _int_check(1, 16)
_check_heartbeat = _int_check(1, INT32_MAX)
_check_pending_handshakes = _int_check(1, 65535)
_check_link_port = _int_check(1, 65535)


def _rank_addresses(arg_name: str, obj: Mapping[Any, Any]) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not (key.isascii() and key.isdigit()):
            check_ipv4(f"{arg_name} key", key)
        elif len(key) > len(str(UINT32_MAX)) or key != str(int(key)) or int(key) > UINT32_MAX:
            # never looked up: ranktable.rank_address asks for str(rank_id) of a uint32
            raise param_invalid(f"{arg_name} key", f"a rank id must be a uint32 in decimal without leading "
                                f"zeros, got {key!r}")
        address = parse_listen(value, f"{arg_name}[{key!r}]")
        if address[1] == 0:
            raise param_invalid(f"{arg_name}[{key!r}]", "port 0 cannot be dialled; name the port")
        out[key] = address
    return out


def _check_rank_addresses(arg_name: str, value: object) -> str:
    """A JSON object (text or dict) of rank id or device ip -> "host:port", kept as its JSON text."""
    if isinstance(value, Mapping):
        obj: Mapping[Any, Any] = {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v
                                  for k, v in value.items()}
        if len(obj) != len(value):
            raise param_invalid(arg_name, "names a rank id twice (as an int and as a str)")
    else:
        text = check_str(arg_name, value)
        if not text:
            return text
        obj = check_json_object(arg_name, text, unique_keys=True)
    _rank_addresses(arg_name, obj)
    return json.dumps(dict(obj), sort_keys=True)


def _rank_addresses_text(key: str, raw: str) -> dict[str, tuple[str, int]]:
    return _rank_addresses(key, check_json_object(key, raw, unique_keys=True)) if raw else {}


_TLS12 = ssl.TLSVersion.TLSv1_2


def _tls_versions(arg_name: str, context: ssl.SSLContext) -> None:
    """Make ``context`` speak nothing older than TLS 1.2 (raising a lower ``minimum_version``)."""
    highest = context.maximum_version
    if highest != ssl.TLSVersion.MAXIMUM_SUPPORTED and highest < _TLS12:
        raise param_invalid(arg_name, f"its maximum_version is {highest.name}; links need TLS 1.2 or later")
    lowest = context.minimum_version
    if lowest == ssl.TLSVersion.MAXIMUM_SUPPORTED or lowest >= _TLS12:
        return
    try:
        context.minimum_version = _TLS12
    except ValueError:  # a fixed-version protocol (ssl.PROTOCOL_TLSv1...): its versions cannot be changed
        if context.protocol != getattr(ssl, "PROTOCOL_TLSv1_2", None):
            raise param_invalid(arg_name, f"it was made with {context.protocol.name}, older than TLS 1.2; use "
                                "ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) or ssl.PROTOCOL_TLS_SERVER") from None


def _tls_check(side: str, wrong: Any) -> Callable[[str, object], ssl.SSLContext]:
    """The check of a TLS option's context, for the ``side`` (client or server) of a connection.

    Refused (``LLM_PARAM_INVALID`` naming the option or property): a context
    made for the other side; a client context that does not check the
    server's certificate (``verify_mode`` other than ``CERT_REQUIRED``, as
    ``ssl.SSLContext()`` / ``PROTOCOL_TLS`` leave it: TLS would then
    authenticate no peer); a server context that asks for a client
    certificate but takes a client without one (``CERT_OPTIONAL``; mutual
    TLS is ``CERT_REQUIRED``, ``CERT_NONE`` asks for none); a context whose
    ``maximum_version`` is below TLS 1.2, or made for a fixed version below it.

    Set on the given context itself (an ``ssl.SSLContext`` cannot be copied),
    so every connection it makes, ours or not, gets them:
    ``ssl.OP_NO_RENEGOTIATION`` (a TLS 1.2 peer that starts a renegotiation
    could otherwise hold plaintext views of cache memory in the TLS layer's
    write backlog after a send finished, and read the memory later), and
    ``minimum_version`` raised to TLS 1.2 where it was lower.
    """
    def check(arg_name: str, value: object) -> ssl.SSLContext:
        if not isinstance(value, ssl.SSLContext):
            raise param_invalid(arg_name, f"expected an ssl.SSLContext, got {type(value).__name__}")
        if value.protocol == wrong:
            raise param_invalid(arg_name, f"this context cannot take the {side} side of a TLS connection "
                                f"(it was made with {wrong.name}); use "
                                f"ssl.SSLContext(ssl.PROTOCOL_TLS_{side.upper()})")
        mode = value.verify_mode
        if side == "client" and mode != ssl.CERT_REQUIRED:
            raise param_invalid(arg_name, f"this context checks no server certificate (verify_mode is "
                                f"{mode.name}; ssl.SSLContext() and PROTOCOL_TLS leave it so), so TLS would "
                                "authenticate no peer; use ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT) or "
                                "ssl.create_default_context() with the peers' CA loaded, or set "
                                "verify_mode = ssl.CERT_REQUIRED")
        if side == "server" and mode == ssl.CERT_OPTIONAL:
            raise param_invalid(arg_name, "this context asks for a client certificate but takes a client "
                                "without one (verify_mode is CERT_OPTIONAL); for mutual TLS set verify_mode = "
                                "ssl.CERT_REQUIRED (with the clients' CA loaded), or CERT_NONE to ask for none")
        _tls_versions(arg_name, value)
        value.options |= ssl.OP_NO_RENEGOTIATION
        return value

    return check


_check_tls_server = _tls_check("server", ssl.PROTOCOL_TLS_CLIENT)
_check_tls_client = _tls_check("client", ssl.PROTOCOL_TLS_SERVER)


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
        _check_device_id, None, "Device id (int >= 0), or a list of them (only one is used). Required."
    )
    sync_kv_timeout = _Setting[int](
        _check_sync_kv_timeout, DEFAULT_SYNC_KV_TIMEOUT_MS, "Default timeout of transfers in ms (> 0; 1000)."
    )
    enable_switch_role = _Setting[bool](_bool, False, "Allow switch_role (bool, False).")
    ge_options = _Setting[dict[str, str]](
        _check_ge_options, {}, "Extra options merged verbatim (dict of str to str). Reading it gives the config's "
        "own dict, as in LLM-DataDist: keys added to it in place are emitted too (checked by generate_options).",
        own=True,
    )
    listen_ip_info = _Setting[str](_check_listen, "", "Listen address 'ip:port' (IPv4); '' = do not listen.")
    mem_utilization = _Setting[float](
        _check_mem_utilization, DEFAULT_MEM_UTILIZATION, "Share of the memory pool to use, [0, 1] (0.95)."
    )
    buf_pool_cfg = _Setting[str](
        _check_buf_pool_cfg,
        "",
        'Buffer tiers, JSON {"buf_cfg": [{"total_size", "blk_size", "max_buf_size"}, ...]}: total_size a '
        "multiple of 2 MiB and of blk_size, <= 0xFFFFFFFF; blk_size a power of two in (0, 2 MiB], "
        "<= max_buf_size; max_buf_size < total_size, increasing across tiers.",
    )
    enable_cache_manager = _Setting[bool](_bool, False, "CacheManager mode (bool, False).")
    enable_remote_cache_accessible = _Setting[bool](
        _bool, False, "Whether peers may read and write this endpoint's caches (bool, False as in LLM-DataDist; "
        "the option unset means on, set False to refuse every peer request with LLM_FEATURE_NOT_ENABLED)."
    )
    mem_pool_cfg = _Setting[str](
        _check_mem_pool_cfg, "", 'Device pool, JSON {"memory_size": int > 0, "page_shift": 10..30 (16)}.'
    )
    host_mem_pool_cfg = _Setting[str](_check_mem_pool_cfg, "", "Host pool, same JSON as mem_pool_cfg.")
    rdma_traffic_class = _Setting[Any](
        _check_traffic_class, None, "RDMA traffic class, 0..255 and a multiple of 4 (unset: 132)."
    )
    rdma_service_level = _Setting[Any](_check_service_level, None, "RDMA service level, 0..7 (unset: 4).")
    local_comm_res = _Setting[str](_check_json, "", "Local communication resources, JSON ('' = automatic).")
    link_total_time = _Setting[int](
        _check_link_total_time, 0, "Total link setup time in s, 0..2**32-1 (0 = HCCL_CONNECT_TIMEOUT, else 120 s)."
    )
    link_retry_count = _Setting[int](_check_link_retry_count, 1, "Link attempts, 1..100 (1).")
    transfer_backend = _Setting[str](_check_transfer_backend, "", "Transfer backend; only 'hixl' is accepted.")
    global_resource_config = _Setting[str](_check_json, "", "Backend resource options, JSON, passed through.")
    deploy_res_path = _Setting[str](_any_str, "", "Undocumented LLM-DataDist option, passed through.")
    cluster_info = _Setting[str](_check_json, "", "Undocumented LLM-DataDist option (JSON), passed through.")
    output_max_size = _Setting[Any](_check_output_max_size, None, "Undocumented LLM-DataDist option, passed through.")

    shared_secret = _Setting[Any](
        _check_secret, None, "Secret (non-empty str) both ends prove with HMAC before a link is accepted."
    )
    device_type = _Setting[str](_check_device_type, "auto", "'auto', 'cpu', 'cuda', 'npu' or 'host' ('auto').")
    device_ipc = _Setting[str](
        _check_device_ipc, "auto", "'auto', 'on' or 'off': device caches between processes of one host by device "
        "IPC; 'auto' only where the peer cannot write what it maps (not CUDA), 'on' also there ('auto').",
    )
    registered_memory_cap = _Setting[int](
        _check_memory_cap, DEFAULT_REGISTERED_MEMORY_CAP, "Cap on registered cache memory in bytes (50 GiB)."
    )
    transport = _Setting[str](_check_transport, "auto", "'auto', 'tcp', 'local' or 'nixl' ('auto').")
    require_transport = _Setting[str](
        _check_require_transport, "", "'tcp', 'local' or 'nixl': links and transfers that would take a slower "
        "transport are refused ('' = none required).",
    )
    copy_threads = _Setting[int](
        _check_copy_threads, _default_copy_threads(), "Host copy worker threads, 1..64 (min(4, cpu_count))."
    )
    data_channels = _Setting[int](
        _check_data_channels, DEFAULT_DATA_CHANNELS, "Parallel data connections per link direction, 1..16 (2)."
    )
    heartbeat_interval = _Setting[int](
        _check_heartbeat, DEFAULT_HEARTBEAT_INTERVAL_MS, "Link heartbeat period in ms (1000)."
    )
    max_pending_handshakes = _Setting[int](
        _check_pending_handshakes, DEFAULT_MAX_PENDING_HANDSHAKES,
        "Incoming connections allowed in their handshake at once, 1..65535 (64); more wait in the listen backlog.",
    )
    tls_server_context = _Setting[Any](
        _check_tls_server, None, "ssl.SSLContext for the links this endpoint accepts (None: no TLS); verify_mode "
        "CERT_NONE or CERT_REQUIRED (mutual TLS), not CERT_OPTIONAL. OP_NO_RENEGOTIATION and minimum_version "
        ">= TLS 1.2 are set on it.",
    )
    tls_client_context = _Setting[Any](
        _check_tls_client, None, "ssl.SSLContext for the links this endpoint dials (None: no TLS); it must check "
        "the server certificate (verify_mode CERT_REQUIRED). OP_NO_RENEGOTIATION and minimum_version >= TLS 1.2 "
        "are set on it.",
    )
    link_port = _Setting[int](
        _check_link_port, DEFAULT_LINK_PORT, "link(): rank r of a rank table is device_ip:link_port + r (26000)."
    )
    rank_addresses = _Setting[str](
        _check_rank_addresses, "", 'link(): JSON object (or dict) of rank id or device ip -> "host:port", '
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
        options = _check_ge_options("ge_options", explicit.get("ge_options", {}))  # may have been filled in place
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
    ("tls_server_context", "aio.TlsServerContext", lambda context: context),
    ("tls_client_context", "aio.TlsClientContext", lambda context: context),
    ("link_port", "aio.LinkPort", str),
    ("rank_addresses", "aio.RankAddresses", _non_empty),
)


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
    copy_threads: int = field(default_factory=_default_copy_threads)
    data_channels: int = DEFAULT_DATA_CHANNELS
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    max_pending_handshakes: int = DEFAULT_MAX_PENDING_HANDSHAKES
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
    ids = [_int_from_text(key, part) for part in raw.split(";")]
    if len(ids) != 1:
        raise param_invalid(key, f"one device per process is supported, got {raw!r}")
    return check_int(key, ids[0], lo=0, hi=INT32_MAX)


def _float_text(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise param_invalid(key, f"expected a number, got {raw!r}") from None
    return _check_mem_utilization(key, value)


def _digits_text(key: str, raw: str) -> str:
    if not raw.isdigit() or not raw.isascii():
        raise param_invalid(key, f"must be a single all-digit string, got {raw!r}")
    return raw


def _role_text(key: str, raw: str) -> str:
    if raw not in _ROLES:
        raise param_invalid(key, f"must be one of {', '.join(_ROLES)}, got {raw!r}")
    return raw


def _listen_text(key: str, raw: str) -> tuple[str, int]:
    return parse_listen(raw, key)


def _secret_text(key: str, raw: str) -> bytes:
    return _check_secret(key, raw).encode("utf-8")


# Maps an option key to (Settings field or None, parser(key, raw) -> value).
_KNOWN_KEYS: dict[str, tuple[str | None, Callable[[str, str], Any]]] = {
    "ge.exec.deviceId": ("device_id", _device_ids_text),
    "ge.session_device_id": ("device_id", _device_ids_text),
    "llm.DeviceId": ("device_id", _device_ids_text),
    "llm.SyncKvCacheWaitTime": ("sync_kv_timeout_ms", _check_sync_kv_timeout),
    "llm.EnableSwitchRole": ("enable_switch_role", _flag_text),
    "llm.listenIpInfo": ("listen", _listen_text),
    "llm.ListenIpInfo": ("listen", _listen_text),
    "llm.MemoryUtilization": (None, _float_text),
    "llm.BufPoolCfg": (None, _check_buf_pool_cfg),
    "llm.EnableCacheManager": (None, _flag_text),
    "llm.EnableRemoteCacheAccessible": ("remote_cache_accessible", _flag_text),
    "llm.MemPoolConfig": (None, _check_mem_pool_cfg),
    "llm.HostMemPoolConfig": (None, _check_mem_pool_cfg),
    "llm.RdmaTrafficClass": (None, _int_text(_check_traffic_class)),
    "llm.RdmaServiceLevel": (None, _int_text(_check_service_level)),
    "llm.LocalCommRes": (None, _check_json),
    "llm.LinkTotalTime": ("link_total_time_s", _int_text(_check_link_total_time)),
    "llm.LinkRetryCount": (None, _int_text(_check_link_retry_count)),
    "llm.TransferBackend": (None, _check_transfer_backend),
    "llm.GlobalResourceConfig": (None, _check_json),
    "llm.ClusterInfo": (None, _check_json),
    "llm.OutputMaxSize": (None, _int_text(_check_output_max_size)),
    "llm.Role": (None, _role_text),
    "ge.flowGraphMemMaxSize": (None, _digits_text),
    "aio.SharedSecret": ("shared_secret", _secret_text),
    "aio.DeviceType": ("device_type", _check_device_type),
    "aio.DeviceIpc": ("device_ipc", _check_device_ipc),
    "aio.RegisteredMemoryCap": ("registered_memory_cap", _int_text(_check_memory_cap)),
    "aio.Transport": ("transport", _check_transport),
    "aio.RequireTransport": ("require_transport", _check_require_transport),
    "aio.CopyThreads": ("copy_threads", _int_text(_check_copy_threads)),
    "aio.DataChannels": ("data_channels", _int_text(_check_data_channels)),
    "aio.HeartbeatIntervalMs": ("heartbeat_interval_ms", _int_text(_check_heartbeat)),
    "aio.MaxPendingHandshakes": ("max_pending_handshakes", _int_text(_check_pending_handshakes)),
    "aio.TlsServerContext": ("tls_server_context", _check_tls_server),
    "aio.TlsClientContext": ("tls_client_context", _check_tls_client),
    "aio.LinkPort": ("link_port", _int_text(_check_link_port)),
    "aio.RankAddresses": ("rank_addresses", _rank_addresses_text),
}

# Keys whose values are objects, not text.
_OBJECT_KEYS = frozenset({"aio.TlsServerContext", "aio.TlsClientContext"})


_AIO_KEYS = tuple(key for key in _KNOWN_KEYS if key.startswith("aio."))


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
            if key.startswith("aio."):
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
