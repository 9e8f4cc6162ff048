"""Hostile wire input: random and mutated frames and requests, in-process and over a live link.

The owner (a PROMPT here) registers its caches out of one host tensor with
random canary bytes before, between and after every cache tensor
(:class:`_harness.Arena`). Whatever a peer sends,

- framing and decoding end in a typed record or a ``ProtocolError``, nothing else;
- the link's protocol object (``protocol.LinkProtocol``) makes the same
  events of the same bytes however they are cut, or fails with a
  ``ProtocolError`` after which it parses nothing; a live link's reader acts
  on every frame, in order, up to a malformed one or the end of the stream;
- the owner's validation (``owner.serve_plan``) refuses with a status
  code or plans byte ranges that lie inside registered cache tensors only;
- over a real authenticated link, a refused request changes no byte, an
  accepted one moves exactly the bytes an independent model of the layout
  predicts (pulls: the bytes received; pushes: the whole arena compared
  with its shadow, canaries included);
- a malformed frame is answered with an error or drops that connection,
  never the process: no exception escapes into the event loop, and the
  endpoint's other link keeps carrying verified transfers.

Counts: at least 10,000 generated cases in all (see the summary).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMRole,
    LLMStatusCode,
    Placement,
    owner,
    protocol,
    wire,
)
from aio_datadist.protocol import LinkProtocol
from aio_datadist.testing import link_to, runtime_of
from aio_datadist.types import UINT64_MAX
from aio_datadist.transport.base import Refusal, Served
from aio_datadist.wire import Msg, ProtocolError, ReqFlag
from peers import port_of

from _harness import Arena, endpoint, state
from _rawpeer import RawLink, Refused, dial, recv_exactly, recv_frame, rest_of_stream
from _budget import SEED, scaled
from _tally import count

S = LLMStatusCode
PROMPT, DECODER = 1, 2
SECRET = "fuzz-secret"
# Halved on 2026-12-03 (CI took 14.5-15.5 minutes on an AMD VM): tools/soak.py runs more, with other seeds.
DECODE_EXAMPLES = scaled(1500)
PLAN_EXAMPLES = scaled(2500)
LIVE_EXAMPLES = scaled(1250)
PROTOCOL_EXAMPLES = scaled(500)
MALFORMED_FRAMES = scaled(300)
WRONG_VERSIONS = [v for v in (0, 1, 2, 255) if v != wire.VERSION]

#: The arena's caches: (desc, blocks?, model_id or req_ids).
ARENA = [
    (CacheDesc(4, (8, 64), DataType.DT_FLOAT16, Placement.HOST), True, 0),  # 8 blocks of 128 B
    (CacheDesc(4, (3, 256), DataType.DT_FLOAT16, Placement.HOST), False, (100, 101, 102)),  # rows of 512 B
    (CacheDesc(2, (16, 32), DataType.DT_BF16, Placement.HOST), True, 1),  # 16 blocks of 64 B, one layer
    (CacheDesc(6, (2, 96), DataType.DT_FLOAT, Placement.HOST), False, ()),  # rows of 384 B, 3 layers
]
LEGIT = CacheDesc(4, (4, 1024), DataType.DT_FLOAT16, Placement.HOST)

# CI: the same examples every run; a soak round (SEED > 0): new ones, the same again for the same seed
SETTINGS = dict(derandomize=SEED == 0, database=None, deadline=None, suppress_health_check=list(HealthCheck))


def u(bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, 2**bits - 1)


def s(bits: int) -> st.SearchStrategy[int]:
    return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


EDGES64 = [0, 1, 2, 3, 7, 8, 15, 16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def edgy(bits: int, extra: Sequence[int] = ()) -> st.SearchStrategy[int]:
    edges = [e for e in EDGES64 if e < 2**bits] + list(extra)
    return st.one_of(st.sampled_from(edges), u(bits))


# -- 1. framing ---------------------------------------------------------------------------


def valid_fields(msg: Msg, draw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, fmt in wire._SCHEMAS[msg]:
        if fmt == "rows":
            fields[name] = draw(st.lists(u(64), max_size=6))
        elif fmt == "text":
            fields[name] = draw(st.text(max_size=20))
        elif fmt == "blob":
            fields[name] = draw(st.binary(max_size=40))
        elif fmt.endswith("s"):
            fields[name] = draw(st.binary(min_size=int(fmt[:-1]), max_size=int(fmt[:-1])))
        else:
            size = struct.calcsize("!" + fmt) * 8
            fields[name] = draw(s(size) if fmt.islower() else u(size))
    return fields


@st.composite
def frames(draw: Any) -> bytes:
    """A valid frame, then (usually) mutated: flipped bytes, cut, extended, header fields rewritten."""
    msg = draw(st.sampled_from(list(Msg)))
    frame = bytearray(wire.encode(msg, draw(u(64)), **valid_fields(msg, draw)))
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(["flip", "cut", "extend", "version", "type", "length", "magic"]))
        if how == "flip" and frame:
            at = draw(st.integers(0, len(frame) - 1))
            frame[at] ^= draw(st.integers(1, 255))
        elif how == "cut":
            del frame[draw(st.integers(0, len(frame))):]
        elif how == "extend":
            frame += draw(st.binary(max_size=16))
        elif len(frame) >= wire.HEADER.size:
            magic, version, kind, flags, req_id, length = wire.HEADER.unpack_from(frame)
            if how == "version":
                version = draw(u(8))
            elif how == "type":
                kind = draw(u(8))
            elif how == "length":
                length = draw(edgy(32, [wire.MAX_BODY, wire.MAX_BODY + 1]))
            else:
                magic = draw(st.binary(min_size=4, max_size=4))
            frame[:wire.HEADER.size] = wire.HEADER.pack(magic, version, kind, flags, req_id, length)
    return bytes(frame)


def decode_frame(frame: bytes) -> tuple[Msg, int, dict[str, Any]]:
    """What a reader does with a frame: header, then exactly ``length`` body bytes; the message's
    typed record (checked) as a dict of its fields."""
    if len(frame) < wire.HEADER.size:
        raise ProtocolError("short frame")
    msg, req_id, length = wire.parse_header(frame[:wire.HEADER.size])
    assert 0 <= length <= wire.MAX_BODY
    body = frame[wire.HEADER.size:wire.HEADER.size + length]
    if len(body) < length:
        raise ProtocolError("short body")
    record = wire.decode(msg, body)
    assert type(record) is wire.RECORDS[msg]
    return msg, req_id, dataclasses.asdict(record)


def test_every_frame_decodes_to_fields_or_a_protocol_error():
    @settings(max_examples=DECODE_EXAMPLES, **SETTINGS)
    @seed(SEED)
    @given(st.one_of(frames(), st.binary(min_size=20, max_size=120)))
    def decode(frame: bytes) -> None:
        count("fuzz cases (in-process)")
        try:
            msg, req_id, fields = decode_frame(frame)
        except ProtocolError:
            return
        # a decoded message re-encodes to the same body (unless invalid UTF-8 text was replaced, or characters
        # that are not printable were escaped: wire.peer_text)
        body = frame[wire.HEADER.size:]
        again = wire.encode(msg, req_id, **fields)[wire.HEADER.size:]
        text = fields.get("text", "")
        assert again == body[:len(again)] or "\ufffd" in text or "\\" in text
        assert text.isprintable()

    decode()


@settings(max_examples=scaled(300), **SETTINGS)
@seed(SEED)
@given(st.sampled_from(list(Msg)), st.data(), st.binary(min_size=1, max_size=16))
def test_a_decoded_body_is_the_whole_message(msg: Msg, data: Any, extra: bytes) -> None:
    """The round trip is exact: a body decodes to a record that re-encodes to all of it, so a body with
    bytes past its last field (a shrunken count, a longer length) is a ProtocolError, not a shorter record."""
    count("fuzz cases (in-process)")
    body = wire.encode(msg, 0, **valid_fields(msg, data.draw))[wire.HEADER.size:]
    fields = dataclasses.asdict(wire.decode(msg, body))
    if "\\" not in fields.get("text", "") and "\ufffd" not in fields.get("text", ""):
        assert wire.encode(msg, 0, **fields)[wire.HEADER.size:] == body
    with pytest.raises(ProtocolError):
        wire.decode(msg, body + extra)


@pytest.mark.parametrize("msg, field, limit", [(Msg.PULL_REQ, "rows", wire.MAX_ROWS), (Msg.DONE, "text", wire.MAX_TEXT),
                                               (Msg.NIXL, "blob", wire.MAX_BLOB)])
def test_a_count_past_its_protocol_limit_is_a_protocol_error(msg: Msg, field: str, limit: int) -> None:
    """A row list, text or blob of exactly its limit round-trips; one more item (the body still far under MAX_BODY)
    is a ProtocolError: its record would re-encode to other bytes (text cut) or not at all (ValueError)."""
    item = {"rows": (7,), "text": "x", "blob": b"x"}[field]
    fields = {n: {"rows": (), "text": "", "blob": b""}.get(f, 0) for n, f in wire._SCHEMAS[msg]}
    body = wire.encode(msg, 0, **{**fields, field: item * limit})[wire.HEADER.size:]
    assert wire.encode(msg, 0, **wire.fields_of(msg, body))[wire.HEADER.size:] == body
    at, width = wire._COMPILED[msg][0].size + 4 * (field == "blob"), 2 if field == "text" else 4  # NIXL: 0 rows
    over = body[:at] + (limit + 1).to_bytes(width, "big") + body[at + width:] + (b"\0" * 8 if field == "rows" else b"x")
    with pytest.raises(ProtocolError):
        wire.decode(msg, over)


def feed(proto: LinkProtocol, pieces: Sequence[bytes]) -> tuple[list[protocol.Event], ProtocolError | None]:
    """Every event ``pieces`` give, and the error that failed ``proto`` (raised or left in ``error``)."""
    events: list[protocol.Event] = []
    for piece in pieces:
        if proto.error is not None:
            with pytest.raises(ProtocolError) as again:  # failed: nothing more is parsed
                proto.receive(piece)
            assert again.value is proto.error and proto.pending_bytes == 0
            continue
        try:
            events += proto.receive(piece)
        except ProtocolError as exc:
            assert exc is proto.error
    return events, proto.error


def reference(data: bytes) -> tuple[list[tuple[Msg, int, Any]], str | None]:
    """What a reader makes of ``data``, frame after frame, up to its first malformed or incomplete one."""
    out, pos = [], 0
    try:
        while len(data) - pos >= wire.HEADER.size:
            msg, req_id, length = wire.parse_header(data[pos:pos + wire.HEADER.size])
            if len(data) - pos - wire.HEADER.size < length:
                break
            out.append((msg, req_id, wire.decode(msg, data[pos + wire.HEADER.size:pos + wire.HEADER.size + length])))
            pos += wire.HEADER.size + length
    except ProtocolError as exc:
        return out, str(exc)
    return out, None


def test_the_link_protocol_gives_the_same_events_however_the_frames_are_cut():
    @settings(max_examples=PROTOCOL_EXAMPLES, **SETTINGS)
    @seed(SEED)
    @given(st.lists(st.one_of(frames(), st.binary(max_size=40)), min_size=1, max_size=6), st.booleans(),
           st.lists(st.integers(0, 2**16), max_size=12), st.data())
    def cut(parts: list[bytes], is_client: bool, cuts: list[int], data: Any) -> None:
        count("fuzz cases (in-process)")
        stream = b"".join(parts)
        ends = sorted({c % (len(stream) + 1) for c in cuts})
        chunked = [stream[a:b] for a, b in zip([0, *ends], [*ends, len(stream)], strict=True)]
        runs = {"whole": [stream, b""], "bytes": [stream[i:i + 1] for i in range(len(stream))] + [b""],
                "chunks": [*chunked, b""]}
        seen = {how: feed(LinkProtocol(is_client), pieces) for how, pieces in runs.items()}
        (events, error), = {(tuple(e), None if x is None else str(x)) for e, x in seen.values()}
        frames_, wanted = reference(stream)
        assert error == wanted
        assert len(events) == len(frames_)
        for event, (msg, req_id, record) in zip(events, frames_, strict=True):
            assert event.req_id == req_id
            assert getattr(event, "record", wire.Empty()) == record
            assert getattr(event, "msg", msg) is msg
        if error is not None:  # failed: more frames are not parsed, whatever they hold
            proto = LinkProtocol(is_client)
            feed(proto, runs["chunks"])
            first = proto.error
            assert first is not None
            for more in (wire.encode(Msg.PROBE, 1), data.draw(frames())):
                with pytest.raises(ProtocolError) as again:
                    proto.receive(more)
                assert again.value is first

    cut()


# -- 2. the owner's validation, in-process --------------------------------------------------


class Target:
    """The fuzzed owner's caches, as an independent model (ids, keys, rows, byte layout)."""

    def __init__(self, arena: Arena, caches: list[Any], legit: Any) -> None:
        self.arena = arena
        self.caches = caches  # arena caches, in ARENA order
        self.legit = legit
        self.by_id = {c.cache_id: c for c in caches + [legit]}  # the legit cache is registered too
        self.blocks_keys = {spec[2]: c for spec, c in zip(ARENA, caches) if spec[1]}
        self.req_keys = {req: (c, row) for spec, c in zip(ARENA, caches) if not spec[1]
                         for row, req in enumerate(spec[2])}
        spans = sorted((b, b + c.layout.tensor_bytes) for c in caches + [legit] for b in c.layout.bases)
        self.registered = spans

    def inside(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies in one registered tensor, or in adjacent ones."""
        pos = start
        for lo, hi in self.registered:
            if lo <= pos < hi:
                pos = hi
                if pos >= end:
                    return True
        return start == end

    def release(self) -> None:
        """Drop the caches: hypothesis may keep the strategies (and so this object) past the test."""
        self.caches.clear()
        self.by_id.clear()
        self.blocks_keys.clear()
        self.req_keys.clear()
        self.legit = None

    def addresses(self) -> list[int]:
        return [b for c in self.caches for b in c.layout.bases]


FIELD_EDGES: dict[str, st.SearchStrategy[int]] = {
    "channel": edgy(16, [1, 2, 3, 4, 5]),
    "target_kind": st.sampled_from([0, 1, 2, 3, 4, 5, 255]),
    "cluster_id": edgy(64),
    "cache_id": st.one_of(st.integers(-3, 12), st.sampled_from([2**63 - 1, -2**63]), s(64)),
    "key_req_id": st.one_of(st.sampled_from([99, 100, 101, 102, 103, UINT64_MAX]), edgy(64)),
    "prefix_id": st.sampled_from([0, 100, UINT64_MAX - 1]),
    "model_id": st.one_of(st.integers(0, 3), edgy(64)),
    "batch_index": st.one_of(st.integers(0, 17), edgy(32)),
    "layer_first": st.one_of(st.integers(-3, 4), st.sampled_from([-2**31, 2**31 - 1]), s(32)),
    "layer_last": st.one_of(st.integers(-3, 4), st.sampled_from([-2**31, 2**31 - 1]), s(32)),
    "tensor_num_per_layer": st.one_of(st.integers(0, 4), st.just(255)),
    "tensor_count": st.one_of(st.integers(0, 9), edgy(32)),
    "data_type": st.one_of(st.sampled_from([0, 1, 2, 13, 27]), u(8)),
    "offset": st.one_of(st.sampled_from([1, 63, 64, 127, 128, 383, 384, 511, 512, 513]), edgy(64)),
    "nbytes": st.one_of(st.sampled_from([0, 1, 63, 64, 65, 127, 128, 129, 383, 384, 385, 511, 512, 513]), edgy(64)),
    "flags": st.one_of(st.integers(0, 15), u(8)),
    "timeout_ms": st.one_of(st.sampled_from([0, 1]), u(32)),
}


def requests(target: Target, channels: Sequence[int]) -> st.SearchStrategy[dict[str, Any]]:
    """PULL_REQ/PUSH_REQ field dicts: a valid request for one of the owner's caches, then 0 to 3
    fields rewritten with edge values, or the row / address list replaced by hostile entries."""
    caches = target.caches
    hostile_row = st.one_of(st.integers(0, 20), st.sampled_from([2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1]), u(64))
    shift = st.one_of(st.integers(-1024, 1024), st.sampled_from([-1, 64, 128, 384, 512, 4096, -4096]),
                      st.integers(-2**40, 2**40))

    @st.composite
    def build(draw: Any) -> dict[str, Any]:
        index = draw(st.integers(0, len(caches) - 1))
        cache, (desc, blocks, keys) = caches[index], ARENA[index]
        lay = cache.layout
        layers = lay.num_tensors // 2
        first = draw(st.integers(-1, layers - 1))
        last = -1 if first == -1 else draw(st.integers(first, layers - 1))
        tensors = lay.num_tensors if first == -1 else 2 * (last - first + 1)
        req = dict(channel=draw(st.sampled_from(list(channels))), target_kind=2, cluster_id=PROMPT,
                   cache_id=cache.cache_id, key_req_id=UINT64_MAX, prefix_id=UINT64_MAX, model_id=0, batch_index=0,
                   layer_first=first, layer_last=last, tensor_num_per_layer=2, tensor_count=tensors,
                   data_type=desc.data_type.value, offset=0, nbytes=lay.row_bytes, flags=0, timeout_ms=1000, rows=())
        if blocks and draw(st.integers(0, 4)) == 0:  # raw addresses (TransferConfig), a block list
            pair = draw(st.integers(0, layers - 1))
            near_edges = st.sampled_from([0, 0, 0, 0, 1, -1, 32, -32, 64, lay.row_bytes, -lay.row_bytes,
                                          lay.tensor_bytes - lay.row_bytes + 32, lay.tensor_bytes])
            addrs = [max(0, b + draw(near_edges)) for b in lay.bases[2 * pair:2 * pair + 2]]
            req.update(target_kind=4, tensor_count=2, offset=lay.row_bytes, flags=ReqFlag.BLOCKS,
                       rows=tuple(addrs + draw(st.lists(st.integers(0, lay.rows - 1), min_size=1, max_size=4,
                                                        unique=True))))
        elif blocks:
            req.update(target_kind=draw(st.sampled_from([2, 3])), model_id=keys,
                       flags=ReqFlag.BLOCKS | ReqFlag.EXACT,
                       rows=tuple(draw(st.lists(st.integers(0, lay.rows - 1), min_size=1, max_size=4, unique=True))))
        else:
            offset = draw(st.sampled_from([0, 0, 0, 64, lay.row_bytes // 2]))
            req.update(offset=offset, nbytes=draw(st.integers(1, lay.row_bytes - offset)), flags=ReqFlag.CONTIG)
            if keys and draw(st.booleans()):
                row = draw(st.integers(0, len(keys) - 1))
                req.update(target_kind=1, key_req_id=keys[row])
            else:
                req.update(batch_index=draw(st.integers(0, lay.rows - 1)))
        for _ in range(draw(st.integers(0, 3))):
            what = draw(st.sampled_from(sorted(FIELD_EDGES) + ["rows", "rows", "addresses"]))
            if what == "rows":
                req["rows"] = tuple(draw(st.lists(hostile_row, max_size=6)))
            elif what == "addresses":
                addrs = [max(0, min(2**64 - 1, b + draw(shift)))
                         for b in draw(st.lists(st.sampled_from(target.addresses()), min_size=1, max_size=3))]
                req.update(rows=tuple(addrs + draw(st.lists(hostile_row, max_size=3))),
                           tensor_count=draw(st.one_of(st.just(len(addrs)), st.integers(0, 5))))
            else:
                req[what] = draw(FIELD_EDGES[what])
        return req

    return build()


def check_plan(target: Target, planned: Served) -> None:
    """Every byte range an accepted plan hands to the native engine lies in registered memory."""
    pairs, total = planned.pairs, planned.total
    values = list(pairs)
    assert len(values) % 2 == 0
    moved = 0
    for addr, nbytes in zip(values[0::2], values[1::2]):
        assert nbytes > 0
        assert target.inside(addr, addr + nbytes), f"planned {nbytes} bytes at {addr:#x} outside registered memory"
        moved += nbytes
    assert moved == total


async def make_target(dd: Any, seed: int) -> Target:
    kv = dd.kv_cache_manager
    arena = Arena([spec[0] for spec in ARENA], seed)
    caches = []
    for index, (desc, blocks, keys) in enumerate(ARENA):
        if blocks:
            caches.append(arena.register(kv, index, blocks=True, blocks_key=BlocksCacheKey(PROMPT, keys)))
        else:
            caches.append(arena.register(kv, index, keys=[CacheKey(PROMPT, k) for k in keys]))
    legit = kv.allocate_cache(LEGIT)
    for t in legit.tensors:
        t.copy_(torch.randn(LEGIT.shape).to(t.dtype))
    return Target(arena, caches, legit)


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_the_owner_plans_only_registered_bytes_or_refuses():
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", heartbeat_interval=600_000) as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp", heartbeat_interval=600_000) as dec:
        target = await make_target(dd, seed=1)
        assert (await dec.link_clusters([info(dd)]))[0] == S.LLM_SUCCESS
        rt, link = runtime_of(dd), link_to(dd, DECODER)
        outcomes: dict[str, int] = {}

        @settings(max_examples=PLAN_EXAMPLES, **SETTINGS)
        @seed(SEED)
        @given(st.sampled_from([Msg.PULL_REQ, Msg.PUSH_REQ]), requests(target, range(link.nchannels)))
        def serve(msg: Msg, req: dict[str, Any]) -> None:
            count("fuzz cases (in-process)")
            try:
                planned = owner.serve_plan(rt, link, msg, wire.TransferReq(**req))
            except Refusal as refusal:
                assert refusal.code in set(LLMStatusCode) - {S.LLM_SUCCESS}
                outcomes["refused"] = outcomes.get("refused", 0) + 1
                return
            check_plan(target, planned)
            outcomes["accepted"] = outcomes.get("accepted", 0) + 1

        try:
            serve()
        finally:
            target.release()
        assert outcomes.get("accepted", 0) > 200 and outcomes.get("refused", 0) > 200, outcomes
        assert target.arena.intact()
        assert state(dd)["pending tokens"] == 0


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_the_owner_checks_every_block_of_a_raw_address_push_in_any_order():
    """Each block a raw-address push lists must lie in the tensor, not only the last one: the highest block
    listed first next to a tensor's end (which the random requests above seldom make) is refused too."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", heartbeat_interval=600_000) as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp", heartbeat_interval=600_000) as dec:
        target = await make_target(dd, seed=2)
        assert (await dec.link_clusters([info(dd)]))[0] == S.LLM_SUCCESS
        rt, link = runtime_of(dd), link_to(dd, DECODER)
        outcomes = {"accepted": 0, "refused": 0}
        try:
            for cache, (desc, blocks, _) in zip(target.caches, ARENA):
                lay = cache.layout
                if not blocks:
                    continue
                for shift in range(0, lay.tensor_bytes, lay.row_bytes // 2):
                    for order in ((lay.rows - 1, 0), (0, lay.rows - 1), (lay.rows - 1, 1, 0)):
                        req = dict(channel=0, target_kind=4, cluster_id=PROMPT, cache_id=0, key_req_id=0, prefix_id=0,
                                   model_id=0, batch_index=0, layer_first=-1, layer_last=-1, tensor_num_per_layer=2,
                                   tensor_count=2, data_type=desc.data_type.value, offset=lay.row_bytes,
                                   nbytes=lay.row_bytes, flags=ReqFlag.BLOCKS, timeout_ms=1000,
                                   rows=(lay.bases[0] + shift, lay.bases[1] + shift, *order))
                        try:
                            planned = owner.serve_plan(rt, link, Msg.PUSH_REQ, wire.TransferReq(**req))
                        except Refusal:
                            outcomes["refused"] += 1
                            continue
                        check_plan(target, planned)
                        outcomes["accepted"] += 1
            # an address count past the list (2 addresses named, 1 sent): refused, not planned for 2 rows' bytes
            with pytest.raises(Refusal):
                owner.serve_plan(rt, link, Msg.PUSH_REQ, wire.TransferReq(**dict(req, rows=(lay.bases[0],), flags=0)))
        finally:
            target.release()
        assert outcomes["accepted"] and outcomes["refused"], outcomes
        assert target.arena.intact()


def info(dd: Any) -> Any:
    from peers import cluster_info

    return cluster_info(dd.cluster_id, port_of(dd))


# -- 3. a live link --------------------------------------------------------------------------


def oracle(target: Target, msg: Msg, req: dict[str, Any]) -> list[tuple[int, int]] | None:
    """The byte ranges an accepted request moves, from the documented layout; None if no such cache."""
    kind, rows = req["target_kind"], list(req["rows"])
    if kind == 4:
        count_, stride, nbytes = req["tensor_count"], req["offset"], req["nbytes"]
        addrs, blocks = rows[:count_], rows[count_:]
        if count_ > owner.MAX_PUSHED_ADDRS:
            return None  # one layer's K and V at most
        return [(a + b * stride, nbytes) for a in addrs for b in (blocks or [0])]
    cache = None
    if kind in (1, 2) and rows and not (kind == 2 and req["cache_id"] in target.by_id
                                        and target.by_id[req["cache_id"]].is_blocks_cache):
        return None  # a key or (id, index) of a contiguous cache names its one row: listed rows reach past it
    if kind == 1 and msg is not Msg.PULL_REQ:
        return None  # a CacheKey is pulled, never pushed to
    if kind == 1 and req["prefix_id"] == UINT64_MAX and req["model_id"] == 0 and req["key_req_id"] in target.req_keys:
        cache, row = target.req_keys[req["key_req_id"]]
        rows = [row]
    elif kind == 2 and req["cache_id"] in target.by_id:
        cache = target.by_id[req["cache_id"]]
        rows = rows or [req["batch_index"]]
    elif kind == 3 and req["model_id"] in target.blocks_keys:
        cache = target.blocks_keys[req["model_id"]]
    if cache is None:
        return None
    lay = cache.layout
    per_layer = req["tensor_num_per_layer"]
    if (req["layer_first"], req["layer_last"]) == (-1, -1):
        first, tensors = 0, lay.num_tensors
    else:
        first, tensors = req["layer_first"] * per_layer, (req["layer_last"] - req["layer_first"] + 1) * per_layer
    base = lambda t: lay.bases[t] if 0 <= t < lay.num_tensors else -(2**70)  # noqa: E731 (never registered)
    return [(base(t) + r * lay.row_bytes + req["offset"], req["nbytes"])
            for t in range(first, first + tensors) for r in rows]


class LiveFuzz:
    """Drives one raw link with generated requests and checks every answer (runs in a worker thread)."""

    def __init__(self, target: Target, raw: RawLink) -> None:
        self.target = target
        self.raw = raw
        self.arena = target.arena
        self.accepted = {Msg.PULL_REQ: 0, Msg.PUSH_REQ: 0}
        self.refused = 0

    def shadow_of(self, ranges: list[tuple[int, int]]) -> bytes:
        return b"".join(self.arena.shadow[a - self.arena.base:a - self.arena.base + n].numpy().tobytes()
                        for a, n in ranges)

    def case(self, msg: Msg, req: dict[str, Any], payload_seed: int) -> None:
        count("fuzz cases (live socket)")
        self.raw.keepalive()
        try:
            if msg is Msg.PULL_REQ:
                data = self.raw.pull(req)
            else:
                pushed: list[bytes] = []

                def payload(total: int) -> bytes:
                    pushed.append(random.Random(payload_seed).randbytes(total))
                    return pushed[0]

                self.raw.push(req, payload)
        except Refused as refusal:
            assert refusal.code != 0
            self.refused += 1
            assert self.arena.intact(), f"a refused {msg.name} changed bytes: {self.arena.first_difference()}"
            return
        self.accepted[msg] += 1
        expected = oracle(self.target, msg, req)
        assert expected is not None, f"accepted a {msg.name} for no known cache: {req}"
        for addr, n in expected:
            assert self.target.inside(addr, addr + n), f"accepted {msg.name} touching {addr:#x}+{n}: {req}"
        in_arena = all(self.arena.registered(a, a + n) for a, n in expected)
        if msg is Msg.PULL_REQ:
            assert len(data) == sum(n for _, n in expected)
            if in_arena:
                assert data == self.shadow_of(expected), f"pulled bytes differ from the layout model: {req}"
        else:
            stream = pushed[0]
            assert len(stream) == sum(n for _, n in expected)
            pos = 0
            for addr, n in expected:
                if self.arena.registered(addr, addr + n):
                    off = addr - self.arena.base
                    self.arena.shadow[off:off + n] = torch.frombuffer(bytearray(stream[pos:pos + n]), dtype=torch.uint8)
                pos += n
        assert self.arena.intact(), f"{msg.name} {req}: {self.arena.first_difference()}"


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_live_link_fuzz_moves_only_what_the_layout_allows():
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", shared_secret=SECRET) as dd, \
                endpoint(LLMRole.DECODER, DECODER, transport="tcp", shared_secret=SECRET) as dec:
            target = await make_target(dd, seed=2)
            assert (await dec.link_clusters([info(dd)]))[0] == S.LLM_SUCCESS
            mine = dec.kv_cache_manager.allocate_cache(LEGIT)
            legit_key = CacheKeyByIdAndIndex(PROMPT, target.legit.cache_id, 0)
            await dec.kv_cache_manager.pull_cache(legit_key, mine, 1)  # the other link works before

            stop = asyncio.Event()

            async def other_link() -> int:
                done = 0
                while not stop.is_set():
                    await dec.check_link_status(PROMPT)
                    # liveness, not latency: the fuzz thread competes for the GIL on a loaded machine
                    await dec.kv_cache_manager.pull_cache(CacheKeyByIdAndIndex(PROMPT, target.legit.cache_id,
                                                                                done % 4), mine, done % 4,
                                                          timeout=10_000)
                    done += 1
                    await asyncio.sleep(0.005)
                return done

            other = asyncio.ensure_future(other_link())
            address = port_of(dd)
            try:
                results = await asyncio.to_thread(run_live_fuzz, target, address)
                malformed = await asyncio.to_thread(run_malformed_frames, address, random.Random(5 + SEED))
            finally:
                stop.set()
                probes = await other
            assert probes > 10
            # the other link still carries verified bytes both ways
            for row in range(4):
                await dec.kv_cache_manager.pull_cache(CacheKeyByIdAndIndex(PROMPT, target.legit.cache_id, row),
                                                      mine, row)
            assert all(torch.equal(m.view(torch.int16), t.view(torch.int16))
                       for m, t in zip(mine.tensors, target.legit.tensors))
            assert target.arena.intact(), target.arena.first_difference()
            assert results.accepted[Msg.PULL_REQ] > 50 and results.accepted[Msg.PUSH_REQ] > 50, results.accepted
            assert results.refused > 500
            count("malformed frames (live socket)", malformed)
            target.release()
    finally:
        loop.set_exception_handler(None)
    assert not errors, f"exceptions escaped into the event loop: {errors[:3]}"


def run_live_fuzz(target: Target, address: tuple[str, int]) -> LiveFuzz:
    with RawLink(address, 50, PROMPT, SECRET.encode()).connect() as raw:
        fuzz = LiveFuzz(target, raw)

        @settings(max_examples=LIVE_EXAMPLES, **SETTINGS)
        @seed(SEED)
        @given(st.sampled_from([Msg.PULL_REQ, Msg.PUSH_REQ]), requests(target, range(raw.channels)), u(32))
        def live(msg: Msg, req: dict[str, Any], payload_seed: int) -> None:
            fuzz.case(msg, req, payload_seed)

        live()
        return fuzz


# -- 4. malformed frames on live connections -------------------------------------------------


def run_malformed_frames(address: tuple[str, int], rng: random.Random) -> int:
    """Send broken frames before and after authentication; each is refused or drops only its connection."""
    sent = 0
    cluster = 1000
    captured_auth: bytes | None = None
    for n in range(MALFORMED_FRAMES):
        how = n % 6
        if how < 3:
            # before authentication: garbage, a mutated HELLO, a wrong version, a huge length, a replayed AUTH
            with dial(address) as sock:
                hello = bytearray(wire.encode(Msg.HELLO, 0, nonce=rng.randbytes(32)))
                choice = rng.randrange(6)
                if choice == 0:
                    frame = rng.randbytes(rng.randrange(1, 80))
                elif choice == 1:
                    hello[rng.randrange(len(hello))] ^= rng.randrange(1, 256)
                    frame = bytes(hello)
                elif choice == 2:
                    frame = bytes(hello[:4]) + bytes([rng.choice(WRONG_VERSIONS)]) + bytes(hello[5:])
                elif choice == 3:
                    length = rng.choice([wire.MAX_BODY + 1, 2**32 - 1])
                    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, Msg.HELLO, 0, 0, length)
                    frame = head + bytes(hello[wire.HEADER.size:])
                elif choice == 4:
                    frame = bytes(hello[:rng.randrange(1, len(hello))])  # truncated, then closed
                else:
                    frame = bytes(hello) + (captured_auth or wire.encode(
                        Msg.AUTH, 0, proof=bytes(32), cluster_id=cluster + n, role=2, peer_id=PROMPT,
                        instance=bytes(32)))
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)
                reply = rest_of_stream(sock)
                assert_no_secret_leaks(reply)
        else:
            # after authentication: one bad frame on a real link
            try:
                raw = RawLink(address, cluster + n, PROMPT, SECRET.encode()).connect()
            except Refused as refusal:
                raise AssertionError(f"a fresh link was refused: {refusal}") from None
            with raw:
                if captured_auth is None:
                    captured_auth = next(f for f in raw.captured if f[5] == Msg.AUTH)
                frame = bytearray(wire.encode(Msg.PULL_REQ, 1, channel=0, target_kind=2, cluster_id=PROMPT,
                                              cache_id=1, key_req_id=UINT64_MAX, prefix_id=UINT64_MAX, model_id=0,
                                              batch_index=0, layer_first=-1, layer_last=-1, tensor_num_per_layer=2,
                                              tensor_count=4, data_type=1, offset=0, nbytes=128, flags=0,
                                              timeout_ms=1000, rows=(0,)))
                choice = rng.randrange(5)
                if choice == 4:  # a truncated frame, then the connection closes
                    raw.send_raw(bytes(frame[:rng.randrange(1, len(frame))]))
                    raw.ctl.shutdown(socket.SHUT_WR)
                    rest_of_stream(raw.ctl)  # until the owner drops it
                    sent += 1
                    continue
                if choice == 0:
                    frame[rng.randrange(len(frame))] ^= rng.randrange(1, 256)
                elif choice == 1:
                    frame[4] = rng.choice(WRONG_VERSIONS)
                elif choice == 2:
                    frame[5] = rng.choice([0, 5, 9, 99, 255])  # message type
                elif choice == 3:
                    frame[16:20] = struct.pack("!I", rng.choice([wire.MAX_BODY + 1, 2**32 - 1, 3]))
                raw.send_raw(bytes(frame))
                raw.send_raw(wire.encode(Msg.PROBE, 3))
                assert raw.ctl is not None
                # a length field that grew leaves the owner waiting for body bytes that never come;
                # its heartbeat drops the link later, so do not wait for that here
                raw.ctl.settimeout(0.2)
                try:
                    while True:  # an answer to the probe, or the link dropped
                        msg, rid, fields = _next_frame(raw)
                        if msg is Msg.PROBE_ACK and rid == 3:
                            break
                        if msg is Msg.RESP:
                            assert fields["status"] != 0 or fields["total"] > 0
                            if fields["status"] == 0:
                                recv_exactly(raw.data[0], fields["total"])
                                raw.send_raw(wire.encode(Msg.DONE, rid, status=0, text=""))
                except (ConnectionError, ProtocolError, OSError):  # dropped (socket.timeout is an OSError)
                    pass
        sent += 1
    return sent


