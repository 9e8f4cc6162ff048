"""Where registered memory lies (``spans.SpanIndex``), against a list scanned in full, and the registry's use of it
at scale: a registration, and a call naming a cache the registry does not hold, check one span, not every one.

Before, each check sorted every registered tensor again: with 4000 caches of 128 tensors a ``register_cache`` or a
pull into a ``create_cpu_cache`` cache held the event loop 140-480 ms, and each address of a peer's raw-address
push scanned every tensor (40 such pushes held the owner's loop 257 ms with 2500 caches of 64; found by a hunt).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from test_cache_manager import S, rejected, v2_endpoint

from aio_datadist import CacheDesc, DataType, LLMRole, Placement
from aio_datadist.spans import SpanIndex
from aio_datadist.testing import registry_of


def test_the_index_answers_as_a_full_scan_does():
    rng = random.Random(7)
    index, model = SpanIndex(), {}  # model: cache id -> [(start, end)]
    cursor, next_id = 4096, 1
    for step in range(3000):
        if model and rng.random() < 0.4:
            gone = rng.choice(sorted(model))
            index.remove(gone)
            del model[gone]
        else:
            count, size = rng.randint(1, 6), rng.choice([8, 64, 4096])
            bases = []
            for _ in range(count):
                cursor += rng.choice([0, 16, 4096])  # adjacent spans too
                bases.append(cursor)
                cursor += size
            rng.shuffle(bases)  # a cache's tensors in any order
            index.add(next_id, bases, size)
            model[next_id] = [(b, b + size) for b in bases]
            next_id += 1
        for _ in range(5):
            begin, nbytes = rng.randint(4000, cursor + 100), rng.choice([1, 8, 100, 5000])
            over = {cid for cid, spans in model.items() for s, e in spans if s < begin + nbytes and begin < e}
            got = index.overlapping(begin, nbytes)
            assert (got is None) == (not over) and (got is None or got in over), (step, begin, nbytes, got, over)
            held = [(cid, t) for cid, spans in model.items() for t, (s, e) in enumerate(spans)
                    if s <= begin and begin + nbytes <= e]
            assert index.holding(begin, begin + nbytes) in (held or [None]), (step, begin, nbytes)
    assert len(index) == sum(map(len, model.values()))
    index.clear()
    assert len(index) == 0 and index.overlapping(0, 1 << 62) is None


MANY = CacheDesc(64, (1, 64), DataType.DT_UINT8, Placement.HOST)  # 64 tensors of 64 bytes


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # the registry's work, not the loop's
async def test_checks_against_registered_memory_do_not_grow_with_it():
    """1500 caches of 64 tensors registered; then 40 registrations, overlap refusals and raw-address lookups take
    well under what one check of every tensor took before (each sorted 96,000 spans: 20-60 ms)."""
    memory = torch.zeros(1600 * 64 * 128, dtype=torch.uint8)  # each tensor 64 bytes, 64 apart: gaps between
    base = memory.data_ptr()
    addrs = [[base + (c * 64 + t) * 128 for t in range(64)] for c in range(1600)]
    async with v2_endpoint(LLMRole.PROMPT, 1) as dd:
        cm = dd.cache_manager
        registry = registry_of(dd)
        caches = [cm.register_cache(MANY, addrs[c], remote_accessible=True) for c in range(1500)]
        started = time.monotonic()
        for c in range(1500, 1540):
            cm.register_cache(MANY, addrs[c])
            with rejected(S.LLM_PARAM_INVALID, "addrs"):
                cm.register_cache(MANY, [a + 32 for a in addrs[c - 1000]])  # overlaps a cache registered earlier
            found = registry.holding(addrs[c - 700][5] + 8, addrs[c - 700][5] + 40)
            assert found == (caches[c - 700], 5)
            assert registry.holding(addrs[c - 700][5] + 60, addrs[c - 700][5] + 70) is None  # past its end
        took = time.monotonic() - started
        assert took < 1.0, f"40 rounds took {took:.2f} s"
        cm.unregister_cache(caches[3].cache_id)
        assert registry.holding(addrs[3][0], addrs[3][0] + 8) is None
        cm.register_cache(MANY, addrs[3])  # its memory is free again
