"""Cache allocation, registration, ids, keys and the reference rules (reference section 4.2)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.devices import host
from aio_datadist.devices.host import PAGE_SIZE, round_up
from aio_datadist.testing import engine_state, registry_of

S = LLMStatusCode
BLOCKS = CacheDesc(4, (16, 2, 8, 16), DataType.DT_FLOAT16, Placement.HOST)   # 16 blocks of 512 B
CONTIG = CacheDesc(2, (3, 64, 8), DataType.DT_FLOAT, Placement.DEVICE)      # 3 batch rows of 2 KiB
U64_MAX = 2**64 - 1


def registry(dd: LLMDataDist):
    return registry_of(dd)


def cache_bytes(desc: CacheDesc) -> int:
    """What an allocated cache in host memory counts against the cap: each tensor starts on a page of its own."""
    return round_up(desc.size) * desc.num_tensors


@pytest.mark.asyncio
async def test_cache_ids_count_from_one_per_instance():
    cfg = LLMConfig()
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt, LLMDataDist(LLMRole.DECODER, 2) as decoder:
        await prompt.init(cfg.generate_options())
        await decoder.init(cfg.generate_options())
        pkv, dkv = prompt.kv_cache_manager, decoder.kv_cache_manager
        a = pkv.allocate_cache(CONTIG)
        b = pkv.allocate_blocks_cache(BLOCKS)
        user = [torch.zeros(CONTIG.shape, dtype=torch.float32) for _ in range(CONTIG.num_tensors)]
        c = pkv.register_cache(CONTIG, user)
        assert [a.cache_id, b.cache_id, c.cache_id] == [1, 2, 3]
        assert dkv.allocate_blocks_cache(BLOCKS).cache_id == 1
        assert dkv.allocate_cache(CONTIG).cache_id == 2
        pkv.deallocate_cache(a)
        assert pkv.allocate_cache(CONTIG).cache_id == 4  # ids are never reused


@pytest.mark.asyncio
async def test_allocated_cache_geometry_and_tensors():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        assert kv.is_initialized()
        for desc, is_blocks in ((CONTIG, False), (BLOCKS, True)):
            cache = (kv.allocate_blocks_cache if is_blocks else kv.allocate_cache)(desc)
            assert isinstance(cache, KvCache)
            assert cache.cache_desc == desc
            assert cache.is_blocks_cache is is_blocks
            assert cache.alive
            addrs = cache.per_device_tensor_addrs
            assert len(addrs) == 1 and len(addrs[0]) == desc.num_tensors
            assert addrs[0] == cache.tensor_addrs == [t.data_ptr() for t in cache.tensors]
            assert all(a % PAGE_SIZE == 0 for a in addrs[0]), "cache memory must be page-aligned"
            for i in range(desc.num_tensors):
                (view,) = kv.get_cache_tensors(cache, i)
                assert view.dtype == desc.data_type.torch_dtype
                assert tuple(view.shape) == desc.shape
                assert view.data_ptr() == addrs[0][i]
                assert not view.view(torch.uint8).any(), "new caches are zeroed"
            # The views share the cache memory.
            kv.get_cache_tensors(cache, 1)[0].fill_(3)
            assert (cache.tensors[1] == 3).all()
        assert registry(dd).used_bytes == cache_bytes(CONTIG) + cache_bytes(BLOCKS)
        assert kv.get_cache_tensors(cache)[0].data_ptr() == cache.tensor_addrs[0]  # tensor_index=0


@pytest.mark.asyncio
async def test_keyed_cache_is_freed_when_deallocated_and_no_key_is_left():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        k0, k2 = CacheKey(1, req_id=10), CacheKey(1, req_id=12)
        placeholder = CacheKey(1, req_id=U64_MAX)
        cache = kv.allocate_cache(CONTIG, [k0, placeholder, k2])
        kv.deallocate_cache(cache)
        assert cache.alive, "keys still refer to the cache"
        assert registry(dd).used_bytes == cache_bytes(CONTIG)
        with pytest.raises(LLMException) as info:
            kv.get_cache_tensors(cache)  # the id reference is gone
        assert info.value.status_code is S.LLM_KV_CACHE_NOT_EXIST
        kv.remove_cache_key(k0)
        kv.remove_cache_key(k0)  # unbound: a no-op
        assert cache.alive
        kv.remove_cache_key(CacheKey(99, req_id=12))  # the cluster id is not part of the key
        assert not cache.alive
        assert registry(dd).used_bytes == 0
        assert len(registry(dd)) == 0
        # Keys are free to bind again.
        again = kv.allocate_cache(CONTIG, [k2, k0])
        assert again.alive and again.cache_id == 2


@pytest.mark.asyncio
async def test_removing_every_key_first_leaves_the_id_reference():
    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        key = CacheKey(1, req_id=U64_MAX, prefix_id=5)
        cache = kv.allocate_cache(CONTIG, [key])
        kv.remove_cache_key(key)
        assert cache.alive
        assert kv.get_cache_tensors(cache, 1)[0].shape == CONTIG.shape
        kv.deallocate_cache(cache)
        assert not cache.alive
        assert registry(dd).used_bytes == 0


@pytest.mark.asyncio
async def test_blocks_cache_is_freed_at_once_and_releases_its_key():
    async with LLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, model_id=7))
        assert registry(dd).by_blocks_key(7) is cache
        kv.deallocate_cache(cache)
        assert not cache.alive
        assert registry(dd).used_bytes == 0
        assert registry(dd).by_blocks_key(7) is None
        assert kv.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, model_id=7)).cache_id == 2


@pytest.mark.asyncio
async def test_registered_cache_is_unregistered_at_once_and_memory_stays_the_callers():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        user = [torch.randn(CONTIG.shape) for _ in range(CONTIG.num_tensors)]
        saved = [t.clone() for t in user]
        key = CacheKey(1, req_id=1)
        cache = kv.register_cache(CONTIG, user, [key])
        assert cache.tensor_addrs == [t.data_ptr() for t in user]
        (view,) = kv.get_cache_tensors(cache, 1)
        assert view.data_ptr() == user[1].data_ptr()
        assert registry(dd).used_bytes == CONTIG.size * CONTIG.num_tensors  # the caller's memory, as it is
        kv.deallocate_cache(cache)  # the key does not keep a registered cache
        assert not cache.alive
        assert registry(dd).used_bytes == 0
        assert all(torch.equal(t, s) for t, s in zip(user, saved))
        assert kv.register_cache(CONTIG, user, [key]).cache_id == 2  # key and memory free again


@pytest.mark.asyncio
async def test_register_blocks_cache_by_address():
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        user = [torch.randn(BLOCKS.shape).half() for _ in range(BLOCKS.num_tensors)]
        cache = kv.register_blocks_cache(BLOCKS, [t.data_ptr() for t in user], BlocksCacheKey(1, 0))
        assert cache.is_blocks_cache
        (view,) = kv.get_cache_tensors(cache, 3)
        assert view.data_ptr() == user[3].data_ptr()
        assert torch.equal(view, user[3])
        kv.deallocate_cache(cache)
        assert registry(dd).used_bytes == 0


@pytest.mark.asyncio
async def test_registered_memory_cap_counts_allocations_and_registrations():
    cfg = LLMConfig()
    cfg.registered_memory_cap = 3 * cache_bytes(BLOCKS)
    async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(cfg.generate_options())
        kv = dd.kv_cache_manager
        first = kv.allocate_blocks_cache(BLOCKS)
        kv.allocate_blocks_cache(BLOCKS)
        user, more = ([torch.zeros(BLOCKS.shape, dtype=torch.float16) for _ in range(BLOCKS.num_tensors)]
                      for _ in range(2))
        kv.register_blocks_cache(BLOCKS, user)
        for attempt in (lambda: kv.allocate_blocks_cache(BLOCKS), lambda: kv.register_blocks_cache(BLOCKS, more)):
            with pytest.raises(LLMException, match="registered-memory cap") as info:
                attempt()
            assert info.value.status_code is S.LLM_OUT_OF_MEMORY
        assert len(registry(dd)) == 3, "a refused cache must not be half-registered"
        assert registry(dd).used_bytes == 3 * cache_bytes(BLOCKS)
        kv.deallocate_cache(first)
        assert kv.allocate_blocks_cache(BLOCKS).cache_id == 4


@pytest.mark.asyncio
async def test_create_cpu_cache_wraps_caller_memory_for_swap_blocks():
    host_desc = CacheDesc(4, BLOCKS.shape, DataType.DT_FLOAT16, Placement.HOST)
    device_desc = CacheDesc(4, BLOCKS.shape, DataType.DT_FLOAT16, Placement.DEVICE)
    async with LLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        device = kv.allocate_blocks_cache(device_desc)
        for t in device.tensors:
            t.copy_(torch.randn(t.shape))
        host_memory = [torch.zeros(BLOCKS.shape, dtype=torch.float16) for _ in range(4)]
        addrs = [t.data_ptr() for t in host_memory]
        host = KvCache.create_cpu_cache(host_desc, addrs)
        nested = KvCache.create_cpu_cache(host_desc, [addrs])
        assert host.cache_id == nested.cache_id == -1
        assert host.is_blocks_cache
        assert host.per_device_tensor_addrs == nested.per_device_tensor_addrs == [addrs]
        assert kv.get_cache_tensors(host, 2)[0].data_ptr() == addrs[2]

        await kv.swap_blocks(device, host, {0: 5, 3: 1, 15: 0})  # swap out
        for src, dst in zip(device.tensors, host_memory):
            assert torch.equal(dst[[5, 1, 0]], src[[0, 3, 15]])
            assert not dst[[2, 3, 4] + list(range(6, 16))].any()
        await kv.swap_blocks(host, device, {5: 9, 1: 10})  # swap in
        for dst in device.tensors:
            assert torch.equal(dst[[9, 10]], dst[[0, 3]])
        assert engine_state(dd)["pending tokens"] == 0
        assert engine_state(dd)["copy jobs"] == 0


@pytest.mark.asyncio
async def test_finalize_releases_every_cache_and_refuses_further_calls():
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    kv = dd.kv_cache_manager
    assert not kv.is_initialized()
    with pytest.raises(LLMException, match="not initialized") as info:
        kv.allocate_cache(CONTIG)
    assert info.value.status_code is S.LLM_FAILED
    await dd.init(LLMConfig().generate_options())
    keyed = kv.allocate_cache(CONTIG, [CacheKey(1, req_id=1)])
    blocks = kv.allocate_blocks_cache(BLOCKS)
    await dd.finalize()
    await dd.finalize()
    assert not kv.is_initialized()
    assert not keyed.alive and not blocks.alive
    for call in (lambda: kv.allocate_cache(CONTIG), lambda: kv.deallocate_cache(blocks),
                 lambda: kv.get_cache_tensors(keyed)):
        with pytest.raises(LLMException) as info:
            call()
        assert info.value.status_code is S.LLM_ENGINE_FINALIZED
    with pytest.raises(LLMException) as info:
        await kv.copy_blocks(blocks, {0: [1]})
    assert info.value.status_code is S.LLM_ENGINE_FINALIZED


def _cache_fds() -> int:
    """Open fds of this process on a host cache's memfd."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:aio_datadist (deleted)")
    return count


