"""A program of the blocking facade (``aio_datadist.compat``) that is interrupted; run by
``test_compat_interrupts.py`` in a process of its own, it prints one JSON line of what happened.

``synchronizer {sync,async} {KeyboardInterrupt,SystemExit}``: a layer synchronizer raises it in the middle
of a v2 ``transfer_cache_async``; then the program carries on and exits normally (its ``atexit``
finalize included). ``task``: a facade call whose own code raises KeyboardInterrupt. ``sigint``: SIGINT
arrives while ``link_clusters`` waits on a listener that never answers. ``made``: SIGINT arrives while the
facade's loop runs a call that makes a cache or starts a transfer (v1 and v2), before and after it made it.
``init``: SIGINT arrives as an ``init`` started the endpoint's life, then during a second ``init`` (a no-op).
``init_race``: the same first case while another thread's ``init`` of the endpoint returns on the life.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from aio_datadist import compat
from aio_datadist.compat import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMException,
    Placement,
    TransferWithCacheKeyConfig,
)
from aio_datadist.link_table import LinkTable
from aio_datadist.testing import engine_state

BLOCKS = CacheDesc(4, [8, 4, 16], DataType.DT_FLOAT16, Placement.DEVICE)


def endpoint(role: LLMRole, cluster_id: int, listen: bool = False, v1: bool = False) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cpu"
    cfg.transport = "tcp"
    if not v1:
        cfg.local_comm_res = ""
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    return dd


def cluster(cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


def facade_alive() -> bool:
    thread = compat._RUNNER._thread
    return thread is not None and thread.is_alive()


def synchronizer(kind: str, raised: type[BaseException]) -> dict:
    class Raising(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            raise raised("in the synchronizer")

    class AsyncRaising(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            raise raised("in the synchronizer")

    prompt, decoder = endpoint(LLMRole.PROMPT, 1, listen=True), endpoint(LLMRole.DECODER, 2)
    memory = [torch.zeros(8, 4, 16, dtype=torch.float16) for _ in range(8)]
    src = prompt.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[:4]], BlocksCacheKey(1, 0))
    decoder.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[4:]], BlocksCacheKey(2, 0))
    out: dict = {"link": int(decoder.link_clusters([cluster(1, prompt.listen_address)], 5000)[0])}
    started = time.monotonic()
    task = prompt.cache_manager.transfer_cache_async(
        src, AsyncRaising() if kind == "async" else Raising(),
        [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 1), range(0, 1))])
    out["synchronize"] = int(task.synchronize(2000))
    out["seconds"] = round(time.monotonic() - started, 2)
    out["facade_alive"] = facade_alive()
    out["links"] = list(decoder.stats().links)
    prompt.finalize()
    out["facade_alive_after"] = facade_alive()
    return out  # the decoder is finalized by the facade's atexit handler


def task() -> dict:
    def interrupted() -> None:
        raise KeyboardInterrupt("in a facade call")

    out: dict = {}
    try:
        compat._RUNNER.call(interrupted)
    except KeyboardInterrupt as exc:
        out["raised"] = str(exc)
    out["facade_alive"] = facade_alive()
    dd = endpoint(LLMRole.PROMPT, 1, listen=True)
    out["stats"] = dd.stats().cluster_id
    return out


def sigint() -> dict:
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])  # accepted, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    dd = endpoint(LLMRole.DECODER, 2)
    target = cluster(1, silent.getsockname())
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    out: dict = {}
    started = time.monotonic()
    try:
        out["returned"] = str(dd.link_clusters([target], 8000))
    except KeyboardInterrupt:
        out["interrupted_after"] = round(time.monotonic() - started, 2)
    loop = compat._RUNNER.loop()
    out["tasks_left"] = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks(loop))
    status, per_cluster = dd.link_clusters([target], 300)  # the same cluster again: no attempt holds it
    out["again"] = [int(status), [int(c) for c in per_cluster]]
    dd.finalize()
    silent.close()
    return out


def interrupt_here() -> Callable[[], None]:
    """Installs a SIGINT handler that raises KeyboardInterrupt; returns what, called on another thread,
    interrupts the main thread and waits until it took the interrupt (so it lands inside a call, however fast)."""
    main = threading.main_thread().ident
    assert main is not None
    taken = threading.Event()

    def on_sigint(signum: int, frame: types.FrameType | None) -> None:
        # Python runs a signal's handler between any two bytecodes of the main thread, a finalizer's included
        # (one that unmaps a collected cache's small memory, run by a collection the waiting caller's allocation
        # started), and there it ignores what the handler raised: the caller never sees it (CI at ca3b37a). A
        # user would press Ctrl-C again; so does this handler, until the interrupt lands outside a finalizer.
        while frame is not None:
            if frame.f_code.co_name == "__del__" or (frame.f_code.co_name == "__call__"
                                                     and frame.f_code.co_filename == weakref.__file__):
                threading.Timer(0.001, signal.pthread_kill, (main, signal.SIGINT)).start()
                return
            frame = frame.f_back
        taken.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)

    def interrupt() -> None:
        taken.clear()
        signal.pthread_kill(main, signal.SIGINT)
        assert taken.wait(5), "the interrupt was not taken"

    return interrupt


def made() -> dict:
    interrupt = interrupt_here()

    def interrupted(manager: object, name: str, when: str, *args: object, **kwargs: object) -> tuple[object, bool]:
        """``manager.name(*args)`` through the facade, its caller interrupted while the loop runs it: the
        interrupt is delivered from inside the call and taken before the call goes on ("during": it then makes
        its product) or once it made it ("after"), so it always lands inside the call, however fast. Returns
        the product and whether the call had ended when the interrupt reached the caller."""
        made: list = []
        inside: list = []
        failed: list[Exception] = []
        finished = threading.Event()
        inner = getattr(manager, "_m")
        original = getattr(inner, name)

        def call(*call_args: object, **call_kwargs: object) -> object:
            if inside:  # the call's own call of the same method (a leased allocation's): as it is
                return original(*call_args, **call_kwargs)
            inside.append(True)
            try:
                if when == "after":
                    made.append(original(*call_args, **call_kwargs))
                interrupt()
                if when == "during":
                    made.append(original(*call_args, **call_kwargs))
                return made[0]
            except Exception as exc:
                failed.append(exc)
                raise
            finally:
                finished.set()

        setattr(inner, name, call)
        try:
            getattr(manager, name)(*args, **kwargs)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError(f"{name} was not interrupted")
        finally:
            ended_first = finished.is_set()
            finished.wait(5)
            delattr(inner, name)
        if failed:  # the caller, interrupted, never saw it
            raise failed[0]
        return made[0], ended_first

    host = CacheDesc(2, [2, 64], DataType.DT_FLOAT16, Placement.HOST)
    memory = [torch.zeros(2, 64, dtype=torch.float16) for _ in range(2)]
    addrs = [t.data_ptr() for t in memory]
    out: dict = {}
    v1 = endpoint(LLMRole.PROMPT, 1, v1=True)
    prompt, decoder = endpoint(LLMRole.PROMPT, 3, listen=True), endpoint(LLMRole.DECODER, 4)
    blocks = [torch.zeros(8, 4, 16, dtype=torch.float16) for _ in range(8)]
    src = prompt.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in blocks[:4]])
    decoder.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in blocks[4:]], BlocksCacheKey(4, 0))
    assert int(decoder.link_clusters([cluster(3, prompt.listen_address)], 5000)[0]) == 0
    for t in blocks[:4]:
        t.fill_(1.0)
    v1_prompt, v1_decoder = endpoint(LLMRole.PROMPT, 5, listen=True, v1=True), endpoint(LLMRole.DECODER, 6, v1=True)
    v1_src = v1_prompt.kv_cache_manager.allocate_blocks_cache(BLOCKS)
    v1_decoder.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(6, 0))  # the push's destination
    assert int(v1_decoder.link_clusters([cluster(5, v1_prompt.listen_address)], 5000)[0]) == 0
    for t in v1_prompt.kv_cache_manager.get_cache_tensors(v1_src, 0):
        t.fill_(1.0)

    class Held(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            await asyncio.Event().wait()  # until the task is cancelled
            return True

    for when in ("during", "after"):
        for mode, dd, manager in (("v1", v1, v1.kv_cache_manager), ("v2", prompt, prompt.cache_manager)):
            key = CacheKey(dd.cluster_id, req_id=1)
            calls = {"allocate_cache": (host, [key]), "allocate_blocks_cache": (BLOCKS, BlocksCacheKey(5, 0)),
                     "register_cache": (host, addrs, [key]), "register_blocks_cache": (BLOCKS, [
                         t.data_ptr() for t in blocks[4:]], BlocksCacheKey(5, 0))}
            for name, args in calls.items():
                before = engine_state(dd)
                try:
                    ended_first = interrupted(manager, name, when, *args)[1]
                except LLMException as exc:  # a key or blocks key still bound to what an earlier call made
                    out[f"{when} {mode} {name}"] = str(exc)
                    continue
                # the registry as before the call (nothing allocated, registered or bound), and the caller
                # interrupted only once the call had ended
                out[f"{when} {mode} {name}"] = engine_state(dd) == before and ended_first
        before = engine_state(v1)  # v1's leased allocation, a call of its own (audit, 2026-12-07)
        try:
            ended_first = interrupted(v1.kv_cache_manager, "allocate_cache", when, host,
                                      [CacheKey(v1.cluster_id, req_id=2)], lease_ms=60_000)[1]
            out[f"{when} v1 leased allocate_cache"] = engine_state(v1) == before and ended_first
        except LLMException as exc:
            out[f"{when} v1 leased allocate_cache"] = str(exc)
        for mode, manager, source, key in (("v2", prompt.cache_manager, src, BlocksCacheKey(4, 0)),
                                           ("v1", v1_prompt.kv_cache_manager, v1_src, BlocksCacheKey(6, 0))):
            task, ended_first = interrupted(manager, "transfer_cache_async", when, source, Held(),
                                            [TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))])
            out[f"{when} {mode} transfer"] = [int(compat.CacheTask(task).synchronize(2000)), ended_first]
    return out


def unstarted() -> dict:
    """SIGINT reaches the caller of a call the facade's loop has not started yet (the loop is held): the
    call never runs, not even once the loop goes on."""
    interrupt = interrupt_here()
    compat._RUNNER.call(lambda: None)  # the facade's loop runs
    held, ran = threading.Event(), []
    compat._RUNNER.loop().call_soon_threadsafe(held.wait, 10)
    threading.Timer(0.2, interrupt).start()
    out: dict = {}
    try:
        compat._RUNNER.call(ran.append, "ran")
        out["returned"] = True
    except KeyboardInterrupt:
        out["interrupted"] = True
    held.set()
    compat._RUNNER.call(lambda: None)  # the loop went past where the call was queued
    out["ran"] = ran
    return out


def listening_options() -> dict[str, str]:
    """A v1 endpoint's options that listen on a loopback port of its own."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cpu"
    cfg.transport = "tcp"
    cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def init() -> dict:
    """Ctrl-C reaches the caller of ``init`` as its life has started (the listener bound); then a second ``init``
    of the live endpoint (a no-op) is interrupted."""
    interrupt = interrupt_here()
    real = LinkTable.listen
    bound: list[tuple[str, int]] = []

    async def listen(self: LinkTable, ip: str, port: int) -> None:
        await real(self, ip, port)
        assert self.listen_address is not None
        bound.append(self.listen_address)
        interrupt()

    options = listening_options()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    out: dict = {}
    LinkTable.listen = listen  # type: ignore[method-assign]
    try:
        dd.init(options)
        out["returned"] = True
    except KeyboardInterrupt:
        out["interrupted"] = True
    finally:
        LinkTable.listen = real  # type: ignore[method-assign]
    try:
        socket.create_connection(bound[0], timeout=2).close()
        out["still_listening"] = True
    except OSError:
        out["still_listening"] = False
    try:
        dd.stats()
        out["after"] = "live"
    except LLMException as exc:
        out["after"] = int(exc.status_code)
    dd.init(options)  # a new life
    inner = getattr(dd, "_dd")
    original = inner._open

    async def interrupted(options: object) -> bool:
        interrupt()
        return await original(options)

    inner._open = interrupted
    try:
        dd.init(options)
        out["second_returned"] = True
    except KeyboardInterrupt:
        out["second_interrupted"] = True
    finally:
        del inner._open
    out["caches_after_second"] = dd.stats().caches  # the life the first init started is still there
    dd.finalize()
    return out


