"""A CacheManager-mode (v2) endpoint in a spawned process, driven like :class:`peers.EndpointProcess`.

It starts with no caches; ``register`` makes one the v2 way (torch tensors
of its own, filled with :func:`peers.pattern`, registered by their raw
addresses) and answers its cache id. ``cm`` calls a ``CacheManager`` method
(:class:`peers.Ref` standing for its caches); ``link``, ``unlink``, ``links``
and ``dump`` are those of :mod:`peers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import traceback
from collections.abc import AsyncIterator
from typing import Any

import torch
from peers import (
    LOCALHOST,
    EndpointProcess,
    EndpointSpec,
    Ref,
    _next_command,
    _run_command,
    _watchdog,
    pattern,
    run_endpoint,
)

from aio_datadist import BlocksCacheKey, CacheDesc, CacheKey, KvCache, LLMConfig, LLMDataDist, LLMException


def v2_options(*, listen: bool = False, transport: str = "tcp", select: str = "local_comm_res",
               sync_kv_timeout: int | None = None) -> dict[str, str]:
    """Options of a loopback v2 endpoint (port 0 when listening), CPU memory for every placement.

    :param select: ``"local_comm_res"`` (``local_comm_res = ""``, as the HIXL push samples) or
        ``"enable"`` (``enable_cache_manager = True``, as vllm-ascend and MindIE).
    """
    config = LLMConfig()
    config.device_id = 0
    config.device_type = "cpu"
    config.transport = transport
    if select == "local_comm_res":
        config.local_comm_res = ""
    else:
        config.enable_cache_manager = True
    if listen:
        config.listen_ip_info = f"{LOCALHOST}:0"
    if sync_kv_timeout is not None:
        config.sync_kv_timeout = sync_kv_timeout
    return config.generate_options()


class V2Endpoint(EndpointProcess):
    """An :class:`EndpointProcess` whose child runs :func:`_serve` (v2) instead of the v1 server."""

    def __init__(self, spec: EndpointSpec) -> None:
        super().__init__(spec, target=_main)

    async def register(self, name: str, desc: CacheDesc, seed: int, *, blocks: bool = False,
                       model_id: int | None = None, req_ids: tuple[int, ...] = (),
                       remote_accessible: bool | None = True) -> int:
        """Register cache ``name`` there (contents ``pattern(desc, seed)``); its cache id."""
        return await self.call("register", name, desc, seed, blocks, model_id, req_ids, remote_accessible)


@contextlib.asynccontextmanager
async def v2_spawned(spec: EndpointSpec) -> AsyncIterator[V2Endpoint]:
    """One v2 endpoint process, closed on exit even on failure."""
    proc = V2Endpoint(spec)
    try:
        proc._launch()
        await proc._ready()
        yield proc
    finally:
        await proc.close()
        proc.reap()


# -- the child's side ---------------------------------------------------------------


def _main(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int) -> None:
    torch.set_num_threads(1)
    run_endpoint(conn, spec, parent_pid, _serve, _watchdog)


async def _serve(conn: multiprocessing.connection.Connection, spec: EndpointSpec) -> None:
    async with LLMDataDist(spec.role, spec.cluster_id) as dd:
        await dd.init(v2_options(listen=spec.listen, **dict(spec.config)))
        caches: dict[str, KvCache] = {}
        owned: list[torch.Tensor] = []  # the registered memory stays alive as long as the endpoint
        port = dd.listen_address[1] if dd.listen_address else 0
        conn.send(("ready", {"port": port, "caches": {}}))
        while True:
            command, args, kwargs = await _next_command(conn)
            if command == "exit":
                break
            try:
                if command == "register":
                    result: Any = _register(dd, spec.cluster_id, caches, owned, *args)
                elif command == "cm":
                    result = await _call(dd, caches, args, kwargs)
                else:
                    result = await _run_command(dd, caches, command, args, kwargs)
            except LLMException as exc:
                conn.send(("llm", int(exc.status_code), str(exc)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))


def _register(dd: LLMDataDist, cluster_id: int, caches: dict[str, KvCache], owned: list[torch.Tensor], name: str,
              desc: CacheDesc, seed: int, blocks: bool, model_id: int | None, req_ids: tuple[int, ...],
              remote_accessible: bool | None) -> int:
    tensors = pattern(desc, seed)
    owned.extend(tensors)
    addrs = [t.data_ptr() for t in tensors]
    cm = dd.cache_manager
    if blocks:
        key = None if model_id is None else BlocksCacheKey(cluster_id, model_id)
        cache = cm.register_blocks_cache(desc, addrs, key, remote_accessible)
    else:
        cache = cm.register_cache(desc, addrs, [CacheKey(cluster_id, r) for r in req_ids], remote_accessible)
    caches[name] = cache
    return cache.cache_id


async def _call(dd: LLMDataDist, caches: dict[str, KvCache], args: tuple, kwargs: dict) -> Any:
    def resolve(value: Any) -> Any:
        return caches[value.name] if isinstance(value, Ref) else value

    result = getattr(dd.cache_manager, args[0])(*map(resolve, args[1:]), **{k: resolve(v) for k, v in kwargs.items()})
    if asyncio.iscoroutine(result):
        result = await result
    return None if isinstance(result, KvCache) else result
