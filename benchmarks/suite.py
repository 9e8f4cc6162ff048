"""The performance suite: ``python -m benchmarks.suite [--quick | --full] [--format markdown]``.

One run, two processes: a PROMPT process (spawned) and the DECODER (this
process), each holding two endpoints, one per data plane:

- TCP: ``aio.Transport=tcp`` on both ends (native writev/readv on the data
  channels);
- same-host: ``aio.Transport=local`` on both ends (the peer's memfd cache is
  mapped here; a transfer is one native copy).

Each endpoint has one blocks cache of the shared geometry (64 tensors, fp16
blocks of [16, 8, 128] = 32 KiB per block per tensor, so a request of B
blocks moves B x 2 MiB; 64 blocks = 128 MiB). Random distinct source and
destination blocks; every destination is checked after timing.

Measured in the same run, in alternating rounds (the order of the cases
rotates each round, so load drift hits them alike):

1. Throughput per request size (1, 4, 64, 512 blocks; 4096 with ``--full``
   when it fits in memory; 1 block is always measured, for the latency rows): ``pull_blocks`` (timed here) and
   ``push_blocks`` (timed in the PROMPT process, until the decoder confirmed) over each data
   plane, against the same bytes moved by a raw loopback TCP connection
   (``sendall`` -> ``recv_into`` of one contiguous buffer), a one-thread
   memcpy, and torch.distributed gloo (gather, send/recv, scatter; its own
   two processes, a few rounds spread over the run since each costs a
   process-group start).
2. Latency of a 1-block pull (p50, p99) against the raw TCP round trip of the
   same bytes.
3. Transfers per second of 64 concurrent 1-block and 4-block pulls on one link.
4. Memory: peak RSS of both processes, and the RSS growth of both while many
   128 MiB transfers run (the high-water mark is reset first): a transfer must
   not allocate a buffer that grows with the request.

Under load (default on; ``--no-load`` leaves it out): after each round, the
cases of issue 19's targets (1- and 4-block TCP pulls, the 1-block same-host
pull, 64 concurrent 1-block TCP pulls, and their raw TCP baselines) run again
while a busy-loop child process of this benchmark spins (not pinned; ``--load-cpu
N`` pins it). The "Small requests (issue 19)" table prints every target of the
issue with its mark, the loaded ratios and loaded / quiet, and the 128 MiB
ratios against a saved reference run (``--reference``, written by ``--format json``; the
default, ``auto``, is the newest run in ``benchmarks/results`` made on this kind of machine,
CPU model and cores: ratios of two machines are not comparable).

Both library processes run asyncio's default event loop; ``--uvloop`` runs them
on uvloop instead (the raw baselines use no event loop either way).

Targets are marks in the table, never assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks import baselines, small_requests
from benchmarks._machine import OtherCpuLoad, RssWatch
from benchmarks._spinner import Spinner
from benchmarks.harness import (
    block_lists,
    blocks_desc,
    endpoint_options,
    MIB,
    KvGeometry,
    Measurement,
    Peer,
    Progress,
    Table,
    add_common_arguments,
    blocks_label,
    block_counts,
    cache_blocks_for,
    fits_in_memory,
    format_bytes,
    machine_info,
    mode_label,
    random_blocks,
    repeats_for,
    run_coroutine,
    time_async,
)

TRANSPORTS = ("tcp", "local")
LABEL = {"tcp": "TCP", "local": "same-host"}
PROMPT_ID = {"tcp": 1, "local": 3}
DECODER_ID = {"tcp": 2, "local": 4}
TRANSFER_TIMEOUT_MS = 120_000
PEER_LIFETIME_S = 1800.0
SEED = 7

TARGET_BLOCKS = 64  # the 128 MiB request the throughput targets are set at
TCP_VS_RAW = ">= 0.9x"
TCP_VS_GLOO = ">= 1.3x"
LOCAL_VS_MEMCPY = ">= 0.8x"
METRICS_COST = "<= 1.02x"
METRICS_BLOCKS = 10  # alternating off/on blocks per round of the metrics a/b case
#: Samples per side and round of the metrics a/b case: the effect is ~1% of a 1-block pull, so it needs
#: several times the latency rows' samples to stand out of the noise (standard error of a p50 ~0.7% here).
METRICS_SAMPLES = 500
RSS_FLAT = "< 0.05x"  # growth against one request: a buffer of 1/20 of it would show

CONCURRENT = 64
CONCURRENT_BLOCKS = (1, 4)


@dataclass(frozen=True)
class Plan:
    """How much a run measures; set by the mode."""

    rounds: int
    gloo_rounds: int
    latency_samples: int  # 1-block samples per case (p99 needs many)
    concurrent_batches: int  # per round, per transport and size
    rss_transfers: int  # 128 MiB transfers per RSS check
    quick: bool

    @classmethod
    def for_mode(cls, quick: bool, full: bool) -> "Plan":
        if quick:
            return cls(rounds=2, gloo_rounds=1, latency_samples=60, concurrent_batches=2, rss_transfers=4,
                       quick=True)
        return cls(rounds=8 if full else 6, gloo_rounds=3 if full else 2, latency_samples=600,
                   concurrent_batches=8, rss_transfers=24, quick=False)

    def total_repeats(self, nbytes: int) -> int:
        """Samples per case: many for 1 block (its p99 is reported), else the harness's byte budget."""
        if nbytes <= 2 * MIB:
            return self.latency_samples
        return repeats_for(nbytes, quick=self.quick, min_repeats=2 if self.quick else None)

    def per_round(self, nbytes: int) -> int:
        return max(1, -(-self.total_repeats(nbytes) // self.rounds))

    def cache_blocks(self, max_count: int) -> int:
        """Blocks per cache: the harness's 2x the largest request (quick: just enough, to allocate less)."""
        floor = 2 * CONCURRENT * max(CONCURRENT_BLOCKS)  # distinct blocks for the concurrent pulls
        return max(max_count if self.quick else cache_blocks_for(max_count), floor)

    def gloo_counts(self, counts: Sequence[int]) -> list[int]:
        """Sizes the gloo baseline runs at (quick: up to the target size; each gloo transfer is slow)."""
        return [c for c in counts if not self.quick or c <= TARGET_BLOCKS]

    def warmup(self, round_index: int, nbytes: int) -> int:
        if round_index == 0:
            return 1 if self.quick else 2
        return 1 if nbytes < 64 * MIB else 0  # large transfers need no warm cache


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.splitlines()[0])
    add_common_arguments(p)
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline (it starts two processes)")
    p.add_argument("--no-load", action="store_true",
                   help="skip the pass under load (a busy child process) of the small-request cases")
    p.add_argument("--load-cpu", type=int, default=None, metavar="CPU",
                   help="pin the busy child to this CPU (default: not pinned)")
    p.add_argument("--uvloop", action="store_true",
                   help="run both library processes' event loops on uvloop (default: asyncio's; the raw baselines "
                        "use no event loop)")
    p.add_argument("--reference", default="auto", metavar="FILE|auto|none",
                   help="a saved --format json run to compare the 128 MiB ratios with (default: auto, the newest one "
                        "in benchmarks/results made on this kind of machine: CPU model and cores)")
    return p.parse_args(argv)





def _concurrent_lists(cache_blocks: int, each: int) -> list[tuple[list[int], list[int]]]:
    src = random_blocks(cache_blocks, CONCURRENT * each, SEED + 2)
    dst = random_blocks(cache_blocks, CONCURRENT * each, SEED + 3)
    return [(src[i * each:(i + 1) * each], dst[i * each:(i + 1) * each]) for i in range(CONCURRENT)]


# -- the PROMPT process -------------------------------------------------------------------------


def _prompt_peer(conn: Any, geometry: KvGeometry, cache_blocks: int, use_uvloop: bool) -> None:
    run_coroutine(lambda: _prompt_main(conn, geometry, cache_blocks), use_uvloop=use_uvloop)


async def _next_command(conn: Any) -> Any:
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


async def _prompt_main(conn: Any, geometry: KvGeometry, cache_blocks: int) -> None:
    from contextlib import AsyncExitStack

    from aio_datadist import BlocksCacheKey, CacheIndex, LLMDataDist, LLMRole

    from benchmarks.harness import stamp_blocks

    async with AsyncExitStack() as stack:
        kv, caches, ports, dds = {}, {}, {}, {}
        for transport in TRANSPORTS:
            dd = await stack.enter_async_context(LLMDataDist(LLMRole.PROMPT, PROMPT_ID[transport]))
            dds[transport] = dd
            await dd.init(endpoint_options(transport, listen=True, timeout_ms=TRANSFER_TIMEOUT_MS))
            kv[transport] = dd.kv_cache_manager
            caches[transport] = kv[transport].allocate_blocks_cache(
                blocks_desc(geometry, cache_blocks), BlocksCacheKey(PROMPT_ID[transport]))
            stamp_blocks(caches[transport].tensors)
            ports[transport] = dd.listen_address[1]
        conn.send(ports)
        while True:
            command = await _next_command(conn)
            if command[0] == "exit":
                return
            if command[0] == "metrics":
                _metrics_on(dds.values(), command[1])
                conn.send("ok")
                continue
            _, transport, count, repeats, warmup, dst_cache_id = command
            src_blocks, dst_blocks = block_lists(cache_blocks, count, SEED)
            target = CacheIndex(DECODER_ID[transport], dst_cache_id)
            manager, cache = kv[transport], caches[transport]
            samples = await time_async(
                lambda: manager.push_blocks(target, cache, src_blocks, dst_blocks, timeout=TRANSFER_TIMEOUT_MS),
                repeats=repeats, warmup=warmup)
            conn.send(samples)


def metrics_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


_EXPORTER: Any = None


def observer_cost_us(calls: int = 100_000) -> float:
    """What the Prometheus observer costs per finished transfer and end, timed alone, in us."""
    from aio_datadist.metrics import _Observer
    from aio_datadist.stats import Outcome
    from aio_datadist.status import LLMStatusCode

    observer = _Observer("0")
    ok, success = Outcome.OK, LLMStatusCode.LLM_SUCCESS
    start = time.perf_counter()
    for _ in range(calls):
        observer.transfer(0, "pull", "tcp", 2 << 20, 0.0005, ok, success)
    return (time.perf_counter() - start) / calls * 1e6


def _metrics_on(dds: Any, on: bool) -> None:
    """Count the endpoints' transfers in a Prometheus registry of this process's own (``on``), or stop."""
    global _EXPORTER
    from aio_datadist.metrics import PrometheusMetrics

    if _EXPORTER is None:
        from prometheus_client import CollectorRegistry

        _EXPORTER = PrometheusMetrics(CollectorRegistry())
    for dd in dds:
        if on:
            _EXPORTER.watch(dd)
        else:
            _EXPORTER.unwatch(dd)


# -- this process: the DECODER ------------------------------------------------------------------


@dataclass
class Results:
    samples: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    nbytes: dict[tuple[str, ...], int] = field(default_factory=dict)
    round_loads: list[float] = field(default_factory=list)
    rss: list[tuple[str, str, int, int, int]] = field(default_factory=list)  # what, process, peak, kept, request
    control_growth: int = 0
    rss_lib_peak: int = 0
    peak: dict[str, int] = field(default_factory=dict)
    settings: dict[str, int] = field(default_factory=dict)
    raw_buffer: int = 0
    status: dict[str, dict[str, int]] = field(default_factory=dict)
    gloo_info: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, float] = field(default_factory=dict)
    spinner_cpu: float = 0.0  # CPU seconds the busy child used during the loaded passes
    spinner_wall: float = 0.0  # seconds the loaded passes took

    def add(self, key: tuple[str, ...], nbytes: int, samples: Sequence[float]) -> None:
        self.samples.setdefault(key, []).extend(samples)
        self.nbytes[key] = nbytes

    def m(self, *key: str) -> Measurement:
        return Measurement(" ".join(key), self.nbytes[key], tuple(self.samples[key]))

    def has(self, *key: str) -> bool:
        return key in self.samples


