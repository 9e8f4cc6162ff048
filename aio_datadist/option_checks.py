"""What each option of ``LLMDataDist.init`` may be: the defaults, and the value checks that ``LLMConfig``'s
properties (``config.py``) and ``parse_options`` (``options.py``) share. Each check takes the argument's name (a
property or an option key) and the value, and returns the value it accepts or raises ``LLMException``
(``LLM_PARAM_INVALID``) naming the argument; the ``*_text`` forms read an option's string value."""

from __future__ import annotations

import json
import os
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any, Literal

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
    shown,
)

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
#: Chunk buffers of the endpoint's staging pool (``aio.StagingBuffers``; device caches on data channels).
DEFAULT_STAGING_BUFFERS = 4
DEFAULT_LINK_PORT = 26000
#: ``link()``'s time when ``llm.LinkTotalTime`` is 0 and ``HCCL_CONNECT_TIMEOUT`` is unset (its default).
DEFAULT_LINK_TOTAL_TIME_S = 120
DEVICE_TYPES: tuple[str, ...] = ("auto", "cpu", "cuda", "npu", "host")
TRANSPORTS: tuple[str, ...] = ("auto", "tcp", "local", "nixl")
#: What ``aio.RequireTransport`` may name ("" = nothing required).
REQUIRED_TRANSPORTS: tuple[str, ...] = ("", "tcp", "local", "nixl")
#: What ``aio.DeviceIpc`` may be.
DEVICE_IPC: tuple[str, ...] = ("auto", "on", "off")
ROLES = ("Prompt", "Decoder", "Mix")

_MIB2 = 2 * 2**20
_INT_TEXT = re.compile(r"-?[0-9]+")


def default_copy_threads() -> int:
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
    port = int_from_text(arg_name, port_text)
    if port > 65535:
        raise param_invalid(arg_name, f"port must be an int in [0, 65535], got {port}")
    return ip, port


def int_from_text(arg_name: str, raw: str) -> int:
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
            raise param_invalid(arg_name, f"must be a multiple of {multiple_of}, got {shown(number)}")
        return number

    return check


def int_text(check: Callable[[str, object], int]) -> Callable[[str, str], int]:
    return lambda key, raw: check(key, int_from_text(key, raw))


def _choice_check(choices: tuple[str, ...]) -> Callable[[str, object], str]:
    def check(arg_name: str, value: object) -> str:
        text = check_str(arg_name, value)
        if text not in choices:
            raise param_invalid(arg_name, f"must be one of {', '.join(map(repr, choices))}, got {text!r}")
        return text

    return check


def flag_text(key: str, raw: str) -> bool:
    if raw not in ("0", "1"):
        raise param_invalid(key, f"must be '0' or '1', got {raw!r}")
    return raw == "1"


