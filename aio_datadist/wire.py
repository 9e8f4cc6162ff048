"""Framing and message schemas of the link protocol.

Every control message is a fixed 20-byte header followed by a body whose
layout is fixed by the message type: struct fields, then at most one
length-prefixed list of u64 row indices, one length-prefixed UTF-8 text and
one length-prefixed opaque byte string (NIXL's serialized agent metadata).
Decoding checks the magic, version, type, body length and every count; no
object serialisation (pickle) is used anywhere.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

__all__ = ["HEADER", "MAX_BODY", "MAX_ROWS", "MAX_TEXT", "VERSION", "Msg", "ProtocolError", "ReqFlag", "Target",
           "decode_body", "encode", "parse_header", "ATTACH", "ATTACH_OK"]

MAGIC = b"AIOD"
VERSION = 3  # 2: the handshake sends nothing identifying before authentication; 3: PUSH_LOCAL
HEADER = struct.Struct("!4sBBHQI")
MAX_BODY = 1 << 20
MAX_ROWS = 65536
MAX_TEXT = 4096
MAX_BLOB = 256 * 1024
NONCE_BYTES = 32


class ProtocolError(Exception):
    """A peer sent bytes that are not a valid message; the connection is dropped."""


class Target(enum.IntEnum):
    """How a transfer request names the owner's cache (``target_kind``)."""

    CACHE_KEY = 1
    ID_INDEX = 2
    BLOCKS_KEY = 3
    ADDRS = 4


class ReqFlag(enum.IntFlag):
    """The ``flags`` of a transfer request."""

    BLOCKS = 1  # the target is a blocks cache
    CONTIG = 2  # the target is a contiguous (batch-row) cache
    EXACT = 4  # whole rows: offset + nbytes must be the row size
    LOCAL = 8  # the requester can copy through a same-host share
    NIXL = 16  # the requester can move the rows with NIXL


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


_TARGET = [("target_kind", "B"), ("cluster_id", "Q"), ("cache_id", "q"), ("key_req_id", "Q"),
           ("prefix_id", "Q"), ("model_id", "Q"), ("batch_index", "I")]
_TRANSFER = [("channel", "H"), *_TARGET, ("layer_first", "i"), ("layer_last", "i"),
             ("tensor_num_per_layer", "B"), ("tensor_count", "I"), ("data_type", "B"), ("offset", "Q"),
             ("nbytes", "Q"), ("flags", "B"), ("timeout_ms", "I"), ("rows", "rows")]

_SCHEMAS: dict[Msg, list[tuple[str, str]]] = {
    # The handshake (handshake.py): nothing identifying before the client proved the secret.
    Msg.HELLO: [("nonce", f"{NONCE_BYTES}s")],
    Msg.HELLO_ACK: [("nonce", f"{NONCE_BYTES}s"), ("proof", "32s")],
    Msg.AUTH: [("proof", "32s"), ("cluster_id", "Q"), ("role", "B"), ("peer_id", "Q"), ("layout_hash", "32s")],
    Msg.LINK_OK: [("status", "q"), ("cluster_id", "Q"), ("role", "B"), ("link_token", "32s"), ("channels", "B"),
                  ("boot_id", "16s"), ("local_name", "48s"), ("proof", "32s"), ("text", "text")],
    Msg.PULL_REQ: _TRANSFER,
    Msg.PUSH_REQ: _TRANSFER,
    # A same-host push: the owner reads the source rows out of the pusher's shared region itself.
    Msg.PUSH_LOCAL: [*_TRANSFER, ("src_cache_id", "q"), ("src_first", "I"), ("src_nbytes", "Q"),
                     ("src_rows", "blob")],
    Msg.RESP: [("status", "q"), ("total", "Q"), ("cache_id", "q"), ("row", "q"), ("text", "text")],
    Msg.DONE: [("status", "q"), ("text", "text")],
    Msg.ABORT: [("channel", "H"), ("generation", "I")],
    Msg.PROBE: [],
    Msg.PROBE_ACK: [],
    Msg.UNLINK: [],
    Msg.UNLINK_ACK: [],
    Msg.PING: [],
    Msg.NIXL: [("kind", "B"), ("cache_id", "q"), ("count", "Q"), ("row_bytes", "Q"), ("rows", "rows"),
               ("blob", "blob")],
}


