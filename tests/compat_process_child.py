"""Programs of the blocking facade (``aio_datadist.compat``) at process edges; run by
``test_compat_processes.py`` in a process of their own, each prints one JSON line of what happened.

``fork-exit``: a process with a live link forks and the child exits at once (its atexit hooks run); the parent
then pulls on its link (``fork-exit-uvloop``: the same under uvloop's event-loop policy). ``fork-task``: the child
asks the parent's layer-wise task for its result. ``fork-use``: the child makes and finalizes an endpoint of its
own. ``fork-reuse``: the child pulls with the parent's endpoint, then finalizes the parent's endpoints.
``interrupt-transfer`` / ``interrupt-allocate``: SIGINT reaches a facade call while the facade's loop is busy
with other work (it has not started the call yet). ``exit-synchronizer``: the main thread returns while a
layer-wise transfer waits in a plain synchronizer for a layer never computed (bounded at 30 s).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch
from compat_interrupt_child import BLOCKS, cluster, endpoint

from aio_datadist import compat
from aio_datadist.compat import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    Placement,
    TransferWithCacheKeyConfig,
)


class Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


def linked(filled: float = 1.0) -> tuple:
    """A PROMPT and a DECODER linked, each with a registered blocks cache (the prompt's ``filled``)."""
    prompt, decoder = endpoint(LLMRole.PROMPT, 1, listen=True), endpoint(LLMRole.DECODER, 2)
    memory = [torch.full((8, 4, 16), filled if i < 4 else 0.0, dtype=torch.float16) for i in range(8)]
    src = prompt.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[:4]], BlocksCacheKey(1, 0))
    dst = decoder.cache_manager.register_blocks_cache(BLOCKS, [t.data_ptr() for t in memory[4:]],
                                                      BlocksCacheKey(2, 0))
    assert decoder.link_clusters([cluster(1, prompt.listen_address)], 5000)[0] == 0
    return prompt, decoder, src, dst, memory


class Slow(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        time.sleep(0.5)
        return True


def fork(mode: str) -> dict:
    prompt, decoder, src, dst, _ = linked()
    if mode.startswith("task"):  # a layer-wise transfer of the parent's, still running as it forks
        task = prompt.cache_manager.transfer_cache_async(
            src, Slow(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 2))])
        if mode == "task-done-each":  # ended before the fork: still the parent's
            assert task.synchronize(10000) == 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if mode == "exit":
            os.close(w)
            sys.exit(0)
        done: dict = {}

        def use() -> None:
            try:
                own = endpoint(LLMRole.DECODER, 7)
                done["init"] = "ok"
                own.finalize()
                done["finalize"] = "ok"
            except BaseException as exc:
                done["init"] = repr(exc)

        def reuse() -> None:  # the parent's endpoint: refused at once, and let go of without touching its links
            try:
                decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 1], [0, 1], timeout=2000)
                done["pull"] = "pulled"
            except LLMException as exc:
                done["pull"] = int(exc.status_code)
            for name, call in {"allocate": lambda: decoder.cache_manager.allocate_blocks_cache(BLOCKS, None),
                               "deallocate": lambda: decoder.cache_manager.deallocate_blocks_cache(dst)}.items():
                try:  # the calls that need no loop (they ran on the parent's engines and tables)
                    call()
                    done[name] = "ran"
                except LLMException as exc:
                    done[name] = int(exc.status_code)
            decoder.finalize()
            prompt.finalize()
            done["finalize"] = "ok"

        def synchronize() -> None:  # the parent's task: refused at once, not waited for
            try:
                done["synchronize"] = int(task.synchronize())
            except LLMException as exc:
                done["synchronize"] = f"LLMException {int(exc.status_code)}"

        def cancel() -> None:  # the parent's task: refused at once, the parent's transfer left alone
            try:
                task.cancel()
                done["cancel"] = "cancelled"
            except LLMException as exc:
                done["cancel"] = f"LLMException {int(exc.status_code)}"

        def each() -> None:  # every call of the parent's task: refused at once
            calls = {"synchronize": lambda: task.synchronize(100), "get_results": lambda: task.get_results(100),
                     "layer": lambda: task._task.layer(0)}
            for name, call in calls.items():
                try:
                    call()
                    done[name] = "answered"
                except LLMException as exc:
                    done[name] = f"LLMException {int(exc.status_code)}"

        if mode == "reuse":
            use = reuse  # noqa: F811 - the case's own body
        elif mode == "task":
            use = synchronize  # noqa: F811
        elif mode == "task-cancel":
            use = cancel  # noqa: F811
        elif mode in ("task-each", "task-done-each"):
            use = each  # noqa: F811

        thread = threading.Thread(target=use, daemon=True)
        thread.start()
        thread.join(10)
        first = {"use": "init", "task": "synchronize", "task-cancel": "cancel",
                 "task-each": "synchronize", "task-done-each": "synchronize"}.get(mode, "finalize")
        done.setdefault(first, "hung for 10 s")
        os.write(w, json.dumps(done).encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    started, status = time.monotonic(), None
    while time.monotonic() - started < 15:
        ended, code = os.waitpid(pid, os.WNOHANG)
        if ended:
            status = code
            break
        time.sleep(0.05)
    waited = time.monotonic() - started
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    try:
        decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 1], [0, 1], timeout=2000)
        pulled = "ok"
    except Exception as exc:
        pulled = repr(exc)
    parent_task = int(task.synchronize(10000)) if mode.startswith("task") else None
    prompt.finalize()
    decoder.finalize()
    return {"child_status": status, "seconds": round(waited, 2), "child": json.loads(data) if data else None,
            "parent_pull_after": pulled, "parent_task": parent_task}


