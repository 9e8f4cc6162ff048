"""kill -9 of the prompt, the decoder, or both, at random points of pulls, pushes and layer-wise tasks.

Each trial links the surviving endpoint (in this process) to forked peers,
starts transfers both ways (pulls, pushes, ``transfer_cache_async``, push
watches, keyed hand-offs), SIGKILLs the victim(s) after a seeded random
delay, and then checks that

- every call that was waiting ended within its timeout + 1 s with
  ``LLM_LINK_FAILED`` or ``LLM_TIMEOUT`` (and none failed before the kill);
- the survivor holds nothing for the dead link: no pending token, no native
  job, no claimed key, no fd, no registered byte beyond its own caches;
- it relinks to a restarted peer (same cluster id, forked while the trial
  ran) and moves verified bytes both ways again.

The restarted peer is the next trial's victim, so a trial costs one fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hashlib
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheIndex,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from aio_datadist.links import Link
from aio_datadist.testing import usable_link
from aio_datadist.wire import Msg
from peers import CacheSpec, EndpointSpec, Ref, cluster_info, fill, pattern, port_of

from _forked import ForkedEndpoint
from _harness import ENDED, baseline_of, endpoint, open_fds, settle, state
from _rawpeer import RawLink, recv_exactly
from _budget import SEED, scaled
from _tally import count

pytestmark = pytest.mark.usefixtures("fork_server")

S = LLMStatusCode
PROMPT, DECODER, MIX = 1, 2, 3
TIMEOUT_MS = 1000
WATCH_TIMEOUT_MS = 300
BOUND_S = 1.0  # what the issue allows past a call's timeout
BIG = CacheDesc(8, (32, 8192), DataType.DT_FLOAT16, Placement.HOST)  # 32 blocks of 16 KiB, 4 MiB
ROWS = CacheDesc(8, (4, 2048), DataType.DT_FLOAT16, Placement.HOST)  # 4 rows of 4 KiB
BLOCKS = list(range(32))
TRIALS_PER_RUN = {k: scaled(n) for k, n in {"prompt": 9, "decoder": 9, "both": 8}.items()}  # x2 loops: 52
#: Each transport a trial may use: TCP data channels, or what ``auto`` picks on one host.
TRANSPORTS = ("tcp", "auto")


def peer_spec(role: LLMRole, cluster_id: int, seed: int, transport: str, *, listen: bool = True) -> EndpointSpec:
    caches = (CacheSpec("big", BIG, seed=cluster_id, blocks=True, model_id=0),
              CacheSpec("rows", ROWS, seed=cluster_id + 10))
    return EndpointSpec(role, cluster_id, listen=listen, caches=caches, loop=("asyncio", "uvloop")[seed % 2],
                        config=(("transport", transport), ("sync_kv_timeout", TIMEOUT_MS)), lifetime=120.0)


def loop_name() -> str:
    return "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"


# -- calls that keep going until the fault ------------------------------------------


@dataclasses.dataclass
class Call:
    what: str
    started: float
    ended: float
    code: LLMStatusCode | None
    timeout_s: float


class Hammers:
    """Coroutines called again and again until one fails; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.tasks: list[asyncio.Task] = []

    def start(self, what: str, make: Callable[[], Awaitable[Any]], timeout_ms: int = TIMEOUT_MS) -> None:
        self.tasks.append(asyncio.ensure_future(self._run(what, make, timeout_ms / 1000)))

    async def _run(self, what: str, make: Callable[[], Awaitable[Any]], timeout_s: float) -> None:
        while True:
            started = time.monotonic()
            try:
                await make()
            except LLMException as exc:
                self.calls.append(Call(what, started, time.monotonic(), exc.status_code, timeout_s))
                return
            self.calls.append(Call(what, started, time.monotonic(), None, timeout_s))
            await asyncio.sleep(0)

    async def ended_after(self, killed: float, context: str) -> None:
        """Every hammer stops within its timeout + 1 s; each call's outcome is as the issue says."""
        try:
            async with asyncio.timeout(TIMEOUT_MS / 1000 + BOUND_S + 0.5):
                await asyncio.gather(*self.tasks)
        except TimeoutError:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            raise AssertionError(f"{context}: calls still waiting {TIMEOUT_MS / 1000 + BOUND_S + 0.5} s after the kill")
        for call in self.calls:
            if call.code is None:
                continue
            assert call.ended >= killed, f"{context}: {call.what} failed before the kill with {call.code!r}"
            assert call.code in ENDED, f"{context}: {call.what} ended with {call.code!r}"
            assert call.ended - call.started <= call.timeout_s + BOUND_S, (
                f"{context}: {call.what} took {call.ended - call.started:.2f} s")
        count("calls ended by a fault", sum(c.code is not None for c in self.calls))


