"""What the vLLM connector sends: its side-channel frames and its ``kv_transfer_params``.

The side channel is one TCP connection from a decode worker to each prefill
worker it pulls from. A frame is a 4-byte big-endian length and a UTF-8 JSON
object of at most :data:`MAX_FRAME` bytes; nothing is ever unpickled. Each
request carries an ``id`` its reply repeats, so one connection carries many
requests at once:

- ``{"id", "op": "hello"}`` -> where the prefill's KV memory is served
  (``cluster_id``, ``data_host``, ``data_port``), its layout, and ``ops``,
  the requests it serves (a prefill of a release before ``held`` sends none);
- ``{"id", "op": "claim", "req"}`` -> ``ok`` while the request's blocks are
  still held; they are then kept for this connection until ``done``, until
  the connection closes, or until ``hold_ms`` after the reply; ``blocks``,
  the :func:`blocks_digest` of the block ids the request holds, lets the
  decode refuse ``kv_transfer_params`` that name other blocks;
- ``{"id", "op": "held", "req"}`` -> ``ok`` if the request's blocks are still
  held for this connection: asked once a pull ended, whose bytes are good only
  if the blocks were held all along (the prefill frees them only on ``done``,
  when this connection closes on its side, or past ``hold_ms``, never to hold
  them again for this connection);
- ``{"id", "op": "done", "req"}`` -> the prefill may free the blocks.

:func:`decode_frame` checks every field before anything acts on it and raises
``LLMException(LLM_PARAM_INVALID)`` naming the field otherwise.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aio_datadist._checks import param_invalid
from aio_datadist.wire import peer_str

__all__ = [
    "MAX_FRAME", "HEADER", "OPS", "CONNECTOR_TAG", "Layout", "RemotePrefill", "encode_frame", "frame_length",
    "decode_frame", "decode_reply", "transfer_params", "parse_transfer_params", "check_blocks_cover",
    "tokens_to_load", "blocks_digest",
]

MAX_FRAME = 64 * 1024
HEADER = struct.Struct(">I")
CONNECTOR_TAG = "aio_datadist"
MAX_TEXT = 256
MAX_BLOCKS = 1 << 20
UINT64_MAX = 2**64 - 1
OPS = ("hello", "claim", "held", "done")


@dataclass(frozen=True)
class Layout:
    """The KV memory a worker registered: ``tensors`` tensors of ``num_blocks`` blocks of ``block_bytes``."""

    tensors: int
    num_blocks: int
    block_bytes: int
    block_tokens: int
    dtype: str

    def as_json(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
                "block_tokens": self.block_tokens, "dtype": self.dtype}


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's ``kv_transfer_params``: where its prompt's KV lies."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    num_tokens: int


def encode_frame(message: dict[str, Any]) -> bytes:
    """One frame: length and compact JSON. Raises ``LLM_PARAM_INVALID`` past :data:`MAX_FRAME`."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_FRAME:
        raise param_invalid("message", f"encodes to {len(body)} bytes, more than {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces, refused past :data:`MAX_FRAME`."""
    if len(header) != HEADER.size:
        raise param_invalid("header", f"must be {HEADER.size} bytes, got {len(header)}")
    (length,) = HEADER.unpack(header)
    if not 0 < length <= MAX_FRAME:
        raise param_invalid("header", f"announces {length} bytes, not in [1, {MAX_FRAME}]")
    return length


def _object(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError too; and CPython's
        # limit on the digits of an int (sys.set_int_max_str_digits), which raises a bare ValueError
        raise param_invalid("frame", f"is not UTF-8 JSON: {str(exc)[:120]}") from None
    if not isinstance(message, dict):
        raise param_invalid("frame", f"must be a JSON object, got {type(message).__name__}")
    return message


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not allowed", name, 0)


def _int(message: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = message.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise param_invalid(name, f"must be an integer in [{lo}, {hi}], got {value!r:.60}")
    return value


def _text(message: dict[str, Any], name: str) -> str:
    value = message.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
        raise param_invalid(name, f"must be a non-empty string of at most {MAX_TEXT} characters, got {value!r:.60}")
    return value


def decode_frame(body: bytes) -> dict[str, Any]:
    """A request frame's body, checked: ``id`` and ``op``, and ``req`` for claim, held and done."""
    message = _object(body)
    _int(message, "id", 0, UINT64_MAX)
    op = message.get("op")
    if op not in OPS:
        raise param_invalid("op", f"must be one of {', '.join(OPS)}, got {op!r:.60}")
    if op != "hello":
        _text(message, "req")
    extra = set(message) - {"id", "op", "req"}
    if extra:
        name = sorted(extra)[0]  # (a peer's: cut as every value is)
        raise param_invalid(name[:60] + ("..." if len(name) > 60 else ""), "is not a field of a side-channel request")
    return message


def decode_reply(body: bytes, op: str) -> dict[str, Any]:
    """A reply frame's body, checked for what the request ``op`` needs."""
    message = _object(body)
    _int(message, "id", 0, UINT64_MAX)
    if not isinstance(message.get("ok"), bool):
        raise param_invalid("ok", f"must be true or false, got {message.get('ok')!r:.60}")
    if not message["ok"]:
        # shown escaped wherever it goes (exceptions, our log): a peer's text forges no log line (row 182)
        message["error"] = peer_str(_text(message, "error"))
        return message
    if op == "hello":
        _int(message, "cluster_id", 0, UINT64_MAX)
        _text(message, "data_host")
        _int(message, "data_port", 1, 65535)
        _text(message, "engine_id")
        layout = message.get("layout")
        if not isinstance(layout, dict):
            raise param_invalid("layout", "must be an object")
        message["layout"] = Layout(
            _int(layout, "tensors", 1, 4096), _int(layout, "num_blocks", 1, 2**40),
            _int(layout, "block_bytes", 1, 2**40), _int(layout, "block_tokens", 1, 2**20), _text(layout, "dtype"))
        ops = message.get("ops", [])  # absent from a prefill of a release before held
        if not isinstance(ops, list) or len(ops) > 64 or not all(isinstance(o, str) and len(o) <= 32 for o in ops):
            raise param_invalid("ops", f"must be a list of request names, got {ops!r:.60}")
    elif op == "claim":
        _int(message, "hold_ms", 1, 2**31 - 1)
        if "blocks" in message:
            _text(message, "blocks")
    return message


def blocks_digest(block_ids: Sequence[int]) -> str:
    """What a claim's reply says of the blocks a request holds: SHA-256 of their ids, in order, in hex."""
    return hashlib.sha256(",".join(str(int(b)) for b in block_ids).encode()).hexdigest()


def transfer_params(*, engine_id: str, request_id: str, host: str, port: int, block_ids: list[int],
                    num_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill returns for a request: JSON-able, forwarded as they are."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "connector": CONNECTOR_TAG,
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "remote_block_ids": list(block_ids), "remote_num_tokens": num_tokens}


def parse_transfer_params(params: dict[str, Any], block_tokens: int = 0) -> RemotePrefill:
    """A decode request's ``kv_transfer_params``, checked (``LLM_PARAM_INVALID`` naming the field); with
    ``block_tokens``, ``remote_block_ids`` must be the blocks of ``remote_num_tokens`` tokens, no more and no
    fewer: the load pulls the blocks of the tokens it needs by their place in that list."""
    if not isinstance(params, dict):
        raise param_invalid("kv_transfer_params", f"must be a dict, got {type(params).__name__}")
    if params.get("connector") != CONNECTOR_TAG:
        raise param_invalid("connector", f"must be {CONNECTOR_TAG!r}, got {params.get('connector')!r:.60}")
    blocks = params.get("remote_block_ids")
    if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], (list, tuple)):
        blocks = blocks[0]  # vLLM's one-group form, [[...]]
    if (not isinstance(blocks, (list, tuple)) or not 0 < len(blocks) <= MAX_BLOCKS
            or any(type(b) is not int or not 0 <= b < 2**40 for b in blocks)):
        raise param_invalid("remote_block_ids", f"must be a non-empty list of block ids, got {blocks!r:.60}")
    if len(set(blocks)) != len(blocks):
        raise param_invalid("remote_block_ids", "has a block id twice")
    remote = RemotePrefill(_text(params, "remote_engine_id"), _text(params, "remote_request_id"),
                           _text(params, "remote_host"), _int(params, "remote_port", 1, 65535), tuple(blocks),
                           _int(params, "remote_num_tokens", 1, 2**40))
    if block_tokens:
        check_blocks_cover(remote, block_tokens)
    return remote


def tokens_to_load(remote: RemotePrefill, prompt_tokens: int, computed_tokens: int) -> int:
    """How many tokens of a prompt of ``prompt_tokens``, ``computed_tokens`` of them found here already, the
    load of ``remote`` brings (0: none). The load pulls the blocks of the last tokens ``remote`` names, so
    those must be this prompt's: ``remote_num_tokens`` past the prompt is ``LLM_PARAM_INVALID``."""
    if remote.num_tokens > prompt_tokens:
        raise param_invalid("remote_num_tokens", f"is {remote.num_tokens}, more than the prompt's "
                                                 f"{prompt_tokens} tokens")
    return max(0, remote.num_tokens - computed_tokens)


def check_blocks_cover(remote: RemotePrefill, block_tokens: int) -> None:
    """``remote``'s block ids are those of its ``num_tokens`` tokens, ``block_tokens`` to a block; else
    ``LLM_PARAM_INVALID`` naming ``remote_block_ids``."""
    need = -(-remote.num_tokens // block_tokens)
    if len(remote.block_ids) != need:
        raise param_invalid("remote_block_ids", f"names {len(remote.block_ids)} blocks for {remote.num_tokens} "
                                                f"tokens ({need} blocks of {block_tokens} tokens)")
