"""Framing and message schemas of the link protocol.

Every control message is a fixed 20-byte header followed by a body whose
layout is fixed by the message type: struct fields, then at most one
length-prefixed list of u64 row indices, one length-prefixed UTF-8 text and
one length-prefixed opaque byte string (NIXL's serialized agent metadata).
Decoding checks the magic, version, type, body length and every count; no
object serialisation (pickle) is used anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import struct
from typing import Any

__all__ = ["ANSWER", "ANSWER_MAGIC", "ATTACH", "ATTACH_OK", "HEADER", "MAX_BODY", "MAX_ROWS", "MAX_TEXT", "RECORDS",
           "VERSION", "Abort", "Auth", "Done", "Empty", "Hello", "HelloAck", "LinkOk", "Msg", "NixlRecord",
           "ProtocolError", "PushLocalReq", "Record", "ReqFlag", "Resp", "Target", "TransferReq", "decode", "encode",
           "encode_record", "fields_of", "parse_header", "peer_str", "peer_text"]

MAGIC = b"AIOD"
VERSION = 11  # 2: the handshake sends nothing identifying before authentication; 3: PUSH_LOCAL;
#             4: TransferReq.block_shape (blocks layouts are checked per request, not at link time),
#                Auth.bilateral (a dial of LLMDataDist.link); 5: ReqFlag.POSTED and the ANSWER header,
#                ReqFlag.DEVICE and the share's device records; 6: the NIXL record OFFER_VRAM;
#             7: a NIXL push's notification names its link (transport/nixl.py link_tag);
#             8: NIXL reads without asking (the NIXL records LEDGER, GRANT, REVOKE, REVOKED, READS, NUDGE);
#             9: Auth.instance (the layout field, zero since 4) and LinkOk.instance: which endpoint dialled
#                (crossing link_clusters dials, link_table.LinkTable._crossing)
#            10: a bilateral dialler's PING says it set the link up (its share, NIXL, RequireTransport)
#            11: PushLocalReq.src_offset (a same-host push from inside its source rows)
HEADER = struct.Struct("!4sBBHQI")
MAX_BODY = 1 << 20
MAX_ROWS = 65536
MAX_TEXT = 4096
MAX_BLOB = 256 * 1024
NONCE_BYTES = 32
#: ``Abort.generation`` of an abort that names only the request (its channel was already replaced).
NO_GENERATION = 0xFFFFFFFF


#: The answer to a posted pull (``ReqFlag.POSTED``), on its data channel ahead of the bytes: magic, status
#: (0: accepted; else the refusal's status code, as u32), request id, total (accepted: the bytes that follow;
#: refused: the length of the refusal's UTF-8 text that follows, at most ``MAX_TEXT``). The requester's gated
#: receive reads it before anything else and stops after it when the status is not 0 (``_core.GATE_BYTES``).
#: An owner that cannot answer on the channel (one it does not hold in step) refuses with ``RESP``.
ANSWER = struct.Struct("<4sIQQ")
ANSWER_MAGIC = b"AIOA"


def peer_text(raw: bytes) -> str:
    """A peer's text as this library shows it (in exceptions and logs): UTF-8, bad bytes replaced, and every
    character that is not printable (newlines, tabs, terminal escape sequences, bidirectional overrides)
    escaped as Python writes it (``\\n``, ``\\x1b``, ``\\u202e``), so that no text of a peer's forges a log
    line or restyles a terminal."""
    text = raw.decode("utf-8", "replace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def peer_str(text: str) -> str:
    """:func:`peer_text` of text a peer sent that was decoded already (a JSON string: it may hold lone
    surrogates, shown as ``\\udcff``)."""
    return peer_text(text.encode("utf-8", "backslashreplace"))


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid message; the connection is dropped."""


class Target(enum.IntEnum):
    """How a transfer request names the owner's cache (``target_kind``)."""

    CACHE_KEY = 1
    ID_INDEX = 2
    BLOCKS_KEY = 3
    ADDRS = 4


class ReqFlag:
    """The bits of a transfer request's ``flags``: plain ints (both ends test them on every request, and
    ``enum.IntFlag`` arithmetic runs in Python)."""

    BLOCKS = 1  # the target is a blocks cache
    CONTIG = 2  # the target is a contiguous (batch-row) cache
    EXACT = 4  # whole rows: offset + nbytes must be the row size
    LOCAL = 8  # the requester can copy through a same-host share
    NIXL = 16  # the requester can move the rows with NIXL
    DEVICE = 32  # the requester can copy from a same-host peer's device cache it mapped (device IPC)
    POSTED = 64  # the requester's receive is posted on the data channel: answer there (ANSWER), not with RESP