def _mapped(address: int) -> bool:
    """Whether a host cache's memfd is mapped at ``address`` (not whatever else took the place since)."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if start <= address < end:
                return "/memfd:aio_datadist" in line
    return False


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["deallocate", "finalize"])
async def test_a_freed_cache_keeps_no_fd_while_its_tensors_live_and_its_memory_goes_with_the_last(how):
    """A host cache holds one fd while it is alive: the read-only one a same-host peer receives. Freed, it holds
    none, even while the caller keeps its tensors (they stay usable: the memory is the caller's until the last
    of them goes, and then it is unmapped). Before, each cache's mapping kept a writable fd of its own open for
    as long as any tensor lived: after every freed cache whose tensors a cycle or a caller held, one more fd."""
    gc.collect()  # no earlier test's cache goes during this one
    before = _cache_fds()
    dd = LLMDataDist(LLMRole.DECODER, 2)
    try:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(BLOCKS)
        assert _cache_fds() == before + 1
        kept = cache.tensors[1]
        kept.fill_(3)
        if how == "deallocate":
            kv.deallocate_cache(cache)
    finally:
        await dd.finalize()
    assert not cache.alive
    assert _cache_fds() == before
    kept.add_(1)  # still the caller's memory
    assert bool((kept == 4).all())
    address = kept.data_ptr()
    del cache
    gc.collect()
    assert _mapped(address), "unmapped while a tensor of it lives"
    del kept
    gc.collect()
    assert not _mapped(address)


@pytest.mark.asyncio
@pytest.mark.loops_take_turns
async def test_a_big_freed_cache_is_unmapped_off_the_thread_that_drops_its_last_tensor(monkeypatch):
    """Unmapping populated shared memory costs about 0.2 ms per MiB (200 ms for 1 GiB), paid by whoever drops
    the last tensor of a freed cache: often the event loop's thread (the caller, or a collection that runs there).
    A mapping of 8 MiB or more is unmapped on a thread of its own; a small one at once. Before, every mapping was
    unmapped where its last tensor went."""
    me = threading.current_thread()
    unmapped: dict[int, bool] = {}  # address -> unmapped on the thread that dropped the last tensor
    real = host.unmap

    def watched(addr: int, size: int) -> None:
        unmapped[addr] = threading.current_thread() is me
        real(addr, size)

    monkeypatch.setattr(host, "unmap", watched)
    dd = LLMDataDist(LLMRole.DECODER, 2)
    try:
        await dd.init(LLMConfig().generate_options())
        kv = dd.kv_cache_manager
        big = kv.allocate_blocks_cache(CacheDesc(1, (2, 8 << 20), DataType.DT_INT8, Placement.HOST))  # 16 MiB
        small = kv.allocate_blocks_cache(BLOCKS)
        kept = [big.tensors[0], small.tensors[0]]
        addresses = [big.region.address, small.region.address]
    finally:
        await dd.finalize()
    del big, small
    gc.collect()
    assert not set(addresses) & set(unmapped), "unmapped while a tensor of it lives"
    kept.clear()
    gc.collect()
    assert host.unmapped_in_background(5.0)
    assert [unmapped.get(a) for a in addresses] == [False, True]  # the big one elsewhere, the small one here
    assert not any(_mapped(a) for a in addresses)


def test_a_big_peer_mapping_is_unmapped_off_the_thread_that_drops_it(monkeypatch):
    """A same-host peer's region mapped here read-only (its pages are the peer's) still costs to unmap once its
    pages were read: 55 ms for 1 GiB, 15 ms for 256 MiB. The last reference to it often goes on the event loop's
    thread (a link closing, a share dropped): 8 MiB or more is unmapped on the unmapping thread, and the peer
    mapping budget (``host.MAX_PEER_MAPPED_BYTES``) is given back there."""
    me = threading.current_thread()
    unmapped: dict[int, bool] = {}
    real = host.unmap_peer

    def watched(addr: int, size: int) -> None:
        unmapped[addr] = threading.current_thread() is me
        real(addr, size)

    monkeypatch.setattr(host, "unmap_peer", watched)
    budget = host._peer_mapped
    regions = [host.HostRegion(16 << 20), host.HostRegion(PAGE_SIZE)]
    mappings = [host.ReadOnlyMapping(r.fd, r.nbytes) for r in regions]
    addresses = [m.address for m in mappings]
    assert all(_mapped(a) for a in addresses)
    assert host._peer_mapped == budget + (16 << 20) + PAGE_SIZE
    mappings.clear()
    assert host.unmapped_in_background(5.0)
    assert [unmapped.get(a) for a in addresses] == [False, True]  # the big one elsewhere, the small one here
    assert not any(_mapped(a) for a in addresses)
    assert host._peer_mapped == budget  # the budget given back with the unmaps


def test_a_peer_mapping_of_exactly_the_unmapping_bound_is_unmapped_off_the_thread_that_drops_it(monkeypatch):
    """The bound is inclusive: a mapping of ``Unmapper.MIN_BYTES`` (8 MiB) goes to the unmapping thread, one page
    less is unmapped at once."""
    me = threading.current_thread()
    unmapped: dict[int, bool] = {}
    real = host.unmap_peer

    def watched(addr: int, size: int) -> None:
        unmapped[addr] = threading.current_thread() is me
        real(addr, size)

    monkeypatch.setattr(host, "unmap_peer", watched)
    bound = host.Unmapper.MIN_BYTES
    regions = [host.HostRegion(bound), host.HostRegion(bound - PAGE_SIZE)]
    mappings = [host.ReadOnlyMapping(r.fd, r.nbytes) for r in regions]
    addresses = [m.address for m in mappings]
    mappings.clear()
    assert host.unmapped_in_background(5.0)
    assert [unmapped.get(a) for a in addresses] == [False, True]  # 8 MiB elsewhere, one page less here


def _child_exit_code(pid: int, limit_s: float = 10.0) -> int:
    """The exit code of forked child ``pid``; the test fails (the child killed) if it runs past ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    return os.waitstatus_to_exitcode(done[1])