def _compile(fields: list[tuple[str, str]]) -> tuple[struct.Struct, list[str], str | None, bool, str | None]:
    fixed = [(n, f) for n, f in fields if f not in ("rows", "text", "blob")]
    rows = next((n for n, f in fields if f == "rows"), None)
    text = any(f == "text" for _, f in fields)
    blob = next((n for n, f in fields if f == "blob"), None)
    return struct.Struct("!" + "".join(f for _, f in fixed)), [n for n, _ in fixed], rows, text, blob


_COMPILED = {m: _compile(f) for m, f in _SCHEMAS.items()}
_U32 = struct.Struct("!I")
_U16 = struct.Struct("!H")

# Data connections open with this fixed record instead of a framed message.
ATTACH_MAGIC = b"AIDC"
ATTACH = struct.Struct("!4sB32sHI")
ATTACH_OK = struct.Struct("!4sq")


def encode(msg: Msg, req_id: int = 0, **fields: Any) -> bytes:
    """One framed message; ``fields`` must name every field of the schema."""
    fixed, names, rows_name, has_text, blob_name = _COMPILED[msg]
    parts = [fixed.pack(*(fields[n] for n in names))]
    if rows_name is not None:
        rows = fields[rows_name]
        if len(rows) > MAX_ROWS:
            raise ValueError(f"{len(rows)} rows exceed the protocol limit of {MAX_ROWS}")
        parts.append(_U32.pack(len(rows)))
        parts.append(struct.pack(f"!{len(rows)}Q", *rows))
    if has_text:
        text = fields.get("text", "").encode("utf-8", "replace")[:MAX_TEXT]
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
    try:
        msg = Msg(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind}") from None
    if length > MAX_BODY:
        raise ProtocolError(f"body of {length} bytes exceeds {MAX_BODY}")
    return msg, req_id, length


def decode_body(msg: Msg, body: bytes) -> dict[str, Any]:
    """The fields of ``body``; any length or count mismatch is a :class:`ProtocolError`."""
    fixed, names, rows_name, has_text, blob_name = _COMPILED[msg]
    if len(body) < fixed.size:
        raise ProtocolError(f"{msg.name} body is truncated")
    out = dict(zip(names, fixed.unpack_from(body, 0), strict=True))
    pos = fixed.size
    if rows_name is not None:
        if len(body) < pos + 4:
            raise ProtocolError(f"{msg.name} row count is truncated")
        (count,) = _U32.unpack_from(body, pos)
        pos += 4
        if count > MAX_ROWS or len(body) < pos + 8 * count:
            raise ProtocolError(f"{msg.name} row list is malformed")
        out[rows_name] = struct.unpack_from(f"!{count}Q", body, pos)
        pos += 8 * count
    if has_text:
        if len(body) < pos + 2:
            raise ProtocolError(f"{msg.name} text is truncated")
        (count,) = _U16.unpack_from(body, pos)
        pos += 2
        if count > MAX_TEXT or len(body) < pos + count:
            raise ProtocolError(f"{msg.name} text is malformed")
        out["text"] = body[pos:pos + count].decode("utf-8", "replace")
        pos += count
    if blob_name is not None:
        if len(body) < pos + 4:
            raise ProtocolError(f"{msg.name} blob length is truncated")
        (count,) = _U32.unpack_from(body, pos)
        pos += 4
        if count > MAX_BLOB or len(body) < pos + count:
            raise ProtocolError(f"{msg.name} blob is malformed")
        out[blob_name] = bytes(body[pos:pos + count])
        pos += count
    if pos != len(body):
        raise ProtocolError(f"{msg.name} body has {len(body) - pos} trailing bytes")
    return out
