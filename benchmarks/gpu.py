"""Issue 8 on the lent GPU, in one call: build, run the GPU tests, measure against same-run ceilings.

Run on the device machine from the repository root (see docs/devices.md for
the exact device-tool call)::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py

Steps, each bounded so the whole run stays inside ``--budget`` seconds
(default 420; the device tool's cap is 600):

1. make pytest-asyncio importable (the machine has no network: the wheel in
   ``benchmarks/wheels/`` is installed into /tmp if it is missing);
2. build the Cython core in place (``setup.py build_ext --inplace``);
3. run the device tests (``tests/gpu``, all marked ``gpu``, plus the CPU-side
   device tests, which then see a real driver);
4. measure, each figure as a ratio to a ceiling measured in this same run:

   * copy_blocks of 512 (and 64) random 32 KiB blocks across 64 tensors of
     [4096, 16, 8, 128] fp16, through the API and per method on the device,
     against a contiguous device copy of the same bytes; torch
     index_select + index_copy_ per tensor as the baseline;
   * swap_blocks host<->device (page-locked host cache) against a contiguous
     page-locked copy of the same bytes, per method;
   * completion latency p50/p99, stream done -> awaiting coroutine resumed,
     against a thread-pool ``event.synchronize()`` and a ctypes
     ``cuLaunchHostFunc`` callback measured the same way;
   * a cross-process same-GPU pull through CUDA IPC against the device copy rate;
   * a device-to-device pull between two endpoints over loopback TCP through
     the staging plane (D2H chunks, socket, H2D chunks, all overlapped)
     against a hand-written D2H + send + H2D pipeline over the same bytes
     and the same chunk size (torch copies on two streams, pinned buffers,
     a thread per side, double-buffered).

Results go to ``$OUT`` (or ``--out``): ``gpu_results.md`` (the table),
``gpu_results.json``, ``gpu_tests.log``; the table is also printed. Results
are written after every section, so a run cut short still leaves what it had.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import glob
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "wheels"
SITE = Path("/tmp/aio_datadist_site")
MIB = 1 << 20
GIB = 1 << 30

# The geometry: 64 tensors of [4096, 16, 8, 128] fp16 = 32 KiB blocks, 8 GiB in all.
TENSORS, BLOCKS, BLOCK_SHAPE = 64, 4096, (16, 8, 128)
HOST_BLOCKS = 512
STAGED_BLOCKS = 512  # the staged TCP pull: 512 random blocks x 64 tensors = 1 GiB
TRACE = False  # --trace: cProfile and torch.profiler traces of the API calls (they slow what follows them)


class Report:
    """Rows and notes, rewritten to the output folder after every section."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.env: dict[str, str] = {}
        self.tests = "not run"

    def row(self, figure: str, ours: float | None, unit: str, ceiling: str, ceiling_value: float | None,
            target: str = "", detail: str = "") -> None:
        ratio = None if ours is None or not ceiling_value else ours / ceiling_value
        if unit == "us" and ratio is not None:
            ratio = ceiling_value / ours  # latency: how many times faster than the baseline
        verdict = ""
        if target and ratio is not None:
            op, num = target.split()
            num = float(num.rstrip("x"))
            value = ours if unit == "us" and op == "<=" else ratio
            verdict = "pass" if (value >= num if op == ">=" else value <= num) else "FAIL"
        self.rows.append(dict(figure=figure, ours=ours, unit=unit, ceiling=ceiling, ceiling_value=ceiling_value,
                              ratio=ratio, target=target, verdict=verdict, detail=detail))
        self.write()

    def note(self, text: str) -> None:
        print("note:", text, flush=True)
        self.notes.append(text)
        self.write()

    def markdown(self) -> str:
        lines = ["# benchmarks/gpu.py results", ""]
        lines += [f"- {k}: {v}" for k, v in self.env.items()]
        lines += [f"- tests: {self.tests}", "",
                  "| figure | ours | ceiling / baseline | ratio | target | |", "|---|---|---|---|---|---|"]
        for r in self.rows:
            ours = "-" if r["ours"] is None else f"{r['ours']:.4g} {r['unit']}"
            ceil = (r["ceiling"] if r["ceiling_value"] is None
                    else f"{r['ceiling']}: {r['ceiling_value']:.4g} {r['unit']}")
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}x"
            figure = r["figure"] + (f" ({r['detail']})" if r["detail"] else "")
            lines.append(f"| {figure} | {ours} | {ceil} | {ratio} | {r['target']} | {r['verdict']} |")
        lines += ["", "Rates are bytes of data moved per second (GB/s = 1e9 B/s). Latency ratios say how many",
                  "times faster than that baseline. Notes:"] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_results.md").write_text(self.markdown())
        (self.out / "gpu_results.json").write_text(json.dumps(
            dict(env=self.env, tests=self.tests, rows=self.rows, notes=self.notes), indent=1, default=str))