# -- 5. the link's reader: frames cut anyhow on a live link -----------------------------------


def _answers(raw: RawLink, n: int) -> list[int]:
    """The ids of the next ``n`` PROBE_ACKs (the owner's own PROBEs and PINGs skipped)."""
    assert raw.ctl is not None
    ids = []
    while len(ids) < n:
        msg, rid, _ = recv_frame(raw.ctl)
        if msg is Msg.PROBE_ACK:
            ids.append(rid)
        else:
            assert msg in (Msg.PROBE, Msg.PING), msg
    return ids


def _drive_reader(address: tuple[str, int], cluster: int, bad: bytes | None) -> list[int]:
    """A PROBE one byte at a time, 200 in one send, then a PROBE with ``bad`` (or half a frame and EOF)
    behind it in one send; the ids of the acks, then those the peer sent before it closed."""
    with RawLink(address, cluster, PROMPT, SECRET.encode()).connect() as raw:
        assert raw.ctl is not None
        for byte in wire.encode(Msg.PROBE, 2):
            raw.ctl.sendall(bytes([byte]))
            time.sleep(0.001)
        got = _answers(raw, 1)
        raw.send_raw(b"".join(wire.encode(Msg.PROBE, 4 + 2 * i) for i in range(200)))
        got += _answers(raw, 200)
        tail = bad if bad is not None else wire.encode(Msg.PROBE, 1000)[:7]
        raw.send_raw(wire.encode(Msg.PROBE, 900) + tail)
        if bad is None:
            raw.ctl.shutdown(socket.SHUT_WR)
        rest = rest_of_stream(raw.ctl)  # until the owner drops the link
        pos = 0
        while pos + wire.HEADER.size <= len(rest):
            msg, rid, length = wire.parse_header(rest[pos:pos + wire.HEADER.size])
            if msg is Msg.PROBE_ACK:
                got.append(rid)
            pos += wire.HEADER.size + length
        return got


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", [b"garbage that is no frame", None], ids=["malformed", "eof"])
async def test_the_link_reader_acts_on_every_frame_however_cut_up_to_a_bad_one(bad: bytes | None, caplog: Any):
    caplog.set_level(logging.INFO, logger="aio_datadist.links")
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", shared_secret=SECRET) as dd:
        got = await asyncio.to_thread(_drive_reader, port_of(dd), 60, bad)
    assert got == [2, *range(4, 404, 2), 900]  # in order; the PROBE just before the bad bytes too
    why = "protocol error: bad magic" if bad is not None else "connection lost (IncompleteReadError)"
    assert any(re.fullmatch(rf"link \d+ to cluster 60 down: failed: {re.escape(why)}.*", r.getMessage())
               for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.asyncio
async def test_the_link_reader_acts_on_the_frames_that_came_with_the_handshake():
    """Guarantee 52 for frames sent with ``AUTH`` (left in the handshake's buffer), the last one cut across
    that send and the next: each is acted on, in order, before the later ones."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", shared_secret=SECRET) as dd:
        def drive() -> list[int]:
            cut = wire.encode(Msg.PROBE, 8)
            early = b"".join(wire.encode(Msg.PROBE, i) for i in (2, 4, 6)) + cut[:7]
            with RawLink(port_of(dd), 61, PROMPT, SECRET.encode()).connect(behind_auth=early) as raw:
                raw.send_raw(cut[7:] + wire.encode(Msg.PROBE, 10))
                return _answers(raw, 5)

        assert await asyncio.to_thread(drive) == [2, 4, 6, 8, 10]


@pytest.mark.asyncio
async def test_the_dialler_acts_on_the_frames_that_came_with_link_ok_then_sees_the_end(caplog: Any):
    """Guarantee 52 on the dialling end, for frames that came with ``LINK_OK`` and a stream that ended inside
    the next one before the link started (while its data channels attached): the PROBE is answered, then the
    link is dropped at once (not by its heartbeat)."""
    from relay import Relay

    class EndAfterLinkOk(Relay):
        control = True
        acks = b""

        async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not self.control:
                return await self.pipe(reader, writer)
            self.control = False
            while True:  # the handshake, frame by frame, up to LINK_OK
                head = await reader.readexactly(wire.HEADER.size)
                msg, _, length = wire.parse_header(head)
                writer.write(head + await reader.readexactly(length))
                if msg is Msg.LINK_OK:
                    break
            writer.write(wire.encode(Msg.PROBE, 2) + wire.encode(Msg.PROBE, 4)[:7])
            writer.write_eof()

        async def upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self.acks == b"":
                self.acks = b"-"  # the control connection is the first
                while data := await reader.read(1 << 16):
                    self.acks += data
                    writer.write(data)
                return
            await self.pipe(reader, writer)

    caplog.set_level(logging.INFO, logger="aio_datadist.links")
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec, EndAfterLinkOk(port_of(dd)) as relay:
        from peers import cluster_info

        await dec.link_clusters([cluster_info(PROMPT, relay.address)])
        why = rf"link .*to cluster {PROMPT}\b.*failed: .*connection lost \(IncompleteReadError\).*"  # up or not yet
        async with asyncio.timeout(2):  # at once, not by the heartbeat (5 intervals of 1 s)
            while not any(re.fullmatch(why, r.getMessage()) for r in caplog.records):
                await asyncio.sleep(0.01)
        assert wire.encode(Msg.PROBE_ACK, 2) in relay.acks


def _next_frame(raw: RawLink) -> tuple[Msg, int, dict]:
    from _rawpeer import recv_frame

    assert raw.ctl is not None
    while True:
        msg, rid, fields = recv_frame(raw.ctl)
        if msg is not Msg.PING:
            return msg, rid, fields


def assert_no_secret_leaks(reply: bytes) -> None:
    """An unauthenticated peer gets at most a HELLO_ACK (a nonce and a proof) and a refusing LINK_OK
    whose every field but the status and its text is zero: no identity, no token, no cache byte."""
    pos = 0
    while pos + wire.HEADER.size <= len(reply):
        msg, _, length = wire.parse_header(reply[pos:pos + wire.HEADER.size])
        fields = wire.fields_of(msg, reply[pos + wire.HEADER.size:pos + wire.HEADER.size + length])
        assert msg in (Msg.HELLO_ACK, Msg.LINK_OK), msg
        if msg is Msg.LINK_OK:
            assert fields["status"] != 0
            assert all(not any(v) if isinstance(v, bytes) else v == 0
                       for k, v in fields.items() if k not in ("status", "text")), fields
        pos += wire.HEADER.size + length
    assert pos == len(reply), f"{len(reply) - pos} stray bytes after the refusal"


def _dropped_after(address: tuple[str, int], cluster: int, edit: str) -> bytes:
    """One bad header on an authenticated link, a PROBE behind it: what the owner sends until it drops the
    connection (an AssertionError if it does not drop it within 2 s)."""
    with RawLink(address, cluster, PROMPT, SECRET.encode()).connect() as raw:
        assert raw.ctl is not None
        frame = bytearray(wire.encode(Msg.PROBE, 1))
        if edit == "version":
            frame[4] = WRONG_VERSIONS[0]
        elif edit == "type":
            frame[5] = 99
        else:
            frame[0] ^= 0xFF  # magic
        raw.send_raw(bytes(frame) + wire.encode(Msg.PROBE, 3))
        deadline = time.monotonic() + 2.0  # the owner's PINGs keep coming: a bound on the whole wait
        got = b""
        try:
            while time.monotonic() < deadline:
                raw.ctl.settimeout(max(deadline - time.monotonic(), 0.01))
                if not (chunk := raw.ctl.recv(65536)):
                    return got
                got += chunk
        except ConnectionResetError:
            return got
        except socket.timeout:
            pass
        raise AssertionError(f"a frame with a bad {edit} was neither answered nor dropped within 2 s")


def _first_frame_reply(address: tuple[str, int], msg: Msg) -> tuple[bytes, float]:
    """What the owner sends a connection whose first frame is a well-formed ``msg`` (all fields zero) before it
    closes it, and how long after the frame it closed it (``inf``: not within 2 s; the handshake's own limit is
    10 s). We keep our end open: only the owner's drop ends the read. A frame shorter than a ``HELLO`` is
    followed by zeros up to a ``HELLO``'s size: the owner reads that many bytes as the first message (with fewer,
    the connection is an arrival that has not sent one yet, which admission bounds: rows 6 and 20)."""
    fields = {n: {"rows": (), "text": "", "blob": b""}.get(f, bytes(int(f[:-1])) if f[:-1].isdigit() else 0)
              for n, f in wire._SCHEMAS[msg]}
    with dial(address) as sock:
        sock.settimeout(2)
        frame = wire.encode(msg, 1, **fields)
        sock.sendall(frame + bytes(max(0, len(wire.encode(Msg.HELLO, 0, nonce=bytes(32))) - len(frame))))
        started, data = time.monotonic(), b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:  # dropped with our frame's bytes unread: a reset
            pass
        except TimeoutError:
            return data, float("inf")
        return data, time.monotonic() - started


@pytest.mark.asyncio
async def test_a_first_frame_that_is_not_hello_drops_the_connection():
    """``run_malformed_frames`` opens with a HELLO (mutated: its type byte seldom becomes another valid type); a
    well-formed frame of any other type first (a HELLO_ACK carries a nonce too) is dropped unanswered, and no
    exception reaches the event loop."""
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", shared_secret=SECRET) as dd:
            for msg in Msg:
                if msg is not Msg.HELLO:
                    reply, closed_after = await asyncio.to_thread(_first_frame_reply, port_of(dd), msg)
                    assert reply == b"" and closed_after < 1.0, (msg, reply, closed_after)  # dropped at once
    finally:
        loop.set_exception_handler(None)
    assert not errors, f"exceptions escaped into the event loop: {errors[:3]}"


@pytest.mark.asyncio
async def test_a_bad_header_after_authentication_drops_that_connection():
    """``run_malformed_frames`` lets a link that answers nothing pass (a grown length field leaves the owner
    waiting for body bytes); a header that is wrong at once (version, type, magic) must drop the connection, and
    the frame behind it is not acted on."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", shared_secret=SECRET) as dd:
        for n, edit in enumerate(("version", "type", "magic")):
            got = await asyncio.to_thread(_dropped_after, port_of(dd), 80 + n, edit)
            pos = 0
            while pos + wire.HEADER.size <= len(got):
                msg, rid, length = wire.parse_header(got[pos:pos + wire.HEADER.size])
                assert not (msg is Msg.PROBE_ACK and rid == 3), f"acted on a frame behind a bad {edit}"
                pos += wire.HEADER.size + length
