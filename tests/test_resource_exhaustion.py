"""The process runs out of something the library needs: a clear ``LLMException``, never a kill or a bare error.

Memory (row 317): host caches are memfds populated at allocation: populating more than there is summons the kernel's OOM
killer, which kills the whole process inside ``allocate_cache``. ``devices/headroom.py`` reads the host's
``MemAvailable`` and the room left under every memory cgroup limit above the process (a container's, a pod's);
an allocation past it is ``LLM_OUT_OF_MEMORY``. The first tests read a cgroup tree of their own (v1, v2 and
a hybrid mount); then a child process runs in a real 512 MiB memory cgroup the test makes, where it can.
File descriptors and threads for ``init``'s engines, and staging buffers: rows 318, 319.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aio_datadist.devices import headroom, host

GIB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(headroom, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(headroom, "PROC_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(headroom, "MEMINFO", str(tmp_path / "meminfo"))
    _write(tmp_path / "meminfo", f"MemTotal: {64 * GIB // 1024} kB\nMemFree: 1024 kB\n"
                                 f"MemAvailable: {40 * GIB // 1024} kB\n")
    return tmp_path


def test_without_a_cgroup_limit_the_host_s_available_memory_bounds_it(tree: Path) -> None:
    _write(tree / "self_cgroup", "0::/\n")
    assert headroom.memory_headroom() == (40 * GIB, "of memory available")  # MemAvailable, not MemFree


def test_a_v2_limit_on_the_process_or_an_ancestor_bounds_it(tree: Path) -> None:
    _write(tree / "self_cgroup", "0::/kubepods/pod1/ctr\n")
    root = tree / "cgroup"
    _write(root / "kubepods/pod1/ctr/memory.max", "max\n")
    _write(root / "kubepods/pod1/ctr/memory.current", str(GIB))
    _write(root / "kubepods/pod1/memory.max", str(4 * GIB))
    _write(root / "kubepods/pod1/memory.current", str(3 * GIB))
    _write(root / "kubepods/pod1/memory.stat", f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB // 2}\n")
    _write(root / "kubepods/memory.max", str(32 * GIB))
    _write(root / "kubepods/memory.current", str(3 * GIB))
    room, what = headroom.memory_headroom()
    assert room == GIB + GIB // 2 and "/kubepods/pod1" in what  # 4 - 3 GiB, and its reclaimable page cache


def test_a_v1_memory_limit_bounds_it_and_a_v2_hierarchy_beside_it_is_not_read(tree: Path) -> None:
    _write(tree / "self_cgroup", "4:memory:/docker/abc\n3:cpu:/docker/abc\n0::/\n")
    root = tree / "cgroup"
    (root / "unified").mkdir(parents=True)
    _write(root / "memory/docker/abc/memory.limit_in_bytes", str(2 * GIB))
    _write(root / "memory/docker/abc/memory.usage_in_bytes", str(GIB + GIB // 4))
    _write(root / "memory/docker/abc/memory.stat", "cache 100\ntotal_inactive_file 4096\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    _write(root / "memory/memory.usage_in_bytes", str(10 * GIB))
    assert headroom.memory_headroom() == (3 * GIB // 4 + 4096, "left under the memory limit of cgroup /docker/abc")


def test_a_path_outside_the_namespace_root_reads_no_cgroup(tree: Path) -> None:
    """``/proc/self/cgroup`` names a cgroup outside this cgroup namespace (``/../x``): its limits cannot be seen
    from here, and the namespace's own root (which does not hold the process) is not taken for it (review)."""
    _write(tree / "self_cgroup", "0::/../x\n")
    _write(tree / "cgroup/memory.max", str(GIB))
    _write(tree / "cgroup/memory.current", str(GIB))
    _write(tree / "cgroup/x/memory.max", str(GIB))
    _write(tree / "cgroup/x/memory.current", str(GIB))
    assert headroom.memory_headroom() == (40 * GIB, "of memory available")


def test_unreadable_files_count_as_no_limit(tree: Path) -> None:
    _write(tree / "self_cgroup", "garbage\n0::/a\n")
    _write(tree / "cgroup/a/memory.max", "12345x")
    assert headroom.memory_headroom()[0] == 40 * GIB