# ---- set-up ---------------------------------------------------------------------------------------


def ensure_pytest_asyncio(report: Report) -> dict[str, str]:
    env = dict(os.environ)
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("pytest-asyncio").split(".")[:2])
        if (major, minor) >= (1, 5):  # tests/conftest.py uses its loop-factories hook
            return env
    except Exception:  # noqa: BLE001 - missing, or a version string we cannot read
        pass
    wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
    if not wheels:
        report.note("pytest-asyncio is missing and benchmarks/wheels/ has no wheel: async tests cannot run")
        return env
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(SITE), *wheels], check=True, timeout=120)
    sys.path.insert(0, str(SITE))
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    report.note(f"installed {', '.join(Path(w).name for w in wheels)} into {SITE}")
    return env


def build(report: Report, timeout: float) -> bool:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    report.env["build"] = f"{'ok' if done.returncode == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s"
    if done.returncode != 0:
        report.note("build failed:\n" + done.stderr[-4000:])
    report.write()
    return done.returncode == 0


DEVICE_TESTS = ["tests/gpu", "tests/test_triton_kernels.py", "tests/test_stream_notifier.py",
                "tests/test_device_cpu.py", "tests/test_device_staging.py", "tests/test_host_backend.py",
                "tests/test_staging_plane.py", "tests/test_device_drivers.py", "tests/test_device_ipc.py",
                "tests/test_device_vmm.py"]


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run_tests(report: Report, env: dict[str, str], timeout: float, paths: list[str] | None = None,
              log: str = "gpu_tests.log", workers: int = 0, verbose: bool = False) -> None:
    """pytest over ``paths`` (default: the device tests), each test bounded where pytest-timeout exists,
    spread over ``workers`` processes where pytest-xdist exists; the log goes to ``log`` under the output."""
    cmd = [sys.executable, "-m", "pytest", "-v" if verbose else "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider"]
    if _have("pytest_timeout"):
        cmd += ["--timeout", "90"]
    if workers and _have("xdist"):
        cmd += ["-n", str(workers)]
    cmd += paths or DEVICE_TESTS
    t0 = time.monotonic()
    # Written as it runs (with each test's verdict where -v is given), so a run cut short keeps what it had.
    path = report.out / log
    with open(path, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = -1
            sink.write(f"\n[timed out after {timeout:.0f} s]\n")
    text = path.read_text(errors="replace")
    summary = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
    said = (f"{summary[-1].strip() if summary else 'no summary'} (exit {code}, "
            f"{time.monotonic() - t0:.0f} s; `{' '.join(cmd[2:])}`; log: {log})")
    if log == "gpu_tests.log":
        report.tests = said
    else:
        report.env[f"tests ({log})"] = said
    print(text[-6000:], flush=True)
    report.write()


def environment(report: Report) -> None:
    import torch

    from aio_datadist.devices import kernels

    props = torch.cuda.get_device_properties(0)
    report.env.update({
        "device": f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / GIB:.0f} GiB",
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "triton": _version("triton") if kernels.available() else "not importable (kernel path off)",
        "test tools": ", ".join(f"{n} {_version(n)}" for n in ("pytest", "pytest-asyncio", "pytest-timeout",
                                                                "pytest-xdist", "uvloop", "anyio", "cython")),
    })
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        report.env["driver, SM clock, memory clock"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    report.write()


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "?"


# ---- timing helpers ---------------------------------------------------------------------------------


def device_time(fn: Callable[[], None], stream: Any, reps: int) -> float:
    """Seconds per call of ``fn`` on ``stream``, by CUDA events around ``reps`` calls (after one warm-up)."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


async def wall_time(coro_fn: Callable[[], Any], reps: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        await coro_fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await coro_fn()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ---- benchmarks --------------------------------------------------------------------------------------


def options() -> dict[str, str]:
    from aio_datadist import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    cfg.sync_kv_timeout = 60000
    return cfg.generate_options()


def random_fill(tensors: list[Any]) -> None:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in tensors:
        raw = t.view(torch.int16).view(-1)
        if raw.is_cuda:
            raw.random_(-32768, 32767, generator=gen)
        else:
            raw.random_(-32768, 32767)


def contiguous_rate(nbytes: int, reps: int) -> float:
    """The ceiling: one contiguous device-to-device copy of ``nbytes``, GB/s of data moved."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return gbps(nbytes, device_time(lambda: b.copy_(a), torch.cuda.Stream(), reps))


async def bench_copy_blocks(report: Report, dd: Any, deadline: float) -> dict[str, float]:
    import torch

    from aio_datadist import CacheDesc, DataType, Placement
    from aio_datadist.devices import kernels
    from aio_datadist.devices.copies import cache_side, enqueue_rows
    from aio_datadist.devices.streams import open_notifier

    kv, rt = dd.kv_cache_manager, dd._runtime
    backend = rt.devices
    cache = kv.allocate_blocks_cache(CacheDesc(TENSORS, (BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16,
                                               Placement.DEVICE))
    random_fill(cache.tensors)
    torch.cuda.synchronize()
    ceilings = {}
    rng = random.Random(1)
    for nblocks in (512, 64):
        if time.monotonic() > deadline:
            report.note(f"copy_blocks {nblocks}: skipped (time budget)")
            continue
        picked = rng.sample(range(BLOCKS), 2 * nblocks)
        srcs, dsts = picked[:nblocks], picked[nblocks:]
        info = {s: [d] for s, d in zip(srcs, dsts)}
        nbytes = nblocks * TENSORS * cache.layout.row_bytes
        reps = 20 if nblocks == 512 else 100
        ceiling = contiguous_rate(nbytes, reps)
        ceilings[nblocks] = ceiling
        label = f"copy_blocks {nblocks} x 32 KiB x {TENSORS} tensors ({nbytes / MIB:.0f} MiB)"
        api = await wall_time(lambda: kv.copy_blocks(cache, info), reps)
        report.row(f"{label}, API (call -> resumed)", gbps(nbytes, statistics.median(api)), "GB/s",
                   "contiguous device copy", ceiling, ">= 0.85x",
                   f"median of {reps}, method {'kernel' if kernels.available() else 'torch'}; event watcher "
                   f"{backend.notifier.watching}, (early, expired) so far {backend.notifier.watch_counts}")
        # The same calls with completions by host function only (the notifier before the event watcher).
        watched = backend.notifier
        plain = open_notifier(rt.completions.queue, "cuda", backend.device.index or 0, poll_us=0)
        backend.notifier = plain
        try:
            api_plain = await wall_time(lambda: kv.copy_blocks(cache, info), reps)
        finally:
            backend.notifier = watched
            plain.close()
        report.row(f"{label}, API, completion by host function only (poll_us=0)",
                   gbps(nbytes, statistics.median(api_plain)), "GB/s", "the API row, event watcher on",
                   gbps(nbytes, statistics.median(api)), "", f"median of {reps}")
        dside = cache_side(cache, dsts, 0, cache.layout.row_bytes)
        sside = cache_side(cache, srcs, 0, cache.layout.row_bytes)
        if kernels.available():
            # Where the API row's time goes: the host's time to enqueue one kernel copy (tables, launch), with
            # no wait, against the call -> resumed median; the completion latency rows give the wake-up.
            keep: list[Any] = []
            with torch.cuda.stream(backend.stream):
                enqueue_rows(backend, dside, sside, cache.layout.row_bytes, "kernel", keep)
                backend.stream.synchronize()
                took, whole = [], []
                for _ in range(20):
                    t0 = time.perf_counter()
                    enqueue_rows(backend, dside, sside, cache.layout.row_bytes, "kernel", keep)
                    took.append(time.perf_counter() - t0)
                    backend.stream.synchronize()
                    whole.append(time.perf_counter() - t0)
            keep.clear()
            report.row(f"{label}, host time to enqueue the kernel copy", statistics.median(took) * 1e6, "us",
                       "API call -> resumed", statistics.median(api) * 1e6, "", "median of 20, stream idle")
            report.row(f"{label}, kernel copy enqueued then stream.synchronize() (wall)",
                       gbps(nbytes, statistics.median(whole)), "GB/s", "contiguous device copy", ceiling, "",
                       "median of 20: enqueued as the API does, a blocking wait in place of validation and completion")
        if nblocks == 512 and TRACE:
            await profile_api(report, lambda: kv.copy_blocks(cache, info), f"profile_copy_blocks_{nblocks}.txt")
            try:
                await trace_api(report, lambda: kv.copy_blocks(cache, info), f"trace_copy_blocks_{nblocks}")
            except Exception as exc:  # noqa: BLE001 - a profiler problem must not cost the figures
                report.note(f"copy_blocks trace failed: {exc!r}")
        for method in ("kernel", "torch", "batch"):
            if method == "kernel" and not kernels.available():
                continue
            if method == "batch" and not backend.batch_copies:
                report.note("the driver has no cuMemcpyBatchAsync: batch rows skipped")
                continue
            keep: list[Any] = []
            try:
                t = device_time(lambda: enqueue_rows(backend, dside, sside, cache.layout.row_bytes, method, keep),
                                backend.stream, reps)
                name = {"kernel": "one-pass Triton kernel", "torch": "torch index_select + index_copy_ per tensor",
                        "batch": "cuMemcpyBatchAsync D2D"}[method]
                report.row(f"{label}, {name} (device time)", gbps(nbytes, t), "GB/s", "contiguous device copy",
                           ceiling, ">= 0.85x" if method == "kernel" else "")
            except Exception as exc:  # noqa: BLE001
                report.note(f"copy_blocks {nblocks} method {method} failed: {exc!r}")
            keep.clear()
    if kernels.available() and time.monotonic() < deadline - 60:
        await tune_kernel(report, cache, backend, ceilings.get(512))
    kv.deallocate_cache(cache)
    return ceilings


async def profile_api(report: Report, coro_fn: Callable[[], Any], name: str, reps: int = 10) -> None:
    """cProfile of ``reps`` API calls (both the loop's and the call's Python), the top of it to ``name``:
    where a call's host time goes where the device time is a fraction of it."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(reps):
            await coro_fn()
    finally:
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    report.out.mkdir(parents=True, exist_ok=True)
    (report.out / name).write_text(text.getvalue())
    report.note(f"profile of {reps} API calls written to {name}")


async def trace_api(report: Report, coro_fn: Callable[[], Any], name: str, reps: int = 5) -> None:
    """A torch.profiler trace (host Python, CUDA API calls and kernels on one clock) of ``reps`` API calls,
    gzipped Chrome trace JSON to ``name``: where a call's time goes between the host and the device."""
    import gzip

    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        for _ in range(reps):
            with torch.profiler.record_function("api_call"):
                await coro_fn()
    tmp = report.out / (name + ".json")
    prof.export_chrome_trace(str(tmp))
    with open(tmp, "rb") as raw, gzip.open(report.out / (name + ".json.gz"), "wb") as packed:
        packed.write(raw.read())
    tmp.unlink()
    (report.out / (name + ".txt")).write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    report.note(f"torch.profiler trace of {reps} API calls written to {name}.json.gz")


async def tune_kernel(report: Report, cache: Any, backend: Any, ceiling: float | None) -> None:
    """A few launch shapes of the kernel, device time only, to guide tuning."""
    from aio_datadist.devices import kernels
    from aio_datadist.devices.copies import cache_side, enqueue_rows

    rng = random.Random(2)
    picked = rng.sample(range(BLOCKS), 1024)
    dside = cache_side(cache, picked[512:], 0, cache.layout.row_bytes)
    sside = cache_side(cache, picked[:512], 0, cache.layout.row_bytes)
    nbytes = 512 * TENSORS * cache.layout.row_bytes
    defaults = (kernels.NUM_WARPS, kernels.STEP_BYTES, kernels.CHUNK_BYTES)
    try:
        for warps, step, chunk in [(4, 8192, 65536), (8, 8192, 65536), (4, 16384, 65536), (8, 16384, 65536),
                                   (4, 4096, 32768), (8, 32768, 65536)]:
            kernels.NUM_WARPS, kernels.STEP_BYTES, kernels.CHUNK_BYTES = warps, step, chunk
            keep: list[Any] = []
            t = device_time(lambda: enqueue_rows(backend, dside, sside, cache.layout.row_bytes, "kernel", keep),
                            backend.stream, 10)
            report.row("kernel tuning, 512 blocks", gbps(nbytes, t), "GB/s", "contiguous device copy", ceiling, "",
                       f"num_warps {warps}, step {step // 1024} KiB, chunk {chunk // 1024} KiB")
    finally:
        kernels.NUM_WARPS, kernels.STEP_BYTES, kernels.CHUNK_BYTES = defaults


def _swap_method(backend: Any, host: Any) -> str:
    from aio_datadist.devices import kernels

    if host._pin is not None and kernels.available():
        return "kernel"
    return "batch" if backend.batch_copies else "staged"


async def bench_swap(report: Report, dd: Any, deadline: float) -> None:
    import torch

    from aio_datadist import CacheDesc, DataType, Placement
    from aio_datadist.devices import kernels
    from aio_datadist.devices.copies import cache_side, enqueue_rows
    from aio_datadist.devices.ops import copy_rows

    kv, rt = dd.kv_cache_manager, dd._runtime
    backend = rt.devices
    dev = kv.allocate_blocks_cache(CacheDesc(TENSORS, (BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.DEVICE))
    host = kv.allocate_blocks_cache(CacheDesc(TENSORS, (HOST_BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16,
                                              Placement.HOST))
    random_fill(dev.tensors)
    for t in host.tensors:
        t.view(torch.uint8).fill_(7)
    rng = random.Random(3)
    host_rows = rng.sample(range(HOST_BLOCKS), HOST_BLOCKS)
    dev_rows = rng.sample(range(BLOCKS), HOST_BLOCKS)
    nbytes = HOST_BLOCKS * TENSORS * dev.layout.row_bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    ceil = {"H2D": gbps(nbytes, device_time(lambda: flat.copy_(pinned, non_blocking=True), s, 5)),
            "D2H": gbps(nbytes, device_time(lambda: pinned.copy_(flat, non_blocking=True), s, 5))}
    for direction in ("H2D", "D2H"):
        if time.monotonic() > deadline:
            report.note(f"swap_blocks {direction}: skipped (time budget)")
            continue
        src, dst, srows, drows = ((host, dev, host_rows, dev_rows) if direction == "H2D"
                                  else (dev, host, dev_rows, host_rows))
        mapping = dict(zip(srows, drows))
        label = f"swap_blocks {direction} {HOST_BLOCKS} x 32 KiB x {TENSORS} tensors ({nbytes / MIB:.0f} MiB)"
        api = await wall_time(lambda: kv.swap_blocks(src, dst, mapping), 5, warm=1)
        report.row(f"{label}, API", gbps(nbytes, statistics.median(api)), "GB/s", f"contiguous pinned {direction}",
                   ceil[direction], ">= 0.9x", f"median of 5, method {_swap_method(backend, host)}")
        dside = cache_side(dst, drows, 0, dst.layout.row_bytes)
        sside = cache_side(src, srows, 0, src.layout.row_bytes)
        for method in ("batch", "kernel"):
            if (method == "batch" and not backend.batch_copies) or (method == "kernel" and not kernels.available()):
                continue
            if method == "kernel" and host._pin is None:
                report.note("the host cache is not page-locked: no kernel swap row")
                continue
            keep: list[Any] = []
            try:
                t = device_time(lambda: enqueue_rows(backend, dside, sside, dst.layout.row_bytes, method, keep),
                                backend.stream, 3)
                report.row(f"{label}, {method} (device time)", gbps(nbytes, t), "GB/s",
                           f"contiguous pinned {direction}", ceil[direction], ">= 0.9x" if method == "batch" else "")
            except Exception as exc:  # noqa: BLE001
                report.note(f"swap {direction} method {method} failed: {exc!r}")
        try:
            staged = await wall_time(lambda: copy_rows(rt, dst, drows, src, srows, 0, dst.layout.row_bytes, 60000,
                                                       "swap", "staged"), 3, warm=1)
            report.row(f"{label}, staged pipeline (wall)", gbps(nbytes, statistics.median(staged)), "GB/s",
                       f"contiguous pinned {direction}", ceil[direction], "",
                       f"{rt.staging.pool.chunk_bytes // MIB} MiB x {rt.staging.pool.buffers} chunks")
        except Exception as exc:  # noqa: BLE001
            report.note(f"swap {direction} staged failed: {exc!r}")
    kv.deallocate_cache(dev)
    kv.deallocate_cache(host)


async def latency_samples(dd: Any, n: int) -> dict[str, list[float]]:
    """Stream done -> awaiting coroutine resumed, on an idle stream, three ways."""
    import concurrent.futures

    import torch

    rt = dd._runtime
    backend, comp = rt.devices, rt.completions
    notifier, handle = backend.notifier, backend.stream_handle
    loop = asyncio.get_running_loop()
    out: dict[str, list[float]] = {"ours": [], "threadpool": [], "ctypes": []}

    async def ours() -> None:
        await comp.start(lambda t: notifier.notify(t, handle, 0), notifier.cancel, timeout_ms=None, what="latency")

    pool = concurrent.futures.ThreadPoolExecutor(1)
    event = torch.cuda.Event()

    async def threadpool() -> None:
        event.record(backend.stream)
        await loop.run_in_executor(pool, event.synchronize)

    libcuda = ctypes.CDLL("libcuda.so.1")
    hostfn_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    waiting: list[asyncio.Future] = []

    def on_host(_: Any) -> None:
        fut = waiting[0]
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

    callback = hostfn_t(on_host)

    async def ctypes_cb() -> None:
        fut = loop.create_future()
        waiting[:] = [fut]
        rc = libcuda.cuLaunchHostFunc(ctypes.c_void_p(handle), callback, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc returned {rc}")
        await fut

    try:
        for name, fn in (("ours", ours), ("threadpool", threadpool), ("ctypes", ctypes_cb)):
            for _ in range(50):
                await fn()
            for _ in range(n):
                t0 = time.perf_counter()
                await fn()
                out[name].append((time.perf_counter() - t0) * 1e6)
    finally:
        pool.shutdown()
    return out


def report_latency(report: Report, samples: dict[str, list[float]], loop_name: str) -> None:
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    ours = samples["ours"]
    for name, label in (("threadpool", "thread-pool event.synchronize()"), ("ctypes", "ctypes host callback")):
        base = samples[name]
        if not base or not ours:
            continue
        report.row(f"completion latency p50, {loop_name}", pct(ours, 0.5), "us", label, pct(base, 0.5),
                   "<= 25" if name == "threadpool" else "", f"{len(ours)} samples, idle stream, notify -> resumed")
        report.row(f"completion latency p99, {loop_name}", pct(ours, 0.99), "us", label, pct(base, 0.99), "")


async def bench_latency(report: Report, dd: Any) -> None:
    try:
        report_latency(report, await latency_samples(dd, 2000), "asyncio")
    except Exception as exc:  # noqa: BLE001
        report.note(f"latency (asyncio) failed: {exc!r}")


def latency_uvloop(report: Report) -> None:
    try:
        import uvloop
    except ImportError:
        report.note("uvloop missing: no uvloop latency row")
        return
    from aio_datadist import LLMDataDist, LLMRole

    async def main() -> None:
        async with LLMDataDist(LLMRole.PROMPT, 9) as dd:
            await dd.init(options())
            report_latency(report, await latency_samples(dd, 2000), "uvloop")

    try:
        uvloop.run(main())
    except Exception as exc:  # noqa: BLE001
        report.note(f"latency (uvloop) failed: {exc!r}")


def ipc_options(listen: bool) -> dict[str, str]:
    """A CUDA endpoint on same-host links (``aio.Transport=local``): device caches go by device IPC."""
    from aio_datadist import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.device_type = "cuda"
    cfg.device_ipc = "on"  # CUDA exports are off by default (aio.DeviceIpc=auto)
    cfg.transport = "local"
    cfg.sync_kv_timeout = 60000
    if listen:
        cfg.listen_ip_info = "127.0.0.1:0"
    return cfg.generate_options()


def _ipc_owner(conn: Any) -> None:
    """The owner in its own process: a device blocks cache under key (1, 0); its port goes back over ``conn``."""
    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, Placement

    async def main() -> None:
        async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
            await dd.init(ipc_options(True))
            cache = dd.kv_cache_manager.allocate_blocks_cache(
                CacheDesc(TENSORS, (BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.DEVICE),
                BlocksCacheKey(1, 0))
            random_fill(cache.tensors)
            torch.cuda.synchronize()
            row = cache.tensors[5].view(torch.uint8).view(BLOCKS, -1)
            conn.send((dd.listen_address[1], cache.device_export is not None))
            conn.send(row.cpu())
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, conn.recv)

    asyncio.run(main())


async def bench_ipc(report: Report, ceiling: float | None, deadline: float) -> None:
    """A pull between two processes on one GPU through the device IPC plane, against a device copy of the
    same bytes inside one process, measured in the same run."""
    import multiprocessing

    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMDataDist, LLMRole, Placement

    if time.monotonic() > deadline:
        report.note("IPC pull: skipped (time budget)")
        return
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    owner = ctx.Process(target=_ipc_owner, args=(theirs,))
    owner.start()
    try:
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, mine.poll, 120):
            report.note("IPC pull: the owner process did not start within 120 s")
            return
        port, exported = mine.recv()
        want = mine.recv()
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init(ipc_options(False))
            local = dd.kv_cache_manager.allocate_blocks_cache(
                CacheDesc(TENSORS, (BLOCKS, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.DEVICE))
            info = LLMClusterInfo()
            info.remote_cluster_id = 1
            info.append_remote_ip_info("127.0.0.1", port)
            await dd.link_clusters([info], timeout=10000)
            rng = random.Random(4)
            src, dst = rng.sample(range(BLOCKS), 512), rng.sample(range(BLOCKS), 512)
            nbytes = 512 * TENSORS * local.layout.row_bytes
            pull = lambda: dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), local, src, dst)  # noqa: E731
            await pull()
            stats = dd.stats().links[1]
            taken = stats.kinds["pull"].transport
            times = await wall_time(pull, 10)
            if TRACE:
                await profile_api(report, pull, "profile_ipc_pull_512.txt", 5)
            if ceiling is None:
                ceiling = contiguous_rate(nbytes, 10)
            report.row(f"cross-process same-GPU pull, 512 blocks x {TENSORS} tensors through device IPC "
                       "(call -> resumed)", gbps(nbytes, statistics.median(times)), "GB/s",
                       "contiguous device copy of the same bytes, in one process", ceiling, ">= 0.8x",
                       f"median of 10; transport {taken}; owner exported: {exported}; "
                       f"device_ipc_off: {stats.device_ipc_off}")
            # Fixed and per-block cost: the same pull of 1 and 64 of those blocks.
            for n in (1, 64):
                few = lambda n=n: dd.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), local, src[:n],  # noqa: E731
                                                                  dst[:n])
                small = await wall_time(few, 20)
                if n == 1 and TRACE:
                    try:
                        await trace_api(report, few, "trace_ipc_pull_1")
                    except Exception as exc:  # noqa: BLE001
                        report.note(f"IPC pull trace failed: {exc!r}")
                report.row(f"cross-process same-GPU pull by device IPC, {n} block(s) (call -> resumed)",
                           statistics.median(small) * 1e6, "us", "the 512-block pull",
                           statistics.median(times) * 1e6, "", "median of 20")
            got = local.tensors[5].view(torch.uint8).view(BLOCKS, -1)[dst[0]].cpu()
            if not torch.equal(got, want[src[0]]):
                report.note("IPC pull: BYTES DIFFER for a checked block")
    except Exception as exc:  # noqa: BLE001
        report.note(f"IPC pull failed: {exc!r}\n{traceback.format_exc()[-2000:]}")
    finally:
        try:
            mine.send(b"done")
        except OSError:
            pass
        owner.join(60)
        if owner.is_alive():
            owner.kill()
            owner.join()



def _hand_pipeline(src: Any, dst: Any, chunk: int, buffers: int = 2) -> float:
    """Seconds to move ``src`` (device bytes) into ``dst`` (device bytes) as D2H -> loopback TCP -> H2D
    in ``chunk``-byte pieces, each side double-buffered with page-locked memory and its own stream."""
    import socket
    import threading

    import torch

    n = src.numel()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    out = socket.create_connection(("127.0.0.1", port))
    inn, _ = listener.accept()
    listener.close()
    for sock in (out, inn):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            stream = torch.cuda.Stream()
            bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
            events = [torch.cuda.Event() for _ in range(buffers)]
            pos = [0] * buffers
            starts = list(range(0, n, chunk))
            with torch.cuda.stream(stream):
                for i, start in enumerate(starts[:buffers]):
                    size = min(chunk, n - start)
                    bufs[i][:size].copy_(src[start:start + size], non_blocking=True)
                    events[i].record(stream)
                    pos[i] = start
                for k, start in enumerate(starts):
                    i = k % buffers
                    size = min(chunk, n - start)
                    events[i].synchronize()
                    out.sendall(memoryview(bufs[i].numpy())[:size])
                    nxt = k + buffers
                    if nxt < len(starts):
                        s2 = starts[nxt]
                        size2 = min(chunk, n - s2)
                        bufs[i][:size2].copy_(src[s2:s2 + size2], non_blocking=True)
                        events[i].record(stream)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def receiver() -> None:
        try:
            stream = torch.cuda.Stream()
            bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
            events: list[Any] = [None] * buffers
            with torch.cuda.stream(stream):
                for k, start in enumerate(range(0, n, chunk)):
                    i = k % buffers
                    size = min(chunk, n - start)
                    if events[i] is not None:
                        events[i].synchronize()  # the H2D of this buffer's last chunk is done
                    view = memoryview(bufs[i].numpy())[:size]
                    got = 0
                    while got < size:
                        got += inn.recv_into(view[got:], size - got)
                    dst[start:start + size].copy_(bufs[i][:size], non_blocking=True)
                    events[i] = torch.cuda.Event()
                    events[i].record(stream)
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=sender), threading.Thread(target=receiver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.perf_counter() - t0
    out.close()
    inn.close()
    if errors:
        raise errors[0]
    return took


async def bench_staging(report: Report, deadline: float) -> None:
    """A device pull over TCP through the staging plane against a hand-written pipeline over the same bytes."""
    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMConfig, LLMDataDist, LLMRole
    from aio_datadist import Placement
    from aio_datadist.devices.staging import DEFAULT_CHUNK_BYTES

    if time.monotonic() > deadline:
        report.note("staging pull: skipped (time budget)")
        return

    def cfg(listen: bool) -> dict[str, str]:
        c = LLMConfig()
        c.device_id = 0
        c.device_type = "cuda"
        c.transport = "tcp"
        c.sync_kv_timeout = 60000
        if listen:
            c.listen_ip_info = "127.0.0.1:0"
        return c.generate_options()

    desc = CacheDesc(TENSORS, (STAGED_BLOCKS * 2, *BLOCK_SHAPE), DataType.DT_FLOAT16, Placement.DEVICE)
    async with LLMDataDist(LLMRole.PROMPT, 1) as prompt, LLMDataDist(LLMRole.DECODER, 2) as decoder:
        await prompt.init(cfg(True))
        await decoder.init(cfg(False))
        src = prompt.kv_cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(desc)
        random_fill(src.tensors)
        torch.cuda.synchronize()
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        host, port = prompt.listen_address
        info.append_remote_ip_info(host, port)
        await decoder.link_clusters([info], timeout=5000)
        rng = random.Random(5)
        blocks = rng.sample(range(STAGED_BLOCKS * 2), STAGED_BLOCKS)
        into = rng.sample(range(STAGED_BLOCKS * 2), STAGED_BLOCKS)
        nbytes = STAGED_BLOCKS * TENSORS * src.layout.row_bytes
        times = await wall_time(lambda: decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, blocks,
                                                                              into), 5, warm=1)
        got = dst.tensors[7].view(torch.uint8).view(STAGED_BLOCKS * 2, -1)[into[3]]
        want = src.tensors[7].view(torch.uint8).view(STAGED_BLOCKS * 2, -1)[blocks[3]]
        if not torch.equal(got, want):
            report.note("staging pull: BYTES DIFFER for a checked block")
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        loop = asyncio.get_running_loop()
        hand = [await loop.run_in_executor(None, _hand_pipeline, a, b, DEFAULT_CHUNK_BYTES) for _ in range(3)]
        report.row(f"device pull over TCP through the staging plane, {STAGED_BLOCKS} random blocks x {TENSORS} "
                   "tensors (call -> resumed)", gbps(nbytes, statistics.median(times)), "GB/s",
                   "hand-written D2H + send + H2D pipeline, same bytes and chunk size",
                   gbps(nbytes, statistics.median(hand)), ">= 0.8x",
                   f"median of 5 (ceiling: median of 3), {nbytes / MIB:.0f} MiB")