def test_a_forked_child_frees_what_its_parent_queued_and_does_not_hang_on_its_locks():
    """A process that forks while its unmapping thread holds the peer-mapping lock (a 55 ms unmap of a big peer
    region) and has more queued: the child has neither the thread nor the lock's owner. It gets a fresh lock,
    frees in place the mappings whose objects were gone before the fork, and starts a thread of its own with
    its first host cache. Before the fix, the child hung in its at-fork handler."""
    regions = [host.HostRegion(16 << 20) for _ in range(2)]
    mappings = [host.ReadOnlyMapping(r.fd, r.nbytes) for r in regions]
    held, release = threading.Event(), threading.Event()

    def holder() -> None:  # holds the lock the unmapping thread's bookkeeping (give_back_peer_mapping) takes
        with host._peer_mapped_lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    try:
        assert held.wait(5)
        addresses = [m.address for m in mappings]
        mappings.clear()  # queued for the unmapping thread, which now waits for the lock
        pid = os.fork()
        if pid == 0:  # the child: only what follows the at-fork handlers runs here
            code = 0 if not any(_mapped(a) for a in addresses) else 3
            here: list[bool] = []  # the child's own unmapping thread frees its big region, not this one
            real, me = host.unmap, threading.current_thread()
            host.unmap = lambda addr, size: (here.append(threading.current_thread() is me), real(addr, size))
            region = host.HostRegion(16 << 20)
            address = region.address
            del region
            code = code or (0 if host.unmapped_in_background(5) and not _mapped(address) else 4)
            code = code or (0 if here == [False] else 5)
            os._exit(code)
        assert _child_exit_code(pid) == 0
    finally:
        release.set()
        thread.join(5)
    assert host.unmapped_in_background(5)
    assert not any(_mapped(a) for a in addresses)