CHILD = textwrap.dedent('''
    import asyncio, sys
    from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole, Placement

    async def main():
        config = LLMConfig()
        config.device_id = 0
        config.enable_cache_manager = sys.argv[1] == "v2"
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(config.generate_options())
        manager = dd.cache_manager if sys.argv[1] == "v2" else dd.kv_cache_manager
        try:
            manager.allocate_cache(CacheDesc(2, (96, 1 << 20), DataType.DT_INT32, Placement.HOST))  # 768 MiB
            print("ALLOCATED", flush=True)
        except LLMException as exc:
            print("REFUSED", exc.status_code.name, flush=True)
        manager.allocate_cache(CacheDesc(1, (4, 1024), DataType.DT_INT32, Placement.HOST))
        print("SMALL_OK", flush=True)
        await dd.finalize()

    asyncio.run(main())
''')


@contextlib.contextmanager
def _memory_cgroup(limit: int) -> Iterator[str]:
    """A memory cgroup of ``limit`` bytes made for the test (v1 or v2), or a skip where none can be made."""
    v1 = Path("/sys/fs/cgroup/memory")
    mount = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    limit_file = "memory.limit_in_bytes" if mount == v1 else "memory.max"
    path = mount / f"aio_datadist_test_{os.getpid()}"
    try:
        path.mkdir()
        (path / limit_file).write_text(str(limit))
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield str(path)
    finally:
        for _ in range(100):  # bounded: the child's pages leave the cgroup once it is reaped
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


AGAIN_CHILD = textwrap.dedent('''
    import asyncio
    from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

    async def main():
        config = LLMConfig()
        config.device_id = 0
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        await dd.init(config.generate_options())
        kv = dd.kv_cache_manager
        for _ in range(4):  # the hand-off pattern: a cache of 250 MiB per request, freed before the next
            cache = kv.allocate_cache(CacheDesc(1, (250, 1 << 20), DataType.DT_INT8, Placement.HOST))
            kv.deallocate_cache(cache)
            del cache
        print("ALL_OK", flush=True)
        await dd.finalize()

    asyncio.run(main())
''')


