"""Layer-wise push overlapping a simulated prefill: ``python -m benchmarks.layerwise [--quick]``.

A prefill of 32 layers runs in a thread of this (PROMPT) process: layer ``i``
computes for ``c`` (a sleep, or a single-threaded torch matmul loop, which
releases the GIL), then records ``i`` on an :class:`EventLayerSynchronizer`.
Meanwhile ``transfer_cache_async`` pushes each recorded layer's K and V blocks
to a DECODER in another process over loopback. Per case, measured in the same
run:

- ``C``: the prefill alone (no transfer), ``T``: the transfer alone (every
  layer recorded before it starts), so ``t = T / 32`` per layer;
- ``total``: prefill and transfer together, from the prefill's start to the
  last layer confirmed in place by the decoder;
- sequential bound ``C + T``; overlap bound ``max(C, T) + min(C, T) / 32``
  (a two-stage pipeline: only one layer's shorter stage is not hidden).

The table gives ``total`` against the overlap bound (target: within 10%) and
against the sequential bound. ``--trace`` prints, for the slowest case, where
the time goes: how long each layer waited after its record until the
decoder confirmed it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import (
    KvGeometry,
    Peer,
    Table,
    cache_blocks_for,
    format_bytes,
    machine_info,
    random_blocks,
    run_coroutine,
    stamp_blocks,
    verify_blocks,
)

PROMPT_ID = 1
DECODER_ID = 2
LAYERS = 32
BALANCES = (0.5, 1.0, 2.0)  # c / t
PEER_LIFETIME_S = 600.0


# -- the decoder, in its own process ------------------------------------------------


def _decoder_peer(conn: Any, num_tensors: int, block_shape: tuple[int, ...], cache_blocks: int,
                  transport: str) -> str:
    """Listen, key a blocks cache ``BlocksCacheKey(DECODER_ID, 0)``, then serve ``cpu``/``verify``/``clear``/``exit``
    requests."""
    return asyncio.run(_decoder(conn, num_tensors, block_shape, cache_blocks, transport))


def _config(transport: str, listen: bool) -> Any:
    from aio_datadist import LLMConfig

    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 10_000
    config.transport = transport
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config


async def _decoder(conn: Any, num_tensors: int, block_shape: tuple[int, ...], cache_blocks: int,
                   transport: str) -> str:
    from aio_datadist import BlocksCacheKey, LLMDataDist, LLMRole

    config = _config(transport, listen=True)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder:
        await decoder.init(config.generate_options())
        cache = decoder.kv_cache_manager.allocate_blocks_cache(_desc(num_tensors, block_shape, cache_blocks),
                                                               BlocksCacheKey(DECODER_ID, 0))
        for tensor in cache.tensors:
            tensor.zero_()
        conn.send(("ready", decoder.listen_address[1]))
        while True:
            command, *args = await asyncio.to_thread(conn.recv)
            if command == "exit":
                return "ok"
            if command == "cpu":
                conn.send(("cpu", time.process_time()))
            elif command == "verify":
                conn.send(("verified", verify_blocks(cache.tensors, args[0], args[1])))
            elif command == "clear":
                for tensor in cache.tensors:
                    tensor.zero_()
                conn.send(("cleared",))


def _desc(num_tensors: int, block_shape: tuple[int, ...], cache_blocks: int) -> Any:
    from aio_datadist import CacheDesc, DataType, Placement

    return CacheDesc(num_tensors, (cache_blocks, *block_shape), DataType.DT_FLOAT16, Placement.HOST)


# -- the prefill ------------------------------------------------------------------------


class Compute:
    """Per-layer work of ``seconds`` in the prefill thread."""

    name = "?"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def start(self) -> None:
        """Called first in the thread that runs the layers."""

    def layer(self) -> None:
        raise NotImplementedError


class SleepCompute(Compute):
    name = "sleep"

    def layer(self) -> None:
        time.sleep(self.seconds)


class MatmulCompute(Compute):
    """A loop of 256x256 fp32 matmuls on one torch thread, calibrated to ``seconds``."""

    name = "matmul"
    SIZE = 256

    def __init__(self, seconds: float) -> None:
        import torch

        super().__init__(seconds)
        self.a = torch.randn(self.SIZE, self.SIZE)
        self.b = torch.randn(self.SIZE, self.SIZE)
        for _ in range(20):
            self.a @ self.b
        start = time.perf_counter()
        for _ in range(200):
            self.a @ self.b
        one = (time.perf_counter() - start) / 200
        self.iterations = max(1, round(seconds / one))

    def start(self) -> None:
        import torch

        # torch.set_num_threads in the main thread does not reach MKL/OpenMP in a new thread:
        # without this, each matmul there forks a team of 2 spinning OpenMP threads.
        torch.set_num_threads(1)

    def layer(self) -> None:
        for _ in range(self.iterations):
            self.a @ self.b


def prefill(compute: Compute, record: Callable[[int], None] | None, stamps: list[float] | None = None) -> None:
    compute.start()
    for layer in range(LAYERS):
        compute.layer()
        if stamps is not None:
            stamps.append(time.perf_counter())
        if record is not None:
            record(layer)


# -- runs -----------------------------------------------------------------------------------


@dataclass
class Run:
    total: float
    recorded: list[float]  # when each layer was recorded (perf_counter)
    confirmed: list[float]  # when each layer's future completed
    start: float


class Bench:
    def __init__(self, blocks: int, repeats: int, use_uvloop: bool, transport: str) -> None:
        self.geometry = KvGeometry()
        self.blocks = blocks
        self.cache_blocks = cache_blocks_for(blocks)
        self.src_blocks = random_blocks(self.cache_blocks, blocks, seed=1)
        self.dst_blocks = random_blocks(self.cache_blocks, blocks, seed=2)
        self.repeats = repeats
        self.use_uvloop = use_uvloop
        self.transport = transport
        self.layer_bytes = 2 * blocks * self.geometry.block_bytes

    def measure(self, table: Table, trace: bool) -> None:
        with Peer(_decoder_peer, self.geometry.num_tensors, self.geometry.block_shape, self.cache_blocks,
                  self.transport, timeout=PEER_LIFETIME_S, name="decoder") as peer:
            ready, port = peer.recv(timeout=120)
            assert ready == "ready"
            try:
                run_coroutine(lambda: self._measure(table, peer, port, trace), use_uvloop=self.use_uvloop)
            finally:
                peer.send(("exit",))
            peer.result(timeout=30)

    async def _measure(self, table: Table, peer: Peer, port: int, trace: bool) -> None:
        from aio_datadist import (
            BlocksCacheKey,
            LLMClusterInfo,
            LLMDataDist,
            LLMRole,
            TransferWithCacheKeyConfig,
        )

        config = _config(self.transport, listen=False)
        async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt:
            await prompt.init(config.generate_options())
            src = prompt.kv_cache_manager.allocate_blocks_cache(
                _desc(self.geometry.num_tensors, self.geometry.block_shape, self.cache_blocks))
            stamp_blocks(src.tensors)
            info = LLMClusterInfo()
            info.remote_cluster_id = DECODER_ID
            info.append_remote_ip_info("127.0.0.1", port)
            status, _ = await prompt.link_clusters([info])
            assert int(status) == 0, status
            self._prompt, self._src = prompt, src
            self._configs = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))]

            await self._run(SleepCompute(0.0), with_compute=False)  # warm-up: faults pages in on both ends
            cpu_before = (time.process_time(), await self._peer_cpu(peer))
            samples = [await self._transfer_alone() for _ in range(self.repeats)]
            cpu_prompt = (time.process_time() - cpu_before[0]) / sum(samples)
            cpu_decoder = (await self._peer_cpu(peer) - cpu_before[1]) / sum(samples)
            t_layer = self._median(samples) / LAYERS
            await self._verify(peer)
            table.note(f"transfer alone: {LAYERS} layers x {format_bytes(self.layer_bytes)}, t = "
                       f"{t_layer * 1e3:.2f} ms per layer ({self.layer_bytes / t_layer / 1e9:.2f} GB/s); it keeps "
                       f"{cpu_prompt:.2f} cores busy in the prompt process and {cpu_decoder:.2f} in the decoder's "
                       f"(of {len(os.sched_getaffinity(0))} usable)")
            for kind in (SleepCompute, MatmulCompute):
                for balance in BALANCES:
                    compute = kind(balance * t_layer)
                    transfers, computes, runs = [], [], []
                    for _ in range(self.repeats):  # interleaved, so that all three see the same machine load
                        transfers.append(await self._transfer_alone())
                        computes.append(await asyncio.to_thread(self._compute_alone, compute))
                        runs.append(await self._run(compute))
                    await self._verify(peer)
                    transfer, alone = self._median(transfers), self._median(computes)
                    total = self._median([r.total for r in runs])
                    overlap = max(alone, transfer) + min(alone, transfer) / LAYERS
                    sequential = alone + transfer
                    case = f"{kind.name} c/t={balance:g}"
                    table.add("transfer alone (T)", case, transfer * 1e3, "ms")
                    table.add("prefill alone (C)", case, alone * 1e3, "ms")
                    table.add("layer-wise total", case, total * 1e3, "ms", baseline="overlap bound",
                              baseline_value=overlap * 1e3, target="<= 1.10x")
                    table.add("layer-wise total", case, total * 1e3, "ms", baseline="sequential bound",
                              baseline_value=sequential * 1e3)
                    if trace:
                        median_run = sorted(runs, key=lambda r: r.total)[len(runs) // 2]
                        table.note(self._trace(case, median_run, transfer / LAYERS, alone))

    async def _transfer_alone(self) -> float:
        """Every layer recorded before the transfer starts."""
        return (await self._run(SleepCompute(0.0), with_compute=False)).total

    @staticmethod
    def _median(values: Sequence[float]) -> float:
        return statistics.median(values)

    def _compute_alone(self, compute: Compute) -> float:
        start = time.perf_counter()
        prefill(compute, None)
        return time.perf_counter() - start

    async def _run(self, compute: Compute, *, with_compute: bool = True) -> Run:
        from aio_datadist import EventLayerSynchronizer

        loop = asyncio.get_running_loop()
        recorded: list[float] = []
        confirmed: list[float] = [0.0] * LAYERS
        with EventLayerSynchronizer(self._prompt, LAYERS) as events:
            if not with_compute:
                for layer in range(LAYERS):
                    events.record(layer)
            start = time.perf_counter()
            task = self._prompt.kv_cache_manager.transfer_cache_async(
                self._src, events, self._configs, self.src_blocks, self.dst_blocks)
            for layer in range(LAYERS):
                task.layer(layer).add_done_callback(lambda f, i=layer: confirmed.__setitem__(i, time.perf_counter()))
            thread = None
            if with_compute:
                thread = threading.Thread(target=prefill, args=(compute, events.record, recorded), name="prefill")
                thread.start()
            await task
            total = time.perf_counter() - start
            await asyncio.sleep(0)  # the last layer's callback
            if thread is not None:
                await loop.run_in_executor(None, thread.join)
        return Run(total, recorded, confirmed, start)

    @staticmethod
    async def _peer_cpu(peer: Peer) -> float:
        peer.send(("cpu",))
        answer = await asyncio.to_thread(peer.recv, 60)
        return float(answer[1])

    async def _verify(self, peer: Peer) -> None:
        peer.send(("verify", self.dst_blocks, self.src_blocks))
        verified = await asyncio.to_thread(peer.recv, 60)
        if verified != ("verified", True):
            raise RuntimeError("the decoder's blocks do not hold what was pushed")
        peer.send(("clear",))
        await asyncio.to_thread(peer.recv, 60)

    @staticmethod
    def _trace(case: str, run: Run, t_layer: float, alone: float) -> str:
        lags = [(run.confirmed[i] - run.recorded[i]) * 1e3 for i in range(LAYERS)]
        first = (run.recorded[0] - run.start) * 1e3
        prefill_ms = (run.recorded[-1] - run.start) * 1e3
        tail = (run.start + run.total - run.recorded[-1]) * 1e3
        return (f"{case} (median run, {run.total * 1e3:.1f} ms): prefill took {prefill_ms:.1f} ms "
                f"(alone {alone * 1e3:.1f}), first record at {first:.2f} ms; record -> confirmed per layer "
                f"median {statistics.median(lags):.2f} ms, max {max(lags):.2f} ms (t alone {t_layer * 1e3:.2f}); "
                f"last record -> end {tail:.2f} ms")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layerwise", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller layers, fewer repeats (about 20 s)")
    p.add_argument("--blocks", type=int, help="blocks per layer and tensor (default 64, quick 16)")
    p.add_argument("--repeats", type=int, help="timed runs per case (default 9, quick 3)")
    p.add_argument("--uvloop", action="store_true", help="run the prompt side on uvloop")
    p.add_argument("--transport", choices=("tcp", "local", "auto"), default="tcp",
                   help="aio.Transport of both ends (default tcp: the bytes cross loopback TCP)")
    p.add_argument("--trace", action="store_true", help="where the time goes, per case")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    import torch

    torch.set_num_threads(1)  # the matmul prefill takes one core; the transfer and the decoder the rest
    blocks = args.blocks or (16 if args.quick else 64)
    repeats = args.repeats or (3 if args.quick else 9)
    bench = Bench(blocks, repeats, args.uvloop, args.transport)
    loop = "uvloop" if args.uvloop else "asyncio"
    table = Table(f"aio_datadist layer-wise push vs a simulated prefill ({LAYERS} layers, {blocks} blocks of "
                  f"{format_bytes(bench.geometry.block_bytes)} per layer and tensor, {args.transport}, {loop}, "
                  f"median of {repeats})",
                  machine=machine_info())
    bench.measure(table, args.trace)
    table.note("overlap bound = max(C, T) + min(C, T)/32; sequential bound = C + T; C and T measured alone, "
               "interleaved with the combined runs; the decoder is a separate process on loopback; blocks "
               "verified after each case")
    if args.format == "markdown":
        print(table.render_markdown())
    elif args.format == "json":
        print(table.to_json())
    else:
        table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