def test_a_fork_while_the_unmapping_thread_runs_a_free_waits_for_it():
    """The unmapping thread has taken a free off its queue and runs it (a slow unmap, held here on an event) when
    the process forks: the fork waits for that free (``Unmapper.before_fork``), so the child has neither that
    mapping (unmapped before the fork) nor the one queued behind it (freed by the child). Before, a free taken
    off the queue but not yet run was in neither place: the child kept its mapping for good (every run on Python
    3.13, where the thread takes the free before the fork; found by a hunt, 2026-12-07)."""
    regions = [host.HostRegion(16 << 20) for _ in range(2)]
    addresses = [host.map_read_only(r.fd, r.nbytes) for r in regions]
    running, go = threading.Event(), threading.Event()

    def slow_free() -> None:
        running.set()
        go.wait(10)
        host.unmap_read_only(addresses[0], regions[0].nbytes)

    host._unmapper.start()
    host._unmapper.free(regions[0].nbytes, slow_free)
    host._unmapper.free(regions[1].nbytes, functools.partial(host.unmap_read_only, addresses[1], regions[1].nbytes))
    assert running.wait(5)
    threading.Timer(0.3, go.set).start()  # the free ends a moment after the fork was asked for
    pid = os.fork()
    if pid == 0:
        os._exit(3 if any(_mapped(a) for a in addresses) else 0)
    code = _child_exit_code(pid)
    go.set()
    assert code == 0, "the child kept a mapping its parent freed"
    assert host.unmapped_in_background(5)
    assert not any(_mapped(a) for a in addresses)


