"""``python -m aio_datadist demo``: a prompt and a decoder process on loopback.

The PROMPT process builds a paged KV cache (32 layers, K and V, 16-token
blocks, fp16) with seeded contents; the DECODER process links to it, pulls
one request's block table, then has the prompt push a second request layer
range by layer range into its own cache. Both sides check every byte against
the same seeded contents. The two processes talk through a pipe for the
side-channel notices a serving framework would send (ports, block tables).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import sys
import time
from dataclasses import dataclass

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

PROMPT_ID, DECODER_ID = 1, 2
SPAWN_LIMIT_S = 120.0


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    blocks: int = 128
    block_tokens: int = 16
    heads: int = 8
    head_dim: int = 128

    @property
    def desc(self) -> CacheDesc:
        return CacheDesc(2 * self.layers, (self.blocks, self.block_tokens, self.heads, self.head_dim),
                         DataType.DT_FLOAT16, Placement.HOST)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.heads * self.head_dim * 2


def seeded_cache(geo: Geometry, seed: int) -> list[torch.Tensor]:
    """The contents the prompt computes, reproducible by the decoder for checking."""
    gen = torch.Generator().manual_seed(seed)
    shape = (geo.blocks, geo.block_tokens, geo.heads, geo.head_dim)
    return [torch.randint(-30000, 30000, shape, generator=gen, dtype=torch.int16).view(torch.float16)
            for _ in range(2 * geo.layers)]


def _config(listen: bool, transport: str) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 20000
    cfg.transport = transport
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


async def _prompt(conn, geo: Geometry, seed: int, transport: str) -> None:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(_config(listen=True, transport=transport))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(geo.desc, BlocksCacheKey(PROMPT_ID, 0))
        for dst, src in zip(cache.tensors, seeded_cache(geo, seed), strict=True):
            dst.copy_(src)
        address = dd.listen_address
        assert address is not None  # init listened
        conn.send(("ready", address[1]))
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "push":
                _, src_blocks, dst_blocks = msg
                t0 = time.perf_counter()
                half = geo.layers // 2
                for first, last in ((0, half - 1), (half, geo.layers - 1)):
                    ext = KvCacheExtParam((first, last), (first, last), 2)
                    await kv.push_blocks(BlocksCacheKey(DECODER_ID, 0), cache, src_blocks, dst_blocks, ext)
                conn.send(("pushed", time.perf_counter() - t0))
            elif msg[0] == "stop":
                conn.send(("stopped",))
                return


async def _decoder(conn, geo: Geometry, seed: int, port: int, transport: str) -> dict:
    rng = random.Random(seed)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(_config(listen=False, transport=transport))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(geo.desc, BlocksCacheKey(DECODER_ID, 0))
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = PROMPT_ID
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", port)
        status, per_cluster = await dd.link_clusters([cluster], timeout=5000)
        if status != 0:
            raise RuntimeError(f"link failed: {per_cluster}")
        link = dd._require_links().get(PROMPT_ID)
        if link.nixl is not None and link.nixl.usable():
            moved_by = "NIXL READ/WRITE (UCX)"
        elif link.local is not None:
            moved_by = "same-host shared memory"
        else:
            moved_by = "TCP data channels"
        expected = seeded_cache(geo, seed)
        request_blocks = geo.blocks // 2
        src = rng.sample(range(geo.blocks), request_blocks)
        dst = rng.sample(range(geo.blocks), request_blocks)
        nbytes = request_blocks * geo.block_bytes * 2 * geo.layers
        await kv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), cache, src, dst)
        pulls = []
        for _ in range(3):
            t0 = time.perf_counter()
            await kv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), cache, src, dst)
            pulls.append(time.perf_counter() - t0)
        idx_s, idx_d = torch.tensor(src), torch.tensor(dst)
        pull_ok = all(torch.equal(c[idx_d].view(torch.int16), e[idx_s].view(torch.int16))
                      for c, e in zip(cache.tensors, expected, strict=True))
        push_src = rng.sample(range(geo.blocks), 16)
        push_dst = [b for b in range(geo.blocks) if b not in set(dst)][:16]
        conn.send(("push", push_src, push_dst))
        reply = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        ps, pd = torch.tensor(push_src), torch.tensor(push_dst)
        push_ok = all(torch.equal(c[pd].view(torch.int16), e[ps].view(torch.int16))
                      for c, e in zip(cache.tensors, expected, strict=True))
        await dd.unlink_clusters([cluster])
        best = min(pulls)
        return {"transport": moved_by, "pull_ok": pull_ok, "push_ok": push_ok, "pull_bytes": nbytes, "pull_s": best,
                "push_bytes": 16 * geo.block_bytes * 2 * geo.layers, "push_s": reply[1]}


def _run_prompt(conn, geo: Geometry, seed: int, transport: str) -> None:
    asyncio.run(_prompt(conn, geo, seed, transport))


def _run_decoder(conn, result, geo: Geometry, seed: int, port: int, transport: str) -> None:
    result.send(asyncio.run(_decoder(conn, geo, seed, port, transport)))


def _recv(conn, what: str, limit: float):
    if not conn.poll(limit):
        raise TimeoutError(f"no {what} within {limit:.0f} s")
    return conn.recv()


def main(transport: str = "auto") -> int:
    """Run the demo with both endpoints on ``aio.Transport=transport``; returns 0 when every byte
    arrived intact."""
    geo = Geometry()
    seed = 1234
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    prompt = ctx.Process(target=_run_prompt, args=(p_child, geo, seed, transport), name="prompt")
    procs = [prompt]
    try:
        t_start = time.perf_counter()
        prompt.start()
        _, port = _recv(p_conn, "prompt start-up", SPAWN_LIMIT_S)
        decoder = ctx.Process(target=_run_decoder, args=(d_child, r_child, geo, seed, port, transport),
                              name="decoder")
        procs.append(decoder)
        decoder.start()
        push = _recv(d_conn, "push request from the decoder", SPAWN_LIMIT_S)
        p_conn.send(push)
        d_conn.send(_recv(p_conn, "push result", SPAWN_LIMIT_S))
        result = _recv(r_conn, "decoder result", SPAWN_LIMIT_S)
        p_conn.send(("stop",))
        _recv(p_conn, "prompt shutdown", 30)
        for proc in procs:
            proc.join(30)
        mib = 2**20
        print(f"aio_datadist demo: PROMPT (cluster {PROMPT_ID}) and DECODER (cluster {DECODER_ID}) "
              f"processes on 127.0.0.1:{port}")
        print(f"  cache: {2 * geo.layers} tensors (32 layers x K,V) of [{geo.blocks}, {geo.block_tokens}, "
              f"{geo.heads}, {geo.head_dim}] fp16, {geo.block_bytes // 1024} KiB per block per tensor")
        print(f"  transport: {result['transport']} (aio.Transport={transport}; --transport tcp|local|nixl|auto)")
        print(f"  pull_blocks of {geo.blocks // 2} blocks ({result['pull_bytes'] / mib:.0f} MiB): "
              f"{result['pull_s'] * 1e3:.1f} ms, {result['pull_bytes'] / result['pull_s'] / 1e9:.2f} GB/s, "
              f"bytes {'verified' if result['pull_ok'] else 'WRONG'}")
        print(f"  push_blocks of 16 blocks in two layer ranges ({result['push_bytes'] / mib:.0f} MiB): "
              f"{result['push_s'] * 1e3:.1f} ms, bytes {'verified' if result['push_ok'] else 'WRONG'}")
        print(f"  total wall time {time.perf_counter() - t_start:.1f} s")
        ok = result["pull_ok"] and result["push_ok"] and all(p.exitcode == 0 for p in procs)
        print("demo OK" if ok else "demo FAILED")
        return 0 if ok else 1
    except Exception as exc:
        print(f"demo FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