def init_race() -> dict:
    """Thread T1's blocking ``init`` starts the life and its caller is interrupted as it ends; thread T2's
    ``init`` of the same endpoint (sent while the loop was held, so it runs before T1's undo) returns on that
    life. T1's undo must leave it: T2's caller holds it."""
    interrupt = interrupt_here()
    compat._RUNNER.call(lambda: None)  # the facade's loop runs
    loop = compat._RUNNER.loop()
    real_listen, real_submit = LinkTable.listen, asyncio.run_coroutine_threadsafe
    sent = [threading.Event(), threading.Event()]

    def submit(coro: Any, on: asyncio.AbstractEventLoop) -> Any:
        future = real_submit(coro, on)
        for event in sent:
            if not event.is_set():
                event.set()
                break
        return future

    interrupted_once: list[bool] = []

    async def listen(self: LinkTable, ip: str, port: int) -> None:
        await real_listen(self, ip, port)
        if not interrupted_once:
            interrupted_once.append(True)
            interrupt()  # T1's caller takes Ctrl-C as its init ends

    options = listening_options()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    out: dict = {}
    held = threading.Event()
    loop.call_soon_threadsafe(held.wait, 10)  # the loop is held while both inits are sent
    asyncio.run_coroutine_threadsafe = submit  # type: ignore[assignment]
    LinkTable.listen = listen  # type: ignore[method-assign]

    def second() -> None:
        sent[0].wait(10)
        try:
            dd.init(options)
            out["t2"] = "returned"
        except BaseException as exc:  # noqa: BLE001 -- reported
            out["t2"] = repr(exc)

    t2 = threading.Thread(target=second)
    t2.start()
    release = threading.Thread(target=lambda: (sent[1].wait(10), held.set()))
    release.start()
    try:
        dd.init(options)
        out["t1"] = "returned"
    except KeyboardInterrupt:
        out["t1"] = "interrupted"
    finally:
        t2.join(10)
        release.join(10)
        asyncio.run_coroutine_threadsafe = real_submit
        LinkTable.listen = real_listen  # type: ignore[method-assign]
    try:
        dd.stats()
        out["after"] = "live"
    except LLMException as exc:
        out["after"] = int(exc.status_code)
    dd.finalize()
    return out