async def run_benchmarks(report: Report, deadline: float) -> None:
    from aio_datadist import LLMDataDist, LLMRole

    import torch

    async with LLMDataDist(LLMRole.MIX, 1) as dd:
        await dd.init(options())
        ceilings: dict[int, float] = {}
        t0 = time.monotonic()
        try:
            ceilings = await bench_copy_blocks(report, dd, deadline - 150)
        except Exception as exc:  # noqa: BLE001
            report.note(f"copy_blocks failed: {exc!r}\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
        report.note(f"copy_blocks section: {time.monotonic() - t0:.0f} s")
        await bench_latency(report, dd)
        t0 = time.monotonic()
        try:
            await bench_swap(report, dd, deadline - 80)
        except Exception as exc:  # noqa: BLE001
            report.note(f"swap_blocks failed: {exc!r}\n{traceback.format_exc()[-2000:]}")
        torch.cuda.empty_cache()
        report.note(f"swap_blocks section: {time.monotonic() - t0:.0f} s")
        await bench_ipc(report, ceilings.get(512), deadline - 40)
        torch.cuda.empty_cache()
    try:
        await bench_staging(report, deadline - 30)
    except Exception as exc:  # noqa: BLE001
        report.note(f"staging pull failed: {exc!r}\n{traceback.format_exc()[-2000:]}")
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "gpu_out"))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--suite", type=float, default=0.0, metavar="S",
                        help="last, the whole test suite (less tests/gpu) for at most S seconds over pytest-xdist "
                             "workers: on a CUDA machine aio.DeviceType=auto puts every device cache on the GPU")
    parser.add_argument("--workers", type=int, default=12, help="pytest-xdist workers for --suite (default 12)")
    parser.add_argument("--trace", action="store_true",
                        help="also write cProfile and torch.profiler traces of the copy_blocks and IPC pull calls")
    args = parser.parse_args()
    global TRACE
    TRACE = args.trace
    start = time.monotonic()
    deadline = start + args.budget
    report = Report(Path(args.out))
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    env = ensure_pytest_asyncio(report)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if not args.skip_build and not build(report, timeout=min(240.0, args.budget / 2)):
        print(report.markdown())
        return 1
    import torch

    if not torch.cuda.is_available():
        report.note("torch sees no CUDA device: nothing to measure")
        print(report.markdown())
        return 1
    environment(report)
    if not args.skip_tests:
        run_tests(report, dict(env, AIO_DATADIST_TEST_CUDA="1"),
                  timeout=max(60.0, min(200.0, deadline - time.monotonic() - 150)), workers=args.workers)
    if not args.skip_bench:
        try:
            asyncio.run(run_benchmarks(report, deadline - args.suite))
            if time.monotonic() < deadline - args.suite - 20:
                latency_uvloop(report)
        except Exception as exc:  # noqa: BLE001
            report.note(f"benchmarks stopped: {exc!r}\n{traceback.format_exc()[-3000:]}")
    if args.suite:
        left = deadline - time.monotonic()
        if left < 30:
            report.note("whole suite: skipped (time budget)")
        else:
            run_tests(report, env, left, ["tests", "--ignore=tests/gpu"], "suite_tests.log", args.workers,
                      verbose=True)
    report.env["wall"] = f"{time.monotonic() - start:.0f} s (budget {args.budget:.0f} s)"
    report.write()
    print(report.markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
