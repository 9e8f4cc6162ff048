"""A request that names a cache by ``CacheKey`` or by (cache id, batch index) moves that one row.

A handed-off cache (``deallocate_cache`` with keys still bound) is reachable only through its keys:
each key is one decoder's door to one row. A raw peer holding one key must not read another key's row
by listing rows beside its key, nor write any row by pushing to a key (keys are pulled, never pushed
to), nor read a keyed row through an unbound batch index without consuming that row's key.
"""

from __future__ import annotations

import asyncio

import pytest
from _harness import endpoint
from _rawpeer import RawLink, Refused
from peers import port_of

from aio_datadist import CacheDesc, CacheKey, DataType, LLMRole, LLMStatusCode, Placement
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Msg

S = LLMStatusCode
OWNER, INTRUDER = 41, 42
ROWS = CacheDesc(2, (2, 256), DataType.DT_FLOAT16, Placement.HOST)  # two 512-byte rows in each of 2 tensors


def by_key(req_id: int, rows: tuple[int, ...]) -> dict:
    return dict(channel=0, target_kind=1, cluster_id=OWNER, cache_id=0, key_req_id=req_id, prefix_id=UINT64_MAX,
                model_id=0, batch_index=0, layer_first=0, layer_last=0, tensor_num_per_layer=2, tensor_count=2,
                data_type=int(ROWS.data_type.value), offset=0, nbytes=512, flags=0, timeout_ms=2000, rows=rows)


def by_id(cache_id: int, batch_index: int, rows: tuple[int, ...]) -> dict:
    return dict(by_key(0, rows), target_kind=2, cache_id=cache_id, key_req_id=0, prefix_id=0,
                batch_index=batch_index)


def answers(address, calls) -> list:
    """Each ``(push?, fields)`` sent on one raw link: the bytes pulled, the count pushed, or the refusal's code."""
    got = []
    with RawLink(address, INTRUDER, OWNER, None) as raw:
        raw.connect()
        for push, fields in calls:
            try:
                if push is Msg.PUSH_LOCAL:  # a same-host push: the owner would copy the rows from our region
                    got.append(raw.offer(push, dict(fields, src_cache_id=0, src_first=0, src_nbytes=fields["nbytes"],
                                                    src_offset=0, src_rows=b""))[1])
                    continue
                got.append(raw.push(fields, lambda n: b"\x11" * n) if push else raw.pull(fields))
            except Refused as refusal:
                got.append(refusal.code)
    return got


def row_bytes(cache, row: int) -> bytes:
    return b"".join(t[row].numpy().tobytes() for t in cache.tensors)


async def handed_off(dd):
    """A cache whose rows 0 and 1 are bound to keys 1 and 2, released by its owner (a hand-off)."""
    cache = dd.kv_cache_manager.allocate_cache(ROWS, [CacheKey(OWNER, 1), CacheKey(OWNER, 2)])
    for t in cache.tensors:
        t[0].fill_(1.0)
        t[1].fill_(2.0)
    dd.kv_cache_manager.deallocate_cache(cache)
    return cache


def keys_bound(dd) -> bool:
    reg = dd._endpoint.runtime.registry
    return all(reg.by_key(CacheKey(OWNER, k).lookup_key()) is not None for k in (1, 2))


@pytest.mark.asyncio
async def test_a_pull_by_one_key_cannot_list_the_row_of_another_key():
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = await handed_off(dd)
        second = row_bytes(cache, 1)
        calls = [(False, by_id(cache.cache_id, 1, ())), (False, by_key(1, (1,))), (False, by_key(1, (0, 1)))]
        got = await asyncio.wait_for(asyncio.to_thread(answers, port_of(dd), calls), 20)
        assert got[0] == S.LLM_KV_CACHE_NOT_EXIST  # by id it is closed: key 2 is row 1's only door
        assert got[1:] == [S.LLM_PARAM_INVALID] * 2, [g if isinstance(g, int) else g == second for g in got]
        # ... and both keys are still there for their decoders
        assert keys_bound(dd)


@pytest.mark.asyncio
async def test_a_pull_by_id_moves_the_row_its_batch_index_names():
    """Rows listed beside an (id, index) target would read a keyed row without its key being claimed or
    consumed (reference 4.2: a pull of a keyed row by id and index is a pull by that key)."""
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = dd.kv_cache_manager.allocate_cache(ROWS, [CacheKey(OWNER, 5)])  # row 0 keyed, row 1 not
        for t in cache.tensors:
            t[0].fill_(3.0)
            t[1].fill_(4.0)
        calls = [(False, by_id(cache.cache_id, 1, (0,))), (False, by_id(cache.cache_id, 1, ()))]
        got = await asyncio.wait_for(asyncio.to_thread(answers, port_of(dd), calls), 20)
        assert got[0] == S.LLM_PARAM_INVALID, got[0] if isinstance(got[0], int) else "row 0's bytes"
        assert got[1] == row_bytes(cache, 1)  # what an honest pull by (id, 1) moves
        assert dd._endpoint.runtime.registry.by_key(CacheKey(OWNER, 5).lookup_key()) is not None


