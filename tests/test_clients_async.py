"""The real clients' flows of ``tests/clients/`` again, written against the async API.

Each test mirrors one port (its docstring names it): the same llm_datadist
calls in the same order with the same arguments and keywords, but on
:class:`aio_datadist.LLMDataDist` and its ``cache_manager`` (v2) or
``kv_cache_manager`` (v1), every link and transfer awaited. Only what the
ports themselves replaced is left out (vLLM's / MindIE's / SGLang's classes
around the calls, their threads and queues); their side channels are the
harness's :class:`Peer`, whose waits run in a thread so the loop keeps
serving the link meanwhile.

Each flow runs in two processes on loopback (``_client_harness.run_pair``),
over ``aio.Transport`` ``tcp`` and ``local`` on asyncio's loop and over
``tcp`` on uvloop, and passes only if every check of the bytes that moved,
made on the receiving side, holds. The processes are forked from a fork
server that has torch loaded (a ``spawn`` start costs ~2 s of imports here,
which 33 runs cannot afford).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import multiprocessing
import multiprocessing.forkserver
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import uvloop

from aio_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
    TransferWithCacheKeyConfig,
)

CLIENTS = Path(__file__).resolve().parent / "clients"
if str(CLIENTS) not in sys.path:
    sys.path.insert(0, str(CLIENTS))

import _client_harness as harness  # noqa: E402
from _client_harness import LOCALHOST, OTHER_LOCALHOST, aligned, pattern, tensors_at  # noqa: E402

FORK = multiprocessing.get_context("forkserver")
LIMIT_S = 30.0
POLL_S = 1.0  # the clients' query_register_mem_status period (MindIE: 50 ms)

#: Both transports on asyncio, and TCP on uvloop too (the loop-specific code is the link's reader and
#: the completions, which the TCP path exercises; the whole grid cost CI time for no new path).
RUNS = pytest.mark.parametrize(("transport", "loop"), [("tcp", "asyncio"), ("tcp", "uvloop"), ("local", "asyncio")])


@pytest.fixture(scope="module", autouse=True)
def fork_server() -> None:
    """Start the fork server before a test's leak check snapshots the fds."""
    FORK.set_forkserver_preload(["torch", "uvloop", "aio_datadist", "_client_harness", __name__])
    multiprocessing.forkserver.ensure_running()


# -- the two-process runner ------------------------------------------------------


class APeer:
    """:class:`_client_harness.Peer` for a coroutine: barrier and receive wait in a thread."""

    def __init__(self, peer: harness.Peer) -> None:
        self.peer = peer

    async def barrier(self) -> None:
        await asyncio.to_thread(self.peer.barrier)

    async def recv(self) -> Any:
        return await asyncio.to_thread(self._recv)

    def _recv(self) -> Any:
        deadline = time.monotonic() + LIMIT_S
        while not self.peer.poll(0.1):  # short slices: our own failure (abort) ends the wait too
            if self.peer.other_failed() or time.monotonic() > deadline:
                raise harness.PeerFailed("the other side failed or sent nothing")
        return self.peer.recv(0)

    def send(self, obj: Any) -> None:
        self.peer.send(obj)

    def check(self, name: str, ok: bool) -> None:
        self.peer.check(name, ok)


def _side(peer: harness.Peer, flow: Any, loop: str, ports: list[int]) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_guarded(peer, flow, ports))


async def _guarded(peer: harness.Peer, flow: Any, ports: list[int]) -> None:
    try:
        async with asyncio.timeout(LIMIT_S):
            await flow(APeer(peer), ports)
    except BaseException:
        peer.abort()  # ends the waits in our threads (so the loop can close) and the other side's
        raise


def _run(prefill: Any, decode: Any, transport: str, loop: str) -> None:
    *ports, link_port = harness.free_ports(3)
    result = harness.run_pair(_side, _side, prefill_args=(prefill, loop, ports), decode_args=(decode, loop, ports),
                              options={"aio.Transport": transport, "aio.LinkPort": str(link_port)},
                              limit_s=LIMIT_S, ctx=FORK)
    tracebacks = "\n".join(result[side].get("traceback", "") for side in ("prefill", "decode"))
    assert result["first_failure"] is None, f"{result['first_failure']}\n{tracebacks}"
    differ = sorted(name for name, ok in result["checks"].items() if not ok)
    assert result["checks"] and not differ, f"bytes differ on the receiving side: {differ}"
    assert result["ok"], result


def _options(**config: Any) -> dict[str, Any]:
    """``LLMConfig`` with these properties set, ``generate_options()``, plus the run's ``aio.`` keys."""
    llm_config = LLMConfig()
    for name, value in config.items():
        setattr(llm_config, name, value)
    options = llm_config.generate_options()
    options.update(harness.extra_options())
    return options


async def _init(role: LLMRole, cluster_id: int, options: dict[str, Any]) -> LLMDataDist:
    datadist = LLMDataDist(role, cluster_id)
    await datadist.init(options)
    return datadist


def _cluster(remote_cluster_id: int | None, local: tuple | None = None, remote: tuple | None = None) -> LLMClusterInfo:
    cluster = LLMClusterInfo()
    if remote_cluster_id is not None:
        cluster.remote_cluster_id = remote_cluster_id
    if local:
        cluster.append_local_ip_info(*local)
    if remote:
        cluster.append_remote_ip_info(*remote)
    return cluster


async def _link_clusters(datadist: LLMDataDist, cluster: LLMClusterInfo, timeout: int = 5000) -> None:
    ret, _ = await datadist.link_clusters([cluster], timeout)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {ret!r}")


async def _unlink_clusters(datadist: LLMDataDist, cluster: LLMClusterInfo, force: bool = False) -> None:
    ret, _ = await (datadist.unlink_clusters([cluster], 5000, force=True) if force
                    else datadist.unlink_clusters([cluster], 5000))
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret!r}")


async def _poll_linked(datadist: LLMDataDist, comm_id: int, period_s: float = POLL_S, by_keyword: bool = False) -> int:
    """The clients' loop over ``query_register_mem_status`` until OK (FAILED raises); vllm-ascend
    passes ``comm_id=`` by keyword."""
    while True:
        ret = (datadist.query_register_mem_status(comm_id=comm_id) if by_keyword
               else datadist.query_register_mem_status(comm_id))
        if ret == RegisterMemStatus.OK:
            return comm_id
        if ret == RegisterMemStatus.FAILED:
            raise RuntimeError(f"link failed, comm id {comm_id}")
        await asyncio.sleep(period_s)


# -- HIXL samples: one-sided links (push_blocks, push_cache, transfer_cache_async, switch_role) --

HIXL_SHAPE = (3, 10)


def _hixl_desc() -> CacheDesc:
    return CacheDesc(num_tensors=2, shape=[3, 10], data_type=DataType.DT_FLOAT, placement=Placement.DEVICE)


def _hixl_tensors(*seeds: int) -> list[torch.Tensor]:
    return [pattern(HIXL_SHAPE, torch.float, seed=s) for s in seeds]


def _addrs(tensors: list[torch.Tensor]) -> list[int]:
    return [int(t.data_ptr()) for t in tensors]


