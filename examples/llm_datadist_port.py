"""LLM-DataDist's prompt/decoder flows, ported by changing one import.

The first flow is the guide's KvCacheManager flow (allocate with CacheKeys on
the prompt, link and pull_cache row by row on the decoder, remove unconsumed
keys and deallocate); the second is the pull_blocks sample (registered blocks
caches, pull_blocks, swap_blocks out to a CPU cache and back). Everything
below is written against llm_datadist's blocking API; only the import differs.

Run both roles on loopback: ``python examples/llm_datadist_port.py``; it ends
with one ``OK: ...`` line naming what it checked, or a ``FAILED: ...`` line
and exit status 1.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import time
import traceback

import torch

from aio_datadist.compat import (  # was: from llm_datadist import ...
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PROMPT_CLUSTER, DECODER_CLUSTER = 0, 1
CACHE_DESC = CacheDesc(num_tensors=4, shape=[2, 8, 16], data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)
BLOCKS_DESC = CacheDesc(num_tensors=2, shape=[8, 16, 32], data_type=DataType.DT_FLOAT16, placement=Placement.DEVICE)
POLL_S = 0.1  # how often the parent looks for a process that died while it waits for a message


def expected(desc: CacheDesc, tensor: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + tensor)
    return torch.randn(desc.shape, generator=gen).to(torch.float16)


def run_prompt(port_out) -> None:
    datadist = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER)
    config = LLMConfig()
    config.device_id = 0
    config.listen_ip_info = "127.0.0.1:0"
    datadist.init(config.generate_options())
    kv_cache_manager = datadist.kv_cache_manager

    keys = [CacheKey(prompt_cluster_id=PROMPT_CLUSTER, req_id=i) for i in range(2)]
    kv_cache = kv_cache_manager.allocate_cache(CACHE_DESC, keys)
    for i in range(CACHE_DESC.num_tensors):
        kv_cache_manager.get_cache_tensors(kv_cache, i)[0].copy_(expected(CACHE_DESC, i))

    blocks = [expected(BLOCKS_DESC, 10 + i).clone() for i in range(BLOCKS_DESC.num_tensors)]
    blocks_cache = kv_cache_manager.register_blocks_cache(BLOCKS_DESC, [t.data_ptr() for t in blocks],
                                                          BlocksCacheKey(PROMPT_CLUSTER, 0))
    port_out.send(datadist.listen_address[1])
    port_out.poll(60)  # EOF: the parent closed its end once the decoder was done, or the parent died
    for key in keys:
        kv_cache_manager.remove_cache_key(key)  # a no-op for keys the decoder consumed
    kv_cache_manager.deallocate_cache(kv_cache)
    kv_cache_manager.deallocate_cache(blocks_cache)
    datadist.finalize()


def run_decoder(port: int, result) -> None:
    datadist = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER)
    config = LLMConfig()
    config.device_id = 0
    datadist.init(config.generate_options())
    kv_cache_manager = datadist.kv_cache_manager

    cluster = LLMClusterInfo()
    cluster.remote_cluster_id = PROMPT_CLUSTER
    cluster.append_local_ip_info("127.0.0.1", 0)
    cluster.append_remote_ip_info("127.0.0.1", port)
    ret, rets = datadist.link_clusters([cluster], 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"link failed: {rets}")
    datadist.check_link_status(PROMPT_CLUSTER)

    kv_cache = kv_cache_manager.allocate_cache(CACHE_DESC)
    for req_id in range(2):
        kv_cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER, req_id=req_id), kv_cache, batch_index=req_id)
    pulled_ok = all(torch.equal(kv_cache_manager.get_cache_tensors(kv_cache, i)[0], expected(CACHE_DESC, i))
                    for i in range(CACHE_DESC.num_tensors))
    try:
        kv_cache_manager.pull_cache(CacheKey(PROMPT_CLUSTER, req_id=0), kv_cache, batch_index=0)
        repeat_code = LLMStatusCode.LLM_SUCCESS
    except Exception as exc:  # the key was consumed by the first pull
        repeat_code = getattr(exc, "status_code", None)

    local = [torch.zeros(BLOCKS_DESC.shape, dtype=torch.float16) for _ in range(BLOCKS_DESC.num_tensors)]
    blocks_cache = kv_cache_manager.register_blocks_cache(BLOCKS_DESC, [t.data_ptr() for t in local])
    kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT_CLUSTER, 0), blocks_cache, src_blocks=[0, 1],
                                 dst_blocks=[0, 1])
    blocks_ok = all(torch.equal(local[i][:2], expected(BLOCKS_DESC, 10 + i)[:2])
                    for i in range(BLOCKS_DESC.num_tensors))

    cpu = [torch.zeros(BLOCKS_DESC.shape, dtype=torch.float16) for _ in range(BLOCKS_DESC.num_tensors)]
    cpu_desc = CacheDesc(BLOCKS_DESC.num_tensors, BLOCKS_DESC.shape, BLOCKS_DESC.data_type, Placement.HOST)
    cpu_cache = KvCache.create_cpu_cache(cpu_desc, [t.data_ptr() for t in cpu])
    kv_cache_manager.swap_blocks(blocks_cache, cpu_cache, {0: 5, 1: 6})
    for t in local:
        t.zero_()
    kv_cache_manager.swap_blocks(cpu_cache, blocks_cache, {5: 0, 6: 1})
    swap_ok = all(torch.equal(local[i][:2], expected(BLOCKS_DESC, 10 + i)[:2])
                  for i in range(BLOCKS_DESC.num_tensors))

    ret, _ = datadist.unlink_clusters([cluster], 5000)
    kv_cache_manager.deallocate_cache(kv_cache)
    kv_cache_manager.deallocate_cache(blocks_cache)
    datadist.finalize()
    result.send({"pull_cache": pulled_ok, "repeat_pull": int(repeat_code or 0), "pull_blocks": blocks_ok,
                 "swap_blocks": swap_ok, "unlink": int(ret)})


def to_blame(procs: list) -> mp.process.BaseProcess | None:
    """The process to blame of those that exited with a nonzero code: one killed by a signal (SIGKILL, the OOM
    killer, a crash) before one that failed on its own, likely because the first one's death reached it."""
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    return min(failed, key=lambda p: p.exitcode > 0, default=None)