@pytest.mark.asyncio
async def test_no_peer_pushes_into_a_cache_through_one_of_its_keys():
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = await handed_off(dd)
        before = [row_bytes(cache, r) for r in (0, 1)]
        calls = [(True, by_id(cache.cache_id, 1, ())), (True, by_key(1, ())), (True, by_key(2, (1,))),
                 (Msg.PUSH_LOCAL, by_key(1, ()))]
        got = await asyncio.wait_for(asyncio.to_thread(answers, port_of(dd), calls), 20)
        assert got == [S.LLM_KV_CACHE_NOT_EXIST] + [S.LLM_PARAM_INVALID] * 3, got
        assert [row_bytes(cache, r) for r in (0, 1)] == before


@pytest.mark.asyncio
async def test_a_push_by_id_lists_no_rows_beside_its_batch_index():
    """Rows listed beside an (id, index) push target are refused as they are for a pull: the push would
    write a row its batch index does not name."""
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = dd.kv_cache_manager.allocate_cache(ROWS)
        before = [row_bytes(cache, r) for r in (0, 1)]
        calls = [(True, by_id(cache.cache_id, 0, (1,))), (True, by_id(cache.cache_id, 0, (0,)))]
        got = await asyncio.wait_for(asyncio.to_thread(answers, port_of(dd), calls), 20)
        assert got == [S.LLM_PARAM_INVALID] * 2, got
        assert [row_bytes(cache, r) for r in (0, 1)] == before


def by_addrs(addrs: list[int], nbytes: int) -> dict:
    """A raw-address push (``TransferConfig.dst_addrs``) of ``nbytes`` at each address, no blocks."""
    from aio_datadist.wire import Target
    return dict(by_key(0, tuple(addrs)), target_kind=int(Target.ADDRS), key_req_id=0, prefix_id=0, offset=0,
                nbytes=nbytes, tensor_count=len(addrs), layer_first=-1, layer_last=-1)


@pytest.mark.asyncio
async def test_no_peer_pushes_into_a_handed_off_cache_by_its_raw_addresses():
    """A handed-off cache is reachable only through its keys (guarantee 208: by id it is closed, a push never
    names a key): a raw-address push naming its rows' addresses must not write them either (hunt, owner)."""
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = await handed_off(dd)
        before = [row_bytes(cache, r) for r in (0, 1)]
        addrs = list(cache.layout.bases)  # row 0 of both tensors: key 1's row
        calls = [(True, by_addrs(addrs, 512))]
        got = await asyncio.wait_for(asyncio.to_thread(answers, port_of(dd), calls), 20)
        assert [row_bytes(cache, r) for r in (0, 1)] == before, got
        assert got != [1024], got
        assert keys_bound(dd)


def two_pullers(address, key_fields: dict, id_fields: dict) -> list:
    """Puller A takes a key's bytes and holds its DONE while puller B (another link) pulls the same key, and
    the same row by id and index; then A says DONE and B tries again."""
    from aio_datadist import wire
    got = []
    with RawLink(address, INTRUDER, OWNER, None) as a, RawLink(address, INTRUDER + 1, OWNER, None) as b:
        a.connect()
        b.connect()
        rid = a.new_req_id()
        a.send_raw(wire.encode(Msg.PULL_REQ, rid, **key_fields))
        _, resp = a.answer(rid)
        assert resp["status"] == 0, resp
        from _rawpeer import recv_exactly
        recv_exactly(a.data[0], resp["total"])
        for fields in (key_fields, id_fields):
            try:
                got.append(b.pull(fields))
            except Refused as refusal:
                got.append(refusal.code)
        a.send_raw(wire.encode(Msg.DONE, rid, status=0, text=""))
        import time
        time.sleep(0.3)
        for fields in (key_fields, id_fields):
            try:
                got.append(b.pull(fields))
            except Refused as refusal:
                got.append(refusal.code)
    return got


@pytest.mark.asyncio
async def test_two_pulls_of_one_key_at_once_one_wins():
    async with endpoint(LLMRole.PROMPT, OWNER, listen=True, transport="tcp") as dd:
        cache = await handed_off(dd)
        got = await asyncio.wait_for(asyncio.to_thread(
            two_pullers, port_of(dd), by_key(1, ()), by_id(cache.cache_id, 0, ())), 20)
        assert got == [S.LLM_KV_CACHE_NOT_EXIST] * 4, got
        reg = dd._endpoint.runtime.registry
        assert reg.by_key(CacheKey(OWNER, 1).lookup_key()) is None
        assert reg.by_key(CacheKey(OWNER, 2).lookup_key()) is not None
