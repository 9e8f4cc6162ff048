"""Endpoint processes started from a fork server that has torch and aio_datadist loaded.

A ``spawn`` start that imports torch costs about 2 s here; a fork of the
preloaded server costs about 20 ms, which is what lets the fault tests run
50+ kill trials in CI. :class:`ForkedEndpoint` is a
:class:`peers.EndpointProcess` (same commands, same closing rules) whose
process comes from the fork server, plus these commands:

- ``state``: the endpoint's :func:`_harness.state` and its open fd count.
- ``background`` (method, args, kwargs, seconds): call a ``KvCacheManager``
  method again and again in a background task until it fails or the time is
  up; returns at once. ``layerwise`` (dst cluster, cache, src blocks, dst
  blocks, seconds) does the same with ``transfer_cache_async``.
- ``die_in`` (seconds): SIGKILL itself from a thread after that long.
- ``digest`` (cache): one SHA-256 per tensor.
- ``swarm`` (cluster ids, prompt id, port, desc, seed, seconds, config): more
  DECODER endpoints in this process, each linked to the prompt and pulling
  random blocks for that long, every byte checked; returns counts.

The fork server must have been started (conftest ``fork_server`` fixture)
before a test snapshots its fds; the processes are children of the fork
server, so they watch this process themselves and exit when it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator
from typing import Any

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheKey,
    KvCache,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    TransferWithCacheKeyConfig,
)
from peers import EndpointProcess, EndpointSpec, Ref, _next_command, _run_command, fill, run_endpoint

import _harness

_CTX = multiprocessing.get_context("forkserver")


class ForkedEndpoint(EndpointProcess):
    """An endpoint process forked from the fork server (see the module docstring)."""

    def __init__(self, spec: EndpointSpec) -> None:
        self.spec = spec
        self._conn, child_conn = _CTX.Pipe(duplex=True)
        self._child_conn: multiprocessing.connection.Connection | None = child_conn
        self._process = _CTX.Process(target=_main, args=(child_conn, spec, os.getpid()),
                                     name=f"forked-endpoint-{spec.cluster_id}", daemon=True)
        self.port = 0
        self.cache_ids: dict[str, int] = {}
        self._started = False
        self._closed = False
        self._reaped = False

    def start(self) -> ForkedEndpoint:
        self._launch()
        self._fds = {self._conn.fileno(), self._process.sentinel}
        _harness.PROCESS_FDS.update(self._fds)
        return self

    def reap(self) -> None:
        _harness.PROCESS_FDS.difference_update(getattr(self, "_fds", ()))
        super().reap()

    async def ready(self, timeout: float = 30.0) -> ForkedEndpoint:
        await self._ready(timeout)
        return self


@contextlib.asynccontextmanager
async def forked(*specs: EndpointSpec) -> AsyncIterator[list[ForkedEndpoint]]:
    """Start endpoint processes together; every one is closed on exit, even on failure."""
    procs = [ForkedEndpoint(spec) for spec in specs]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            await proc.ready()
        yield procs
    finally:
        await asyncio.gather(*(p.close(grace=2.0) for p in procs), return_exceptions=True)
        for proc in procs:
            proc.reap()


# -- the child's side ---------------------------------------------------------------


def _watch(parent_pid: int, deadline: float) -> None:
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        if time.monotonic() > deadline:
            os._exit(71)
        time.sleep(0.2)


def _main(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int) -> None:
    torch.set_num_threads(1)  # several peers share 2 cores: spinning OpenMP workers would starve them
    run_endpoint(conn, spec, parent_pid, _serve, _watch)
    os._exit(0)  # skip interpreter teardown (torch's costs ~1 s)


async def _serve(conn: multiprocessing.connection.Connection, spec: EndpointSpec) -> None:
    async with LLMDataDist(spec.role, spec.cluster_id) as dd:
        await dd.init(_harness.options(listen=spec.listen, **dict(spec.config)))
        kv = dd.kv_cache_manager
        caches: dict[str, KvCache] = {}
        for c in spec.caches:
            if c.blocks:
                key = None if c.model_id is None else BlocksCacheKey(spec.cluster_id, c.model_id)
                caches[c.name] = kv.allocate_blocks_cache(c.desc, key)
            else:
                caches[c.name] = kv.allocate_cache(c.desc, [CacheKey(spec.cluster_id, r) for r in c.req_ids])
            fill(caches[c.name], c.seed)
        port = dd.listen_address[1] if dd.listen_address else 0
        conn.send(("ready", {"port": port, "caches": {n: c.cache_id for n, c in caches.items()}}))
        background: set[asyncio.Task] = set()
        while True:
            command, args, kwargs = await _next_command(conn)
            if command == "exit":
                break
            try:
                result = await _command(dd, caches, background, command, args, kwargs)
            except LLMException as exc:
                conn.send(("llm", int(exc.status_code), str(exc)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)


class _Jitter(LayerSynchronizer):
    """Every layer is ready after a random pause of up to 2 ms."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(self.rng.random() * 0.002)
        return True