class Decoder:
    """The two DECODER endpoints, their caches and links to the PROMPT process."""

    def __init__(self, geometry: KvGeometry, cache_blocks: int, peer: Peer) -> None:
        self.geometry = geometry
        self.cache_blocks = cache_blocks
        self.peer = peer
        self.kv: dict[str, Any] = {}
        self.caches: dict[str, Any] = {}
        self.dds: dict[str, Any] = {}
        self.settings: dict[str, int] = {}

    async def open(self, stack: Any) -> None:
        from aio_datadist import LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode

        for transport in TRANSPORTS:
            dd = await stack.enter_async_context(LLMDataDist(LLMRole.DECODER, DECODER_ID[transport]))
            await dd.init(endpoint_options(transport, listen=False, timeout_ms=TRANSFER_TIMEOUT_MS))
            self.dds[transport] = dd
            self.kv[transport] = dd.kv_cache_manager
            # Allocation populates the whole cache: done before any link exists, since a loop blocked
            # for seconds would miss the heartbeats of a live link.
            desc = blocks_desc(self.geometry, self.cache_blocks)
            self.caches[transport] = self.kv[transport].allocate_blocks_cache(desc)
        ports = await self.peer.recv_async(300.0)
        for transport, dd in self.dds.items():
            info = LLMClusterInfo()
            info.remote_cluster_id = PROMPT_ID[transport]
            info.append_remote_ip_info("127.0.0.1", ports[transport])
            status, _ = await dd.link_clusters([info])
            if status != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"link_clusters ({transport}) failed: {status!r}")
            self.settings = {"data channels": dd._runtime.settings.data_channels,
                             "copy threads": dd._runtime.copier.threads}
            shares = dd._links.get(PROMPT_ID[transport]).local is not None
            if shares != (transport == "local"):
                raise RuntimeError(f"the {transport} link {'shares' if shares else 'does not share'} memory")

    def clear(self, transport: str, blocks: Sequence[int]) -> None:
        import torch

        idx = torch.tensor(list(blocks), dtype=torch.int64)
        for t in self.caches[transport].tensors:
            t.index_fill_(0, idx, 0)

    def check(self, transport: str, what: str, dst: Sequence[int], src: Sequence[int]) -> None:
        from benchmarks.harness import verify_blocks

        if not verify_blocks(self.caches[transport].tensors, dst, src):
            raise RuntimeError(f"{what} over {transport} put wrong bytes in place")

    async def pull(self, transport: str, count: int, repeats: int, warmup: int) -> list[float]:
        from aio_datadist import BlocksCacheKey

        src, dst = block_lists(self.cache_blocks, count, SEED)
        self.clear(transport, dst)
        kv, cache, key = self.kv[transport], self.caches[transport], BlocksCacheKey(PROMPT_ID[transport])
        samples = await time_async(lambda: kv.pull_blocks(key, cache, src, dst, timeout=TRANSFER_TIMEOUT_MS),
                                   repeats=repeats, warmup=warmup)
        self.check(transport, "pull_blocks", dst, src)
        return samples

    async def push(self, transport: str, count: int, repeats: int, warmup: int) -> list[float]:
        src, dst = block_lists(self.cache_blocks, count, SEED)
        self.clear(transport, dst)
        self.peer.send(("push", transport, count, repeats, warmup, self.caches[transport].cache_id))
        samples = await self.peer.recv_async(600.0)
        self.check(transport, "push_blocks", dst, src)
        return samples

    async def metrics(self, on: bool) -> None:
        """Count both ends' transfers in Prometheus metrics (``on``), or stop counting."""
        _metrics_on(self.dds.values(), on)
        self.peer.send(("metrics", on))
        await self.peer.recv_async(60.0)

    async def concurrent_pulls(self, transport: str, each: int, batches: int, warmup: int) -> list[float]:
        from aio_datadist import BlocksCacheKey

        lists = _concurrent_lists(self.cache_blocks, each)
        self.clear(transport, [b for _, dst in lists for b in dst])
        kv, cache, key = self.kv[transport], self.caches[transport], BlocksCacheKey(PROMPT_ID[transport])

        def batch() -> Any:
            return asyncio.gather(*(kv.pull_blocks(key, cache, src, dst, timeout=TRANSFER_TIMEOUT_MS)
                                    for src, dst in lists))

        samples = await time_async(batch, repeats=batches, warmup=warmup)
        for src, dst in lists:
            self.check(transport, "concurrent pull_blocks", dst, src)
        return samples