def _run_in_memory_cgroup(limit: int, code: str, *argv: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a child process inside a memory cgroup of ``limit`` bytes made for it."""
    with _memory_cgroup(limit) as cgroup:
        def join() -> None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run([sys.executable, "-c", code, *argv], preexec_fn=join, capture_output=True,
                              text=True, timeout=120)


def test_a_cache_freed_just_before_leaves_its_room_to_the_next() -> None:
    """In a 512 MiB memory cgroup, 250 MiB caches allocated and freed in turn all fit: a refusal first waits for
    the frees already handed to the unmapping thread (a cache of 8 MiB or more is unmapped there, row 175, and
    counts against the cgroup until it ran). The first form of row 317 refused every second one (review)."""
    done = _run_in_memory_cgroup(512 << 20, AGAIN_CHILD)
    assert done.returncode == 0 and done.stdout.split() == ["ALL_OK"], (done.returncode, done.stdout,
                                                                       done.stderr[-2000:])


AT_ONCE_CHILD = textwrap.dedent('''
    import asyncio, threading
    from aio_datadist import CacheDesc, DataType, LLMConfig, LLMDataDist, LLMException, LLMRole, Placement
    from aio_datadist.devices.headroom import memory_headroom

    rows = int(memory_headroom()[0] * 0.55) >> 20  # each cache alone fits, both together do not
    both = threading.Barrier(2)
    results = []

    def endpoint(i):
        async def main():
            config = LLMConfig()
            config.device_id = 0
            dd = LLMDataDist(LLMRole.PROMPT, 10 + i)
            await dd.init(config.generate_options())
            both.wait()
            try:
                dd.kv_cache_manager.allocate_cache(CacheDesc(1, (rows, 1 << 20), DataType.DT_INT8, Placement.HOST))
                results.append("OK")
            except LLMException as exc:
                results.append(exc.status_code.name)
            both.wait()
            await dd.finalize()
        asyncio.run(main())

    threads = [threading.Thread(target=endpoint, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(*sorted(results), flush=True)
''')


def test_two_caches_allocated_at_once_that_do_not_both_fit_one_is_refused() -> None:
    """Two endpoints of one process (threads) each allocate 55 % of a 512 MiB memory cgroup's room at the same
    moment: one is ``LLM_OUT_OF_MEMORY`` and the process lives. The check counts what other allocations are still
    populating (not in the cgroup's usage yet); its first form let both through and the process was OOM-killed
    (review)."""
    done = _run_in_memory_cgroup(512 << 20, AT_ONCE_CHILD)
    assert done.returncode == 0 and done.stdout.split() == ["LLM_OUT_OF_MEMORY", "OK"], (
        done.returncode, done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_a_host_cache_past_the_process_s_memory_cgroup_is_refused_and_the_process_lives(api: str) -> None:
    """Before: the child in a 512 MiB memory cgroup was OOM-killed (SIGKILL) inside ``allocate_cache`` of
    768 MiB, with the host's free memory (tens of GiB) the only bound checked (found by the exhaustion audit)."""
    done = _run_in_memory_cgroup(512 << 20, CHILD, api)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.split() == ["REFUSED", "LLM_OUT_OF_MEMORY", "SMALL_OK"], done.stdout


#: Child prelude: ``fill_fds(n)`` caps the fd table ``n`` above what is open (soft = hard) and fills it; the fds.
FILL_FDS = textwrap.dedent('''
    import os, resource

    def fill_fds(n):
        base = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (base + n, base + n))
        fill = []
        try:
            while True:
                fill.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        return fill
''')


INIT_CHILD = FILL_FDS + textwrap.dedent('''
    import asyncio, os, sys
    from aio_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole

    async def main():
        config = LLMConfig()
        config.device_id = 0
        fill = fill_fds(40)  # soft = hard: init cannot raise it
        for _ in range(int(sys.argv[1])):
            os.close(fill.pop())
        before = len(os.listdir("/proc/self/fd"))
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        try:
            await dd.init(config.generate_options())
            print("INIT_OK", flush=True)
            await dd.finalize()
        except LLMException as exc:
            print("REFUSED", exc.status_code.name, "Too many open files" in str(exc), flush=True)
        print("LEFT", len(os.listdir("/proc/self/fd")) - before, flush=True)
        for fd in fill:
            os.close(fd)
        again = LLMDataDist(LLMRole.PROMPT, 1)
        await again.init(config.generate_options())
        await again.finalize()
        print("AGAIN_OK", flush=True)

    asyncio.run(main())
''')


@pytest.mark.parametrize("free_fds", [1, 2])
def test_init_without_fds_for_its_engines_is_an_llm_exception_naming_them(free_fds: int) -> None:
    """``init`` in a process with one or two fds left: ``LLM_FAILED`` saying "Too many open files", nothing
    left open, and an ``init`` once fds are back works. Before, a bare ``OSError`` escaped, which a caller that
    catches ``LLMException`` missed (found by the exhaustion audit; the same for a thread that cannot start)."""
    done = subprocess.run([sys.executable, "-c", INIT_CHILD, str(free_fds)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.split() == ["REFUSED", "LLM_FAILED", "True", "LEFT", "0", "AGAIN_OK"], done.stdout


FULL_TABLE_CHILD = FILL_FDS + textwrap.dedent('''
    import asyncio, fcntl, os, sys
    from aio_datadist import CacheDesc, DataType, LLMClusterInfo, LLMDataDist, LLMException, LLMRole, Placement
    from aio_datadist import fd_budget
    from aio_datadist.testing import loopback_options

    async def main():
        prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
        await prompt.init(loopback_options(listen=True))
        await decoder.init(loopback_options())
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_remote_ip_info(*prompt.listen_address)
        fill = fill_fds(600)  # (room for the listener's reserve once they are closed again)
        full = fd_budget.open_count() == fd_budget.soft_limit()
        status, per = await decoder.link_clusters([info], timeout=3000)
        os.close(fill.pop())  # one fd free: the memfd, but none for its read-only open
        try:
            prompt.kv_cache_manager.allocate_cache(CacheDesc(1, (4, 4096), DataType.DT_INT8, Placement.HOST))
            kept = "ALLOCATED"
        except LLMException as exc:
            kept = f"{exc.status_code.name}:{'Too many open files' in str(exc)}"
        for fd in fill:
            os.close(fd)
        cache = prompt.kv_cache_manager.allocate_cache(CacheDesc(1, (4, 4096), DataType.DT_INT8, Placement.HOST))
        mode = fcntl.fcntl(cache.region.fd, fcntl.F_GETFL) & os.O_ACCMODE
        again, _ = await decoder.link_clusters([info], timeout=3000)
        print(full, status.name, per[0].name, kept, mode == os.O_RDONLY, again.name, flush=True)
        await decoder.finalize()
        await prompt.finalize()

    asyncio.run(main())
''')


def test_a_full_fd_table_refuses_links_and_allocations_instead_of_failing_later() -> None:
    """No fd left at all: ``fd_budget.open_count`` cannot list ``/proc/self/fd`` and counts the table full (it
    read 0: the budget let the link through, to fail ``LLM_LINK_FAILED`` on ``EMFILE``, and an accepting end took
    a link whose data channels it could not accept, the dialler timing out), so ``link_clusters`` is refused
    ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` (row 32). With one fd left a host cache's memfd is made but its read-only
    open is not: the allocation is refused ``LLM_OUT_OF_MEMORY`` ("Too many open files"); before, the cache kept
    its writable fd, which a same-host peer then received (row 44). Once fds are back, both work (found by a hunt,
    2026-12-07)."""
    done = subprocess.run([sys.executable, "-c", FULL_TABLE_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.split() == ["True", "LLM_CLUSTER_NUM_EXCEED_LIMIT", "LLM_CLUSTER_NUM_EXCEED_LIMIT",
                                   "LLM_OUT_OF_MEMORY:True", "True", "LLM_SUCCESS"], done.stdout


CTRUNC_CHILD = FILL_FDS + textwrap.dedent('''
    import socket
    from aio_datadist.transport.local import ShareError, parse_record

    def why() -> str:
        try:
            parse_record(b"", 0, socket.MSG_CTRUNC)
        except ShareError as exc:
            return str(exc)
        return "taken"

    print(why(), flush=True)
    fill_fds(20)
    print(why(), flush=True)
''')


def test_a_share_record_whose_fds_we_had_no_room_for_blames_us_not_the_peer() -> None:
    """A same-host share record whose fds the kernel dropped because our fd table was full (``MSG_CTRUNC``)
    says so: the share goes (its caches move over TCP), and the warning no longer calls it the peer's bad record
    (found by the exhaustion audit)."""
    done = subprocess.run([sys.executable, "-c", CTRUNC_CHILD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    room, full = done.stdout.splitlines()
    assert room == "message or its fds were truncated"
    assert "no file descriptor left" in full and "not at fault" in full


def test_without_an_unmapping_thread_a_refusal_waits_for_nothing() -> None:
    """A process that could not start the unmapping thread frees in place: a refused allocation's wait for the
    queued frees (row 317) returns at once and queues nothing. Before, it waited the whole 2 s on the caller's
    thread (the event loop), under the room's lock, and left its marker queued for good (review)."""
    from aio_datadist.devices.unmapping import Unmapper

    unmapper = Unmapper()
    unmapper._pid, unmapper._thread = os.getpid(), None  # what start() leaves when no thread can start
    started = time.monotonic()
    assert unmapper.wait_idle(2.0)
    assert time.monotonic() - started < 0.5 and not unmapper._frees and unmapper._wake.qsize() == 0


def test_the_room_read_is_spent_by_the_allocations_that_follow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The room read is kept a while (no file read per small allocation) and spent by the allocations meanwhile:
    a read of 200 MiB admits no more than 200 MiB of requests (each a page, its page tables and 16 MiB of slack),
    however long it is kept. Here the memory is gone after the first read (another process took it)."""
    rooms = iter([200 << 20])
    monkeypatch.setattr(host, "memory_headroom", lambda: (next(rooms, 0), "of memory available"))
    monkeypatch.setattr(host, "ROOM_TTL_S", 60.0)
    monkeypatch.setattr(host, "_room", [float("-inf"), 0, ""])
    regions = []
    with pytest.raises(MemoryError):
        for _ in range(20):
            regions.append(host.HostRegion(host.PAGE_SIZE))
    assert 0 < len(regions) and len(regions) * (host.PAGE_SIZE + host.POPULATE_SLACK) <= 200 << 20, len(regions)


#: Child: ``init`` with ``aio.Transport=nixl`` while no Python thread can start (a stack no ``pthread_create`` can
#: map), then again once threads can start.
NIXL_THREAD_CHILD = textwrap.dedent('''
    import asyncio, threading
    from aio_datadist import LLMConfig, LLMDataDist, LLMException, LLMRole

    async def main():
        config = LLMConfig()
        config.device_id = 0
        options = config.generate_options()
        options["aio.Transport"] = "nixl"
        dd = LLMDataDist(LLMRole.PROMPT, 1)
        threading.stack_size(1 << 45)  # no Python thread can start from here on
        try:
            await dd.init(options)
            print("INIT_OK", flush=True)
        except LLMException as exc:
            print("REFUSED", exc.status_code.name, "thread" in str(exc), flush=True)
        except Exception as exc:
            print("BARE", type(exc).__name__, flush=True)
        finally:
            threading.stack_size(0)
        await dd.init(options)
        await dd.finalize()
        print("AGAIN_OK", flush=True)

    asyncio.run(main())
''')


def test_init_without_a_thread_for_the_nixl_worker_is_an_llm_exception_naming_it() -> None:
    """``init`` with ``aio.Transport=nixl`` where the NIXL agent's worker thread cannot start: ``LLM_FAILED``
    naming the thread, as for the core engines (row 318), and a later ``init`` works. Found by a hunt:
    a bare ``RuntimeError`` ("can't start new thread") escaped ``init``."""
    from peers import NIXL_MISSING
    if NIXL_MISSING:
        pytest.skip(NIXL_MISSING)
    done = subprocess.run([sys.executable, "-c", NIXL_THREAD_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.split() == ["REFUSED", "LLM_FAILED", "True", "AGAIN_OK"], done.stdout


#: Child: the blocking facade's ``init`` with ``argv[1]`` fds free (soft = hard), or no Python thread able to start
#: (``argv[1]`` is ``thread``); then again once they are back.
COMPAT_INIT_CHILD = FILL_FDS + textwrap.dedent('''
    import os, sys, threading
    from aio_datadist.compat import LLMConfig, LLMDataDist, LLMException, LLMRole

    config = LLMConfig()
    config.device_id = 0
    options = config.generate_options()
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    fill = []
    if sys.argv[1] == "thread":
        threading.stack_size(1 << 45)
    else:
        fill = fill_fds(40)
        for _ in range(int(sys.argv[1])):
            os.close(fill.pop())
    try:
        dd.init(options)
        print("INIT_OK", flush=True)
    except LLMException as exc:
        print("REFUSED", exc.status_code.name, flush=True)
    except Exception as exc:
        print("BARE", type(exc).__name__, flush=True)
    threading.stack_size(0)
    for fd in fill:
        os.close(fd)
    dd.init(options)
    dd.finalize()
    print("AGAIN_OK", flush=True)
''')


@pytest.mark.parametrize("short_of", ["0", "1", "thread"])
def test_a_blocking_init_without_an_fd_or_thread_for_its_loop_is_an_llm_exception(short_of: str) -> None:
    """The blocking facade's ``init`` in a process with no fd for its event loop (0 or 1 free), or no thread for
    the loop's thread: ``LLM_FAILED``, as the async ``init`` (row 318), and a later ``init`` works. Found by a
    hunt: a bare ``OSError`` (``Too many open files``) or ``RuntimeError`` escaped the facade's ``init``."""
    done = subprocess.run([sys.executable, "-c", COMPAT_INIT_CHILD, short_of], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.split() == ["REFUSED", "LLM_FAILED", "AGAIN_OK"], done.stdout
