"""Endpoints in separate spawned processes on loopback.

Each test runs on one event loop here (the spawned peers use the other one),
since every test pays for starting processes. Every process is closed (exit,
terminate, kill, join) when a test ends, passed or failed.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCacheExtParam,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    wire,
)
from aio_datadist.testing import nixl_agent_of, usable_link
from peers import (
    BLOCKS_DESC,
    CACHE_DESC,
    DECODER_ID,
    LOCALHOST,
    PROMPT_ID,
    TRANSPORTS,
    CacheSpec,
    EndpointSpec,
    Ref,
    endpoint,
    spawned,
    tensors_from_dump,
)

pytestmark = pytest.mark.usefixtures("fork_server")  # peers are forked from it

S = LLMStatusCode
ROWS_DESC = CacheDesc(4, (6, 256), DataType.DT_FLOAT16, Placement.HOST)  # 6 rows of 512 B


def prompt_spec(**kwargs) -> EndpointSpec:
    """A PROMPT with keyed rows (req_id 100 + row) and a blocks cache keyed by model 0."""
    caches = (CacheSpec("rows", ROWS_DESC, seed=11, req_ids=tuple(range(100, 106))),
              CacheSpec("blocks", BLOCKS_DESC, seed=12, blocks=True, model_id=0))
    return EndpointSpec(LLMRole.PROMPT, PROMPT_ID, caches=caches, **kwargs)


async def expect_code(code: LLMStatusCode, awaitable) -> LLMException:
    with pytest.raises(LLMException) as exc:
        await awaitable
    assert exc.value.status_code == code, exc.value
    return exc.value


def nixl_posted(dd) -> int:
    """Transfers this endpoint posted to NIXL (0 when it does not use NIXL)."""
    plane = nixl_agent_of(dd)
    return 0 if plane is None else plane.engine.posted


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "local"])
async def test_pull_and_push_between_processes(transport):
    config = (("transport", transport),)
    async with spawned(prompt_spec(loop="uvloop", config=config)) as (prompt,), \
            endpoint(LLMRole.DECODER, DECODER_ID, transport=transport) as dd:
        kv = dd.kv_cache_manager
        blocks = kv.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(DECODER_ID))
        rows = kv.allocate_cache(CACHE_DESC)
        assert await dd.link_clusters([prompt.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert await prompt.call("links") == {DECODER_ID: "up"}
        await prompt.call("check_link", DECODER_ID)
        await dd.check_link_status(PROMPT_ID)
        p_rows, p_blocks = prompt.expected("rows"), prompt.expected("blocks")

        await kv.pull_cache(CacheKey(PROMPT_ID, 101), rows, batch_index=2)
        await expect_code(S.LLM_KV_CACHE_NOT_EXIST, kv.pull_cache(CacheKey(PROMPT_ID, 101), rows))
        await kv.pull_cache(CacheKeyByIdAndIndex(PROMPT_ID, prompt.cache_ids["rows"], 4), rows, 0,
                            src_layer_range=range(1, 2), dst_layer_range=range(1, 2))
        await kv.pull_cache(CacheKey(PROMPT_ID, 105), rows, 1, size=200)
        for t, (d, v) in enumerate(zip(rows.tensors, p_rows)):
            assert torch.equal(d[2], v[1]) and torch.equal(d[1, :100], v[5, :100])
            assert torch.equal(d[0], v[4]) if t >= 2 else not d[0].any()

        await kv.pull_blocks(BlocksCacheKey(PROMPT_ID), blocks, [0, 1, 2, 7], [4, 5, 6, 0])
        for d, v in zip(blocks.tensors, p_blocks):
            assert torch.equal(d[4:7], v[0:3]) and torch.equal(d[0], v[7])
        await kv.pull_blocks(CacheKey(PROMPT_ID, 103), blocks, [], [1, 2, 3, 7])  # a row into 4 blocks
        for d, v in zip(blocks.tensors, p_rows):
            assert torch.equal(d[[1, 2, 3, 7]], v[3].view(4, 4, 16))

        # pushes from the prompt, over the link the decoder made
        await prompt.call("kv", "push_blocks", BlocksCacheKey(DECODER_ID), Ref("blocks"), [5, 6], [0, 1],
                          KvCacheExtParam((0, 1), (0, 1), 2))
        await prompt.call("kv", "push_blocks", CacheIndex(DECODER_ID, blocks.cache_id), Ref("blocks"), [3], [2],
                          KvCacheExtParam((1, 1), (0, 0)))
        for t, (d, v) in enumerate(zip(blocks.tensors, p_blocks)):
            assert torch.equal(d[0:2], v[5:7])
            if t < 2:
                assert torch.equal(d[2], p_blocks[t + 2][3])
        await prompt.call("kv", "push_cache", CacheIndex(DECODER_ID, rows.cache_id, 1), Ref("rows"), 0)
        assert all(torch.equal(d[1], v[0]) for d, v in zip(rows.tensors, p_rows))
        if transport == "nixl":  # whole-row pulls went by NIXL READ (partial rows and row-into-blocks by TCP)
            assert nixl_posted(dd) == 3

        # non-forced unlink: both ends go
        assert await dd.unlink_clusters([prompt.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert await prompt.call("links") == {}
        await expect_code(S.LLM_NOT_YET_LINK, prompt.call("kv", "push_blocks", BlocksCacheKey(DECODER_ID),
                                                          Ref("blocks"), [0], [0]))


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "local"])
async def test_concurrent_decoders_pull_from_one_prompt(transport):
    config = (("transport", transport),)
    decoders = [EndpointSpec(LLMRole.DECODER, 20 + n, listen=False, loop="asyncio", config=config,
                             caches=(CacheSpec("rows", CACHE_DESC, seed=0),
                                     CacheSpec("blocks", BLOCKS_DESC, seed=0, blocks=True)))
                for n in range(3)]
    async with spawned(prompt_spec(config=config), *decoders) as (prompt, *procs), \
            endpoint(LLMRole.DECODER, DECODER_ID, transport=transport) as dd:
        p_rows, p_blocks = prompt.expected("rows"), prompt.expected("blocks")
        for proc in procs:
            proc.send("link", PROMPT_ID, prompt.port)
        assert (await dd.link_clusters([prompt.info]))[0] == S.LLM_SUCCESS
        for proc in procs:
            assert await proc.answer() == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        assert sorted(await prompt.call("links")) == [DECODER_ID, 20, 21, 22]

        # every decoder at once: its own key, then every block in reverse order
        for n, proc in enumerate(procs):
            proc.send("kv", "pull_cache", CacheKey(PROMPT_ID, 100 + n), Ref("rows"), 2)
            proc.send("kv", "pull_blocks", BlocksCacheKey(PROMPT_ID), Ref("blocks"), list(range(8)),
                      list(range(7, -1, -1)))
        rows = dd.kv_cache_manager.allocate_cache(CACHE_DESC)
        mine = [dd.kv_cache_manager.pull_cache(CacheKey(PROMPT_ID, 103 + r), rows, r) for r in range(3)]
        await asyncio.gather(*mine)
        for proc in procs:
            assert await proc.answer() is None
            assert await proc.answer() is None
        for d, v in zip(rows.tensors, p_rows):
            assert torch.equal(d, v[3:6])
        assert nixl_posted(dd) == (3 if transport == "nixl" else 0)
        for n, proc in enumerate(procs):
            got_rows = tensors_from_dump(CACHE_DESC, await proc.call("dump", "rows"))
            got_blocks = tensors_from_dump(BLOCKS_DESC, await proc.call("dump", "blocks"))
            assert all(torch.equal(g[2], v[n]) for g, v in zip(got_rows, p_rows))
            assert all(torch.equal(g, v.flip(0)) for g, v in zip(got_blocks, p_blocks))

        # each key went to exactly one decoder
        for n, proc in enumerate(procs):
            with pytest.raises(LLMException) as exc:
                await proc.call("kv", "pull_cache", CacheKey(PROMPT_ID, 100 + (n + 1) % 3), Ref("rows"))
            assert exc.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_killed_prompt_fails_the_transfer_promptly_and_the_decoder_recovers():
    big = CacheDesc(16, (64, 16, 8, 128), DataType.DT_FLOAT16, Placement.HOST)  # 32 MiB
    spec = EndpointSpec(LLMRole.PROMPT, PROMPT_ID, caches=(CacheSpec("big", big, seed=3, blocks=True, model_id=0),))
    all_blocks = list(range(64))
    async with endpoint(LLMRole.DECODER, DECODER_ID, sync_kv_timeout=500) as dd:
        kv = dd.kv_cache_manager
        dst = kv.allocate_blocks_cache(big)
        async with spawned(spec) as (prompt,):
            assert (await dd.link_clusters([prompt.info]))[0] == S.LLM_SUCCESS
            await kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [1], [1])

            # a stopped prompt answers nothing: the pull times out and the link stays usable
            prompt.stop()
            t0 = time.monotonic()
            await expect_code(S.LLM_TIMEOUT, kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [2], [2], timeout=300))
            await expect_code(S.LLM_TIMEOUT, dd.check_link_status(PROMPT_ID))
            assert time.monotonic() - t0 < 0.3 + 0.5 + 1.0
            prompt.resume()
            await kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [3], [3], timeout=3000)

            # killed while bytes flow: the call in flight fails within its timeout + 1 s
            timeout_ms = 2000

            async def keep_pulling() -> LLMException:
                for _ in range(2000):
                    try:
                        await kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, all_blocks, all_blocks,
                                             timeout=timeout_ms)
                    except LLMException as exc:
                        return exc
                raise AssertionError("pulls kept succeeding after the prompt was killed")

            puller = asyncio.ensure_future(keep_pulling())
            await asyncio.sleep(0.3)
            assert not puller.done()
            prompt.kill()
            killed = time.monotonic()
            async with asyncio.timeout(timeout_ms / 1000 + 1.0):
                error = await puller
            assert error.status_code in (S.LLM_LINK_FAILED, S.LLM_TIMEOUT), error
            assert time.monotonic() - killed < timeout_ms / 1000 + 1.0

            t0 = time.monotonic()
            await expect_code(S.LLM_LINK_FAILED, dd.check_link_status(PROMPT_ID))
            await expect_code(S.LLM_LINK_FAILED, kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, [0], [0]))
            assert time.monotonic() - t0 < 1.0
            # local work goes on
            await kv.copy_blocks(dst, {0: [5]})

        async with spawned(spec) as (restarted,):  # same cluster id, another port
            assert (await dd.link_clusters([restarted.info]))[0] == S.LLM_SUCCESS
            await kv.pull_blocks(BlocksCacheKey(PROMPT_ID), dst, all_blocks, all_blocks, timeout=5000)
            expected = restarted.expected("big")
            assert all(torch.equal(d.view(torch.int64), v.view(torch.int64)) for d, v in zip(dst.tensors, expected))


def _recv_frame(sock: socket.socket) -> tuple[wire.Msg, dict]:
    head = _recv_exactly(sock, wire.HEADER.size)
    msg, _, length = wire.parse_header(head)
    return msg, wire.fields_of(msg, _recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _rest_of_stream(sock: socket.socket) -> bytes:
    """Everything the peer still sends before it closes (bounded by the socket timeout)."""
    data = b""
    try:
        while len(data) < 1 << 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _pull_request(cache_id: int) -> bytes:
    return wire.encode(wire.Msg.PULL_REQ, 1, channel=0, target_kind=2, cluster_id=PROMPT_ID, cache_id=cache_id,
                       key_req_id=2**64 - 1, prefix_id=2**64 - 1, model_id=0, batch_index=0, layer_first=-1,
                       layer_last=-1, tensor_num_per_layer=2, tensor_count=4, data_type=1, offset=0, nbytes=512,
                       flags=2, timeout_ms=1000, rows=())


def _intruder(port: int, cache_id: int) -> list[bytes]:
    """Try to get cache bytes without the secret; returns whatever the prompt sent back after refusing."""
    leftovers = []
    address = (LOCALHOST, port)
    # 1. a request with no handshake at all
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(_pull_request(cache_id))
        leftovers.append(_rest_of_stream(sock))
    # 2. a handshake with a made-up proof, then a request anyway
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(wire.encode(wire.Msg.HELLO, 0, nonce=bytes(32)))
        msg, ack = _recv_frame(sock)
        assert msg is wire.Msg.HELLO_ACK
        sock.sendall(wire.encode(wire.Msg.AUTH, 0, proof=bytes(32), cluster_id=66, role=LLMRole.DECODER,
                                 peer_id=PROMPT_ID, instance=bytes(32)))
        msg, ok = _recv_frame(sock)
        assert msg is wire.Msg.LINK_OK and ok["status"] == S.LLM_LINK_FAILED and ok["link_token"] == bytes(32)
        with pytest.raises(OSError):  # the prompt has closed the connection
            for _ in range(100):
                sock.sendall(_pull_request(cache_id))
                time.sleep(0.01)
        leftovers.append(_rest_of_stream(sock))
    # 3. a data channel with a guessed token
    with socket.create_connection(address, timeout=5) as sock:
        sock.sendall(wire.ATTACH.pack(wire.ATTACH_MAGIC, wire.VERSION, bytes(32), 0, 0))
        magic, status = wire.ATTACH_OK.unpack(_recv_exactly(sock, wire.ATTACH_OK.size))
        assert status == S.LLM_LINK_FAILED
        leftovers.append(_rest_of_stream(sock))
    return leftovers


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_authentication_between_processes():
    async with spawned(prompt_spec(config=(("secret", "s3cret"),), loop="uvloop")) as (prompt,):
        rows_id = prompt.cache_ids["rows"]
        for secret in ("wrong", None):
            async with endpoint(LLMRole.DECODER, DECODER_ID, secret=secret) as dd:
                assert await dd.link_clusters([prompt.info]) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])
                await expect_code(S.LLM_NOT_YET_LINK,
                                  dd.kv_cache_manager.pull_cache(CacheKey(PROMPT_ID, 100),
                                                                 dd.kv_cache_manager.allocate_cache(CACHE_DESC)))
        leftovers = await asyncio.to_thread(_intruder, prompt.port, rows_id)
        assert leftovers == [b"", b"", b""]
        assert await prompt.call("links") == {}

        async with endpoint(LLMRole.DECODER, DECODER_ID, secret="s3cret") as dd:
            assert await dd.link_clusters([prompt.info]) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
            rows = dd.kv_cache_manager.allocate_cache(CACHE_DESC)
            await dd.kv_cache_manager.pull_cache(CacheKey(PROMPT_ID, 100), rows)  # no key was taken before
            assert all(torch.equal(d[0], v[0]) for d, v in zip(rows.tensors, prompt.expected("rows")))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_heartbeat_detects_a_stopped_peer_without_any_call_pending():
    spec = EndpointSpec(LLMRole.PROMPT, PROMPT_ID, caches=())
    async with endpoint(LLMRole.DECODER, DECODER_ID, heartbeat_interval=100) as dd:
        async with spawned(spec) as (prompt,):
            assert (await dd.link_clusters([prompt.info]))[0] == S.LLM_SUCCESS
            await dd.check_link_status(PROMPT_ID)
            prompt.stop()
            try:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 5.0:  # 5 misses of 100 ms, plus slack
                    await asyncio.sleep(0.05)
                    try:
                        usable_link(dd, PROMPT_ID)
                    except LLMException as exc:
                        assert exc.status_code == S.LLM_LINK_FAILED
                        break
                else:
                    pytest.fail("a silent peer was not detected")
                assert time.monotonic() - t0 < 2.0
                await expect_code(S.LLM_LINK_FAILED, dd.check_link_status(PROMPT_ID))
            finally:
                prompt.resume()