def exited(proc: mp.process.BaseProcess) -> str:
    code = proc.exitcode
    how = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return f"the {proc.name} process exited with code {code}{how}"


def receive(conn, what: str, sender: mp.process.BaseProcess, procs: list, limit_s: float):
    """The next message from ``sender``. Fails as soon as a process dies (the message would never come, or the
    run is broken), naming that process, rather than after ``limit_s`` naming the wait."""
    deadline = time.monotonic() + limit_s
    while not conn.poll(POLL_S):
        if (dead := to_blame(procs)) is not None:
            raise RuntimeError(f"{exited(dead)} before sending the {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} from the {sender.name} process within {limit_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:  # the sender ended: its end of the pipe closed with it (main keeps no copy open)
        sender.join(1)  # for its exit code
        raise RuntimeError(f"{exited(to_blame(procs) or sender)} before sending the {what}") from None


def main(limit_s: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    port_in, port_out = ctx.Pipe()
    result_in, result_out = ctx.Pipe()
    # no mp.Event for "the decoder is done": a prompt killed inside Event.wait() hangs Event.set() for ever
    prompt = ctx.Process(target=run_prompt, args=(port_out,), name="prompt")
    procs = [prompt]
    try:
        prompt.start()
        port_out.close()  # the prompt's copy alone: its death is an EOF here, not a wait of limit_s
        port = receive(port_in, "port it listens on", prompt, procs, limit_s)
        decoder = ctx.Process(target=run_decoder, args=(port, result_out), name="decoder")
        procs.append(decoder)
        decoder.start()
        result_out.close()
        result = receive(result_in, "result", decoder, procs, limit_s)
        port_in.close()  # the decoder is done: the prompt frees its caches and ends
        for proc in procs:
            proc.join(30)
        result["exitcodes"] = [p.exitcode for p in procs]
        return result
    finally:
        for proc in procs:
            if proc.pid is None:
                continue
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        for conn in (port_in, port_out, result_in, result_out):
            conn.close()


def checks(outcome: dict) -> list[tuple[bool, str]]:
    """Each check of ``main()``'s outcome: whether it held, and what was found."""
    repeat, unlink = LLMStatusCode(outcome["repeat_pull"]), LLMStatusCode(outcome["unlink"])
    same = {True: "bytes equal", False: "bytes differ"}
    return [
        (outcome["pull_cache"], f"pull_cache of 2 rows by CacheKey: {same[outcome['pull_cache']]}"),
        (repeat == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
         f"pull_cache of the consumed key again: {repeat.name} (LLM_KV_CACHE_NOT_EXIST expected)"),
        (outcome["pull_blocks"], f"pull_blocks of 2 blocks: {same[outcome['pull_blocks']]}"),
        (outcome["swap_blocks"], f"swap_blocks out to a CPU cache and back: {same[outcome['swap_blocks']]}"),
        (unlink == LLMStatusCode.LLM_SUCCESS, f"unlink_clusters: {unlink.name}"),
        (outcome["exitcodes"] == [0, 0], f"exit codes of prompt and decoder: {outcome['exitcodes']}"),
    ]


def exit_on_sigterm() -> None:
    """`kill PID` (SIGTERM) raises SystemExit here, so that main()'s finally stops the processes it spawned; by
    default SIGTERM ends this process at once and the prompt serves on for up to a minute."""
    def terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the reaping short
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)


if __name__ == "__main__":
    exit_on_sigterm()
    try:
        results = checks(main())
    except Exception as exc:
        traceback.print_exc()
        print(f"FAILED: llm_datadist_port: {exc}")
        sys.exit(1)
    for held, what in results:
        print(f"{'ok    ' if held else 'FAILED'} {what}")
    failed = [what for held, what in results if not held]
    if failed:
        print(f"FAILED: llm_datadist_port: {'; '.join(failed)}")
        sys.exit(1)
    print("OK: llm_datadist_port: both flows through the blocking facade; pull_cache, pull_blocks and swap_blocks "
          "bytes equal; the consumed key refused with LLM_KV_CACHE_NOT_EXIST; unlinked")