async def _push_blocks_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 0, _options(device_id=0, local_comm_res="",
                                                       listen_ip_info=f"{LOCALHOST}:{ports[0]}"))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(1, 2)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(0, 0))
    await p.barrier()  # register end
    await p.barrier()  # decoder push blocks end
    for i, (mine, own, theirs) in enumerate(zip(tensors, _hixl_tensors(1, 2), _hixl_tensors(11, 12), strict=True)):
        p.check(f"tensor{i}_blocks_0_2_pushed_1_kept", torch.equal(mine, torch.stack([theirs[0], own[1], theirs[1]])))
    await _unlink_clusters(datadist, _cluster(1), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _push_blocks_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 1, _options(device_id=0, local_comm_res="",
                                                        listen_ip_info=f"{LOCALHOST}:{ports[1]}"))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(11, 12)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(1, 0))
    await p.barrier()  # register end
    await _link_clusters(datadist, _cluster(0, (LOCALHOST, ports[1]), (LOCALHOST, ports[0])))
    await cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    await p.barrier()  # push_blocks end
    await _unlink_clusters(datadist, _cluster(0), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


@RUNS
def test_hixl_push_blocks(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_push_blocks.py``: the DECODER links and awaits ``push_blocks`` into the prompt."""
    _run(_push_blocks_prompt, _push_blocks_decoder, transport, loop)


async def _push_cache_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 0, _options(device_id=0, local_comm_res="",
                                                       listen_ip_info=f"{LOCALHOST}:{ports[0]}"))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(1, 2)
    cache = cache_manager.register_cache(_hixl_desc(), _addrs(tensors))
    await p.barrier()  # register end
    await p.barrier()  # decoder push cache end
    for i, (mine, own, theirs) in enumerate(zip(tensors, _hixl_tensors(1, 2), _hixl_tensors(11, 12), strict=True)):
        p.check(f"tensor{i}_row0_pushed_rows_1_2_kept", torch.equal(mine, torch.cat([theirs[:1], own[1:]])))
    await p.barrier()  # wait unlink end
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _push_cache_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 1, _options(device_id=0, local_comm_res="",
                                                        listen_ip_info=f"{LOCALHOST}:{ports[1]}"))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(11, 12)
    cache = cache_manager.register_cache(_hixl_desc(), _addrs(tensors))
    await p.barrier()  # register end
    await _link_clusters(datadist, _cluster(0, (LOCALHOST, ports[1]), (LOCALHOST, ports[0])))
    await cache_manager.push_cache(CacheKeyByIdAndIndex(cluster_id=0, cache_id=1, batch_index=0), cache,
                                   src_batch_index=0)
    await p.barrier()  # push cache end
    await _unlink_clusters(datadist, _cluster(0, remote=(LOCALHOST, ports[0])))
    await p.barrier()  # unlink end
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


@RUNS
def test_hixl_push_cache(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_push_cache.py``: the DECODER awaits ``push_cache`` into the prompt's cache id 1."""
    _run(_push_cache_prompt, _push_cache_decoder, transport, loop)


class LayerSynchronizerImpl(LayerSynchronizer):
    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


async def _transfer_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 0, _options(device_id=0, listen_ip_info=f"{LOCALHOST}:{ports[0]}",
                                                       enable_cache_manager=True,
                                                       enable_remote_cache_accessible=True))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(1, 2)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(0, 0))
    await p.barrier()  # register end
    await _link_clusters(datadist, _cluster(1, (LOCALHOST, ports[0]), (LOCALHOST, ports[1])))
    transfer_config = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))
    cache_task = cache_manager.transfer_cache_async(cache, LayerSynchronizerImpl(), [transfer_config])
    p.check("get_results_success", await cache_task.get_results() == [LLMStatusCode.LLM_SUCCESS])
    await p.barrier()  # transfer cache end
    await _unlink_clusters(datadist, _cluster(1), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _transfer_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 1, _options(device_id=0, listen_ip_info=f"{LOCALHOST}:{ports[1]}",
                                                        enable_cache_manager=True,
                                                        enable_remote_cache_accessible=True))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(11, 12)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(1, 0))
    await p.barrier()  # register end
    await p.barrier()  # prompt transfer cache end
    # layer 0 = tensors 0 and 1; without block indices only block 0 moves (LLM-DataDist's layer-wise job)
    for i, (mine, src, own) in enumerate(zip(tensors, _hixl_tensors(1, 2), _hixl_tensors(11, 12), strict=True)):
        p.check(f"tensor{i}_block0_equals_prompt", torch.equal(mine[0], src[0]))
        p.check(f"tensor{i}_other_blocks_kept", torch.equal(mine[1:], own[1:]))
    await _unlink_clusters(datadist, _cluster(0), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


@RUNS
def test_hixl_transfer_cache_async(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_transfer_cache_async.py``: the PROMPT dials, ``transfer_cache_async`` of a
    whole blocks cache, ``await cache_task.get_results()``."""
    _run(_transfer_prompt, _transfer_decoder, transport, loop)


async def _switch_role_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 0, _options(device_id=0, local_comm_res="",
                                                       listen_ip_info=f"{LOCALHOST}:{ports[0]}"))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(1, 2)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(0, 0))
    await p.barrier()  # register end
    await p.barrier()  # decoder unlink
    await datadist.switch_role(LLMRole.DECODER)
    await p.barrier()  # prompt switch role end, close listen
    await p.barrier()  # decoder switch role end, listen
    await _link_clusters(datadist, _cluster(1, (LOCALHOST, ports[0]), (LOCALHOST, ports[1])))
    await p.barrier()  # prompt link end
    await p.barrier()  # decoder push blocks end
    for i, (mine, own, theirs) in enumerate(zip(tensors, _hixl_tensors(1, 2), _hixl_tensors(11, 12), strict=True)):
        p.check(f"tensor{i}_after_push_back", torch.equal(mine, torch.stack([own[0], theirs[1], own[1]])))
    await _unlink_clusters(datadist, _cluster(1), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _switch_role_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 1, _options(device_id=0, local_comm_res=""))
    cache_manager = datadist.cache_manager
    tensors = _hixl_tensors(11, 12)
    cache = cache_manager.register_blocks_cache(_hixl_desc(), _addrs(tensors), BlocksCacheKey(1, 0))
    await p.barrier()  # register end
    await _link_clusters(datadist, _cluster(0, (LOCALHOST, ports[1]), (LOCALHOST, ports[0])))
    await cache_manager.pull_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 2])
    for i, (mine, src, own) in enumerate(zip(tensors, _hixl_tensors(1, 2), _hixl_tensors(11, 12), strict=True)):
        p.check(f"tensor{i}_pulled", torch.equal(mine, torch.stack([src[0], own[1], src[1]])))
    await _unlink_clusters(datadist, _cluster(0, remote=(LOCALHOST, ports[0])))
    await p.barrier()  # decoder unlink
    await p.barrier()  # prompt switch role end, close listen
    llm_config = LLMConfig()
    llm_config.listen_ip_info = f"{LOCALHOST}:{ports[1]}"
    await datadist.switch_role(LLMRole.PROMPT, llm_config.generate_options())
    await p.barrier()  # decoder switch role end, listen
    await p.barrier()  # prompt link end
    await cache_manager.push_blocks(BlocksCacheKey(0, 0), cache, src_blocks=[0, 1, 2], dst_blocks=[0, 1, 2],
                                    src_layer_range=range(0, 2), dst_layer_range=range(0, 2),
                                    tensor_num_per_layer=1)
    await p.barrier()  # decoder push blocks end
    await _unlink_clusters(datadist, _cluster(0), force=True)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


@RUNS
def test_hixl_switch_role(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_switch_role.py``: pull, non-forced unlink, both ``switch_role``, push back
    with ``src_layer_range`` / ``dst_layer_range`` / ``tensor_num_per_layer`` keywords."""
    _run(_switch_role_prompt, _switch_role_decoder, transport, loop)


# -- HIXL pull samples: bilateral link("link", {1: 0, 2: 1}, rank_table) ---------------------

PULL_SHAPE = (2, 1024 * 1024)


def _hixl_pull_options(**extra: Any) -> dict[str, Any]:
    return _options(device_id=0, enable_cache_manager=True, **extra)


async def _hixl_link(datadist: LLMDataDist, device_id: int = 0) -> int:
    rank_table_dict = {
        "server_count": "2", "status": "completed", "version": "1.2",
        "server_list": [
            {"device": [{"device_id": str(device_id), "device_ip": LOCALHOST, "rank_id": "0"}],
             "host_ip": LOCALHOST, "server_id": "1"},
            {"device": [{"device_id": str(device_id), "device_ip": OTHER_LOCALHOST, "rank_id": "1"}],
             "host_ip": OTHER_LOCALHOST, "server_id": "2"},
        ],
    }
    comm_id = await datadist.link("link", {1: 0, 2: 1}, json.dumps(rank_table_dict))
    return await _poll_linked(datadist, comm_id)


async def _pull_blocks_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 1, _hixl_pull_options())
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=1, shape=[2, 1024 * 1024], data_type=DataType.DT_FLOAT,
                           placement=Placement.DEVICE)
    tensor = pattern(PULL_SHAPE, torch.float, seed=1)
    cache_manager.register_blocks_cache(cache_desc, [int(tensor.data_ptr())], BlocksCacheKey(1, 0))
    comm_id = await _hixl_link(datadist)
    await p.barrier()  # prepared
    await p.barrier()  # the decoder is done
    await datadist.unlink(comm_id)
    await datadist.finalize()


