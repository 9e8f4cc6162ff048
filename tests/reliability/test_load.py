"""Load: 32 decoder endpoints in 4 processes pull from one prompt at once, every byte checked.

The prompt runs in its own forked process so its resident memory can be
watched on its own: after the links are up it must stay flat (bounded by a
fixed allowance, not growing with the number of pulls). Throughput is
reported in the run's summary; it is not asserted (tests never assert
wall-clock rates).
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from aio_datadist import BlocksCacheKey, CacheDesc, CacheKeyByIdAndIndex, DataType, LLMRole, Placement
from peers import CacheSpec, EndpointSpec, cluster_info, port_of

from _forked import forked
from _harness import endpoint, rss_bytes
from _budget import scaled
from _tally import at_least, note

PROMPT = 1
HOSTS, PER_HOST = 4, 8
LOAD_S = 2.0 * scaled(1)
LIFETIME_S = LOAD_S + 60.0  # of the peers, and the wait for their answers: past the load, at any scale
BIG = CacheDesc(8, (64, 8192), DataType.DT_FLOAT16, Placement.HOST)  # 64 blocks of 128 KiB (all tensors), 8 MiB
RSS_ALLOWANCE = 48 << 20  # growth of the prompt's RSS once every link is up


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_32_decoders_pull_from_one_prompt_with_bounded_memory(fork_server, transport):
    config = (("transport", transport), ("sync_kv_timeout", 10_000))
    prompt_spec = EndpointSpec(LLMRole.PROMPT, PROMPT, caches=(CacheSpec("big", BIG, 11, blocks=True, model_id=0),),
                               config=config, loop="asyncio", lifetime=LIFETIME_S)
    host_specs = [EndpointSpec(LLMRole.DECODER, 100 + h, listen=False, config=config, lifetime=LIFETIME_S,
                               loop=("asyncio", "uvloop")[h % 2]) for h in range(HOSTS)]
    async with forked(prompt_spec, *host_specs) as (prompt, *hosts):
        rss_idle = rss_bytes(prompt.pid)
        for h, host in enumerate(hosts):
            ids = [1000 + h * PER_HOST + i for i in range(PER_HOST)]
            host.send("swarm", ids, PROMPT, prompt.port, BIG, 11, LOAD_S, dict(config))
        samples = []  # (seconds since start, prompt RSS) once every link is up
        links_up = 0
        started = time.monotonic()
        answers = asyncio.gather(*(host.answer(timeout=LIFETIME_S) for host in hosts))
        while not answers.done():
            if links_up < HOSTS * PER_HOST:
                links_up = sum(state == "up" for state in (await prompt.call("links")).values())
            else:
                samples.append((time.monotonic() - started, rss_bytes(prompt.pid)))
            await asyncio.wait([answers], timeout=0.05)
        stats = answers.result()
        elapsed = time.monotonic() - started
        assert links_up == HOSTS * PER_HOST, f"only {links_up} links were up at once"
        for h, s in enumerate(stats):
            assert not s["errors"], f"host {h}: {s['errors'][:3]}"
            assert s["wrong"] == 0, f"host {h}: {s['wrong']} pulls brought wrong bytes"
            assert s["pulls"] >= PER_HOST, s
        # memory: flat while the 32 links pull (no growth with the number of pulls)
        assert len(samples) >= 5, samples
        warm = [rss for _, rss in samples]
        growth = max(warm) - warm[0]
        assert growth < RSS_ALLOWANCE, f"prompt RSS grew {growth >> 20} MiB under load"
        pulls = sum(s["pulls"] for s in stats)
        moved = sum(s["bytes"] for s in stats)
        at_least("concurrent peers", HOSTS * PER_HOST)
        note(f"load ({transport})",
             f"{HOSTS * PER_HOST} decoders in {HOSTS} processes, {pulls} pulls, {moved / 2**20:.0f} MiB verified, "
             f"{moved / LOAD_S / 1e9:.2f} GB/s over {LOAD_S:.0f} s ({elapsed:.1f} s with set-up); prompt RSS "
             f"{rss_idle >> 20} MiB idle, {(max(warm) - rss_idle) / 2**20:+.0f} MiB with {HOSTS * PER_HOST} links, "
             f"{growth >> 20} MiB growth under load")


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("transport", ["tcp", "auto"])  # auto: the same-host plane, which serves in place
async def test_what_an_owner_keeps_does_not_grow_with_its_pulls(transport):
    """The RSS check above sees growth of 48 MiB over a few hundred pulls (some 100 KB a pull): a leak of what the
    owner plans per pull (kilobytes) passes it. Counted in Python objects (both ends live in this process), nothing
    is kept per pull."""
    desc = CacheDesc(2, (8, 64), DataType.DT_FLOAT16, Placement.HOST)
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport) as prompt, \
            endpoint(LLMRole.DECODER, 2, transport=transport) as dec:
        prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT, 0))
        rows = prompt.kv_cache_manager.allocate_cache(desc)
        dst, dst_rows = dec.kv_cache_manager.allocate_blocks_cache(desc), dec.kv_cache_manager.allocate_cache(desc)
        assert (await dec.link_clusters([cluster_info(PROMPT, port_of(prompt))]))[0] == 0

        async def pulls(n: int) -> int:
            for i in range(n):
                await dec.kv_cache_manager.pull_blocks(BlocksCacheKey(PROMPT, 0), dst, [i % 8], [i % 8])
                # same host, a blocks key is read without asking (transport/ledger.py); this one the owner serves
                await dec.kv_cache_manager.pull_cache(CacheKeyByIdAndIndex(PROMPT, rows.cache_id, i % 8), dst_rows,
                                                      i % 8)
            gc.collect()
            return len(gc.get_objects())

        await pulls(100)  # warm: caches of the first pulls
        before = await pulls(100)
        after = await pulls(400)
        assert after - before < 200, f"{after - before} more objects after 400 more pulls"