class Jitter(LayerSynchronizer):
    """Every layer is ready after a random pause of up to 2 ms."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(self.rng.random() * 0.002)
        return True


def some_blocks(rng: random.Random) -> tuple[list[int], list[int]]:
    n = rng.choice((1, 4, 16, 32))
    return rng.sample(BLOCKS, n), rng.sample(BLOCKS, n)


async def layerwise(kv: Any, src: KvCache, dst_cluster: int, rng: random.Random) -> None:
    srcs, dsts = some_blocks(rng)
    task = kv.transfer_cache_async(src, Jitter(rng), [TransferWithCacheKeyConfig(BlocksCacheKey(dst_cluster, 0))],
                                   srcs, dsts)
    try:
        await task
    finally:
        for layer in range(BIG.num_tensors // 2):  # every layer future is resolved once the task ended
            assert task.done() and task.layer(layer).done()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def expected_of(cluster_id: int) -> list[torch.Tensor]:
    return pattern(BIG, cluster_id)


async def kill_after(rng: random.Random, *victims: ForkedEndpoint) -> float:
    """SIGKILL each victim after its own random delay (0 to 200 ms); the time of the first kill."""
    delays = sorted((rng.uniform(0.0, 0.2), victim) for victim in victims)
    start = time.monotonic()
    killed = []
    for delay, victim in delays:
        await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
        victim.kill()
        killed.append(time.monotonic())
    return killed[0]


async def check_survivor(dd: Any, baseline: dict[str, int], fds: set[str], dead: list[int], context: str) -> None:
    await settle(dd, baseline, fds, within=BOUND_S + 1.0)
    for cluster_id in dead:
        with pytest.raises(LLMException) as info:
            await dd.check_link_status(cluster_id)
        assert info.value.status_code == S.LLM_LINK_FAILED, f"{context}: {info.value}"


@contextlib.asynccontextmanager
async def chain(spec_of: Callable[[int], EndpointSpec]) -> Any:
    """Hands out forked peers; each next one is started while the current trial runs."""
    procs: list[ForkedEndpoint] = []

    def start(seed: int) -> ForkedEndpoint:
        proc = ForkedEndpoint(spec_of(seed)).start()
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        await asyncio.gather(*(p.close(grace=1.0) for p in procs), return_exceptions=True)
        for proc in procs:
            proc.reap()


# -- the victim is the prompt -----------------------------------------------------------


@pytest.mark.asyncio
async def test_kill_the_prompt_during_pulls_pushes_and_layerwise():
    first = {"asyncio": 0, "uvloop": 100_000}[loop_name()] + 1_000_000 * SEED
    async with endpoint(LLMRole.DECODER, DECODER, sync_kv_timeout=TIMEOUT_MS) as dd, \
            chain(lambda seed: peer_spec(LLMRole.PROMPT, PROMPT, seed, TRANSPORTS[seed % 2])) as start:
        kv = dd.kv_cache_manager
        dst = kv.allocate_blocks_cache(BIG, BlocksCacheKey(DECODER, 0))
        pushed = kv.allocate_blocks_cache(BIG)
        rows = kv.allocate_cache(ROWS)
        expected = expected_of(PROMPT)
        baseline, fds = baseline_of(dd)
        victim = await start(first).ready()
        assert (await dd.link_clusters([victim.info]))[0] == S.LLM_SUCCESS
        for seed in range(first, first + TRIALS_PER_RUN["prompt"]):
            rng = random.Random(seed)
            context = f"prompt trial seed={seed} ({victim.spec.loop}, {victim.spec.config[0][1]})"
            replacement = start(seed + 1)
            srcs, dsts = some_blocks(rng)
            victim.send("background", "push_blocks", (CacheIndex(DECODER, pushed.cache_id), Ref("big"), srcs, dsts),
                        {}, 10.0)
            victim.send("layerwise", DECODER, Ref("big"), *some_blocks(rng), 10.0)
            hammers = Hammers()
            hammers.start("pull_blocks", lambda: kv.pull_blocks(BlocksCacheKey(PROMPT), dst, *some_blocks(rng)))
            hammers.start("pull_blocks all", lambda: kv.pull_blocks(BlocksCacheKey(PROMPT), dst, BLOCKS, BLOCKS))
            hammers.start("pull_cache", lambda: kv.pull_cache(
                CacheKeyByIdAndIndex(PROMPT, victim.cache_ids["rows"], rng.randrange(4)), rows, rng.randrange(4)))
            hammers.start("push watch", lambda: kv.watch_pushes(pushed, dsts).wait(timeout=WATCH_TIMEOUT_MS),
                          WATCH_TIMEOUT_MS)
            killed = await kill_after(rng, victim)
            await hammers.ended_after(killed, context)
            await check_survivor(dd, baseline, fds, [PROMPT], context)
            victim.reap()

            victim = await replacement.ready()
            assert (await dd.link_clusters([victim.info]))[0] == S.LLM_SUCCESS, context
            for t in dst.tensors + pushed.tensors:
                t.zero_()
            await kv.pull_blocks(BlocksCacheKey(PROMPT), dst, BLOCKS, BLOCKS)
            await victim.call("kv", "push_blocks", CacheIndex(DECODER, pushed.cache_id), Ref("big"), [3, 5], [0, 1])
            assert all(same_bytes(d, v) for d, v in zip(dst.tensors, expected)), context
            assert all(same_bytes(p[0:2], v[[3, 5]]) for p, v in zip(pushed.tensors, expected)), context
            count("fault trials")


# -- the victim is the decoder --------------------------------------------------------------


@pytest.mark.asyncio
async def test_kill_the_decoder_during_pulls_pushes_and_layerwise():
    first = {"asyncio": 0, "uvloop": 100_000}[loop_name()] + 1_000_000 * SEED
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, sync_kv_timeout=TIMEOUT_MS) as dd, \
            chain(lambda seed: peer_spec(LLMRole.DECODER, DECODER, seed, TRANSPORTS[seed % 2],
                                         listen=False)) as start:
        kv = dd.kv_cache_manager
        src = kv.allocate_blocks_cache(BIG, BlocksCacheKey(PROMPT, 0))
        src_rows = kv.allocate_cache(ROWS)
        fill(src, 7)
        fill(src_rows, 8)
        baseline, fds = baseline_of(dd)
        victim = await start(first).ready()
        link = ("link", PROMPT, port_of(dd)[1])
        assert (await victim.call(*link))[0] == S.LLM_SUCCESS
        for seed in range(first, first + TRIALS_PER_RUN["decoder"]):
            rng = random.Random(seed)
            context = f"decoder trial seed={seed} ({victim.spec.loop}, {victim.spec.config[0][1]})"
            replacement = start(seed + 1)
            # a hand-off: keyed rows the decoder pulls, the prompt's own reference dropped at once
            before, before_inodes = open_fds(), memfd_inodes()
            keys = hand_off(kv, seed)
            handoff_fds, handoff_inodes = open_fds() - before, memfd_inodes() - before_inodes
            assert handoff_inodes, context
            for row, key in enumerate(keys):
                victim.send("background", "pull_cache", (key, Ref("rows"), row), {}, 10.0)
            victim.send("background", "pull_blocks", (BlocksCacheKey(PROMPT), Ref("big"), BLOCKS, BLOCKS), {}, 10.0)
            hammers = Hammers()
            hammers.start("push_blocks", lambda: kv.push_blocks(BlocksCacheKey(DECODER), src, *some_blocks(rng)))
            hammers.start("push_cache", lambda: kv.push_cache(
                CacheIndex(DECODER, victim.cache_ids["rows"], rng.randrange(4)), src_rows, rng.randrange(4)))
            hammers.start("transfer_cache_async", lambda: layerwise(kv, src, DECODER, rng))
            killed = await kill_after(rng, victim)
            await hammers.ended_after(killed, context)
            # the hand-off cache stays while a key the dead decoder did not finish is bound
            held = baseline | {"registered bytes": baseline["registered bytes"] + ROWS.size * ROWS.num_tensors,
                               "caches": baseline["caches"] + 1}
            keys_left = state(dd)["caches"] == held["caches"]
            await settle(dd, held if keys_left else baseline, fds | handoff_fds if keys_left else fds,
                         within=BOUND_S + 1.0)
            victim.reap()

            victim = await replacement.ready()
            assert (await victim.call(*link))[0] == S.LLM_SUCCESS, context
            pulled = 0
            for row, key in enumerate(keys):  # no key is stuck claimed by the dead decoder's pull
                try:
                    await victim.call("kv", "pull_cache", key, Ref("rows"), row)
                    pulled += 1
                except LLMException as exc:
                    assert exc.status_code == S.LLM_KV_CACHE_NOT_EXIST, context
            assert keys_left == (pulled > 0), context
            await settle(dd, baseline, within=BOUND_S)  # the hand-off cache went with its last key
            await released(handoff_inodes, context)
            await victim.call("kv", "pull_blocks", BlocksCacheKey(PROMPT), Ref("big"), BLOCKS, BLOCKS)
            assert await victim.call("digest", "big") == digests(src.tensors), context
            await kv.push_cache(CacheIndex(DECODER, victim.cache_ids["rows"], 2), src_rows, 1)
            await layerwise(kv, src, DECODER, rng)
            got = await victim.call("dump", "rows")
            assert all(raw[2 * 4096:3 * 4096] == t[1].numpy().tobytes() for raw, t in zip(got, src_rows.tensors))
            count("fault trials")


def memfd_inodes() -> set[int]:
    """Inodes of the memfds this process has open (fd numbers get reused; inodes do not)."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "memfd:" in os.readlink(f"/proc/self/fd/{name}"):
                inodes.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            pass
    return inodes