async def _pull_blocks_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 2, _hixl_pull_options())
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=1, shape=[2, 1024 * 1024], data_type=DataType.DT_FLOAT,
                           placement=Placement.DEVICE)
    tensor = pattern(PULL_SHAPE, torch.float, seed=2)
    cache = cache_manager.register_blocks_cache(cache_desc, [int(tensor.data_ptr())])
    comm_id = await _hixl_link(datadist)
    await p.barrier()  # wait prompt prepared
    await cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, src_blocks=[0, 1], dst_blocks=[0, 1])
    expected = pattern(PULL_SHAPE, torch.float, seed=1)
    p.check("pulled_blocks_equal_prompt", torch.equal(tensor, expected))
    cpu_tensor = torch.rand(size=PULL_SHAPE, dtype=torch.float32)
    cpu_cache_desc = CacheDesc(num_tensors=1, shape=[2, 1024 * 1024], data_type=DataType.DT_FLOAT,
                               placement=Placement.HOST)
    cpu_cache = Cache.create_cpu_cache(cpu_cache_desc, [cpu_tensor.data_ptr()])
    await cache_manager.swap_blocks(cache, cpu_cache, {0: 0, 1: 1})
    p.check("swapped_out_equal", torch.equal(cpu_tensor, expected))
    tensor.zero_()
    await cache_manager.swap_blocks(cpu_cache, cache, {0: 0, 1: 1})
    p.check("swapped_in_equal", torch.equal(tensor, expected))
    await p.barrier()
    await datadist.unlink(comm_id)
    await datadist.finalize()