class Msg(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    AUTH = 3
    LINK_OK = 4
    PULL_REQ = 10
    PUSH_REQ = 11
    RESP = 12
    DONE = 13
    ABORT = 14
    PUSH_LOCAL = 15
    PROBE = 20
    PROBE_ACK = 21
    UNLINK = 22
    UNLINK_ACK = 23
    PING = 24
    NIXL = 30


def _f(fmt: str) -> Any:
    """A record field with its wire format: a ``struct`` code, or ``rows`` (u64 list), ``text``, ``blob``."""
    return dataclasses.field(metadata={"fmt": fmt})


@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """The client's opening nonce; nothing identifying before it proved the secret."""

    nonce: bytes = _f(f"{NONCE_BYTES}s")


@dataclasses.dataclass(frozen=True, slots=True)
class HelloAck:
    """The server's nonce and its proof of the secret over both nonces."""

    nonce: bytes = _f(f"{NONCE_BYTES}s")
    proof: bytes = _f("32s")


@dataclasses.dataclass(frozen=True, slots=True)
class Auth:
    """The client's proof and identity."""

    proof: bytes = _f("32s")
    cluster_id: int = _f("Q")
    role: int = _f("B")
    peer_id: int = _f("Q")
    #: The dialling endpoint's instance: random, one per initialised endpoint (``LinkTable.instance``).
    instance: bytes = _f("32s")
    #: 1 for a dial of ``LLMDataDist.link`` (the peer takes it only while its own ``link`` waits for it).
    bilateral: int = dataclasses.field(default=0, metadata={"fmt": "B"})


@dataclasses.dataclass(frozen=True, slots=True)
class LinkOk:
    """The server's answer to ``AUTH``: a refusal carries only its status and text."""

    status: int = _f("q")
    cluster_id: int = _f("Q")
    role: int = _f("B")
    link_token: bytes = _f("32s")
    channels: int = _f("B")
    boot_id: bytes = _f("16s")
    local_name: bytes = _f("48s")
    #: The answering endpoint's instance (see ``Auth.instance``).
    instance: bytes = _f("32s")
    proof: bytes = _f("32s")
    text: str = _f("text")


@dataclasses.dataclass(frozen=True, slots=True)
class TransferReq:
    """``PULL_REQ`` / ``PUSH_REQ``: which cache rows, which layers, how many bytes per row, on which channel."""

    channel: int = _f("H")
    target_kind: int = _f("B")  # a :class:`Target`; an unknown kind is refused by the owner, not the framing
    cluster_id: int = _f("Q")
    cache_id: int = _f("q")
    key_req_id: int = _f("Q")
    prefix_id: int = _f("Q")
    model_id: int = _f("Q")
    batch_index: int = _f("I")
    layer_first: int = _f("i")
    layer_last: int = _f("i")
    tensor_num_per_layer: int = _f("B")
    tensor_count: int = _f("I")
    data_type: int = _f("B")
    offset: int = _f("Q")
    nbytes: int = _f("Q")
    flags: int = _f("B")
    timeout_ms: int = _f("I")
    rows: tuple[int, ...] = _f("rows")
    # A digest of the requester's block shape (its blocks cache's shape[1:]) for a whole-block
    # transfer between blocks caches, 0 otherwise; the owner compares it with its cache's.
    block_shape: int = dataclasses.field(default=0, kw_only=True, metadata={"fmt": "Q"})


@dataclasses.dataclass(frozen=True, slots=True)
class PushLocalReq(TransferReq):
    """A same-host push: the request plus the source rows the owner reads out of the pusher's region."""

    src_cache_id: int = _f("q")
    src_first: int = _f("I")
    src_nbytes: int = _f("Q")
    src_offset: int = _f("Q")  # where in each source row the bytes start
    src_rows: bytes = _f("blob")


@dataclasses.dataclass(frozen=True, slots=True)
class Resp:
    """The owner's answer to a request: refused (status), or how many bytes and where they are shared."""

    status: int = _f("q")
    total: int = _f("Q")
    cache_id: int = _f("q")
    row: int = _f("q")
    text: str = _f("text")


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """A transfer's end, as the side that saw it end reports it."""

    status: int = _f("q")
    text: str = _f("text")


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop serving a request; reset data channel ``channel`` if it is still at ``generation``."""

    channel: int = _f("H")
    generation: int = _f("I")


@dataclasses.dataclass(frozen=True, slots=True)
class Empty:
    """The body of ``PROBE``, ``PROBE_ACK``, ``UNLINK``, ``UNLINK_ACK`` and ``PING``."""


@dataclasses.dataclass(frozen=True, slots=True)
class NixlRecord:
    """One step of the NIXL exchange (``transport/nixl.py``): agent metadata or a cache's registration."""

    kind: int = _f("B")
    cache_id: int = _f("q")
    count: int = _f("Q")
    row_bytes: int = _f("Q")
    rows: tuple[int, ...] = _f("rows")
    blob: bytes = _f("blob")


#: A decoded message body.
Record = Hello | HelloAck | Auth | LinkOk | TransferReq | PushLocalReq | Resp | Done | Abort | Empty | NixlRecord

RECORDS: dict[Msg, type[Any]] = {
    # The handshake (handshake.py): nothing identifying before the client proved the secret.
    Msg.HELLO: Hello, Msg.HELLO_ACK: HelloAck, Msg.AUTH: Auth, Msg.LINK_OK: LinkOk,
    Msg.PULL_REQ: TransferReq, Msg.PUSH_REQ: TransferReq, Msg.PUSH_LOCAL: PushLocalReq,
    Msg.RESP: Resp, Msg.DONE: Done, Msg.ABORT: Abort,
    Msg.PROBE: Empty, Msg.PROBE_ACK: Empty, Msg.UNLINK: Empty, Msg.UNLINK_ACK: Empty, Msg.PING: Empty,
    Msg.NIXL: NixlRecord,
}

_SCHEMAS: dict[Msg, list[tuple[str, str]]] = {
    m: [(f.name, f.metadata["fmt"]) for f in dataclasses.fields(cls)] for m, cls in RECORDS.items()}


def _compile(fields: list[tuple[str, str]]) -> tuple[struct.Struct, list[str], str | None, bool, str | None]:
    fixed = [(n, f) for n, f in fields if f not in ("rows", "text", "blob")]
    rows = next((n for n, f in fields if f == "rows"), None)
    text = any(f == "text" for _, f in fields)
    blob = next((n for n, f in fields if f == "blob"), None)
    return struct.Struct("!" + "".join(f for _, f in fixed)), [n for n, _ in fixed], rows, text, blob


_COMPILED = {m: _compile(f) for m, f in _SCHEMAS.items()}
_NAMES = {m: [n for n, _ in f] for m, f in _SCHEMAS.items()}
_NAMESETS = {m: frozenset(names) for m, names in _NAMES.items()}
_DEFAULTS = {m: {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
             for m, cls in RECORDS.items()}


def _getter(names: list[str]) -> Any:
    """A record's field values in ``names`` order, as a tuple."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda record: tuple(getattr(record, n) for n in names)


_GET = {m: _getter(names) for m, names in _NAMES.items()}


def _slot(cls: type, name: str) -> Any:
    return next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__)


# A decoded record is built by setting its slots directly: the frozen dataclass __init__ costs
# about 3 us more per request record on the control path (measured), and decode has checked
# every value already.
_new = object.__new__


def _wire_order(msg: Msg) -> list[str]:
    """The field names in the order decode reads them: the fixed fields, then rows, text and blob."""
    _fixed, names, rows_name, has_text, blob_name = _COMPILED[msg]
    return [*names, *([rows_name] if rows_name else []), *(["text"] if has_text else []),
            *([blob_name] if blob_name else [])]


_PUT = {m: [_slot(RECORDS[m], n).__set__ for n in _wire_order(m)] for m in RECORDS}
_MSGS = {int(m): m for m in Msg}  # Msg(kind) runs enum's Python on every record
_U32 = struct.Struct("!I")
_U16 = struct.Struct("!H")

# Data connections open with this fixed record instead of a framed message.
ATTACH_MAGIC = b"AIDC"
ATTACH = struct.Struct("!4sB32sHI")
ATTACH_OK = struct.Struct("!4sq")


def encode(msg: Msg, req_id: int = 0, **fields: Any) -> bytes:
    """One framed message; ``fields`` must name every field of ``msg``'s record (a ``TypeError`` else)."""
    if fields.keys() != _NAMESETS[msg]:
        defaults = _DEFAULTS[msg]
        missing, extra = _NAMESETS[msg] - fields.keys() - defaults.keys(), fields.keys() - _NAMESETS[msg]
        if missing or extra:
            raise TypeError(f"{msg.name} ({RECORDS[msg].__name__}): missing fields {sorted(missing)}, "
                            f"unexpected fields {sorted(extra)}")
        fields = {**defaults, **fields}
    return _pack(msg, req_id, fields)


def encode_record(msg: Msg, req_id: int, record: Record, **changes: Any) -> bytes:
    """One framed message carrying ``record`` (``msg``'s record type) with ``changes`` to its fields,
    as ``dataclasses.replace`` would make them but without building the changed record."""
    if type(record) is not RECORDS[msg]:
        raise TypeError(f"{msg.name} carries {RECORDS[msg].__name__}, not {type(record).__name__}")
    fields = dict(zip(_NAMES[msg], _GET[msg](record), strict=True))
    if changes:
        if not changes.keys() <= _NAMESETS[msg]:
            raise TypeError(f"{msg.name}: unexpected fields {sorted(changes.keys() - _NAMESETS[msg])}")
        fields.update(changes)
    return _pack(msg, req_id, fields)


def _pack(msg: Msg, req_id: int, fields: dict[str, Any]) -> bytes:
    fixed, names, rows_name, has_text, blob_name = _COMPILED[msg]
    parts = [fixed.pack(*[fields[n] for n in names])]
    if rows_name is not None:
        rows = fields[rows_name]
        if len(rows) > MAX_ROWS:
            raise ValueError(f"{len(rows)} rows exceed the protocol limit of {MAX_ROWS}")
        parts.append(_U32.pack(len(rows)))
        parts.append(struct.pack(f"!{len(rows)}Q", *rows))
    if has_text:
        text = fields["text"].encode("utf-8", "replace")[:MAX_TEXT]
        parts.append(_U16.pack(len(text)))
        parts.append(text)
    if blob_name is not None:
        blob = fields[blob_name]
        if len(blob) > MAX_BLOB:
            raise ValueError(f"{len(blob)} bytes exceed the protocol's blob limit of {MAX_BLOB}")
        parts.append(_U32.pack(len(blob)))
        parts.append(bytes(blob))
    body = b"".join(parts)
    return HEADER.pack(MAGIC, VERSION, msg, 0, req_id, len(body)) + body


def parse_header(data: bytes) -> tuple[Msg, int, int]:
    """``(type, req_id, body_length)`` of a header, or :class:`ProtocolError`."""
    magic, version, kind, _flags, req_id, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not {VERSION}")
    msg = _MSGS.get(kind)
    if msg is None:
        raise ProtocolError(f"unknown message type {kind}")
    if length > MAX_BODY:
        raise ProtocolError(f"body of {length} bytes exceeds {MAX_BODY}")
    return msg, req_id, length


def decode(msg: Msg, body: bytes) -> Any:
    """``msg``'s record from ``body`` (see :data:`RECORDS`); any length or count mismatch is a
    :class:`ProtocolError`."""
    fixed, _names, rows_name, has_text, blob_name = _COMPILED[msg]
    if len(body) < fixed.size:
        raise ProtocolError(f"{msg.name} body is truncated")
    values = list(fixed.unpack_from(body, 0))  # then rows, text, blob: the order _PUT reads them in
    pos = fixed.size
    if rows_name is not None:
        if len(body) < pos + 4:
            raise ProtocolError(f"{msg.name} row count is truncated")
        (count,) = _U32.unpack_from(body, pos)
        pos += 4
        if count > MAX_ROWS or len(body) < pos + 8 * count:
            raise ProtocolError(f"{msg.name} row list is malformed")
        values.append(struct.unpack_from(f"!{count}Q", body, pos))
        pos += 8 * count
    if has_text:
        if len(body) < pos + 2:
            raise ProtocolError(f"{msg.name} text is truncated")
        (count,) = _U16.unpack_from(body, pos)
        pos += 2
        if count > MAX_TEXT or len(body) < pos + count:
            raise ProtocolError(f"{msg.name} text is malformed")
        values.append(peer_text(body[pos:pos + count]))
        pos += count
    if blob_name is not None:
        if len(body) < pos + 4:
            raise ProtocolError(f"{msg.name} blob length is truncated")
        (count,) = _U32.unpack_from(body, pos)
        pos += 4
        if count > MAX_BLOB or len(body) < pos + count:
            raise ProtocolError(f"{msg.name} blob is malformed")
        values.append(bytes(body[pos:pos + count]))
        pos += count
    if pos != len(body):
        raise ProtocolError(f"{msg.name} body has {len(body) - pos} trailing bytes")
    record = _new(RECORDS[msg])
    for put, value in zip(_PUT[msg], values, strict=True):
        put(record, value)
    return record


def fields_of(msg: Msg, body: bytes) -> dict[str, Any]:
    """:func:`decode`'s record as a dict of its fields (for tools and tests that rewrite messages)."""
    return dataclasses.asdict(decode(msg, body))

