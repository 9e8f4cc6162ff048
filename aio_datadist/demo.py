"""``python -m aio_datadist demo``: a prompt and a decoder process on loopback.

The PROMPT process builds a paged KV cache (32 layers, K and V, 16-token
blocks, fp16) with seeded contents; the DECODER process links to it, pulls
one request's block table, then has the prompt push a second request layer
range by layer range into its own cache. Both sides check every byte against
the same seeded contents. The two processes talk through a pipe for the
side-channel notices a serving framework would send (ports, block tables).

Each transfer runs 1 + :data:`TIMED` times: the first one pays page faults
on fresh cache memory and one-time set-up, so the figures are the best of
the warm ones, and the cold first one is printed beside them. The
transport printed is the one the link negotiated, which need not be the one
asked (``auto`` shares memory with a same-host peer).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    KvCacheExtParam,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)
from aio_datadist._negotiated_transport import TRANSPORT_WORDS, negotiated_transport

PROMPT_ID, DECODER_ID = 1, 2
SPAWN_LIMIT_S = 120.0
#: Warm repeats of each transfer after the cold first one; the best is printed.
TIMED = 3
_POLL_S = 0.2


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


def _export(dd: LLMDataDist, port: int | None) -> tuple[Any, int]:
    """Serve ``dd``'s metrics on 127.0.0.1:``port`` (0: any free port); the server and its port.

    :raises SystemExit: with one line naming the port if it cannot be served (taken since the command
        line checked it): the process ends with that line, not a traceback.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    from aio_datadist.metrics import instrument

    registry = CollectorRegistry()
    instrument(dd, registry)
    try:
        server, _ = start_http_server(port or 0, addr="127.0.0.1", registry=registry)
    except OSError as exc:
        raise SystemExit(f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    return server, server.server_port


def _scrape(url: str) -> list[str]:
    """The ``aio_datadist_`` samples at ``url`` (no buckets, no ``_created``), as text lines."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as answer:
        text = answer.read().decode()
    return [line for line in text.splitlines() if line.startswith("aio_datadist_")
            and "_bucket{" not in line and "_created{" not in line]


async def _prompt(conn, geo: Geometry, seed: int, transport: str, metrics_port: int | None = None) -> None:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        server, metrics_at = _export(dd, 0 if metrics_port else None) if metrics_port is not None else (None, 0)
        await dd.init(_config(listen=True, transport=transport))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(geo.desc, BlocksCacheKey(PROMPT_ID, 0))
        for dst, src in zip(cache.tensors, seeded_cache(geo, seed), strict=True):
            dst.copy_(src)
        address = dd.listen_address
        assert address is not None  # init listened
        conn.send(("ready", address[1], metrics_at))
        loop = asyncio.get_running_loop()
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "push":
                _, src_blocks, dst_blocks = msg
                half = geo.layers // 2
                times = []
                for _ in range(1 + TIMED):  # the first, cold one is left out of the best
                    t0 = time.perf_counter()
                    for first, last in ((0, half - 1), (half, geo.layers - 1)):
                        ext = KvCacheExtParam((first, last), (first, last), 2)
                        await kv.push_blocks(BlocksCacheKey(DECODER_ID, 0), cache, src_blocks, dst_blocks, ext)
                    times.append(time.perf_counter() - t0)
                conn.send(("pushed", times[0], min(times[1:])))
            elif msg[0] == "stop":
                if server is not None:
                    server.shutdown()
                    server.server_close()
                conn.send(("stopped",))
                return


async def _decoder(conn, geo: Geometry, seed: int, port: int, transport: str,
                   metrics: tuple[int, int] | None = None) -> dict:
    rng = random.Random(seed)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        server = None
        if metrics is not None:
            server, own_port = _export(dd, metrics[0])
            metrics = (own_port, metrics[1])
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
        moved_by = negotiated_transport(dd, PROMPT_ID)
        expected = seeded_cache(geo, seed)
        request_blocks = geo.blocks // 2
        src = rng.sample(range(geo.blocks), request_blocks)
        dst = rng.sample(range(geo.blocks), request_blocks)
        nbytes = request_blocks * geo.block_bytes * 2 * geo.layers
        pulls = []
        for _ in range(1 + TIMED):  # the first, cold one is left out of the best
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
        scraped: dict[str, list[str]] = {}
        if metrics is not None:
            for at in metrics:  # the decoder's, then the prompt's
                url = f"http://127.0.0.1:{at}/metrics"
                scraped[url] = await asyncio.to_thread(_scrape, url)
        if server is not None:
            server.shutdown()
            server.server_close()
        await dd.unlink_clusters([cluster])
        return {"scraped": scraped, "transport": moved_by, "pull_ok": pull_ok, "push_ok": push_ok, "pull_bytes": nbytes,
                "pull_cold_s": pulls[0], "pull_s": min(pulls[1:]), "push_bytes": 16 * geo.block_bytes * 2 * geo.layers,
                "push_cold_s": reply[1], "push_s": reply[2]}


def _run_prompt(conn, geo: Geometry, seed: int, transport: str, metrics_port: int | None) -> None:
    try:
        asyncio.run(_prompt(conn, geo, seed, transport, metrics_port))
    except LLMException as exc:  # a refusal (init's: NIXL without its plugins) says what, not a traceback
        raise SystemExit(f"prompt: {exc}") from None


def _run_decoder(conn, result, geo: Geometry, seed: int, port: int, transport: str,
                 metrics: tuple[int, int] | None) -> None:
    try:
        result.send(asyncio.run(_decoder(conn, geo, seed, port, transport, metrics)))
    except LLMException as exc:
        raise SystemExit(f"decoder: {exc}") from None


def _recv(conn, what: str, limit: float, sender: mp.process.BaseProcess, procs: list) -> Any:
    """The next message on ``conn``; fails as soon as ``sender`` ended without sending it or any
    process failed, rather than after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not conn.poll(_POLL_S):
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"the {failed[0].name} process exited with code {failed[0].exitcode} "
                               f"before the {what} (its error is above)")
        if sender.exitcode is not None and not conn.poll(0):
            raise RuntimeError(f"the {sender.name} process ended without sending the {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {limit:.0f} s")
    return conn.recv()