@RUNS
def test_hixl_pull_blocks(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_pull_blocks.py``: bilateral ``link``, ``pull_blocks``, ``swap_blocks`` out and in."""
    _run(_pull_blocks_prompt, _pull_blocks_decoder, transport, loop)


POOL_DESC = {"num_tensors": 4, "shape": [2, 1024 * 1024], "data_type": DataType.DT_FLOAT16,
             "placement": Placement.DEVICE}


async def _pull_cache_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 1, _hixl_pull_options(mem_pool_cfg='{"memory_size": 1073741824}'))
    comm_id = await _hixl_link(datadist)
    cache_manager = datadist.cache_manager
    cache_key_0 = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache_key_1 = CacheKey(prompt_cluster_id=1, req_id=1, model_id=0)
    cache = cache_manager.allocate_cache(CacheDesc(**POOL_DESC), [cache_key_0, cache_key_1])
    for i, t in enumerate(tensors_at(cache.cache_desc.shape, torch.float16, cache.tensor_addrs)):
        t.copy_(pattern(t.shape, torch.float16, seed=i))
    await p.barrier()  # prepared
    await p.barrier()  # the decoder pulled
    cache_manager.remove_cache_key(cache_key_0)
    cache_manager.remove_cache_key(cache_key_1)
    cache_manager.deallocate_cache(cache)
    await datadist.unlink(comm_id)
    await datadist.finalize()


async def _pull_cache_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 2, _hixl_pull_options(mem_pool_cfg='{"memory_size": 1073741824}'))
    comm_id = await _hixl_link(datadist)
    cache_manager = datadist.cache_manager
    cache = cache_manager.allocate_cache(CacheDesc(**POOL_DESC))
    await p.barrier()  # wait prompt prepared
    await cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=0, model_id=0), cache, batch_index=0)
    await cache_manager.pull_cache(CacheKey(prompt_cluster_id=1, req_id=1, model_id=0), cache, batch_index=1)
    tensors = tensors_at(cache.cache_desc.shape, torch.float16, cache.tensor_addrs)
    for i, t in enumerate(tensors):
        p.check(f"tensor{i}_equal_prompt", torch.equal(t, pattern(t.shape, torch.float16, seed=i)))
    del tensors
    await p.barrier()
    cache_manager.deallocate_cache(cache)
    await datadist.unlink(comm_id)
    await datadist.finalize()


@RUNS
def test_hixl_pull_cache(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_pull_cache.py``: ``link`` first, pool caches, ``pull_cache`` by ``CacheKey``
    row by row, ``remove_cache_key``."""
    _run(_pull_cache_prompt, _pull_cache_decoder, transport, loop)


TO_BLOCKS_SHAPE = [2, 16 * 1024]


def _to_blocks_desc() -> CacheDesc:
    return CacheDesc(num_tensors=4, shape=TO_BLOCKS_SHAPE, data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)


async def _to_blocks_prompt(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.PROMPT, 1, _hixl_pull_options(mem_pool_cfg=f'{{"memory_size": {64 << 20}}}'))
    comm_id = await _hixl_link(datadist)
    cache_manager = datadist.cache_manager
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    cache = cache_manager.allocate_cache(_to_blocks_desc(), [cache_key])
    for i, t in enumerate(tensors_at(TO_BLOCKS_SHAPE, torch.float16, cache.tensor_addrs)):
        t.copy_(pattern(TO_BLOCKS_SHAPE, torch.float16, seed=i))
    await p.barrier()  # cache ready
    await p.barrier()  # decoder pull_blocks end
    await datadist.unlink(comm_id)
    await p.barrier()  # wait peer unlink end
    cache_manager.remove_cache_key(cache_key)
    cache_manager.deallocate_cache(cache)
    await datadist.finalize()


async def _to_blocks_decoder(p: APeer, ports: list[int]) -> None:
    datadist = await _init(LLMRole.DECODER, 2, _hixl_pull_options(mem_pool_cfg=f'{{"memory_size": {64 << 20}}}'))
    cache_manager = datadist.cache_manager
    tensors = [torch.ones(*TO_BLOCKS_SHAPE, dtype=torch.float16) for _ in range(4)]
    cache = cache_manager.register_blocks_cache(_to_blocks_desc(), [t.data_ptr() for t in tensors])
    comm_id = await _hixl_link(datadist)
    await p.barrier()  # cache ready
    cache_key = CacheKey(prompt_cluster_id=1, req_id=0, model_id=0)
    await cache_manager.pull_blocks(cache_key, cache, src_blocks=[], dst_blocks=[0])
    for i, t in enumerate(tensors):
        p.check(f"tensor{i}_block0_is_prompt_row0", torch.equal(t[0], pattern(TO_BLOCKS_SHAPE, torch.float16, i)[0]))
        p.check(f"tensor{i}_block1_untouched", bool((t[1] == 1).all()))
    await p.barrier()  # pull_blocks end
    await datadist.unlink(comm_id)
    await p.barrier()  # wait peer unlink end
    await datadist.finalize()


@RUNS
def test_hixl_pull_cache_to_blocks(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_pull_cache_to_blocks.py``: ``pull_blocks(CacheKey(...), cache, src_blocks=[],
    dst_blocks=[0])``, then both sides ``unlink`` at once."""
    _run(_to_blocks_prompt, _to_blocks_decoder, transport, loop)


# -- vllm-ascend LLMDataDistCMgrConnector (MHA) and the v0 LLMDataDistConnector ------------------

VLLM_PREFILL = {"super_pod_id": None, "server_id": LOCALHOST, "device_id": "0", "device_ip": LOCALHOST,
                "super_device_id": None, "cluster_id": 1}
VLLM_DECODE = {**VLLM_PREFILL, "device_id": "1", "device_ip": OTHER_LOCALHOST, "cluster_id": 2}
REQ_FOR_METADATA, REQ_FOR_FINISHED = 0, 1
REMOTE_BLOCK_IDS, LOCAL_BLOCK_IDS = [0, 1, 3], [2, 3]


async def _vllm_worker(role: LLMRole, meta: dict, seeded: bool) -> tuple[LLMDataDist, Any, Any, list]:
    """``__init__``, ``init_llm_datadist`` and ``register_kv_caches`` (MHA) of the connector worker."""
    datadist = LLMDataDist(role, meta["cluster_id"])
    hccl_rdma_timeout, hccl_rdma_retry_cnt = 20, 7
    await datadist.init(_options(
        device_id=0, sync_kv_timeout=int((4.096 * (2**hccl_rdma_timeout)) * hccl_rdma_retry_cnt // 1000 + 3000),
        enable_switch_role=True, enable_cache_manager=True, enable_remote_cache_accessible=True))
    cache_manager = datadist.cache_manager
    kv = []
    for layer in range(2):  # (k, v) per layer: [num_blocks, block_size, heads, head_dim], 2 MiB aligned
        for j in range(2):
            t = aligned((4, 16, 2, 8), torch.float16)
            if seeded:
                t.copy_(pattern(t.shape, torch.float16, seed=10 * layer + j))
            kv.append(t)
    cache_addr = [t.data_ptr() for t in kv]
    assert all(addr % (2 << 20) == 0 for addr in cache_addr)
    cache_desc = CacheDesc(len(cache_addr), [*kv[0].shape], DataType.DT_FLOAT16)
    cache_key = BlocksCacheKey(cluster_id=int(meta["cluster_id"]))
    cache = cache_manager.register_blocks_cache(cache_desc, cache_addr, cache_key)
    return datadist, cache_manager, cache, kv


async def _vllm_add_remote_agent(datadist: LLMDataDist, prefill: dict, decode: dict) -> int:
    def device_entry(meta: dict, rank_id: str) -> dict:
        return {k: v for k, v in [("device_id", meta["device_id"]), ("device_ip", meta["device_ip"]),
                                  ("super_device_id", meta["super_device_id"]), ("rank_id", rank_id)]
                if v is not None}

    comm_name = f"pd_comm_{prefill['device_ip']}_{decode['device_ip']}"
    cluster_rank_info = {prefill["cluster_id"]: 0, decode["cluster_id"]: 1}
    rank_table = {"version": "1.2", "server_count": "1", "status": "completed",
                  "server_list": [{"device": [device_entry(prefill, "0"), device_entry(decode, "1")],
                                   "server_id": prefill["server_id"]}]}
    comm_id = await datadist.link(comm_name, cluster_rank_info, json.dumps(rank_table))
    return await _poll_linked(datadist, comm_id, by_keyword=True)


async def _remove_remote_agent(datadist: LLMDataDist, comm_id: int) -> None:
    try:
        await datadist.unlink(comm_id)
    except LLMException as exc:
        raise RuntimeError(f"unlink failed: {exc}") from exc  # vLLM logs it; here it fails the flow


async def _vllm_cmgr_prefill(p: APeer, ports: list[int]) -> None:
    datadist, _, _, _kv = await _vllm_worker(LLMRole.PROMPT, VLLM_PREFILL, seeded=True)  # registered: kept alive
    await p.barrier()  # registered and listening
    event, decode_meta = await p.recv()
    assert event == REQ_FOR_METADATA
    p.send(VLLM_PREFILL)
    comm_id = await _vllm_add_remote_agent(datadist, VLLM_PREFILL, decode_meta)
    event, finished = await p.recv()
    p.check("finished_notice_received", (event, finished) == (REQ_FOR_FINISHED, ["req-0"]))
    p.send(b"receiving decode finished")
    await p.barrier()  # the decode side checked its blocks
    await _remove_remote_agent(datadist, comm_id)
    await datadist.finalize()


async def _vllm_cmgr_decode(p: APeer, ports: list[int]) -> None:
    datadist, cache_manager, cache, kv = await _vllm_worker(LLMRole.DECODER, VLLM_DECODE, seeded=False)
    await p.barrier()
    p.send([REQ_FOR_METADATA, VLLM_DECODE])
    prefill_meta = await p.recv()
    comm_id = await _vllm_add_remote_agent(datadist, prefill_meta, VLLM_DECODE)
    remote_block_ids = REMOTE_BLOCK_IDS[-len(LOCAL_BLOCK_IDS):]
    remote_cache_key = BlocksCacheKey(cluster_id=prefill_meta["cluster_id"])
    await cache_manager.pull_blocks(remote_cache_key, cache, remote_block_ids, LOCAL_BLOCK_IDS)
    for n, t in enumerate(kv):
        src = pattern(t.shape, torch.float16, seed=10 * (n // 2) + n % 2)
        expected = torch.zeros_like(t)
        expected[LOCAL_BLOCK_IDS] = src[remote_block_ids]
        p.check(f"tensor{n}_blocks_pulled_others_untouched", torch.equal(t, expected))
    p.send([REQ_FOR_FINISHED, ["req-0"]])
    await p.recv()
    await p.barrier()
    await _remove_remote_agent(datadist, comm_id)
    await datadist.finalize()


@RUNS
def test_vllm_ascend_cmgr(transport: str, loop: str) -> None:
    """Mirrors ``client_vllm_ascend_cmgr.py`` (MHA layout, one server): both workers ``link`` by rank
    table, poll ``query_register_mem_status(comm_id=...)``, the decoder awaits ``pull_blocks`` positional."""
    _run(_vllm_cmgr_prefill, _vllm_cmgr_decode, transport, loop)


V0_TOKENS, V0_KV = 6, (1, 6, 2, 8)


def _v0_descs(kv_seq_len_dim_index: int) -> list[CacheDesc]:
    return [CacheDesc(2, V0_KV, DataType.DT_FLOAT16, seq_len_dim_index=kv_seq_len_dim_index),
            CacheDesc(2, V0_KV, DataType.DT_FLOAT16, seq_len_dim_index=kv_seq_len_dim_index),
            CacheDesc(1, (1, V0_TOKENS, 1, 1), DataType.DT_INT32, seq_len_dim_index=-1),
            CacheDesc(1, (1, V0_TOKENS, 1, 16), DataType.DT_FLOAT16, seq_len_dim_index=-1)]


def _v0_sources() -> list[list[torch.Tensor]]:
    return [[pattern(V0_KV, torch.float16, seed=layer) for layer in range(2)],
            [pattern(V0_KV, torch.float16, seed=10 + layer) for layer in range(2)],
            [torch.arange(V0_TOKENS, dtype=torch.int32).view(1, V0_TOKENS, 1, 1) + 1000],
            [pattern((1, V0_TOKENS, 1, 16), torch.float16, seed=20)]]


def _v0_views(buffer: Any) -> list[torch.Tensor]:
    dtype = buffer.cache_desc.data_type.torch_dtype
    return tensors_at(buffer.cache_desc.shape, dtype, buffer.per_device_tensor_addrs[0])


async def _vllm_v0_prompt(p: APeer, ports: list[int]) -> None:
    data_dist = LLMDataDist(LLMRole.PROMPT, 0)
    await data_dist.init({"llm.SyncKvCacheWaitTime": "5000", "ge.exec.deviceId": "0",
                          "llm.listenIpInfo": f"{LOCALHOST}:{ports[0]}", **harness.extra_options()})
    kv_transfer = data_dist.kv_cache_manager
    buffers = [kv_transfer.allocate_cache(desc, [CacheKey(0, 0, model_id)])
               for model_id, desc in enumerate(_v0_descs(1), 1)]
    for buffer, sources in zip(buffers, _v0_sources(), strict=True):
        for view, src in zip(_v0_views(buffer), sources, strict=True):
            view.copy_(src)
    await p.barrier()  # buffers filled; the decoder may link and pull
    await p.barrier()  # the decoder pulled
    await data_dist.finalize()


async def _vllm_v0_decoder(p: APeer, ports: list[int]) -> None:
    await p.barrier()
    data_dist = LLMDataDist(LLMRole.DECODER, 0)
    await data_dist.init({"llm.SyncKvCacheWaitTime": "5000", "ge.exec.deviceId": "0", **harness.extra_options()})
    kv_transfer = data_dist.kv_cache_manager
    cluster = _cluster(0, (OTHER_LOCALHOST, 0), (LOCALHOST, ports[0]))
    await data_dist.link_clusters([cluster], 20000)  # the connector does not check the result
    buffers = [kv_transfer.allocate_cache(desc) for desc in _v0_descs(-1)]
    for cache_id, buffer in enumerate(buffers, 1):
        await kv_transfer.pull_cache(CacheKeyByIdAndIndex(cluster.remote_cluster_id, cache_id, 0), buffer, 0)
    for name, buffer, sources in zip(("key", "value", "input", "hidden"), buffers, _v0_sources(), strict=True):
        views = _v0_views(buffer)
        p.check(f"{name}_buffer_equal_prompt", all(torch.equal(v, s) for v, s in zip(views, sources, strict=True)))
        del views
    await data_dist.unlink_clusters([cluster], 5000)
    await p.barrier()
    await data_dist.finalize()


@RUNS
def test_vllm_ascend_v0(transport: str, loop: str) -> None:
    """Mirrors ``client_vllm_ascend_v0.py`` (KvCacheManager mode): four ``allocate_cache`` with
    ``CacheKey``s, the decoder links to a cluster id equal to its own and awaits ``pull_cache``
    by ``CacheKeyByIdAndIndex``."""
    _run(_vllm_v0_prompt, _vllm_v0_decoder, transport, loop)


# -- MindIE-LLM separate deployment ------------------------------------------------------------------

MINDIE_PREFILL = {"cluster_id": 11, "device_ip": LOCALHOST, "physical_device_id": 0, "dp": 0}
MINDIE_DECODE = {"cluster_id": 22, "device_ip": OTHER_LOCALHOST, "physical_device_id": 1, "dp": 1}
MINDIE_SHAPE, SRC_BLOCKS, DST_BLOCKS = (8, 16, 32), [1, 2, 5], [0, 3, 4]


async def _mindie_engine(p: APeer, role: LLMRole, me: dict, other: dict, seeded: bool):
    """Engine init, ``build`` / ``set_npu_cache`` for K (model 0) and V (model 1), then one link."""
    datadist = LLMDataDist(role, me["cluster_id"])
    llm_options = _options(device_id=0, enable_cache_manager=True, enable_remote_cache_accessible=True,
                           link_total_time=60, link_retry_count=80, sync_kv_timeout=5 * 1000)
    llm_options["llm.RdmaServiceLevel"] = "4"
    llm_options["llm.RdmaTrafficClass"] = "132"
    await datadist.init(llm_options)
    caches, tensors = {}, {}
    for model_id in (0, 1):
        desc = CacheDesc(num_tensors=2, shape=MINDIE_SHAPE, data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)
        tensors[model_id] = [pattern(MINDIE_SHAPE, torch.float16, seed=10 * model_id + layer) if seeded
                             else torch.zeros(MINDIE_SHAPE, dtype=torch.float16) for layer in range(2)]
        caches[model_id] = datadist.cache_manager.register_blocks_cache(
            desc, [t.data_ptr() for t in tensors[model_id]],
            BlocksCacheKey(cluster_id=me["cluster_id"], model_id=model_id))
    await p.barrier()  # both registered
    # RankInfo: the smaller device ip is rank 0; one server entry (same host), local device first
    local_rank = 0 if ipaddress.ip_address(me["device_ip"]) < ipaddress.ip_address(other["device_ip"]) else 1
    local = {"device_id": str(me["physical_device_id"]), "device_ip": me["device_ip"], "rank_id": str(local_rank)}
    remote = {"device_id": str(other["physical_device_id"]), "device_ip": other["device_ip"],
              "rank_id": str(1 - local_rank)}
    rank_table = json.dumps({"server_count": "1", "server_list": [{"device": [local, remote], "server_id": LOCALHOST}],
                             "status": "completed", "version": "1.0"})
    ranked = sorted([(local_rank, me), (1 - local_rank, other)], key=lambda item: item[0])
    cluster_rank_info = {int(m["cluster_id"]): rank for rank, m in ranked}
    ip_small, ip_big = sorted((me["device_ip"], other["device_ip"]), key=ipaddress.ip_address)
    link_name = f"link{ip_big}:{ip_small}_{min(me['dp'], other['dp'])}:{max(me['dp'], other['dp'])}"
    result = await datadist.link(link_name, cluster_rank_info, rank_table)
    if result == LLMStatusCode.LLM_ALREADY_LINK:
        raise RuntimeError("already linked")
    await _poll_linked(datadist, result, period_s=0.05)
    return datadist, caches, tensors, result


async def _mindie_prefill(p: APeer, ports: list[int]) -> None:
    datadist, _, _tensors, comm_id = await _mindie_engine(p, LLMRole.PROMPT, MINDIE_PREFILL, MINDIE_DECODE,
                                                          seeded=True)  # registered: kept alive
    await p.barrier()  # the decoder pulled
    await datadist.unlink(comm_id)
    await datadist.finalize()


async def _mindie_decode(p: APeer, ports: list[int]) -> None:
    datadist, caches, tensors, comm_id = await _mindie_engine(p, LLMRole.DECODER, MINDIE_DECODE, MINDIE_PREFILL,
                                                              seeded=False)
    for model_id in caches:
        remote_cache_key = BlocksCacheKey(cluster_id=MINDIE_PREFILL["cluster_id"], model_id=model_id)
        await datadist.cache_manager.pull_blocks(remote_cache_key, caches[model_id], SRC_BLOCKS, DST_BLOCKS)
    for model_id, layers in tensors.items():
        for layer, t in enumerate(layers):
            expected = torch.zeros_like(t)
            expected[DST_BLOCKS] = pattern(MINDIE_SHAPE, torch.float16, seed=10 * model_id + layer)[SRC_BLOCKS]
            p.check(f"model{model_id}_layer{layer}_blocks_pulled_others_untouched", torch.equal(t, expected))
    await p.barrier()
    await datadist.unlink(comm_id)
    await datadist.finalize()


@RUNS
def test_mindie(transport: str, loop: str) -> None:
    """Mirrors ``client_mindie.py``: raw Rdma option keys, ``link`` compared with ``LLM_ALREADY_LINK``,
    50 ms status polls, ``pull_blocks`` per model id (K, V), ``unlink`` from both sides."""
    _run(_mindie_prefill, _mindie_decode, transport, loop)


# -- SGLang llm_datadist backend ---------------------------------------------------------------------

SGL_KV_SHAPE, SGL_AUX_SHAPE = (16, 2, 8), (8, 16)
PREFILL_KV_INDICES, DECODE_KV_INDICES, PREFILL_AUX_INDEX, DECODE_AUX_INDEX = [1, 2, 3], [9, 4, 5], 2, 6


async def _sglang_manager(role: LLMRole, cluster_id: int, device_ip: str, listen: str | None, seeded: bool):
    """``DataDistKVManager.__init__`` and ``register_buffer_to_engine``."""
    rank_info = {"status": "completed", "version": "1.2", "server_count": "1",
                 "server_list": [{"server_id": LOCALHOST,
                                  "device": [{"device_id": "0", "super_device_id": "100", "device_ip": device_ip}]}],
                 "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": LOCALHOST}]}]}
    config = {"device_id": 0, "sync_kv_timeout": 20000, "local_comm_res": json.dumps(rank_info)}
    if listen:
        config["listen_ip_info"] = listen
    llm_datadist = await _init(role, cluster_id, _options(**config))
    cache_manager = llm_datadist.cache_manager
    kv = [pattern(SGL_KV_SHAPE, torch.float16, seed=i) if seeded else torch.zeros(SGL_KV_SHAPE, dtype=torch.float16)
          for i in range(4)]
    aux = pattern(SGL_AUX_SHAPE, torch.int32, seed=50) if seeded else torch.zeros(SGL_AUX_SHAPE, dtype=torch.int32)
    caches = [
        cache_manager.register_blocks_cache(CacheDesc(num_tensors=len(kv), shape=SGL_KV_SHAPE,
                                                      data_type=DataType.DT_FLOAT16),
                                            [t.data_ptr() for t in kv], BlocksCacheKey(cluster_id, 0)),
        cache_manager.register_blocks_cache(CacheDesc(num_tensors=1, shape=SGL_AUX_SHAPE, data_type=DataType.DT_INT32),
                                            [aux.data_ptr()], BlocksCacheKey(cluster_id, 1)),
    ]
    return llm_datadist, cache_manager, caches, kv, aux


async def _sglang_prefill(p: APeer, ports: list[int]) -> None:
    llm_datadist, cache_manager, caches, _kv, _aux = await _sglang_manager(  # registered: kept alive
        LLMRole.PROMPT, 0, LOCALHOST, f"{LOCALHOST}:{ports[0] + 0}", seeded=True)
    await p.barrier()  # listening, registered
    room, dst_kv_indices, dst_aux_index, decode_cluster_id = await p.recv()  # the bootstrap message
    await cache_manager.push_blocks(BlocksCacheKey(decode_cluster_id, 0), caches[0], PREFILL_KV_INDICES,
                                    dst_kv_indices, range(4), range(4), 1)
    await cache_manager.push_blocks(BlocksCacheKey(decode_cluster_id, 1), caches[1], [PREFILL_AUX_INDEX],
                                    [dst_aux_index], range(1), range(1), 1)
    p.send(["status", str(room), "success", "0"])
    await p.barrier()  # the decode side checked
    await llm_datadist.finalize()


async def _sglang_decode(p: APeer, ports: list[int]) -> None:
    cluster_id = 0 + 8 * 0 + 8 * 1  # device_id + world_size * node_rank + world_size * nnodes
    llm_datadist, _, _, kv, aux = await _sglang_manager(LLMRole.DECODER, cluster_id, OTHER_LOCALHOST, None,
                                                        seeded=False)
    await p.barrier()
    cluster = _cluster(None, remote=(LOCALHOST, ports[0] + 0))  # no remote_cluster_id, as register_link
    ret, rets = await llm_datadist.link_clusters([cluster], 20000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link cluster failure {ret} {rets}")
    p.send([7, DECODE_KV_INDICES, DECODE_AUX_INDEX, cluster_id])
    p.check("success_status_received", (await p.recv())[:3] == ["status", "7", "success"])
    for i, t in enumerate(kv):
        expected = torch.zeros_like(t)
        expected[DECODE_KV_INDICES] = pattern(SGL_KV_SHAPE, torch.float16, seed=i)[PREFILL_KV_INDICES]
        p.check(f"kv{i}_slots_pushed_others_untouched", torch.equal(t, expected))
    expected_aux = torch.zeros_like(aux)
    expected_aux[DECODE_AUX_INDEX] = pattern(SGL_AUX_SHAPE, torch.int32, seed=50)[PREFILL_AUX_INDEX]
    p.check("aux_row_pushed_others_untouched", torch.equal(aux, expected_aux))
    await p.barrier()
    await llm_datadist.finalize()


@RUNS
def test_sglang_datadist(transport: str, loop: str) -> None:
    """Mirrors ``client_sglang_datadist.py``: ``local_comm_res`` rank table, ``link_clusters`` without a
    remote cluster id, the PREFILL awaits ``push_blocks(key, cache, src, dst, range(n), range(n), 1)``."""
    _run(_sglang_prefill, _sglang_decode, transport, loop)



# -- Omni-Infer: an empty local_comm_res, cluster ids that encode ip:port, a forced unlink after a restart --

OMNI_SHAPE = (8, 4, 2, 8)  # num_blocks, block_size tokens, heads, head_dim
#: Per request: (prefill block, decoder block) pairs after the connector's trimming (req-1: the local blocks
#: cut to the remote count; req-2: the last N remote blocks).
OMNI_PULLS = [([1, 2, 4], [3, 0, 5]), ([3, 6], [2, 7])]


def _omni_cluster_id(ip: str, port: int, tp_size: int = 1) -> int:
    """``ip_port_to_int``: ip in the top 32 bits, then the port, then the tp size."""
    return (int(ipaddress.IPv4Address(ip)) << 32) | (port << 16) | (tp_size & 0xFFFF)


def _omni_options(listen: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {"device_id": 0, "local_comm_res": "", "sync_kv_timeout": 5000,
                              "enable_remote_cache_accessible": True}
    if listen is not None:
        config["listen_ip_info"] = listen
    return _options(**config)


def _omni_register(cache_manager: Any, seeds: tuple[int, int] | None, key: Any) -> tuple[list, list]:
    """Two layers of (K, V); per model_id (K, then V) one blocks cache of the two layers' tensors."""
    kv = [[aligned(OMNI_SHAPE, torch.float16) for _ in range(2)] for _ in range(2)]  # [model_id][layer]
    for model_id, layers in enumerate(kv):
        for layer, t in enumerate(layers):
            t.copy_(pattern(OMNI_SHAPE, torch.float16, seed=seeds[model_id] + layer) if seeds else torch.zeros(
                OMNI_SHAPE, dtype=torch.float16))
    caches = [cache_manager.register_blocks_cache(
        CacheDesc(num_tensors=len(layers), shape=tuple(layers[0].shape), data_type=DataType.DT_FLOAT16),
        [int(t.data_ptr()) for t in layers], key(model_id)) for model_id, layers in enumerate(kv)]
    return caches, kv


async def _omni_prefill(p: APeer, ports: list[int]) -> None:
    cluster_id = _omni_cluster_id(LOCALHOST, ports[0])
    for generation in range(len(OMNI_PULLS)):  # the second is a restarted instance: same ip, port and id
        data_dist = LLMDataDist(LLMRole.PROMPT, cluster_id)
        await data_dist.init(_omni_options(f"{LOCALHOST}:{ports[0]}"))
        _caches, _kv = _omni_register(data_dist.cache_manager, (100 * generation, 100 * generation + 10),
                                      lambda model_id: BlocksCacheKey(data_dist.cluster_id, model_id=model_id))
        p.send(("kv_transfer_params", generation))
        await p.barrier()  # the decoder pulled and checked
        await data_dist.finalize()  # the instance exits


async def _omni_decode(p: APeer, ports: list[int]) -> None:
    prompt_cluster_id = _omni_cluster_id(LOCALHOST, ports[0])
    data_dist = LLMDataDist(LLMRole.DECODER, _omni_cluster_id(OTHER_LOCALHOST, ports[0]))
    await data_dist.init(_omni_options(None))
    caches, kv = _omni_register(data_dist.cache_manager, None, lambda model_id: None)
    for generation, (src_blocks, dst_blocks) in enumerate(OMNI_PULLS):
        p.check(f"params_{generation}", await p.recv() == ("kv_transfer_params", generation))
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = prompt_cluster_id
        cluster.append_local_ip_info(OTHER_LOCALHOST, 0)
        cluster.append_remote_ip_info(LOCALHOST, ports[0])
        if generation:  # close_link: the prefill restarted, its old link is stale (or gone already)
            ret, _ = await data_dist.unlink_clusters([cluster], timeout=5000, force=True)
            p.check("forced_unlink_of_the_stale_link_succeeds", ret == LLMStatusCode.LLM_SUCCESS)
        ret, _ = await data_dist.link_clusters([cluster], timeout=5000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError("link failed")
        for model_id, kv_cache in enumerate(caches):
            await data_dist.cache_manager.pull_blocks(
                BlocksCacheKey(prompt_cluster_id=prompt_cluster_id, model_id=model_id), kv_cache, src_blocks,
                dst_blocks)
            for layer, t in enumerate(kv[model_id]):
                src = pattern(OMNI_SHAPE, torch.float16, seed=100 * generation + 10 * model_id + layer)
                p.check(f"gen{generation}_model{model_id}_layer{layer}",
                        torch.equal(t[dst_blocks], src[src_blocks]))
        await p.barrier()
    await data_dist.finalize()


@RUNS
def test_omni_infer(transport: str, loop: str) -> None:
    """Mirrors ``client_omni_infer.py``: CacheManager mode by an empty ``local_comm_res``, cluster ids that
    encode ``ip:port``, ``BlocksCacheKey(prompt_cluster_id=..., model_id=...)``, and after the prefill
    restarted the decoder's ``unlink_clusters(clusters, timeout=5000, force=True)`` (``LLM_SUCCESS`` though
    the old instance's finalize took the link down) and ``link_clusters`` to the new instance."""
    _run(_omni_prefill, _omni_decode, transport, loop)

def test_every_two_process_port_has_an_async_mirror() -> None:
    mirrored = " ".join(f.__doc__ or "" for name, f in globals().items() if name.startswith("test_"))
    ports = [p.stem for p in CLIENTS.glob("client_*.py") if p.stem != "client_public_names"]
    assert len(ports) == 14 and all(f"``{port}.py``" in mirrored for port in ports), ports


# -- HIXL pull_blocks_xpyd: 2P2D, two prompts in one process, two decoders in the other ----------------

XPYD_SHAPE = (3, 10)


def _xpyd_desc() -> CacheDesc:
    return CacheDesc(num_tensors=1, shape=[3, 10], data_type=DataType.DT_FLOAT, placement=Placement.DEVICE)


def _ip_port_to_int(ip_port: str) -> int:
    """The sample's cluster id: the ip's 32 bits, then the port's 16."""
    ip, port = ip_port.split(":")
    return (int(ipaddress.IPv4Address(ip)) << 16) | int(port)


def _xpyd_prompt_ip_ports(ports: list[int]) -> list[str]:
    return [f"{LOCALHOST}:{port}" for port in ports[:2]]


async def _xpyd_one_prompt(ip_port: str, seed: int, registered: asyncio.Event, done: asyncio.Event) -> None:
    datadist = LLMDataDist(LLMRole.PROMPT, _ip_port_to_int(ip_port))
    await datadist.init(_options(device_id=0, local_comm_res="", listen_ip_info=ip_port))
    cache_manager = datadist.cache_manager
    tensor = pattern(XPYD_SHAPE, torch.float, seed=seed)
    cache = cache_manager.register_blocks_cache(_xpyd_desc(), [int(tensor.data_ptr())],
                                                BlocksCacheKey(_ip_port_to_int(ip_port), 0))
    registered.set()
    await done.wait()  # the sample's time.sleep(30)
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _xpyd_prompts(p: APeer, ports: list[int]) -> None:
    registered = [asyncio.Event(), asyncio.Event()]
    done = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        for i, ip_port in enumerate(_xpyd_prompt_ip_ports(ports)):
            tg.create_task(_xpyd_one_prompt(ip_port, 1 + i, registered[i], done))
        for event in registered:
            await event.wait()
        await p.barrier()  # register end
        await p.barrier()  # the decoders are done
        done.set()


async def _xpyd_one_decoder(p: APeer, name: str, local_ip_port: str, remote_list: list[str],
                            go: asyncio.Event) -> None:
    datadist = LLMDataDist(LLMRole.DECODER, _ip_port_to_int(local_ip_port))
    await datadist.init(_options(device_id=0, local_comm_res=""))
    cache_manager = datadist.cache_manager
    tensor = torch.full(XPYD_SHAPE, 0, dtype=torch.float)
    cache = cache_manager.register_blocks_cache(_xpyd_desc(), [int(tensor.data_ptr())],
                                                BlocksCacheKey(_ip_port_to_int(local_ip_port), 0))
    await go.wait()  # the sample's time.sleep(5): register end
    cluster_list = [_cluster(_ip_port_to_int(remote), (local_ip_port.split(":")[0], 0),
                             (remote.split(":")[0], int(remote.split(":")[1]))) for remote in remote_list]
    ret, _ = await datadist.link_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {ret!r}")
    for i, remote in enumerate(remote_list):
        await cache_manager.pull_blocks(BlocksCacheKey(_ip_port_to_int(remote), 0), cache,
                                        src_blocks=[0, 1], dst_blocks=[0, 2])
        src = pattern(XPYD_SHAPE, torch.float, seed=1 + i)
        p.check(f"{name}_after_pull_from_prompt{i}",
                torch.equal(tensor, torch.stack([src[0], torch.zeros(XPYD_SHAPE[1]), src[1]])))
    ret, _ = await datadist.unlink_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"unlink failed: {ret!r}")
    cache_manager.unregister_cache(cache.cache_id)
    await datadist.finalize()


async def _xpyd_decoders(p: APeer, ports: list[int]) -> None:
    go = asyncio.Event()
    remote_list = _xpyd_prompt_ip_ports(ports)
    async with asyncio.TaskGroup() as tg:
        for j, port in enumerate(ports[:2]):  # never listened on: the ports only make the decoders' ids
            tg.create_task(_xpyd_one_decoder(p, f"decoder{j}", f"{OTHER_LOCALHOST}:{port}", remote_list, go))
        await p.barrier()  # register end
        go.set()
    await p.barrier()  # the decoders are done


@RUNS
def test_hixl_pull_blocks_xpyd(transport: str, loop: str) -> None:
    """Mirrors ``client_hixl_pull_blocks_xpyd.py``: 2P2D, the two prompts' endpoints in one process and the
    two decoders' in the other, each decoder awaiting one ``link_clusters`` to both prompts (cluster ids
    ``ip << 16 | port``, local port 0), ``pull_blocks`` from each in turn and a non-forced
    ``unlink_clusters`` of both, all at once with the other decoder; the prompts never link."""
    _run(_xpyd_prompts, _xpyd_decoders, transport, loop)


# -- Torchair PD separation (v1): batch caches keyed per row, pulled by CacheKey row by row ----------------

TORCHAIR_SHAPE = [4, 16, 8, 8]  # the benchmark's [4, 2048, 8 // world_size, 128], smaller


def _torchair_desc() -> CacheDesc:
    return CacheDesc(num_tensors=160, shape=TORCHAIR_SHAPE, data_type=DataType.DT_FLOAT16)


def _torchair_options(**config: Any) -> dict[str, Any]:
    return _options(ge_options={"ge.flowGraphMemMaxSize": "2589934592"}, **config)


async def _torchair_prompt(p: APeer, ports: list[int]) -> None:
    prompt_engine = await _init(LLMRole.PROMPT, 0,
                                _torchair_options(device_id=0, listen_ip_info=f"{LOCALHOST}:{ports[0]}"))
    await p.barrier()  # the prompt listens
    kv_cache_manager = prompt_engine.kv_cache_manager
    caches, all_keys = [], []
    for start_id in (0, 4):  # the warmup batch, then the second one
        keys = [CacheKey(prompt_cluster_id=0, req_id=i, model_id=0) for i in range(start_id, start_id + 4)]
        cache = kv_cache_manager.allocate_cache(_torchair_desc(), keys)
        views = tensors_at(cache.cache_desc.shape, torch.float16, cache.per_device_tensor_addrs[0])
        for index, view in enumerate(views):
            view.copy_(pattern(TORCHAIR_SHAPE, torch.float16, seed=start_id * 1000 + index))
        del views
        caches.append(cache)
        all_keys += keys
    p.send({"prompt_cache_ids": [cache.cache_id for cache in caches]})
    await p.barrier()  # the prompt ran its model
    await p.barrier()  # the decoder pulled, unlinked and finalized
    for cache in caches:
        kv_cache_manager.deallocate_cache(cache)
    for key in all_keys:
        kv_cache_manager.remove_cache_key(key)  # every key was taken by a pull: no-op
    await prompt_engine.finalize()


async def _torchair_decoder(p: APeer, ports: list[int]) -> None:
    decoder_engine = await _init(LLMRole.DECODER, 0, _torchair_options(device_id=0))
    clusters_info = [_cluster(0, (OTHER_LOCALHOST, ports[0]), (LOCALHOST, ports[0]))]
    await p.barrier()  # the prompt listens
    await decoder_engine.link_clusters(clusters_info)  # the benchmark does not check the result
    kv_cache_manager = decoder_engine.kv_cache_manager
    kv_cache = kv_cache_manager.allocate_cache(_torchair_desc())
    await p.barrier()  # the prompt ran its model
    for start_id, name in ((0, "warmup"), (4, "second_batch")):
        for index in range(start_id, start_id + 4):
            await kv_cache_manager.pull_cache(CacheKey(prompt_cluster_id=0, req_id=index, model_id=0),
                                              kv_cache, index % 4)
        if start_id == 0:
            await p.recv()  # recv_inputs_from_prompt
        views = tensors_at(kv_cache.cache_desc.shape, torch.float16, kv_cache.per_device_tensor_addrs[0])
        p.check(f"{name}_rows_equal_prompt",
                all(torch.equal(view, pattern(TORCHAIR_SHAPE, torch.float16, seed=start_id * 1000 + index))
                    for index, view in enumerate(views)))
        del views
    kv_cache_manager.deallocate_cache(kv_cache)
    await decoder_engine.unlink_clusters(clusters_info)
    await decoder_engine.finalize()
    await p.barrier()  # ends the prompt's time.sleep(1200)


@RUNS
def test_torchair_pd_separate(transport: str, loop: str) -> None:
    """Mirrors ``client_torchair_pd_separate.py`` (KvCacheManager mode): two 4-row caches on the prompt with a
    ``CacheKey`` per row, the decoder (cluster id 0, as the prompt's) awaiting ``link_clusters`` without a
    timeout and eight ``pull_cache`` by ``CacheKey`` into rows ``index % 4`` of one cache; the prompt then
    ``deallocate_cache`` and ``remove_cache_key`` of keys the pulls already took."""
    _run(_torchair_prompt, _torchair_decoder, transport, loop)
