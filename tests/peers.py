"""Endpoints for link and transfer tests: in-process pairs and spawned peers.

- :func:`options`, :func:`cluster_info`, :func:`endpoint`: one initialised
  :class:`LLMDataDist`, listening on a free loopback port when asked.
- :func:`linked_pair`: a PROMPT (listening) and a DECODER in this event loop,
  linked by the decoder. Two endpoints in one loop are supported and make
  the fastest tests.
- :func:`free_port`: a port a test hands to an endpoint before it listens
  (rank tables, ``aio.LinkPort``), chosen where no outgoing connection takes it.
- :func:`fill`, :func:`pattern`: seeded, exactly representable cache
  contents, so a spawned peer's bytes can be checked here without sending them.
- :class:`EndpointProcess` / :func:`spawned`: an endpoint in a process of its own
  (forked from the preloaded fork server once the ``fork_server`` fixture
  started it, else spawned), on loopback only, that allocates the caches of a
  :class:`CacheSpec` list with seeded contents, reports its port through a
  pipe and is then driven by small commands. It always ends: an ``exit``
  command, then terminate, then kill, each bounded in time, and it exits by
  itself if this process dies or its lifetime runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import links_of, runtime_of
from aio_datadist.transport.nixl_engine import NIXL_MODULES

LOCALHOST = "127.0.0.1"
PROMPT_ID = 1
DECODER_ID = 2

#: Small geometries: 4 tensors (2 layers of K and V) in both.
BLOCKS_DESC = CacheDesc(4, (8, 4, 16), DataType.DT_FLOAT16, Placement.HOST)  # 8 blocks of 128 B
CACHE_DESC = CacheDesc(4, (3, 256), DataType.DT_FLOAT16, Placement.HOST)  # 3 rows of 512 B


# -- one endpoint -------------------------------------------------------------


TRANSPORT = {"default": "tcp"}


def _nixl_missing() -> str:
    """Why the NIXL transport cannot run here ("" when it can); looks, does not import."""
    if any(importlib.util.find_spec(name.split(".")[0]) for name in NIXL_MODULES):
        return ""
    return f"none of {', '.join(NIXL_MODULES)} is installed"


NIXL_MISSING = _nixl_missing()
#: Transport parameters: ``nixl`` is skipped where the NIXL package cannot be imported.
TRANSPORTS = ["tcp", "local", pytest.param("nixl", marks=[pytest.mark.nixl, *(
    [pytest.mark.skip(reason=NIXL_MISSING)] if NIXL_MISSING else [])])]


def free_port(ip: str) -> int:
    """A port free on ``ip`` right now, below the kernel's ephemeral range: one ``bind(0)`` gave comes from that
    range, where the other test worker's outgoing connections (and links) may take it before an endpoint of
    ours listens on it (as ``clients/_client_harness.free_ports`` chooses its ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.SystemRandom()
    for _ in range(1000):
        port = chooser.randrange(10002, max(10003, low))  # callers may take port - 1 and port - 2 as a link port
        try:
            with socket.socket() as sock:
                sock.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port on {ip} below {low}")


def options(*, listen: bool = False, secret: str | None = None, sync_kv_timeout: int | None = None,
            switch_role: bool = False, data_channels: int | None = None,
            heartbeat_interval: int | None = None, transport: str | None = None,
            device_type: str | None = None, device_ipc: str | None = None,
            staging_buffers: int | None = None) -> dict[str, str]:
    """``LLMConfig(...).generate_options()`` for a loopback endpoint (port 0 when listening).

    The transport defaults to ``TRANSPORT["default"]``: TCP data channels, so
    tests of streaming behaviour keep testing it; tests that cover both set it.
    """
    config = LLMConfig()
    config.device_id = 0
    config.transport = transport or TRANSPORT["default"]
    if listen:
        config.listen_ip_info = f"{LOCALHOST}:0"
    if secret is not None:
        config.shared_secret = secret
    if sync_kv_timeout is not None:
        config.sync_kv_timeout = sync_kv_timeout
    if switch_role:
        config.enable_switch_role = True
    if data_channels is not None:
        config.data_channels = data_channels
    if heartbeat_interval is not None:
        config.heartbeat_interval = heartbeat_interval
    if device_type is not None:
        config.device_type = device_type
    if device_ipc is not None:
        config.device_ipc = device_ipc
    if staging_buffers is not None:
        config.staging_buffers = staging_buffers
    return config.generate_options()


def leave_during_set_up(monkeypatch: pytest.MonkeyPatch, dialler: LLMDataDist, peer: LLMDataDist) -> None:
    """Make ``peer`` finalize while ``dialler`` sets up its next link (after ``LINK_OK``, in its transport
    check); the dialler goes on once it has seen the link's control connection end (at most 5 s)."""
    from aio_datadist.link_table import LinkTable
    from aio_datadist.testing import runtime_of

    original = LinkTable._require_transport
    dialler_runtime = runtime_of(dialler)

    async def peer_goes_away(self: LinkTable, link: Any) -> None:
        if self.runtime is dialler_runtime:
            await peer.finalize()
            for _ in range(500):
                if link.broken is not None or link.closed:
                    break
                await asyncio.sleep(0.01)
        await original(self, link)

    monkeypatch.setattr(LinkTable, "_require_transport", peer_goes_away)


def cluster_info(remote_cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    """An :class:`LLMClusterInfo` naming a peer that listens on ``address``."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_remote_ip_info(address[0], address[1])
    return info


def port_of(dd: LLMDataDist) -> tuple[str, int]:
    address = dd.listen_address
    assert address is not None, "endpoint does not listen"
    return address


@contextlib.asynccontextmanager
async def endpoint(role: LLMRole, cluster_id: int, *, listen: bool = False,
                   **config: Any) -> AsyncIterator[LLMDataDist]:
    """An initialised endpoint, finalized on exit."""
    async with LLMDataDist(role, cluster_id) as dd:
        await dd.init(options(listen=listen, **config))
        yield dd


def stop_process(pid: int, bound_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` returns with the stop pending on
    one thread only: the others run until that thread gets a CPU and stops the group, and on a loaded host a
    loop thread woken by our next request meanwhile served it (a pull meant to time out succeeded)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + bound_s
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {bound_s} s: {states}"
        time.sleep(0.001)


@dataclasses.dataclass
class Pair:
    """A PROMPT that listens and a DECODER that links to it, in one loop."""

    prompt: LLMDataDist
    decoder: LLMDataDist

    @property
    def pm(self) -> Any:
        return self.prompt.kv_cache_manager

    @property
    def dm(self) -> Any:
        return self.decoder.kv_cache_manager

    @property
    def info(self) -> LLMClusterInfo:
        """The prompt, as the decoder links to it."""
        return cluster_info(self.prompt.cluster_id, port_of(self.prompt))

    async def link(self) -> None:
        status, per_cluster = await self.decoder.link_clusters([self.info], timeout=3000)
        assert (status, per_cluster) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])

    async def unlink(self, *, force: bool = False) -> None:
        status, _ = await self.decoder.unlink_clusters([self.info], force=force)
        assert status == LLMStatusCode.LLM_SUCCESS

    async def end(self, how: str) -> None:
        """End the link ``how``: ``unlink`` (the decoder unlinks), ``requester_finalizes`` (the decoder
        finalizes) or ``owner_finalizes`` (the prompt does)."""
        if how == "unlink":
            await self.unlink()
        elif how == "requester_finalizes":
            await self.decoder.finalize()
        else:
            assert how == "owner_finalizes", how
            await self.prompt.finalize()


@contextlib.asynccontextmanager
async def linked_pair(*, link: bool = True, prompt_config: dict[str, Any] | None = None,
                      decoder_config: dict[str, Any] | None = None) -> AsyncIterator[Pair]:
    """PROMPT ``PROMPT_ID`` (listening) and DECODER ``DECODER_ID``; linked unless ``link=False``.

    Blocks caches made before linking enter the compatibility check, so a
    test that needs blocks caches on both sides makes them before
    ``pair.link()`` (with ``link=False``) or with equal block geometry.
    """
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True, **(prompt_config or {})) as prompt, \
            endpoint(LLMRole.DECODER, DECODER_ID, **(decoder_config or {})) as decoder:
        pair = Pair(prompt, decoder)
        if link:
            await pair.link()
        yield pair


# -- cache contents -----------------------------------------------------------


def alone_in_a_mapping(shape: tuple[int, ...]) -> torch.Tensor:
    """An int8 tensor of ``shape`` over an anonymous mapping of its own, unmapped once nothing holds its storage:
    what a caller's freed memory is, whatever the allocator does (a process that loaded UCX keeps even large
    ``malloc`` blocks in its heap, so a ``torch.zeros`` tensor freed there stays mapped)."""
    size = 1
    for n in shape:
        size *= n
    return torch.from_numpy(np.frombuffer(mmap.mmap(-1, size), dtype=np.int8).reshape(shape))


def mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (``/proc/self/maps``): memory freed by an unmap is not."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def pattern(desc: CacheDesc, seed: int) -> list[torch.Tensor]:
    """The tensors :func:`fill` writes: small integers, exact in every float dtype."""
    dtype = desc.data_type.torch_dtype
    out = []
    for index in range(desc.num_tensors):
        gen = torch.Generator().manual_seed(seed * 10007 + index)
        out.append(torch.randint(-1000, 1000, desc.shape, generator=gen).to(dtype))
    return out


def require_local(dd: Any) -> None:
    """From now on ``dd`` refuses any transfer that would not take the same-host plane (``aio.RequireTransport``
    set to ``local`` on a running endpoint)."""
    rt = runtime_of(dd)
    rt.settings = dataclasses.replace(rt.settings, require_transport="local")


def fill(cache: KvCache, seed: int) -> list[torch.Tensor]:
    """Write :func:`pattern` into ``cache``; returns copies of what was written."""
    values = pattern(cache.cache_desc, seed)
    for tensor, value in zip(cache.tensors, values):
        tensor.copy_(value)
    return values


def snapshot(cache: KvCache) -> list[torch.Tensor]:
    """Copies of a cache's tensors (to check later that nothing was written)."""
    return [t.clone() for t in cache.tensors]


def same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- spawned endpoints ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """A cache a spawned endpoint allocates: ``fill(cache, seed)``, keys as given."""

    name: str
    desc: CacheDesc
    seed: int
    blocks: bool = False
    req_ids: tuple[int, ...] = ()  # CacheKey(own cluster, req_id) bound to rows 0, 1, ...
    model_id: int | None = None  # BlocksCacheKey(own cluster, model_id)


@dataclasses.dataclass(frozen=True)
class Ref:
    """A command argument standing for the spawned endpoint's cache ``name``."""

    name: str


@dataclasses.dataclass(frozen=True)
class EndpointSpec:
    role: LLMRole
    cluster_id: int
    listen: bool = True
    caches: tuple[CacheSpec, ...] = ()
    config: tuple[tuple[str, Any], ...] = ()
    loop: str = "asyncio"
    lifetime: float = 60.0


class PeerError(RuntimeError):
    """A spawned endpoint died, failed a command in an unexpected way, or did not answer."""


class EndpointProcess:
    """An endpoint in a spawned process; see the module docstring.

    Made by :func:`spawned`, which returns once it listens; :attr:`port` and
    :attr:`cache_ids` are known then. ``await call(command, *args)`` runs one
    command there and returns its result; an ``LLMException`` there is raised
    here with the same status code. Commands: ``kv`` (a ``KvCacheManager``
    method, :class:`Ref` standing for its caches), ``link`` / ``unlink``
    (cluster id, port), ``check_link`` (cluster id), ``links`` (cluster id ->
    "up" | "broken"), ``dump`` (cache name -> bytes per tensor), ``exit``.
    """

    def __init__(self, spec: EndpointSpec, target: Any = None) -> None:
        self.spec = spec
        ctx = process_context()
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._child_conn: multiprocessing.connection.Connection | None = child_conn
        self._process = ctx.Process(target=target or _endpoint_main, args=(child_conn, spec, os.getpid()),
                                    name=f"endpoint-{spec.cluster_id}", daemon=True)
        self.port: int = 0
        self.cache_ids: dict[str, int] = {}
        self._started = False
        self._closed = False
        self._reaped = False

    @property
    def address(self) -> tuple[str, int]:
        return (LOCALHOST, self.port)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def info(self) -> LLMClusterInfo:
        return cluster_info(self.spec.cluster_id, self.address)

    def expected(self, name: str) -> list[torch.Tensor]:
        """What the spawned endpoint wrote into its cache ``name``."""
        cache = next(c for c in self.spec.caches if c.name == name)
        return pattern(cache.desc, cache.seed)

    def _launch(self) -> None:
        self._process.start()
        self._started = True
        assert self._child_conn is not None
        self._child_conn.close()  # so that recv here sees EOF when the child dies
        self._child_conn = None

    async def _ready(self, timeout: float = 60.0) -> None:
        ready = await self._recv(timeout, "its start")
        if ready[0] != "ready":
            raise PeerError(f"endpoint {self.spec.cluster_id} failed to start:\n{ready[1]}")
        self.port, self.cache_ids = ready[1]["port"], ready[1]["caches"]

    async def _recv(self, timeout: float, what: str) -> Any:
        try:
            await wait_readable(self._conn, timeout)
        except TimeoutError:
            raise PeerError(f"endpoint {self.spec.cluster_id}: no answer to {what} within {timeout} s") from None
        try:
            return self._conn.recv()
        except EOFError:
            self._process.join(1.0)
            raise PeerError(f"endpoint {self.spec.cluster_id} ended (exit code {self._process.exitcode}) "
                            f"before answering {what}") from None

    def send(self, command: str, *args: Any, **kwargs: Any) -> None:
        """Send a command without waiting for its answer (collect it with :meth:`answer`)."""
        self._conn.send((command, args, kwargs))

    async def answer(self, timeout: float = 30.0) -> Any:
        """The answer to the oldest command sent and not answered yet."""
        reply = await self._recv(timeout, "a command")
        kind, value = reply[0], reply[1:]
        if kind == "ok":
            return value[0]
        if kind == "llm":
            raise LLMException(value[1], status_code=value[0])
        raise PeerError(f"endpoint {self.spec.cluster_id}: command failed:\n{value[0]}")

    async def call(self, command: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        self.send(command, *args, **kwargs)
        return await self.answer(timeout)

    def kill(self) -> None:
        """SIGKILL the process now (a crash: no finalize, no unlink)."""
        self._process.kill()

    def stop(self) -> None:
        """SIGSTOP: the process stays alive but answers nothing (every thread stopped once this returns)."""
        assert self.pid is not None
        stop_process(self.pid)

    def resume(self) -> None:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGCONT)

    async def close(self, grace: float = 10.0) -> None:
        """Ask for ``exit``, then terminate, then kill; reap; close the pipe. Idempotent."""
        if self._closed:
            return
        self._closed = True
        p = self._process
        try:
            if self._started and p.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    self.resume()
                    self.send("exit")
                await _join(p, grace)
                for signal_it in (p.terminate, p.kill):
                    if p.is_alive():
                        signal_it()
                        await _join(p, 5.0)
        finally:
            self.reap()

    def reap(self) -> None:
        """Kill (if still alive) and reap at once, close the pipes; a no-op the second time."""
        if self._reaped:
            return
        self._reaped = True
        self._closed = True
        p = self._process
        if self._started:
            if p.is_alive():
                p.kill()
            p.join(5.0)
            if not p.is_alive():
                p.close()
        self._conn.close()
        if self._child_conn is not None:
            self._child_conn.close()


async def wait_readable(conn: multiprocessing.connection.Connection, timeout: float) -> None:
    """Wait (without blocking the loop) until ``conn`` has a message; ``TimeoutError`` after ``timeout``.
    The fd is left blocking again, so the ``recv()`` that follows reads the whole message."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        async with asyncio.timeout(timeout):
            await readable
    finally:
        loop.remove_reader(fd)
        os.set_blocking(fd, True)  # uvloop's add_reader made it non-blocking; a message may still be arriving


async def _join(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait (without blocking the loop) for ``process`` to end, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        await asyncio.to_thread(process.join, min(0.5, max(deadline - time.monotonic(), 0.0)))


@contextlib.asynccontextmanager
async def spawned(*specs: EndpointSpec, target: Any = None) -> AsyncIterator[list[EndpointProcess]]:
    """Start endpoint processes together; every one is closed on exit, even on failure.

    ``target`` replaces the child's body (``_endpoint_main``): a module-level
    ``(conn, spec, parent_pid)`` function that sends ``("ready", {...})`` and
    then answers commands as :func:`run_endpoint` and ``_serve`` do.
    """
    procs = [EndpointProcess(spec, target) for spec in specs]
    try:
        for proc in procs:
            proc._launch()
        for proc in procs:
            await proc._ready()
        yield procs
    finally:
        await asyncio.gather(*(p.close() for p in procs), return_exceptions=True)
        for proc in procs:  # in case close() itself was interrupted
            proc.reap()


# -- the child's side ---------------------------------------------------------------


def process_context() -> Any:
    """The fork server's context once it runs (the ``fork_server`` fixture starts it before a test looks at
    its fds), else ``spawn``: a peer forked from the preloaded server starts in tens of milliseconds."""
    from multiprocessing import forkserver

    running = getattr(forkserver._forkserver, "_forkserver_pid", None) is not None
    return multiprocessing.get_context("forkserver" if running else "spawn")


def _watchdog(parent_pid: int, deadline: float) -> None:
    # The test process may not be our parent (a fork server's children are the server's): ask whether it lives.
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.2)


def _endpoint_main(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int) -> None:
    run_endpoint(conn, spec, parent_pid, _serve, _watchdog)


def run_endpoint(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int,
                 serve: Any, watchdog: Any) -> None:
    """A child's body: a watchdog thread, then ``serve(conn, spec)`` on the spec's loop; errors go to ``conn``."""
    threading.Thread(target=watchdog, args=(parent_pid, time.monotonic() + spec.lifetime), daemon=True).start()
    factory = None
    if spec.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(conn, spec))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()


async def _next_command(conn: multiprocessing.connection.Connection) -> Any:
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(conn.fileno())
    os.set_blocking(conn.fileno(), True)  # see EndpointProcess._recv
    try:
        return conn.recv()
    except EOFError:
        return ("exit", (), {})


async def _serve(conn: multiprocessing.connection.Connection, spec: EndpointSpec) -> None:
    async with LLMDataDist(spec.role, spec.cluster_id) as dd:
        await dd.init(options(listen=spec.listen, **dict(spec.config)))
        kv = dd.kv_cache_manager
        caches: dict[str, KvCache] = {}
        for c in spec.caches:
            if c.blocks:
                key = None if c.model_id is None else BlocksCacheKey(spec.cluster_id, c.model_id)
                caches[c.name] = kv.allocate_blocks_cache(c.desc, key)
            else:
                keys = [CacheKey(spec.cluster_id, req_id) for req_id in c.req_ids]
                caches[c.name] = kv.allocate_cache(c.desc, keys)
            fill(caches[c.name], c.seed)
        port = dd.listen_address[1] if dd.listen_address else 0
        conn.send(("ready", {"port": port, "caches": {n: c.cache_id for n, c in caches.items()}}))
        while True:
            command, args, kwargs = await _next_command(conn)
            if command == "exit":
                break
            try:
                result = await _run_command(dd, caches, command, args, kwargs)
            except LLMException as exc:
                conn.send(("llm", int(exc.status_code), str(exc)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))


async def _run_command(dd: LLMDataDist, caches: dict[str, KvCache], command: str, args: tuple,
                       kwargs: dict) -> Any:
    def resolve(value: Any) -> Any:
        return caches[value.name] if isinstance(value, Ref) else value

    if command == "kv":
        method = getattr(dd.kv_cache_manager, args[0])
        result = method(*map(resolve, args[1:]), **{k: resolve(v) for k, v in kwargs.items()})
        if asyncio.iscoroutine(result):
            result = await result
        return None if isinstance(result, KvCache) else result
    if command == "link":
        remote_id, port = args
        status, codes = await dd.link_clusters([cluster_info(remote_id, (LOCALHOST, port))], **kwargs)
        return int(status), [int(c) for c in codes]
    if command == "unlink":
        remote_id, port = args
        status, codes = await dd.unlink_clusters([cluster_info(remote_id, (LOCALHOST, port))], **kwargs)
        return int(status), [int(c) for c in codes]
    if command == "check_link":
        await dd.check_link_status(args[0])
        return None
    if command == "links":
        return {cid: ("broken" if link.broken else "up") for cid, link in links_of(dd).items() if not link.closed}
    if command == "dump":
        return [t.numpy().tobytes() for t in caches[args[0]].tensors]
    raise ValueError(f"unknown command {command!r}")


def tensors_from_dump(desc: CacheDesc, dump: list[bytes]) -> list[torch.Tensor]:
    """Turn a ``dump`` answer back into tensors of ``desc``."""
    dtype = desc.data_type.torch_dtype
    return [torch.frombuffer(bytearray(raw), dtype=dtype).view(desc.shape) for raw in dump]


# -- a push cut mid-way, and which blocks of it landed -------------------------------------------------------

MARK = 0xCD


def last_bytes(cache: KvCache) -> torch.Tensor:
    """The last byte of each block of each tensor of ``cache``: which blocks of a transfer have landed."""
    return torch.stack([t.view(t.shape[0], -1)[:, -1].clone() for t in cache.tensors])


def mark_and_clear(src: KvCache, dst: KvCache) -> None:
    """``src`` filled with :data:`MARK`, ``dst`` zeroed: a block of ``dst`` whose last byte is not 0 has landed."""
    for t in src.tensors:
        t.fill_(MARK)
    for t in dst.tensors:
        t.zero_()


async def push_until_it_lands(manager: Any, key: BlocksCacheKey, src: KvCache, dst: KvCache, rows: list[int],
                              timeout_ms: int) -> asyncio.Task:
    """Start ``manager.push_blocks(key, src, rows, rows)`` and return once its first block landed in ``dst`` (or
    it ended; 20,000 loop turns at most): its task, whose result is "done" or the failure's status name."""
    async def push() -> str:
        try:
            await manager.push_blocks(key, src, rows, rows, timeout=timeout_ms)
            return "done"
        except LLMException as exc:
            return exc.status_code.name

    task = asyncio.ensure_future(push())
    for _ in range(20_000):
        if task.done() or bool((last_bytes(dst) == MARK).any()):
            break
        await asyncio.sleep(0)
    return task