async def _repeat(call: Any, seconds: float) -> tuple[int, int | None]:
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await call()
        except LLMException as exc:
            return done, int(exc.status_code)
        done += 1
    return done, None


async def _command(dd: LLMDataDist, caches: dict[str, KvCache], background: set[asyncio.Task], command: str,
                   args: tuple, kwargs: dict) -> Any:
    def resolve(value: Any) -> Any:
        return caches[value.name] if isinstance(value, Ref) else value

    kv = dd.kv_cache_manager
    if command == "state":
        return dict(_harness.state(dd), fds=len(_harness.open_fds()))
    if command == "background":
        method, call_args, call_kwargs, seconds = args
        bound = getattr(kv, method)
        call = lambda: bound(*map(resolve, call_args), **{k: resolve(v) for k, v in call_kwargs.items()})  # noqa: E731
        task = asyncio.ensure_future(_repeat(call, seconds))
        background.add(task)
        return None
    if command == "layerwise":
        dst_cluster, src, src_blocks, dst_blocks, seconds = args
        rng = random.Random(os.getpid())
        config = [TransferWithCacheKeyConfig(BlocksCacheKey(dst_cluster, 0))]

        async def once() -> None:
            await kv.transfer_cache_async(resolve(src), _Jitter(rng), config, src_blocks, dst_blocks)

        background.add(asyncio.ensure_future(_repeat(once, seconds)))
        return None
    if command == "die_in":
        seconds = args[0]
        threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return None
    if command == "digest":
        return [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in caches[args[0]].tensors]
    if command == "swarm":
        return await _swarm(*args, **kwargs)
    return await _run_command(dd, caches, command, args, kwargs)


async def _swarm(cluster_ids: list[int], prompt_id: int, port: int, desc: Any, seed: int, seconds: float,
                 config: dict[str, Any], link_timeout_ms: int = 10_000) -> dict[str, Any]:
    """``len(cluster_ids)`` more DECODER endpoints here, each linked to the prompt (``link_timeout_ms``: the
    default 3 s timed some of 256 links out on a CI machine busy with other work), pulling random blocks of its
    blocks cache (``fill(..., seed)``) for ``seconds`` and checking every byte."""
    from peers import cluster_info, pattern

    expected = pattern(desc, seed)
    stats = {"pulls": 0, "bytes": 0, "wrong": 0, "errors": []}
    async with contextlib.AsyncExitStack() as stack:
        ends = []
        for cid in cluster_ids:
            dd = await stack.enter_async_context(LLMDataDist(LLMRole.DECODER, cid))
            await dd.init(_harness.options(**config))
            ends.append(dd)
        results = await asyncio.gather(*(dd.link_clusters([cluster_info(prompt_id, ("127.0.0.1", port))],
                                                          timeout=link_timeout_ms) for dd in ends))
        assert all(r[0] == 0 for r in results), results
        deadline = time.monotonic() + seconds
        rows = desc.shape[0]
        block_bytes = desc.size // rows * desc.num_tensors

        async def puller(dd: LLMDataDist, rng: random.Random) -> None:
            kv = dd.kv_cache_manager
            dst = kv.allocate_blocks_cache(desc)
            while time.monotonic() < deadline:
                n = rng.randint(1, rows)
                srcs, dsts = rng.sample(range(rows), n), rng.sample(range(rows), n)
                try:
                    await kv.pull_blocks(BlocksCacheKey(prompt_id, 0), dst, srcs, dsts, timeout=10_000)
                except LLMException as exc:
                    stats["errors"].append(f"{dd.cluster_id}: {exc}")
                    return
                stats["pulls"] += 1
                stats["bytes"] += n * block_bytes
                if not all(torch.equal(d[dsts].view(torch.int16), e[srcs].view(torch.int16))
                           for d, e in zip(dst.tensors, expected)):
                    stats["wrong"] += 1

        await asyncio.gather(*(puller(dd, random.Random(dd.cluster_id)) for dd in ends))
    return stats