async def released(inodes: set[int], context: str) -> None:
    """Wait (bounded) until no fd refers to these memfds any more."""
    deadline = time.monotonic() + BOUND_S
    while memfd_inodes() & inodes:
        if time.monotonic() > deadline:
            gc.collect()
            assert not memfd_inodes() & inodes, f"{context}: a released cache's memory is still open"
        await asyncio.sleep(0.01)


def hand_off(kv: Any, seed: int) -> list[CacheKey]:
    """Keyed rows for a decoder; the cache object is not kept (its tensors would keep the memory)."""
    keys = [CacheKey(PROMPT, 1000 * seed + r) for r in range(4)]
    cache = kv.allocate_cache(ROWS, keys)
    fill(cache, seed)
    kv.deallocate_cache(cache)
    return keys


def digests(tensors: list[torch.Tensor]) -> list[str]:
    """One SHA-256 per tensor, as the forked peers' ``digest`` command gives them."""
    return [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in tensors]


# -- both die -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_kill_prompt_and_decoder_while_a_third_endpoint_uses_both():
    first = {"asyncio": 0, "uvloop": 100_000}[loop_name()] + 1_000_000 * SEED
    async with endpoint(LLMRole.MIX, MIX, listen=True, sync_kv_timeout=TIMEOUT_MS) as dd, \
            chain(lambda seed: peer_spec(LLMRole.PROMPT, PROMPT, seed, TRANSPORTS[seed % 2])) as start_p, \
            chain(lambda seed: peer_spec(LLMRole.DECODER, DECODER, seed + 1, TRANSPORTS[(seed + 1) % 2])) as start_d:
        kv = dd.kv_cache_manager
        src = kv.allocate_blocks_cache(BIG)
        dst = kv.allocate_blocks_cache(BIG, BlocksCacheKey(MIX, 0))
        fill(src, 9)
        expected = expected_of(PROMPT)
        baseline, fds = baseline_of(dd)
        prompt, decoder = await start_p(first).ready(), await start_d(first).ready()

        async def link_all() -> None:
            status, _ = await dd.link_clusters([prompt.info, decoder.info])
            assert status == S.LLM_SUCCESS
            assert (await decoder.call("link", PROMPT, prompt.port))[0] == S.LLM_SUCCESS

        await link_all()
        for seed in range(first, first + TRIALS_PER_RUN["both"]):
            rng = random.Random(seed)
            context = f"both trial seed={seed}"
            next_p, next_d = start_p(seed + 1), start_d(seed + 1)
            decoder.send("background", "pull_blocks", (BlocksCacheKey(PROMPT), Ref("big"), BLOCKS, BLOCKS), {}, 10.0)
            prompt.send("background", "push_blocks", (BlocksCacheKey(MIX), Ref("big"), *some_blocks(rng)), {}, 10.0)
            hammers = Hammers()
            hammers.start("pull_blocks", lambda: kv.pull_blocks(BlocksCacheKey(PROMPT), dst, *some_blocks(rng)))
            hammers.start("push_blocks", lambda: kv.push_blocks(BlocksCacheKey(DECODER), src, *some_blocks(rng)))
            hammers.start("transfer_cache_async", lambda: layerwise(kv, src, DECODER, rng))
            killed = await kill_after(rng, prompt, decoder)
            await hammers.ended_after(killed, context)
            await check_survivor(dd, baseline, fds, [PROMPT, DECODER], context)
            prompt.reap()
            decoder.reap()

            prompt, decoder = await next_p.ready(), await next_d.ready()
            await link_all()
            for t in dst.tensors:
                t.zero_()
            await kv.pull_blocks(BlocksCacheKey(PROMPT), dst, BLOCKS, BLOCKS)
            assert all(same_bytes(d, v) for d, v in zip(dst.tensors, expected)), context
            await kv.push_blocks(BlocksCacheKey(DECODER), src, BLOCKS, BLOCKS)
            assert await decoder.call("digest", "big") == digests(src.tensors), context
            await decoder.call("kv", "pull_blocks", BlocksCacheKey(PROMPT), Ref("big"), BLOCKS, BLOCKS)
            assert await decoder.call("digest", "big") == digests(expected), context
            count("fault trials")