def _json_int(arg_name: str, obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise param_invalid(arg_name, f"{name!r} must be an integer, got {value!r}")
    return value


def check_json(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text:
        check_json_object(arg_name, text)
    return text


def _json_fields(arg_name: str, value: object, fields: set[str]) -> tuple[str, dict[str, Any] | None]:
    """The text of a JSON-object option and the object (None for ''), refused if it has fields beyond
    ``fields``."""
    text = check_str(arg_name, value)
    if not text:
        return text, None
    obj = check_json_object(arg_name, text)
    unknown = set(obj) - fields
    if unknown:
        raise param_invalid(arg_name, f"unknown field(s) {sorted(unknown)}")
    return text, obj


def check_buf_pool_cfg(arg_name: str, value: object) -> str:
    text, obj = _json_fields(arg_name, value, {"buf_cfg", "buf_pool_size"})
    if obj is None:
        return text
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


def check_mem_pool_cfg(arg_name: str, value: object) -> str:
    text, obj = _json_fields(arg_name, value, {"memory_size", "page_shift"})
    if obj is None:
        return text
    if _json_int(arg_name, obj, "memory_size") <= 0:
        raise param_invalid(arg_name, "'memory_size' must be > 0")
    if "page_shift" in obj and not 10 <= _json_int(arg_name, obj, "page_shift") < 31:
        raise param_invalid(arg_name, f"'page_shift' must be in [10, 31), got {obj['page_shift']}")
    return text


def _int32(arg_name: str, value: object, lo: int) -> int:
    """An int32 (``ValueError`` too outside it, as LLM-DataDist's ``check_int32``) of at least ``lo``."""
    return check_int(arg_name, check_sint(arg_name, value, 32), lo=lo)


def check_device_id(arg_name: str, value: object) -> int | list[int] | tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise param_invalid(arg_name, "must not be empty")
        ids = [_int32(arg_name, v, 0) for v in value]
        return ids if isinstance(value, list) else tuple(ids)  # read back as given, as LLM-DataDist's
    return _int32(arg_name, value, 0)


def check_sync_kv_timeout(arg_name: str, value: object) -> int:
    if isinstance(value, str):
        value = int_from_text(arg_name, value)
    return _int32(arg_name, value, 1)


def check_mem_utilization(arg_name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise param_type_error(arg_name, f"expected a float, got {type(value).__name__}")
    if not 0.0 <= value <= 1.0:
        raise param_invalid(arg_name, f"must be in [0, 1], got {shown(value)}")
    return float(value)


def check_ge_options(arg_name: str, value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise param_type_error(arg_name, f"expected a dict of str to str, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise param_type_error(arg_name, f"expected a dict of str to str, got {key!r}: {item!r}")
    return dict(value)


def check_listen(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text:
        parse_listen(text, arg_name)
    return text


def check_transfer_backend(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value)
    if text not in ("", "hixl"):
        raise param_invalid(arg_name, f"only 'hixl' is supported, got {text!r}")
    return text


def utf8_encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates). A caller refusing a secret raises after this
    returned, outside any ``except``: the ``UnicodeEncodeError`` (its ``object``: the whole secret) is then in
    no exception's ``__context__``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_secret(arg_name: str, value: object) -> str:
    text = check_str(arg_name, value, allow_empty=False)
    if not utf8_encodable(text):
        raise param_invalid(arg_name, "must be encodable as UTF-8")
    return text


def any_str(arg_name: str, value: object) -> str:
    return check_str(arg_name, value)


def as_bool(arg_name: str, value: object) -> bool:
    return check_bool(arg_name, value)


check_link_total_time = _int_check(0, UINT32_MAX)
check_link_retry_count = _int_check(1, 100)
check_traffic_class = _int_check(0, 255, multiple_of=4, uint32=True)
check_service_level = _int_check(0, 7, uint32=True)
check_output_max_size = _int_check(0, INT64_MAX)
check_device_type = _choice_check(DEVICE_TYPES)
check_transport = _choice_check(TRANSPORTS)
check_require_transport = _choice_check(REQUIRED_TRANSPORTS)
check_device_ipc = _choice_check(DEVICE_IPC)
check_memory_cap = _int_check(1, INT64_MAX)
check_copy_threads = _int_check(1, 64)
check_data_channels = _int_check(1, 16)
check_heartbeat = _int_check(1, INT32_MAX)
check_pending_handshakes = _int_check(1, 65535)
check_staging_buffers = _int_check(4, 1024)  # fewer: a link's send and receive at once would wait for each other
check_link_port = _int_check(1, 65535)


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


def check_rank_addresses(arg_name: str, value: object) -> str:
    """A JSON object (text or dict) of rank id or device ip -> "ipv4:port" (an IPv4 address), kept as its JSON text."""
    if isinstance(value, Mapping):
        for key in value:  # a rank id str() cannot write (over 4300 digits) is no uint32 either
            if isinstance(key, int) and not isinstance(key, bool) and not 0 <= key <= UINT32_MAX:
                raise param_invalid(f"{arg_name} key", f"rank id {shown(key)} is not a uint32")
        obj: Mapping[Any, Any] = {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v
                                  for k, v in value.items()}
        if len(obj) != len(value):
            twice = next(k for k in value if isinstance(k, int) and not isinstance(k, bool) and str(k) in value)
            raise param_invalid(arg_name, f"names rank id {twice} twice (as an int and as a str)")
    else:
        text = check_str(arg_name, value)
        if not text:
            return text
        obj = check_json_object(arg_name, text, unique_keys=True)
    _rank_addresses(arg_name, obj)
    return json.dumps(dict(obj), sort_keys=True)


def rank_addresses_text(key: str, raw: str) -> dict[str, tuple[str, int]]:
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
                                "ssl.create_default_context() with the peers' CA loaded (they also check that the "
                                "certificate names the address dialled), or set verify_mode = ssl.CERT_REQUIRED and "
                                "check_hostname = True")
        if side == "server" and mode == ssl.CERT_OPTIONAL:
            raise param_invalid(arg_name, "this context asks for a client certificate but takes a client "
                                "without one (verify_mode is CERT_OPTIONAL); for mutual TLS set verify_mode = "
                                "ssl.CERT_REQUIRED (with the clients' CA loaded), or CERT_NONE to ask for none")
        _tls_versions(arg_name, value)
        value.options |= ssl.OP_NO_RENEGOTIATION
        return value

    return check


check_tls_server = _tls_check("server", ssl.PROTOCOL_TLS_CLIENT)
check_tls_client = _tls_check("client", ssl.PROTOCOL_TLS_SERVER)