def interrupt_while_the_loop_is_busy() -> None:
    # Other work holds the facade's loop for 1 s (time.sleep releases the GIL as native steps do) and Ctrl-C
    # comes while this thread's call waits for the loop to start it.
    compat._RUNNER.loop().call_soon_threadsafe(time.sleep, 1.0)
    threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()


def interrupt(mode: str) -> dict:
    out: dict = {}
    if mode == "transfer":
        prompt, decoder, src, _, memory = linked()
        interrupt_while_the_loop_is_busy()
        try:
            prompt.cache_manager.transfer_cache_async(
                src, Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 2))])
        except KeyboardInterrupt:
            out["interrupted"] = True
        time.sleep(1.5)
        out["landed"] = int(sum(int((t != 0).sum()) for t in memory[4:]))
        prompt.finalize()
        decoder.finalize()
        return out
    dd, other = endpoint(LLMRole.DECODER, 2), endpoint(LLMRole.DECODER, 3)
    interrupt_while_the_loop_is_busy()
    try:
        dd.cache_manager.allocate_cache(CacheDesc(1, [64, 1024], DataType.DT_FLOAT16, Placement.HOST))
    except KeyboardInterrupt:
        out["interrupted"] = True
    time.sleep(1.2)
    out["caches"] = dd.stats().caches
    dd.finalize()
    other.finalize()
    return out


never = threading.Event()


class WaitsForTheForwardPass(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return never.wait(30)


def exit_while_a_synchronizer_waits() -> None:
    prompt, _, src, _, _ = linked(0.0)
    prompt.cache_manager.transfer_cache_async(
        src, WaitsForTheForwardPass(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(0, 2), range(0, 2))])
    time.sleep(0.3)
    print(json.dumps({"main_returns": time.monotonic()}), flush=True)


def exit_while_a_callback_holds_the_loop() -> None:
    """The facade's loop is held past the exit's wait for it (made short here) by a callback of the caller's,
    with an endpoint left for the exit to finalize (as a program usually leaves one)."""
    compat.STOP_JOIN_S = 0.3
    endpoint(LLMRole.PROMPT, 1, listen=True)
    compat._RUNNER.loop().call_soon_threadsafe(time.sleep, 20)
    time.sleep(0.1)
    print(json.dumps({"main_returns": time.monotonic()}), flush=True)


if __name__ == "__main__":
    case = sys.argv[1]
    if case == "exit-synchronizer":
        exit_while_a_synchronizer_waits()
    elif case == "exit-held-loop":
        exit_while_a_callback_holds_the_loop()
    elif case == "fork-exit-uvloop":  # a process that set uvloop's policy, as serving frameworks do
        import asyncio

        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        print(json.dumps(fork("exit")), flush=True)
    else:
        kind, _, mode = case.partition("-")
        print(json.dumps(fork(mode) if kind == "fork" else interrupt(mode)), flush=True)