def link() -> dict:
    """A dialler's v2 ``link()`` (made in one step on the loop), its caller interrupted from inside the call."""
    interrupt = interrupt_here()
    peer = socket.create_server(("127.0.0.1", 0))  # rank 1: takes the dials, answers nothing
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cpu"
    cfg.transport = "tcp"
    cfg.local_comm_res = ""
    cfg.rank_addresses = json.dumps({"127.0.0.1": "127.0.0.1:1", "127.0.0.2": f"127.0.0.1:{peer.getsockname()[1]}"})
    cfg.link_total_time = 30
    dd.init(cfg.generate_options())
    table = json.dumps({"server_count": "2", "status": "completed", "version": "1.2", "server_list": [
        {"device": [{"device_id": "0", "device_ip": ip, "rank_id": str(rank)}], "host_ip": ip,
         "server_id": str(rank + 1)} for rank, ip in enumerate(["127.0.0.1", "127.0.0.2"])]})
    inner = getattr(dd, "_dd")
    original = inner.link

    async def interrupted(*args: object) -> int:
        interrupt()
        return await original(*args)

    inner.link = interrupted
    out: dict = {}
    try:
        out["returned"] = dd.link("pd", {1: 0, 2: 1}, table)
    except KeyboardInterrupt:
        out["interrupted"] = True
    del inner.link
    comms = getattr(inner, "_comms")
    out["comms_left"] = sorted((comms.comms if comms is not None else {}).keys())
    out["tasks_left"] = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks(compat._RUNNER.loop())
                               if "dial" in t.get_coro().__qualname__)
    dd.finalize()
    peer.close()
    return out


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "synchronizer":
        result = synchronizer(sys.argv[2], {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[
            sys.argv[3]])
    else:
        cases = {"task": task, "sigint": sigint, "made": made, "link": link, "init": init, "init_race": init_race,
                 "unstarted": unstarted}
        result = cases[case]()
    print(json.dumps(result), flush=True)