_FORK_BESIDE_A_WAITER = """
import os, signal, sys, threading, time
from aio_datadist.devices import host

sys.setswitchinterval(1e-5)
region = host.HostRegion(16 << 20)  # starts the unmapping thread
stop = False

def waiter():
    while not stop:
        host.unmapped_in_background(0.0)

threading.Thread(target=waiter, daemon=True).start()
hung = 0
for _ in range(60):
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # past its at-fork hooks
    deadline = time.monotonic() + 2.0
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
stop = True
print(hung)
"""


def test_a_fork_beside_a_thread_waiting_for_the_unmapping_queue_does_not_hang_the_child():
    """A thread waits for the queued frees (``unmapped_in_background``) while another forks, 60 times: every child
    gets past its at-fork handlers. Before, the child ran the parent's queued wake-up of that waiter, whose lock
    the waiter's thread held at the fork: the child hung for good in ``os.fork()`` (19 of 200; found by review,
    2026-12-07)."""
    done = subprocess.run([sys.executable, "-c", _FORK_BESIDE_A_WAITER], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0", f"{done.stdout.strip()} children hung"


def test_a_fork_that_waits_for_a_free_is_not_stopped_by_an_interrupt():
    """An interrupt (Ctrl-C) lands while a fork waits for the free the unmapping thread runs: the wait goes on (a
    ``before`` at-fork hook that raises does not stop the fork, CPython only reports it), the lock is given back
    after the fork, and the thread runs on. Before, the hook raised, the fork went on without waiting, and the
    parent's after-fork hook released the lock the thread held: the thread died ("release unlocked lock") and the
    frees queued behind it stayed mapped for good (found by review, 2026-12-07)."""
    from aio_datadist.devices.unmapping import Unmapper

    unmapper = Unmapper()
    unmapper.start()
    running, ran = threading.Event(), []
    unmapper.free(Unmapper.MIN_BYTES, lambda: (running.set(), time.sleep(0.3)))
    unmapper.free(Unmapper.MIN_BYTES, lambda: ran.append(True))
    assert running.wait(5)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous, stopped = signal.signal(signal.SIGALRM, interrupt), False
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        unmapper.before_fork()  # (no fork here: the hooks alone)
    except KeyboardInterrupt:
        stopped = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not stopped, "the interrupt stopped the fork's wait"
    unmapper.after_fork_in_parent()
    assert unmapper.wait_idle(5) and ran == [True]
    assert unmapper._thread is not None and unmapper._thread.is_alive()
    with unmapper._running:  # held as the unmapping thread holds it inside a free, when a finalizer there forks
        unmapper.before_fork()  # reentrant: at once (a plain lock deadlocked that thread and every later fork)
        unmapper.after_fork_in_parent()
    assert unmapper.wait_idle(5)


def test_the_fork_hooks_give_back_what_their_own_thread_took_and_never_spin():
    """The unmapping fork hooks, per forking thread and bounded: an after-hook gives back only what its own
    thread's before-hook took (one shared flag let one thread's after-hook release another's hold, which then kept
    the lock for good); a before-hook whose acquire keeps raising (a ``RecursionError`` near the recursion limit)
    returns instead of spinning (it hung the fork for good); a free raising ``SystemExit`` leaves the thread running
    the frees behind it (it ended the thread). All found by review, 2026-12-07."""
    from aio_datadist.devices.unmapping import Unmapper

    unmapper = Unmapper()
    unmapper.start()
    took, release = threading.Event(), threading.Event()

    def forking_thread() -> None:  # thread A, inside its fork
        unmapper.before_fork()
        took.set()
        release.wait(5)
        unmapper.after_fork_in_parent()

    other = threading.Thread(target=forking_thread)
    other.start()
    assert took.wait(5)
    unmapper.after_fork_in_parent()  # this thread's before-hook never ran: nothing of A's is given back
    assert not unmapper._running.acquire(timeout=0.05), "A's hold was released by another thread's hook"
    release.set()
    other.join(5)
    assert unmapper.wait_idle(5)  # A gave back its own: the thread runs frees again

    class Raising:
        def acquire(self, *args: object) -> bool:
            raise RecursionError

        def _recursion_count(self) -> int:
            return 0

    real, unmapper._running = unmapper._running, Raising()
    spun = threading.Thread(target=unmapper.before_fork, daemon=True)
    spun.start()
    spun.join(5)
    unmapper._running = real
    assert not spun.is_alive(), "the before-hook spun on an acquire that keeps raising"

    ran: list[int] = []
    unmapper.free(Unmapper.MIN_BYTES, lambda: sys.exit(3))
    unmapper.free(Unmapper.MIN_BYTES, lambda: ran.append(1))
    assert unmapper.wait_idle(5) and ran == [1] and unmapper._thread is not None and unmapper._thread.is_alive()


def test_a_view_of_a_peer_mapping_keeps_it_mapped():
    """A tensor :meth:`ReadOnlyMapping.view` made reads the peer's memory for as long as it lives, also once the
    mapping object itself is dropped. Before, the view did not hold the mapping: only its users' keepalives did,
    and a view that outlived them read unmapped memory."""
    region = host.HostRegion(PAGE_SIZE)
    region.base[:8] = torch.arange(8, dtype=torch.uint8)
    mapping = host.ReadOnlyMapping(region.fd, region.nbytes)
    view = mapping.view(0, 8)
    address = mapping.address
    del mapping
    gc.collect()
    assert _mapped(address)
    assert view.tolist() == list(range(8))
    del view
    gc.collect()
    assert not _mapped(address)