def _start(proc: mp.process.BaseProcess) -> None:
    """Start ``proc`` with SIGINT ignored: a terminal's Ctrl-C reaches the whole process group, and this
    process reaps the children (an ignored signal stays ignored across exec; Python keeps it so)."""
    if threading.current_thread() is not threading.main_thread():  # signal() is the main thread's alone
        proc.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _timing(nbytes: int, best_s: float, cold_s: float) -> str:
    return f"{best_s * 1e3:.1f} ms, {nbytes / best_s / 1e9:.2f} GB/s (first, cold one: {cold_s * 1e3:.1f} ms)"


def main(transport: str = "auto", metrics_port: int | None = None) -> int:
    """Run the demo with both endpoints on ``aio.Transport=transport``; returns 0 when every byte
    arrived intact. With ``metrics_port`` both export Prometheus metrics and the scrape is printed."""
    geo = Geometry()
    seed = 1234
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    prompt = ctx.Process(target=_run_prompt, args=(p_child, geo, seed, transport, metrics_port), name="prompt")
    procs = [prompt]
    try:
        t_start = time.perf_counter()
        _start(prompt)
        _, port, prompt_metrics = _recv(p_conn, "prompt start-up", SPAWN_LIMIT_S, prompt, procs)
        t_ready = time.perf_counter()
        metrics = None if metrics_port is None else (metrics_port, prompt_metrics)
        decoder = ctx.Process(target=_run_decoder, args=(d_child, r_child, geo, seed, port, transport, metrics),
                              name="decoder")
        procs.append(decoder)
        _start(decoder)
        push = _recv(d_conn, "push request from the decoder", SPAWN_LIMIT_S, decoder, procs)
        p_conn.send(push)
        d_conn.send(_recv(p_conn, "push result", SPAWN_LIMIT_S, prompt, procs))
        result = _recv(r_conn, "decoder result", SPAWN_LIMIT_S, decoder, procs)
        p_conn.send(("stop",))
        _recv(p_conn, "prompt shutdown", 30, prompt, procs)
        for proc in procs:
            proc.join(30)
        mib = 2**20
        moved_by = result["transport"]
        print(f"aio_datadist demo: PROMPT (cluster {PROMPT_ID}) and DECODER (cluster {DECODER_ID}) "
              f"processes on 127.0.0.1:{port}")
        print(f"  cache: {2 * geo.layers} tensors (32 layers x K,V) of [{geo.blocks}, {geo.block_tokens}, "
              f"{geo.heads}, {geo.head_dim}] fp16, {geo.block_bytes // 1024} KiB per block per tensor")
        print(f"  transport: {moved_by} ({TRANSPORT_WORDS[moved_by]}), as the link negotiated it; "
              f"asked aio.Transport={transport} (--transport tcp|local|nixl|auto)")
        print(f"  pull_blocks of {geo.blocks // 2} blocks ({result['pull_bytes'] / mib:.0f} MiB) over {moved_by}: "
              f"{_timing(result['pull_bytes'], result['pull_s'], result['pull_cold_s'])}, "
              f"bytes {'verified' if result['pull_ok'] else 'WRONG'}")
        print(f"  push_blocks of 16 blocks in two layer ranges ({result['push_bytes'] / mib:.0f} MiB) over "
              f"{moved_by}: {_timing(result['push_bytes'], result['push_s'], result['push_cold_s'])}, "
              f"bytes {'verified' if result['push_ok'] else 'WRONG'}")
        print(f"  timings: best of {TIMED} warm transfers; the first, cold one (page faults on fresh cache memory, "
              "one-time set-up) is left out and shown apart")
        print(f"  total wall time {time.perf_counter() - t_start:.1f} s ({t_ready - t_start:.1f} s of it starting "
              "the prompt process: Python, torch, init; a first run after installing also compiles bytecode)")
        for url, lines in result["scraped"].items():
            print(f"  metrics scraped from {url} (no buckets):")
            for line in lines:
                print(f"    {line}")
        failed = [what for what, held in (("pulled bytes differ", result["pull_ok"]),
                                          ("pushed bytes differ", result["push_ok"]),
                                          (f"exit codes {[p.exitcode for p in procs]}",
                                           all(p.exitcode == 0 for p in procs))) if not held]
        print(f"demo FAILED: {'; '.join(failed)}" if failed
              else f"demo OK: pulled and pushed over {moved_by}; bytes equal")
        return 1 if failed else 0
    except Exception as exc:
        print(f"demo FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        # Ctrl-C pressed again while the children are reaped must not cut it short (a child left unkilled)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            for proc in procs:
                if proc.pid is None:  # never started (its start failed)
                    continue
                if proc.is_alive():
                    proc.kill()
                proc.join(10)
            for end in (p_conn, p_child, d_conn, d_child, r_conn, r_child):
                end.close()
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)
