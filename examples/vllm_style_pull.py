"""The pull flow of vLLM-style KV connectors: the decoder pulls, then tells the prefill to free.

Two spawned processes on loopback, each owning its paged KV cache as torch
tensors (K and V of each layer, blocks of 16 tokens) and registering it with
``kv.register_blocks_cache``, as a connector registers the engine's KV caches:

1. the PREFILL (``LLMRole.PROMPT``) computes a request's KV into blocks of
   its own pool and keeps them, registered and untouched, for the decoder;
   it sends a side-channel notice: request id, its block ids, token count
   (vLLM's ``kv_transfer_params``: ``remote_block_ids``, engine, host, port);
2. the DECODER (``LLMRole.DECODER``) allocates new blocks of its own and
   ``await kv.pull_blocks(BlocksCacheKey(PREFILL_ID, 0), cache, remote_ids,
   local_ids)``, checks the bytes and sends a "finished" notice;
3. on "finished" the prefill frees the blocks. A decoder that never answers
   (its request was aborted, or it died) would pin them for ever, so each
   held request also has a deadline (vLLM's abort-request timeout,
   ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default; 1 s here): past it
   the prefill releases the blocks on its own. A pull arriving after that
   could read reused blocks, so the deadline must exceed any real decoder's
   queueing delay.

Several requests are in flight at once: the decoder pulls each in its own
asyncio task. One request is abandoned by the decoder to show the timeout.
Side-channel notices travel over multiprocessing pipes (ZMQ in vLLM).

Run: ``python examples/vllm_style_pull.py [--requests 6] [--abort-timeout 1.0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PREFILL_ID, DECODE_ID = 1, 2
LAYERS, KV_HEADS, HEAD_DIM = 8, 8, 128
BLOCK_TOKENS = 16
NUM_BLOCKS = 128
BLOCK_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2  # one block of one tensor, fp16
PULL_TIMEOUT_MS = 5_000
ARRIVAL_GAP_S = 0.01  # between two requests reaching the prefill
RUN_LIMIT_S = 120.0
POLL_S = 0.1  # how often the parent looks for a process that died while it waits for a result
MIB = 2**20


def cache_desc() -> CacheDesc:
    return CacheDesc(2 * LAYERS, (NUM_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), DataType.DT_FLOAT16, Placement.HOST)


def engine_kv_caches() -> list[torch.Tensor]:
    """The serving engine's own KV memory: tensor ``2l`` is K of layer ``l``, ``2l+1`` its V."""
    return [torch.zeros(NUM_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(2 * LAYERS)]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def request_kv(req_id: int, tensor: int, tokens: int) -> torch.Tensor:
    """What the prefill computes for one request and one cache tensor (the decoder checks against it)."""
    gen = torch.Generator().manual_seed(req_id * 1000 + tensor)
    return torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(torch.float16)


def write_tokens(tensor: torch.Tensor, blocks: list[int], states: torch.Tensor) -> None:
    padded = states.new_zeros((len(blocks) * BLOCK_TOKENS, *states.shape[1:]))
    padded[:len(states)] = states
    tensor.index_copy_(0, torch.tensor(blocks), padded.view(len(blocks), BLOCK_TOKENS, *states.shape[1:]))


def read_tokens(tensor: torch.Tensor, blocks: list[int], tokens: int) -> torch.Tensor:
    return tensor.index_select(0, torch.tensor(blocks)).flatten(0, 1)[:tokens]


class BlockPool:
    """Free block ids of one paged cache."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.size = num_blocks
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: {count} wanted, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)


async def recv(conn: Any) -> Any:
    """The next message on a pipe, waited for by the event loop (no thread, no polling)."""
    if not conn.poll():
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


def options(*, listen: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = PULL_TIMEOUT_MS
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


# -- the PREFILL process ----------------------------------------------------------------


@dataclass
class Held:
    """A request whose blocks wait for the decoder to read them."""

    blocks: list[int]
    since: float
    deadline: asyncio.TimerHandle


class PrefillEngine:
    def __init__(self, side: Any, abort_timeout_s: float) -> None:
        self.side = side
        self.abort_timeout_s = abort_timeout_s
        self.kv_caches = engine_kv_caches()
        self.pool = BlockPool(NUM_BLOCKS, seed=1)
        self.held: dict[int, Held] = {}
        self.finished: list[int] = []
        self.expired: list[int] = []
        self._drained: asyncio.Future | None = None

    async def drained(self) -> None:
        """Wait until no request holds blocks (each read, or released by its deadline)."""
        if self.held:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _release(self, held: Held) -> None:
        self.pool.free(held.blocks)
        if not self.held and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def prefill(self, req_id: int, tokens: int) -> list[int]:
        """'Compute' the request's KV into fresh blocks, hold them, and tell the decoder where they are."""
        blocks = self.pool.take(blocks_for(tokens))
        for tensor, cache in enumerate(self.kv_caches):
            write_tokens(cache, blocks, request_kv(req_id, tensor, tokens))
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(self.abort_timeout_s, self.expire, req_id)
        self.held[req_id] = Held(blocks, time.perf_counter(), expiry)
        self.side.send(("kv_ready", req_id, blocks, tokens))
        print(f"[prefill] request {req_id}: {tokens} tokens computed into blocks {blocks}, held for the decoder "
              f"({self.pool.num_free}/{self.pool.size} blocks free)", flush=True)
        return blocks

    def finish(self, req_id: int) -> None:
        held = self.held.pop(req_id, None)
        if held is None:  # already released by its deadline: nothing is pinned any more
            print(f"[prefill] request {req_id}: 'finished' after its blocks were released", flush=True)
            return
        held.deadline.cancel()
        self.finished.append(req_id)
        self._release(held)
        print(f"[prefill] request {req_id}: decoder finished reading after "
              f"{(time.perf_counter() - held.since) * 1e3:.1f} ms -> blocks {held.blocks} freed "
              f"({self.pool.num_free}/{self.pool.size} free)", flush=True)

    def expire(self, req_id: int) -> None:
        held = self.held.pop(req_id)
        self.expired.append(req_id)
        self._release(held)
        print(f"[prefill] request {req_id}: no 'finished' within {self.abort_timeout_s:g} s -> blocks {held.blocks} "
              f"released by the abort timeout ({self.pool.num_free}/{self.pool.size} free)", flush=True)


async def prefill_main(side: Any, requests: list[tuple[int, int]], abort_timeout_s: float) -> dict:
    torch.set_num_threads(1)
    engine = PrefillEngine(side, abort_timeout_s)
    async with LLMDataDist(LLMRole.PROMPT, PREFILL_ID) as dd:
        await dd.init(options(listen=True))
        kv = dd.kv_cache_manager
        kv.register_blocks_cache(cache_desc(), engine.kv_caches, BlocksCacheKey(PREFILL_ID, 0))
        side.send(("hello", dd.listen_address[1]))  # the connector's handshake: where to pull from
        ready = await recv(side)  # the decoder has linked: requests may flow
        assert ready == ("ready",), ready
        decoder_done = asyncio.get_running_loop().create_future()

        async def notices() -> None:
            while True:
                message = await recv(side)
                if message[0] == "finished":
                    engine.finish(message[1])
                elif message[0] == "bye":
                    decoder_done.set_result(None)
                    return

        listener = asyncio.create_task(notices())
        try:
            for req_id, tokens in requests:
                engine.prefill(req_id, tokens)
                await asyncio.sleep(ARRIVAL_GAP_S)
            await decoder_done
            await engine.drained()  # requests nobody will read: until their deadlines
        finally:
            listener.cancel()
        return {"finished": sorted(engine.finished), "expired": sorted(engine.expired),
                "free": engine.pool.num_free, "size": engine.pool.size}


# -- the DECODE process -----------------------------------------------------------------


async def decode_main(side: Any, expected: int, abandon: set[int]) -> dict:
    torch.set_num_threads(1)
    kv_caches = engine_kv_caches()
    pool = BlockPool(NUM_BLOCKS, seed=2)
    pulled: dict[int, bool] = {}
    async with LLMDataDist(LLMRole.DECODER, DECODE_ID) as dd:
        await dd.init(options(listen=False))
        kv = dd.kv_cache_manager
        cache = kv.register_blocks_cache(cache_desc(), kv_caches)
        hello, port = await recv(side)
        assert hello == "hello", hello
        peer = LLMClusterInfo()
        peer.remote_cluster_id = PREFILL_ID
        peer.append_remote_ip_info("127.0.0.1", port)
        status, per_cluster = await dd.link_clusters([peer], timeout=5000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {per_cluster}")
        side.send(("ready",))

        async def load(req_id: int, remote_blocks: list[int], tokens: int) -> None:
            local_blocks = pool.take(len(remote_blocks))
            start = time.perf_counter()
            try:
                await kv.pull_blocks(BlocksCacheKey(PREFILL_ID, 0), cache, src_blocks=remote_blocks,
                                     dst_blocks=local_blocks, timeout=PULL_TIMEOUT_MS)
            except LLMException as exc:  # a real decoder would recompute the prefill or fail the request
                print(f"[decode]  request {req_id}: pull failed ({exc.status_code.name}): {exc}", flush=True)
                pulled[req_id] = False
                pool.free(local_blocks)
                return
            elapsed = time.perf_counter() - start
            side.send(("finished", req_id))  # the prefill may free its blocks now
            ok = all(torch.equal(read_tokens(t, local_blocks, tokens), request_kv(req_id, i, tokens))
                     for i, t in enumerate(kv_caches))
            pulled[req_id] = ok
            nbytes = len(remote_blocks) * BLOCK_BYTES * 2 * LAYERS
            print(f"[decode]  request {req_id}: pulled remote blocks {remote_blocks} into local blocks {local_blocks} "
                  f"({nbytes / MIB:.1f} MiB) in {elapsed * 1e3:.1f} ms, bytes {'verified' if ok else 'WRONG'}; "
                  "'finished' sent", flush=True)
            pool.free(local_blocks)  # decoding would use them here

        loads = []
        for _ in range(expected):
            kind, req_id, remote_blocks, tokens = await recv(side)
            assert kind == "kv_ready", kind
            if req_id in abandon:
                print(f"[decode]  request {req_id}: aborted before decoding: no pull, no 'finished' notice", flush=True)
                continue
            loads.append(asyncio.create_task(load(req_id, remote_blocks, tokens)))
        await asyncio.gather(*loads)
        side.send(("bye",))
        await dd.unlink_clusters([peer])
    return {"pulled": pulled}


# -- processes --------------------------------------------------------------------------


def run_prefill(side: Any, report: Any, requests: list[tuple[int, int]], abort_timeout_s: float) -> None:
    _report(report, lambda: prefill_main(side, requests, abort_timeout_s))


def run_decode(side: Any, report: Any, expected: int, abandon: set[int]) -> None:
    _report(report, lambda: decode_main(side, expected, abandon))


def _report(report: Any, main: Any) -> None:
    try:
        report.send(("ok", asyncio.run(main())))
    except BaseException:
        report.send(("error", traceback.format_exc()))
        raise


def _to_blame(procs: list[Any]) -> Any:
    """The process to blame of those that exited with a nonzero code: one killed by a signal (SIGKILL, the OOM
    killer, a crash) before one that failed on its own, likely because the first one's death reached it."""
    failed = [p for p in procs if p.exitcode not in (None, 0)]
    return min(failed, key=lambda p: p.exitcode > 0, default=None)


def _exited(proc: Any) -> str:
    code = proc.exitcode
    how = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return f"the {proc.name} process exited with code {code}{how} without a result"


def _result(conn: Any, proc: Any, procs: list[Any], deadline: float) -> dict:
    """``proc``'s result. Fails as soon as a process dies (killed, out of memory, a crash), naming it, rather than
    at ``deadline`` naming the wait."""
    while not conn.poll(POLL_S):
        if (dead := _to_blame(procs)) is not None:
            raise RuntimeError(_exited(dead))
        if time.monotonic() > deadline:
            raise TimeoutError(f"no result from the {proc.name} process within {RUN_LIMIT_S:.0f} s")
    try:
        status, value = conn.recv()
    except EOFError:  # it ended without one: its end of the pipe closed with it (main keeps no copy open)
        proc.join(1)  # for its exit code
        raise RuntimeError(_exited(_to_blame(procs) or proc)) from None
    if status != "ok":
        killed = _to_blame([p for p in procs if p is not proc and p.exitcode is not None and p.exitcode < 0])
        if killed is not None:  # its death is why this one failed (the side channel closed under it)
            raise RuntimeError(_exited(killed))
        raise RuntimeError(f"the {proc.name} process failed:\n{value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6, help="requests to serve (default 6; one is abandoned)")
    parser.add_argument("--abort-timeout", type=float, default=1.0,
                        help="seconds the prefill holds blocks nobody reads (default 1.0; vLLM's is 480)")
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests must be >= 2 (one of them is abandoned)")
    if not 0 < args.abort_timeout <= RUN_LIMIT_S / 2:  # the abandoned request expires within the run's limit
        parser.error(f"--abort-timeout must be > 0 and at most {RUN_LIMIT_S / 2:g} s (the example's run limit is "
                     f"{RUN_LIMIT_S:g} s)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(0)
    requests = [(req_id, rng.randrange(5, 200)) for req_id in range(args.requests)]
    if sum(blocks_for(tokens) for _, tokens in requests) > NUM_BLOCKS:
        print(f"FAILED: vllm_style_pull: {args.requests} requests need more than the {NUM_BLOCKS} blocks of the "
              "example")
        return 1
    abandon = {args.requests // 2}
    print(f"vLLM-style pull: {args.requests} requests of {[t for _, t in requests]} tokens; paged KV of {LAYERS} "
          f"layers x K,V, blocks of {BLOCK_TOKENS} tokens x {KV_HEADS} heads x {HEAD_DIM} fp16; decoder abandons "
          f"request {sorted(abandon)}; abort timeout {args.abort_timeout:g} s", flush=True)
    ctx = mp.get_context("spawn")
    side_prefill, side_decode = ctx.Pipe()
    prefill_report, prefill_report_child = ctx.Pipe(duplex=False)
    decode_report, decode_report_child = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=run_prefill, name="prefill", daemon=True,
                         args=(side_prefill, prefill_report_child, requests, args.abort_timeout)),
             ctx.Process(target=run_decode, name="decode", daemon=True,
                         args=(side_decode, decode_report_child, len(requests), abandon))]
    prefill, decode = procs
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    # the children's copies alone: one's death is an EOF to the other and to this process, not a wait for ever
    for end in (side_prefill, side_decode, prefill_report_child, decode_report_child):
        end.close()
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        decoded = _result(decode_report, decode, procs, deadline)
        prefilled = _result(prefill_report, prefill, procs, deadline)
        for proc in procs:
            proc.join(30)
        read = sorted(r for r, ok in decoded["pulled"].items() if ok)
        wanted = sorted(set(range(len(requests))) - abandon)
        problems = [what for held, what in (
            (read == wanted, f"requests pulled with verified bytes: {read}, not {wanted}"),
            (prefilled["finished"] == wanted, f"blocks freed on 'finished' for {prefilled['finished']}, not {wanted}"),
            (prefilled["expired"] == sorted(abandon),
             f"released by the abort timeout: {prefilled['expired']}, not {sorted(abandon)}"),
            (prefilled["free"] == prefilled["size"],
             f"prefill pool {prefilled['free']}/{prefilled['size']} blocks free at the end"),
            (all(proc.exitcode == 0 for proc in procs), f"exit codes {[proc.exitcode for proc in procs]}"),
        ) if not held]
        if problems:
            print(f"FAILED: vllm_style_pull: {'; '.join(problems)}", flush=True)
            return 1
        print(f"OK: vllm_style_pull: {len(read)} requests pulled and verified, blocks freed on 'finished'; "
              f"abandoned request(s) {prefilled['expired']} released by the abort timeout; prefill pool "
              f"{prefilled['free']}/{prefilled['size']} blocks free ({time.perf_counter() - start:.1f} s)", flush=True)
        return 0
    except Exception as exc:
        print(f"FAILED: vllm_style_pull: {str(exc) or type(exc).__name__}", flush=True)  # EOFError() says nothing
        return 1
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


if __name__ == "__main__":
    sys.exit(main())