@pytest.mark.asyncio
async def test_a_decoder_that_dies_between_its_bytes_and_its_done_consumes_no_key():
    """Row 4 in the window a random kill of a small pull seldom hits: the owner sent every byte and holds the
    key's claim until the decoder's DONE, and the decoder dies (its sockets close) before sending it. The key
    is released, not consumed: a restarted decoder pulls it, and the hand-off cache goes with its last key."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp") as dd, \
            endpoint(LLMRole.DECODER, DECODER, transport="tcp") as dec:
        kv = dd.kv_cache_manager
        baseline, _ = baseline_of(dd)
        before = memfd_inodes()
        keys = [CacheKey(PROMPT, 500 + r) for r in range(4)]
        cache = kv.allocate_cache(ROWS, keys)
        values = fill(cache, 4)
        kv.deallocate_cache(cache)
        del cache
        inodes = memfd_inodes() - before

        def pull_and_die() -> None:
            with RawLink(port_of(dd), DECODER + 10, PROMPT, None).connect() as raw:
                _, total = raw.offer(Msg.PULL_REQ, dict(
                    channel=0, target_kind=1, cluster_id=PROMPT, cache_id=0, key_req_id=keys[0].req_id,
                    prefix_id=2**64 - 1, model_id=0, batch_index=0, layer_first=-1, layer_last=-1,
                    tensor_num_per_layer=2, tensor_count=ROWS.num_tensors, data_type=ROWS.data_type.value,
                    offset=0, nbytes=ROWS.size // ROWS.shape[0], flags=2 | 4, timeout_ms=TIMEOUT_MS, rows=()))
                recv_exactly(raw.data[0], total)
            # every byte read, the sockets closed without DONE: as a SIGKILL then would close them

        await asyncio.to_thread(pull_and_die)
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        for row, key in enumerate(keys):  # keys[0] first: the dead decoder's pull did not consume it
            await dec.kv_cache_manager.pull_cache(key, dst, row)
        assert all(same_bytes(d, v) for d, v in zip(dst.tensors, values))
        await settle(dd, baseline, within=BOUND_S)  # the hand-off cache went with its last key
        await released(inodes, "the hand-off cache")


@pytest.mark.asyncio
async def test_a_same_host_decoder_that_dies_between_its_copy_and_its_done_consumes_no_key(monkeypatch):
    """As above over the same-host plane, whose requester copies the rows out of the shared memory itself: the
    owner's in-place plane holds the key's claim until DONE, and a link that ends first must release it, not
    consume it. The TCP test above never reaches that plane, and the trials' random kills seldom hit the
    window: an in-place plane that consumed the key of a cut pull passed both (audit)."""
    dead_id = DECODER + 10
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local") as dd, \
            endpoint(LLMRole.DECODER, dead_id, transport="local") as dead, \
            endpoint(LLMRole.DECODER, DECODER, transport="local") as dec:
        kv = dd.kv_cache_manager
        for peer in (dead, dec):
            assert (await peer.link_clusters([cluster_info(PROMPT, port_of(dd))]))[0] == S.LLM_SUCCESS
        baseline, _ = baseline_of(dd)
        keys = [CacheKey(PROMPT, 600 + r) for r in range(4)]
        cache = kv.allocate_cache(ROWS, keys)
        values = fill(cache, 6)
        kv.deallocate_cache(cache)
        del cache
        link = usable_link(dead, PROMPT)

        def quiet(real: Any) -> Any:  # the successful DONE never leaves: it dies first
            def send(msg: Msg, req_id: int, **fields: Any) -> None:
                if not (msg is Msg.DONE and fields.get("status") == S.LLM_SUCCESS):
                    real(link, msg, req_id, **fields)
            return send

        monkeypatch.setattr(link, "send", quiet(Link.send))
        monkeypatch.setattr(link, "send_soon", quiet(Link.send_soon))
        got = dead.kv_cache_manager.allocate_cache(ROWS)
        await dead.kv_cache_manager.pull_cache(keys[0], got, 0)
        assert same_bytes(got.tensors[0][0], values[0][0])
        assert state(dd)["claimed keys"] == 1  # copied in place; the owner waits for the DONE
        link.writer.transport.abort()  # its control connection goes as a SIGKILL would close it
        async with asyncio.timeout(BOUND_S):
            while state(dd)["claimed keys"]:
                await asyncio.sleep(0.005)
        dst = dec.kv_cache_manager.allocate_cache(ROWS)
        for row, key in enumerate(keys):  # keys[0] first: the dead decoder's pull did not consume it
            await dec.kv_cache_manager.pull_cache(key, dst, row)
        assert all(same_bytes(d, v) for d, v in zip(dst.tensors, values))
        await settle(dd, baseline, within=BOUND_S)  # the hand-off cache went with its last key