async def _loaded_pass(res: Results, dec: Decoder, raw: Any, spinner: Spinner, counts: Sequence[int],
                       plan: Plan, r: int, request: dict[int, int]) -> None:
    """Issue 19's cases again while the spinner runs; keys prefixed ``loaded``."""
    keys = [k for k in small_requests.loaded_keys() if int(k[2]) in counts]
    shift = r % len(keys)
    cpu0, t0 = spinner.cpu_seconds(), time.perf_counter()
    with spinner.running():
        for op, transport, c in keys[shift:] + keys[:shift]:
            count = int(c)
            nbytes, n = request[count], plan.per_round(request[count])
            key = (small_requests.LOADED, op, transport, c)
            if op == "raw":
                m = await asyncio.to_thread(raw.throughput, nbytes, n, warmup=1)
                res.add(key, nbytes, m.samples)
            elif op == "pull":
                res.add(key, nbytes, await dec.pull(transport, count, n, 1))
            else:
                res.add(key, CONCURRENT * nbytes, await dec.concurrent_pulls(transport, count,
                                                                             plan.concurrent_batches, 1))
    res.spinner_wall += time.perf_counter() - t0
    res.spinner_cpu += spinner.cpu_seconds() - cpu0


async def _measure(geometry: KvGeometry, counts: Sequence[int], plan: Plan, gloo: bool,
                   progress: Progress, spinner: Spinner | None = None, use_uvloop: bool = False) -> Results:
    from contextlib import AsyncExitStack

    res = Results()
    max_count = max(counts)
    cache_blocks = plan.cache_blocks(max_count)
    request = {c: geometry.request_bytes(c) for c in counts}
    raw_bytes = max(request.values())
    gloo_after = ({round(i * (plan.rounds - 1) / max(1, plan.gloo_rounds - 1)) for i in range(plan.gloo_rounds)}
                  if gloo else set())
    concurrent = [b for b in CONCURRENT_BLOCKS if b in counts]
    metrics = metrics_available()
    t0 = time.perf_counter()
    with Peer(_prompt_peer, geometry, cache_blocks, use_uvloop, timeout=PEER_LIFETIME_S, name="prompt") as peer, \
            baselines.TcpReplyPeer(raw_bytes, timeout=PEER_LIFETIME_S) as raw:
        prompt_rss, my_rss = RssWatch(peer.pid), RssWatch()
        async with AsyncExitStack() as stack:
            dec = Decoder(geometry, cache_blocks, peer)
            await dec.open(stack)
            res.sections["start and link"] = time.perf_counter() - t0
            progress("linked")

            res.settings = dec.settings
            lib_peak = 0
            t1 = time.perf_counter()
            for r in range(plan.rounds):
                load = OtherCpuLoad(live_children=True)
                for count in counts:
                    nbytes = request[count]
                    n, w = plan.per_round(nbytes), plan.warmup(r, nbytes)
                    cases = [("raw", "tcp")] + [(op, t) for t in TRANSPORTS for op in ("pull", "push")]
                    if count == 1 and metrics:  # the cost of the Prometheus exporter on a 1-block pull
                        cases += [("metrics a/b", t) for t in TRANSPORTS]
                    shift = r % len(cases)
                    for op, transport in cases[shift:] + cases[:shift]:
                        key = (op, transport, str(count))
                        if op == "raw":
                            # in a thread: the loop must keep answering the links' heartbeats
                            m = await asyncio.to_thread(raw.throughput, nbytes, n, warmup=max(w, 1))
                            res.add(key, nbytes, m.samples)
                        elif op == "pull":
                            res.add(key, nbytes, await dec.pull(transport, count, n, w))
                        elif op == "metrics a/b":
                            # metrics off and on in short alternating blocks, so drift hits both alike
                            for block in range(METRICS_BLOCKS):
                                for on in ((False, True) if block % 2 == 0 else (True, False)):
                                    await dec.metrics(on)
                                    per_block = max(1, max(n, METRICS_SAMPLES) // METRICS_BLOCKS)
                                    samples = await dec.pull(transport, count, per_block, w)
                                    res.add(("pull+metrics" if on else "pull, metrics a/b", transport, str(count)),
                                            nbytes, samples)
                            await dec.metrics(False)
                        else:
                            res.add(key, nbytes, await dec.push(transport, count, n, w))
                for each in concurrent:
                    for transport in TRANSPORTS:
                        res.add(("concurrent", transport, str(each)), CONCURRENT * request[each],
                                await dec.concurrent_pulls(transport, each, plan.concurrent_batches,
                                                           2 if r == 0 and not plan.quick else 1))
                lib_peak = max(lib_peak, my_rss.status()["VmHWM"])
                memcpy = await asyncio.to_thread(
                    baselines.raw_memcpy_sizes, {request[c]: plan.per_round(request[c]) for c in counts})
                my_rss.reset()  # memcpy's two buffers are the baseline's, not the library's
                for count in counts:
                    res.add(("memcpy", "-", str(count)), request[count], memcpy[request[count]].samples)
                if r in gloo_after:
                    reps = {c: max(1, -(-plan.total_repeats(request[c]) // len(gloo_after)))
                            for c in plan.gloo_counts(counts)}
                    tg = time.perf_counter()
                    measured, info = await asyncio.to_thread(baselines.gloo_send_recv_sizes, reps,
                                                             cache_blocks=cache_blocks)
                    res.gloo_info = dict(info, start_s=time.perf_counter() - tg, rounds=len(gloo_after))
                    for count, m in measured.items():
                        res.add(("gloo", "-", str(count)), m.nbytes, m.samples)
                res.round_loads.append(load.cores_busy())
                if spinner is not None:
                    await _loaded_pass(res, dec, raw, spinner, counts, plan, r, request)
                progress(f"round {r + 1}/{plan.rounds} (other load {res.round_loads[-1]:.2f} cores)")
            res.sections["throughput, latency, concurrency rounds"] = time.perf_counter() - t1
            if spinner is not None:
                res.sections["of which loaded passes"] = res.spinner_wall

            t2 = time.perf_counter()
            await _rss_checks(res, dec, geometry, plan, prompt_rss, my_rss, min(TARGET_BLOCKS, max_count))
            res.sections["RSS checks"] = time.perf_counter() - t2
            progress("rss checks")

            # the control buffer of the RSS checks is not the library's either
            res.peak = {"decoder": my_rss.peak(), "decoder, library": max(lib_peak, res.rss_lib_peak),
                        "prompt": prompt_rss.peak()}
            res.raw_buffer = raw_bytes
            res.status = {"decoder": my_rss.status(), "prompt": prompt_rss.status()}
            peer.send(("exit",))
            await peer.result_async(60.0)
    return res


async def _rss_checks(res: Results, dec: Decoder, geometry: KvGeometry, plan: Plan, prompt_rss: RssWatch,
                      my_rss: RssWatch, count: int) -> None:
    """Peak and kept RSS growth of both processes over many transfers of ``count`` blocks, after a warmup."""
    request = geometry.request_bytes(count)
    # Control: the method sees a temporary buffer of one request's size.
    res.rss_lib_peak = my_rss.status()["VmHWM"]
    before = my_rss.reset()
    buf = np.empty(request, dtype=np.uint8)
    buf.fill(1)
    del buf
    res.control_growth = my_rss.since_reset()["VmHWM"] - before["VmRSS"]
    my_rss.reset()
    for transport in TRANSPORTS:
        for op in ("pull", "push"):
            run = dec.pull if op == "pull" else dec.push
            await run(transport, count, 1, 2)  # pages in the blocks and whatever a first transfer sets up
            res.rss_lib_peak = max(res.rss_lib_peak, my_rss.status()["VmHWM"])
            start = {"decoder": my_rss.reset(), "prompt": prompt_rss.reset()}
            await run(transport, count, plan.rss_transfers, 0)
            end = {"decoder": my_rss.since_reset(), "prompt": prompt_rss.since_reset()}
            res.rss_lib_peak = max(res.rss_lib_peak, end["decoder"]["VmHWM"])
            for proc in ("decoder", "prompt"):
                res.rss.append((f"{op}_blocks {LABEL[transport]}", proc,
                                end[proc]["VmHWM"] - start[proc]["VmRSS"],
                                end[proc]["VmRSS"] - start[proc]["VmRSS"], request))


# -- the tables -----------------------------------------------------------------------------------


def _footprint(geometry: KvGeometry, plan: Plan, count: int, gloo: bool) -> int:
    """Four caches (two per process), the raw TCP buffers, and the larger of memcpy's and gloo's."""
    cache_blocks = plan.cache_blocks(count)
    request = geometry.request_bytes(count)
    gloo_bytes = baselines.gloo_footprint(count, geometry, cache_blocks) if gloo and plan.gloo_counts([count]) else 0
    return 4 * geometry.request_bytes(cache_blocks) + 2 * request + max(2 * request, gloo_bytes)


def _throughput_table(res: Results, counts: Sequence[int], geometry: KvGeometry, machine: str, mode: str,
                      gloo: bool) -> Table:
    table = Table(f"Throughput: pull_blocks / push_blocks against raw TCP, memcpy and gloo ({mode}; "
                  "GB = 1e9 B; value = median)", machine=machine)
    for count in counts:
        case = blocks_label(count, geometry)
        c = str(count)
        raw, mem = res.m("raw", "tcp", c).gbps, res.m("memcpy", "-", c).gbps
        g = res.m("gloo", "-", c).gbps if gloo and res.has("gloo", "-", c) else None
        table.add("raw TCP sendall/recv_into", case, raw, "GB/s")
        table.add("memcpy 1 thread", case, mem, "GB/s")
        if g is not None:
            table.add("gloo send/recv (gathered)", case, g, "GB/s")
        at_target = count == TARGET_BLOCKS
        for op in ("pull", "push"):
            v = res.m(op, "tcp", c).gbps
            table.add(f"{op}_blocks TCP", case, v, "GB/s", baseline="raw TCP", baseline_value=raw,
                      target=TCP_VS_RAW if at_target else None)
            if g is not None:
                table.add(f"{op}_blocks TCP", case, v, "GB/s", baseline="gloo", baseline_value=g,
                          target=TCP_VS_GLOO if at_target else None)
        for op in ("pull", "push"):
            v = res.m(op, "local", c).gbps
            table.add(f"{op}_blocks same-host", case, v, "GB/s", baseline="memcpy 1 thread", baseline_value=mem,
                      target=LOCAL_VS_MEMCPY if at_target and op == "pull" else None)
    samples = ", ".join(f"{c} blk: {res.m('pull', 'tcp', str(c)).summary.n}" for c in counts)
    gloo_samples = ", ".join(f"{c} blk: {res.m('gloo', '-', str(c)).summary.n}" for c in counts
                             if res.has("gloo", "-", str(c)))
    table.note(f"samples per case: {samples}" + (f"; gloo: {gloo_samples}" if gloo_samples else ""))
    table.note("pull_blocks is timed in the DECODER (this process) from the call to its return; push_blocks in the "
               "PROMPT process until the decoder confirmed; raw TCP from the 32-byte request to the last byte")
    table.note("memcpy copies one contiguous buffer of the same size: sizes that fit the CPU caches run from them; "
               "same-host transfers gather random 32 KiB blocks")
    if gloo:
        table.note(f"gloo: two more processes, torch threads {res.gloo_info.get('torch_threads')}, cache "
                   f"{res.gloo_info.get('cache_blocks')} blocks; index_select gather, send/recv, index_copy_ scatter, "
                   f"timed at the receiver; measured in {res.gloo_info.get('rounds')} of the rounds only (each "
                   f"gloo round starts two processes: the last took {res.gloo_info.get('start_s', 0):.0f} s)")
    return table


def _latency_table(res: Results, geometry: KvGeometry, machine: str, mode: str) -> Table:
    table = Table(f"Latency of a 1-block pull ({format_bytes(geometry.request_bytes(1))}) against a raw TCP "
                  f"round trip of the same bytes ({mode}; us)", machine=machine)
    raw = res.m("raw", "tcp", "1")
    table.add("raw TCP round trip p50", "1 blk", raw.p50_us, "us")
    table.add("raw TCP round trip p99", "1 blk", raw.p99_us, "us")
    for transport in TRANSPORTS:
        for op in ("pull", "push"):
            m = res.m(op, transport, "1")
            table.add(f"{op}_blocks {LABEL[transport]} p50", "1 blk", m.p50_us, "us", baseline="raw TCP p50",
                      baseline_value=raw.p50_us)
            table.add(f"{op}_blocks {LABEL[transport]} p99", "1 blk", m.p99_us, "us", baseline="raw TCP p99",
                      baseline_value=raw.p99_us)
    if res.has("pull+metrics", TRANSPORTS[0], "1"):
        for transport in TRANSPORTS:
            m, bare = res.m("pull+metrics", transport, "1"), res.m("pull, metrics a/b", transport, "1")
            table.add(f"pull_blocks {LABEL[transport]} p50, Prometheus metrics on", "1 blk", m.p50_us, "us",
                      baseline="the same pull, metrics off", baseline_value=bare.p50_us, target=METRICS_COST)
        each_us = observer_cost_us()
        for transport in TRANSPORTS:
            bare = res.m("pull, metrics a/b", transport, "1")
            table.add(f"pull_blocks {LABEL[transport]} p50 + the observer's cost at both ends", "1 blk",
                      bare.p50_us + 2 * each_us, "us", baseline="the same pull, metrics off",
                      baseline_value=bare.p50_us, target=METRICS_COST)
    table.note(f"{raw.summary.n} samples per case; ratios above 1 are slower than raw TCP (the pull targets are "
               "in the small-requests table); push_blocks for "
               "information (timed in the PROMPT process); 'metrics on': both ends count every transfer in "
               "aio_datadist.metrics (counters and the latency histogram), against the same pull with them off, "
               f"in {METRICS_BLOCKS} alternating blocks per round ({METRICS_SAMPLES} samples per side and round); "
               "the rows '+ the observer's cost' add what counting one transfer costs (timed alone, 100,000 "
               "calls) twice, once per end: the a/b rows scatter by a few percent from run to run here, more "
               "than the effect"
               + ("" if res.has("pull+metrics", TRANSPORTS[0], "1") else
                  "; no metrics rows: prometheus_client is not installed (pip install 'aio_datadist[metrics]')"))
    return table


def _concurrency_table(res: Results, geometry: KvGeometry, machine: str, mode: str) -> Table:
    table = Table(f"{CONCURRENT} concurrent pulls on one link ({mode}; transfers/s = {CONCURRENT} / median batch "
                  "time)", machine=machine)
    for each in CONCURRENT_BLOCKS:
        if not res.has("concurrent", "tcp", str(each)):
            continue
        case = f"{CONCURRENT} x {blocks_label(each, geometry)}"
        raw = res.m("raw", "tcp", str(each))
        raw_rate = 1.0 / raw.summary.median
        table.add("raw TCP round trips, one at a time", case, raw_rate, "1/s")
        for transport in TRANSPORTS:
            serial = res.m("pull", transport, str(each))
            table.add(f"pull_blocks {LABEL[transport]}, one at a time", case, 1.0 / serial.summary.median, "1/s",
                      baseline="raw TCP serial", baseline_value=raw_rate)
            m = res.m("concurrent", transport, str(each))
            table.add(f"pull_blocks {LABEL[transport]}, {CONCURRENT} concurrent", case,
                      CONCURRENT / m.summary.median, "1/s", baseline="raw TCP serial", baseline_value=raw_rate)
        n = res.m("concurrent", "tcp", str(each)).summary.n
    table.note(f"{n} batches per case; every pull its own distinct blocks; the TCP link has "
               f"{res.settings.get('data channels')} data channels per direction (requests beyond them wait for a "
               f"free channel), same-host copies run on {res.settings.get('copy threads')} copy threads")
    return table


def _memory_table(res: Results, geometry: KvGeometry, cache_blocks: int, machine: str, mode: str,
                  transfers: int) -> Table:
    table = Table(f"Memory ({mode}; MiB)", machine=machine)
    table.add("peak RSS decoder", "whole run, baselines included", res.peak["decoder"] / MIB, "MiB")
    table.add("peak RSS decoder", f"library phases (raw TCP buffer {format_bytes(res.raw_buffer)} included)",
              res.peak["decoder, library"] / MIB, "MiB")
    table.add("peak RSS prompt", "whole run", res.peak["prompt"] / MIB, "MiB")
    for proc in ("decoder", "prompt"):
        st = res.status[proc]
        table.add(f"RSS at end {proc}", f"anon {st['RssAnon'] / MIB:.0f}, shmem {st['RssShmem'] / MIB:.0f}, "
                  f"file {st['RssFile'] / MIB:.0f}", st["VmRSS"] / MIB, "MiB")
    table.add("control: one temporary buffer of a request", "decoder", res.control_growth / MIB, "MiB",
              baseline="request", baseline_value=res.rss[0][4] / MIB)
    for what, proc, peak, kept, req in res.rss:
        case = f"{proc}, {transfers} x {format_bytes(req)}, kept {kept / MIB:+.1f} MiB"
        table.add(f"RSS growth, {what}", case, peak / MIB, "MiB", baseline="request", baseline_value=req / MIB,
                  target=RSS_FLAT)
    cache = geometry.request_bytes(cache_blocks)
    table.note(f"each process holds two blocks caches of {format_bytes(cache)} (one per transport), populated at "
               "allocation (memfd, MAP_POPULATE); a same-host peer's cache pages mapped here count in both "
               "processes' RSS (shmem)")
    table.note("RSS growth: after two warmup transfers the kernel's RSS high-water mark is reset "
               "(/proc/PID/clear_refs), then value = high-water mark over the timed transfers minus the RSS before "
               "them, kept = RSS after minus before; the control row shows the method sees one temporary "
               "request-sized buffer")
    table.note("peak RSS is the highest VmHWM over the run, resets included; \"library phases\" leaves out the "
               "memcpy baseline's two buffers and the control buffer, but the decoder also holds the raw TCP "
               "baseline's receive buffer (anon) throughout; the raw TCP server and gloo processes are not counted")
    return table


def _emit_all(tables: list[Table], fmt: str) -> None:
    if fmt == "json":
        print(json.dumps([t.to_dict() for t in tables], indent=2), flush=True)
        return
    for i, t in enumerate(tables):
        if fmt == "markdown":
            print(t.render_markdown(heading_level=3), flush=True)
        else:
            if i:
                print()
            t.print()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    t_start = time.perf_counter()
    load = OtherCpuLoad(live_children=True)
    geometry = KvGeometry()
    plan = Plan.for_mode(args.quick, args.full)
    progress = Progress(args.verbose)
    gloo = not args.no_gloo
    mode = mode_label(args) + (", uvloop" if args.uvloop else "")
    machine = machine_info()
    wanted = sorted(set(block_counts(args)) | {1})
    head = Table(f"aio_datadist performance suite ({mode})", machine=machine)
    counts = [c for c in wanted if fits_in_memory(head, "the suite", c, _footprint(geometry, plan, c, gloo))]
    if not counts:
        _emit_all([head], args.format)
        return 1
    reference, no_reference = None, ""
    if args.reference == "auto":
        reference, unreadable = small_requests.find_reference(machine)
        for note in unreadable:
            head.note(f"saved reference runs: {note}")
        if reference is None:
            no_reference = (f"no saved reference run of this kind of machine in {small_requests.REFERENCES}; make "
                            "one with the code before (a worktree of it): python -m benchmarks.suite --sizes 64 "
                            "--no-gloo --no-load --format json > benchmarks/results/suite-<commit>-reference.json")
    elif args.reference == "none":
        no_reference = "--reference none"
    else:
        path = Path(args.reference)
        if path.exists():
            reference = small_requests.load_reference(path)
        else:
            no_reference = f"no reference file {path}"
    cache_blocks = plan.cache_blocks(max(counts))
    with contextlib.ExitStack() as stack:
        # created here, on the main thread: the child's death signal follows the thread that started it
        spinner = None if args.no_load else stack.enter_context(Spinner(args.load_cpu))
        res = run_coroutine(lambda: _measure(geometry, counts, plan, gloo, progress, spinner, args.uvloop),
                            use_uvloop=args.uvloop)
        spun = None if spinner is None else {"what": spinner.describe(),
                                             "cores": res.spinner_cpu / max(res.spinner_wall, 1e-9)}
    throughput = _throughput_table(res, counts, geometry, machine, mode, gloo)
    small = small_requests.build(res.has, res.m, throughput, reference, CONCURRENT, spun, machine, mode,
                                 no_reference)
    tables = [
        small,
        throughput,
        _latency_table(res, geometry, machine, mode),
        _concurrency_table(res, geometry, machine, mode),
        _memory_table(res, geometry, cache_blocks, machine, mode, plan.rss_transfers),
    ]
    summary = tables[-1]
    for n in head.notes:
        summary.note(n)
    loads = res.round_loads
    summary.note(f"other-process load per round: median {statistics.median(loads):.2f}, min {min(loads):.2f}, "
                 f"max {max(loads):.2f} cores; {load.describe()}")
    summary.note(f"{plan.rounds} rounds; cases rotate their order each round; cache {cache_blocks} blocks x "
                 f"{geometry.num_tensors} tensors x {format_bytes(geometry.block_bytes)}; library defaults "
                 f"otherwise ({res.settings.get('data channels')} data channels, "
                 f"{res.settings.get('copy threads')} copy threads, {'uvloop' if args.uvloop else 'asyncio'} loop)")
    summary.note("run time " + ", ".join(f"{k} {v:.0f} s" for k, v in res.sections.items())
                 + f"; total {time.perf_counter() - t_start:.0f} s")
    _emit_all(tables, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
