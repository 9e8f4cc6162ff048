"""pytest fixtures for testing code that uses aio_datadist.

This module is a pytest plugin, registered through the ``pytest11`` entry
point, so it is available in every pytest run of an environment where
aio_datadist is installed. It is opt-in: it defines two fixtures and nothing
else (no hooks, options or markers), so a test that does not ask for one of
them runs exactly as without the plugin. At module level it imports only the
standard library, pytest and pytest-asyncio; the library's modules are
imported where they are used (importing this module still runs the
``aio_datadist`` package's ``__init__``; see docs/testing.md).

Fixtures (async; they need pytest-asyncio, in strict or auto mode, and run on
the event loop of the test that asks for them):

``datadist_pair`` -> :class:`DataDistPair`
    A PROMPT (cluster :data:`PROMPT_CLUSTER_ID`, listening on 127.0.0.1) and a
    DECODER (cluster :data:`DECODER_CLUSTER_ID`) in this process, linked,
    with keyed caches on both sides; finalized after the test.

``datadist_process_pair`` -> :class:`ProcessPair`
    The same, with the PROMPT in a spawned process; the process is stopped,
    and killed if it does not stop, after the test.

In both, the prompt's caches hold :func:`seeded_pattern` contents, so a test
can check every byte it pulled. :func:`open_pair` and
:func:`open_process_pair` are the context managers behind the fixtures (other
seeds or options); :func:`loopback_options` builds ``init`` options for
endpoints of your own.

Inspection helpers let a test look inside an initialized endpoint without
reaching through its private attributes: :func:`runtime_of`,
:func:`registry_of`, :func:`engine_state` (what a finished transfer must have
given back; :func:`settled_engine_state` waits for the owner's side to give it
back), :func:`link_table_of`, :func:`links_of`, :func:`link_to`,
:func:`usable_link`, :func:`link_count`, :func:`handshakes_in_progress`,
:func:`admission_of`, :func:`share_listener_of` and :func:`nixl_agent_of`.
What they return are the library's internal objects: fine to look at in a
test, not an API to build on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

    from aio_datadist import BlocksCacheKey, CacheDesc, CacheKey, KvCache, LLMDataDist
    from aio_datadist.admission import Admission
    from aio_datadist.cache import CacheRegistry
    from aio_datadist.link_table import LinkTable
    from aio_datadist.links import Link
    from aio_datadist.runtime import Runtime
    from aio_datadist.transport.local import LocalListener
    from aio_datadist.transport.nixl_agent import NixlAgent

__all__ = [
    "DECODER_CLUSTER_ID",
    "DEFAULT_SEED",
    "PROMPT_CLUSTER_ID",
    "ROW_REQ_IDS",
    "DataDistPair",
    "ProcessPair",
    "admission_of",
    "blocks_desc",
    "engine_state",
    "handshakes_in_progress",
    "link_count",
    "link_table_of",
    "link_to",
    "links_of",
    "loopback_options",
    "nixl_agent_of",
    "open_pair",
    "open_process_pair",
    "registry_of",
    "rows_desc",
    "runtime_of",
    "seeded_pattern",
    "settled_engine_state",
    "share_listener_of",
    "usable_link",
]

LOOPBACK = "127.0.0.1"
PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
#: ``model_id`` of the blocks caches' ``BlocksCacheKey`` on both sides.
MODEL_ID = 0
#: ``req_id`` of the ``CacheKey`` naming row ``i`` of the prompt's rows cache.
ROW_REQ_IDS = (101, 102)
DEFAULT_SEED = 1234
#: Blocks caches: 2 layers (K, V) = 4 tensors of 8 blocks of 4 x 16 fp16 (128 bytes a block).
BLOCKS_GEOMETRY = (4, (8, 4, 16))
#: Rows caches: 4 tensors of 2 rows of 256 fp16 (512 bytes a row).
ROWS_GEOMETRY = (4, (2, 256))
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
COMMAND_TIMEOUT_S = 60.0
SETTLE_POLL_S = 0.005


# -- helpers --------------------------------------------------------------------------------


def loopback_options(listen: bool | int = False, **config: Any) -> dict[str, str]:
    """``LLMConfig`` options for an endpoint on 127.0.0.1, for ``await dd.init(...)``.

    :param listen: ``True`` listens on a free port (read it from
        ``dd.listen_address`` after ``init``), an ``int`` on that port,
        ``False`` does not listen.
    :param config: ``LLMConfig`` properties by name, for example
        ``sync_kv_timeout=5000``, ``shared_secret="s"``, ``data_channels=1``;
        ``device_id`` is 0 unless given.
    :raises TypeError: for a name that is not an ``LLMConfig`` property, or a
        ``listen`` that is neither a bool nor a port number.
    :raises LLMException: ``LLM_PARAM_INVALID`` for a bad property value.
    """
    from aio_datadist import LLMConfig

    cfg = LLMConfig()
    cfg.device_id = 0
    for name, value in config.items():
        if name.startswith("_") or callable(getattr(LLMConfig, name, None)):
            raise TypeError(f"loopback_options() got an unexpected keyword argument {name!r}")
        try:
            setattr(cfg, name, value)
        except AttributeError:
            raise TypeError(f"loopback_options() got an unexpected keyword argument {name!r} "
                            "(not an LLMConfig property)") from None
    if isinstance(listen, bool):
        if listen:
            cfg.listen_ip_info = f"{LOOPBACK}:0"
    elif isinstance(listen, int) and 0 <= listen <= 65535:
        cfg.listen_ip_info = f"{LOOPBACK}:{listen}"
    else:
        raise TypeError(f"listen must be a bool or a port number, got {listen!r}")
    return cfg.generate_options()


def blocks_desc() -> CacheDesc:
    """The fixtures' blocks caches: ``CacheDesc(4, (8, 4, 16), DT_FLOAT16, HOST)``."""
    from aio_datadist import CacheDesc, DataType, Placement

    return CacheDesc(BLOCKS_GEOMETRY[0], BLOCKS_GEOMETRY[1], DataType.DT_FLOAT16, Placement.HOST)


def rows_desc() -> CacheDesc:
    """The fixtures' contiguous caches: ``CacheDesc(4, (2, 256), DT_FLOAT16, HOST)``."""
    from aio_datadist import CacheDesc, DataType, Placement

    return CacheDesc(ROWS_GEOMETRY[0], ROWS_GEOMETRY[1], DataType.DT_FLOAT16, Placement.HOST)


def seeded_pattern(desc: CacheDesc, seed: int) -> list[torch.Tensor]:
    """The contents the fixtures write into a prompt cache of ``desc``: one CPU tensor per cache tensor.

    Tensor ``i`` is ``torch.randint(0, 128, desc.shape,
    generator=torch.Generator().manual_seed(seed * 1000 + i),
    dtype=torch.int16)`` converted to the cache's dtype: small integers,
    exact in fp16, bf16, fp32 and every integer dtype, and the same in every
    process.
    """
    import torch

    dtype = desc.data_type.torch_dtype
    return [torch.randint(0, 128, desc.shape, generator=torch.Generator().manual_seed(seed * 1000 + i),
                          dtype=torch.int16).to(dtype)
            for i in range(desc.num_tensors)]


def _fill(cache: KvCache, seed: int) -> None:
    for tensor, value in zip(cache.tensors, seeded_pattern(cache.cache_desc, seed), strict=True):
        tensor.copy_(value)


def _cluster(remote_cluster_id: int, address: tuple[str, int]) -> Any:
    from aio_datadist import LLMClusterInfo

    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_remote_ip_info(address[0], address[1])
    return info


# -- inspection ------------------------------------------------------------------------------
# What a test looks at inside an endpoint, in one place: the endpoint's internals may move, these
# names stay. Each takes an initialized ``LLMDataDist`` (or the blocking ``aio_datadist.compat`` one)
# and raises its ``LLMException`` (``LLM_FAILED`` before ``init``, ``LLM_ENGINE_FINALIZED`` after
# ``finalize``) for one that is not, ``LLM_PARAM_INVALID`` for anything else.


def _endpoint(dd: Any) -> LLMDataDist:
    """The async endpoint ``dd`` is or wraps, as ``metrics.instrument`` takes it (imported on use: see above)."""
    from aio_datadist.datadist import endpoint_of

    return endpoint_of(dd)


def runtime_of(dd: LLMDataDist) -> Runtime:
    """``dd``'s runtime: settings, engines, registry, arrivals and device of the endpoint."""
    return _endpoint(dd)._require_runtime()


def registry_of(dd: LLMDataDist) -> CacheRegistry:
    """``dd``'s cache registry (``by_key``, ``by_blocks_key``, ``caches()``, ``used_bytes``)."""
    return _endpoint(dd)._require_runtime().registry


def engine_state(dd: LLMDataDist) -> dict[str, int]:
    """What ``dd`` holds that a finished transfer must have given back.

    Keys: ``"pending tokens"`` (native completions not yet delivered),
    ``"socket jobs"`` and ``"copy jobs"`` (running in the socket and copy
    engines), ``"registered bytes"`` and ``"caches"`` (of the registry) and
    ``"claimed keys"`` (key bindings an owner holds while it serves them) and
    ``"serving registered"`` (jobs serving peers against registered caches,
    which unregistering them cuts). Compare one taken before with one taken after.
    """
    rt = _endpoint(dd)._require_runtime()
    return {
        "pending tokens": rt.completions.pending_count(),
        "socket jobs": rt.sockets.pending(),
        "copy jobs": rt.copier.pending(),
        "registered bytes": rt.registry.used_bytes,
        "caches": len(rt.registry),
        "claimed keys": len(rt.registry._reserved),
        "serving registered": rt.registry.serving_count(),
    }


async def settled_engine_state(dd: LLMDataDist, expected: Mapping[str, int], timeout: float = 2.0) -> dict[str, int]:
    """:func:`engine_state` of ``dd`` once it equals ``expected``, or as it is after ``timeout`` seconds.

    For the owner's side of a transfer: a pull by a key the pull consumes (``pull_cache`` of a
    ``CacheKey``) returns to the requester before the owner has its ``DONE``, and until then the owner
    still holds the key's claim (``"claimed keys"``); nothing signals that arrival to a test, so this
    looks again every few milliseconds. Compare what it returns with ``expected``.
    """
    from aio_datadist._checks import param_invalid, param_type_error

    if not isinstance(expected, Mapping):
        raise param_type_error("expected", f"expected a mapping as engine_state returns, got {type(expected).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise param_invalid("timeout", f"expected seconds, a number >= 0, got {timeout!r}")
    expected = dict(expected)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        state = engine_state(dd)
        if state == expected or loop.time() >= deadline:
            return state
        await asyncio.sleep(SETTLE_POLL_S)


def link_table_of(dd: LLMDataDist) -> LinkTable:
    """``dd``'s link table itself (for a test that wraps one of its methods, or that takes it before finalize to
    look at it after: like every helper here, this raises ``LLM_ENGINE_FINALIZED`` once ``dd`` is finalized)."""
    return _endpoint(dd)._require_links()


def links_of(dd: LLMDataDist) -> dict[int, Link]:
    """A copy of ``dd``'s links by remote cluster id, in whatever state (broken or closed ones included)."""
    return dict(_endpoint(dd)._require_links().links)


def link_to(dd: LLMDataDist, cluster_id: int) -> Link | None:
    """``dd``'s link to ``cluster_id`` in whatever state, or None if it has none.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``cluster_id`` when it is not a cluster id."""
    from aio_datadist._checks import check_uint

    return _endpoint(dd)._require_links().links.get(check_uint("cluster_id", cluster_id))


def usable_link(dd: LLMDataDist, cluster_id: int) -> Link:
    """``dd``'s usable link to ``cluster_id``, as a transfer would find it.

    :raises LLMException: ``LLM_NOT_YET_LINK`` if there is none (or it is
        closed), the link's failure (``LLM_LINK_FAILED``) if it is broken;
        ``LLM_PARAM_INVALID`` naming ``cluster_id`` when it is not a cluster id.
    """
    from aio_datadist._checks import check_uint

    return _endpoint(dd)._require_links().get(check_uint("cluster_id", cluster_id))


def link_count(dd: LLMDataDist) -> int:
    """How many links of ``dd`` are not closed."""
    return _endpoint(dd)._require_links().count()


def handshakes_in_progress(dd: LLMDataDist) -> int:
    """Incoming connections ``dd`` accepted that are not through their handshake yet."""
    return len(_endpoint(dd)._require_links().listener.handshakes)


def admission_of(dd: LLMDataDist) -> Admission | None:
    """The admission gate of ``dd``'s listener (its ``arriving`` stage, ``tasks()``), or None if it does not listen."""
    return _endpoint(dd)._require_links().listener.admission


def share_listener_of(dd: LLMDataDist) -> LocalListener | None:
    """``dd``'s same-host share listener (``name``, ``pending()``), or None if it shares no memory."""
    return _endpoint(dd)._require_links().listener.local_listener


def nixl_agent_of(dd: LLMDataDist) -> NixlAgent | None:
    """``dd``'s NIXL plane (``engine.posted``, ``engine.in_flight()``, ``registered(cache)``), or None without NIXL."""
    return _endpoint(dd)._require_links().nixl


# -- the pairs ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Decoder:
    decoder: LLMDataDist
    decoder_blocks: KvCache
    decoder_rows: KvCache
    seed: int

    def _release(self) -> None:
        # The endpoints are finalized: drop the cache views, so their memory goes now and not
        # whenever the test framework lets go of this object.
        for name in ("decoder_blocks", "decoder_rows", "prompt_blocks", "prompt_rows"):
            if hasattr(self, name):
                setattr(self, name, None)

    @property
    def prompt_cluster_id(self) -> int:
        return PROMPT_CLUSTER_ID

    @property
    def decoder_cluster_id(self) -> int:
        return DECODER_CLUSTER_ID

    @property
    def blocks_key(self) -> BlocksCacheKey:
        """The prompt's blocks cache, to pull from: ``BlocksCacheKey(PROMPT_CLUSTER_ID, 0)``."""
        from aio_datadist import BlocksCacheKey

        return BlocksCacheKey(PROMPT_CLUSTER_ID, MODEL_ID)

    @property
    def decoder_blocks_key(self) -> BlocksCacheKey:
        """The decoder's blocks cache, to push into: ``BlocksCacheKey(DECODER_CLUSTER_ID, 0)``."""
        from aio_datadist import BlocksCacheKey

        return BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID)

    def row_key(self, row: int) -> CacheKey:
        """The key of row ``row`` of the prompt's rows cache (a successful pull by it consumes it)."""
        from aio_datadist import CacheKey

        return CacheKey(PROMPT_CLUSTER_ID, ROW_REQ_IDS[row])

    @property
    def expected_blocks(self) -> list[torch.Tensor]:
        """What the prompt's blocks cache holds: ``seeded_pattern(blocks_desc(), seed)``."""
        return seeded_pattern(blocks_desc(), self.seed)

    @property
    def expected_rows(self) -> list[torch.Tensor]:
        """What the prompt's rows cache holds: ``seeded_pattern(rows_desc(), seed + 1)``."""
        return seeded_pattern(rows_desc(), self.seed + 1)


@dataclasses.dataclass
class DataDistPair(_Decoder):
    """A linked PROMPT and DECODER in this process (the ``datadist_pair`` fixture).

    Prompt (cluster 1, listening on 127.0.0.1): ``prompt_blocks`` (keyed
    :attr:`blocks_key`, holding :attr:`expected_blocks`) and ``prompt_rows``
    (row ``i`` keyed :meth:`row_key` ``(i)``, holding :attr:`expected_rows`).
    Decoder (cluster 2): ``decoder_blocks`` (keyed :attr:`decoder_blocks_key`)
    and ``decoder_rows``, both zero. The decoder linked to the prompt; both
    ends can use the link.
    """

    prompt: LLMDataDist = dataclasses.field(kw_only=True)
    prompt_blocks: KvCache = dataclasses.field(kw_only=True)
    prompt_rows: KvCache = dataclasses.field(kw_only=True)


@dataclasses.dataclass
class ProcessPair(_Decoder):
    """A PROMPT in a spawned process and a DECODER here, linked (the ``datadist_process_pair`` fixture).

    The prompt process holds the same caches and contents as in
    :class:`DataDistPair` (ids in :attr:`prompt_cache_ids`) and serves pulls
    until the fixture ends. :meth:`prompt_push_blocks` makes it push.
    """

    prompt_address: tuple[str, int] = dataclasses.field(kw_only=True)
    prompt_cache_ids: dict[str, int] = dataclasses.field(kw_only=True)
    _process: Any = dataclasses.field(kw_only=True, repr=False)
    _conn: Any = dataclasses.field(kw_only=True, repr=False)
    _lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock, repr=False)
    _sent: int = dataclasses.field(default=0, repr=False)

    @property
    def prompt_pid(self) -> int:
        """The prompt process's id; ``RuntimeError`` once the pair was closed (the process reaped)."""
        return self._open_process().pid

    def _open_process(self) -> Any:
        try:
            self._process.pid  # noqa: B018 -- raises once the process object was closed by the pair's end
        except ValueError:
            raise RuntimeError("the prompt process was reaped: its pair is closed") from None
        return self._process

    async def _answer(self, seq: int, wait: float) -> Any:
        """The prompt's answer to command ``seq`` (answers to earlier commands dropped), within ``wait`` s."""
        deadline = time.monotonic() + wait
        while True:
            reply = await _recv(self._conn, max(0.0, deadline - time.monotonic()), "push_blocks", wait)
            if reply[0] == seq or reply[0] == "error":  # else: the answer to a call that ran out of time
                return reply

    def kill_prompt(self) -> None:
        """SIGKILL the prompt process (a crash: no unlink) and return once it is gone (at most 5 s), so that its
        sockets are closed and its peers can tell; the fixture still reaps it. ``RuntimeError`` once the pair
        was closed."""
        process = self._open_process()
        process.kill()
        process.join(5)

    async def prompt_push_blocks(self, src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
                                 timeout: int | None = 5000) -> None:
        """Have the prompt ``push_blocks`` its blocks into ``decoder_blocks``; returns once they are in place.

        Waits for the prompt's answer at most ``COMMAND_TIMEOUT_S`` or the push's own ``timeout`` (ms; None:
        the prompt endpoint's default) and 5 s, whichever is longer. A call cancelled before its answer came
        returns (raising the cancel) once the prompt answered, as a cancelled transfer ends before it raises,
        so no byte of the push lands after it; each command carries a number the prompt echoes, and an answer
        left by a call that ran out of time is dropped.

        :raises LLMException: as raised by ``push_blocks`` in the prompt process.
        :raises RuntimeError: if the prompt process failed otherwise, is gone or did not answer in time.
        """
        wait = COMMAND_TIMEOUT_S if timeout is None else max(COMMAND_TIMEOUT_S, timeout / 1000 + 5)  # before sending
        async with self._lock:
            self._sent += 1
            seq = self._sent
            try:
                self._conn.send(("push_blocks", seq, list(src_blocks), list(dst_blocks), timeout))
            except OSError as exc:
                process = self._open_process()  # (a pair closed: said as such)
                raise RuntimeError(f"the prompt process is gone (exit code {process.exitcode})") from exc
            answer = asyncio.ensure_future(self._answer(seq, wait))
            try:
                reply = await asyncio.shield(answer)
            except asyncio.CancelledError:
                # The push goes on in the prompt process: the cancel is raised once it answered (or in ``wait``,
                # which bounds this), whatever more cancels come meanwhile. Before, a second cancel returned at
                # once: the push landed after the call, and the answer's reader, left behind, later removed the
                # reader of the next call, which then waited out its time for an answer already there (a hunt).
                while not answer.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([answer])
                if not answer.cancelled():
                    answer.exception()
                raise
        if reply[0] == "error":  # the prompt process failed, not its push
            raise RuntimeError(f"the prompt process failed:\n{reply[1]}")
        if reply[1] == "llm":
            from aio_datadist import LLMException

            raise LLMException(reply[3], status_code=reply[2])
        if reply[1] != "ok":
            raise RuntimeError(f"the prompt process failed:\n{reply[2]}")


@contextlib.asynccontextmanager
async def open_pair(*, seed: int = DEFAULT_SEED, prompt_config: Mapping[str, Any] | None = None,
                    decoder_config: Mapping[str, Any] | None = None) -> AsyncIterator[DataDistPair]:
    """The ``datadist_pair`` fixture as an async context manager.

    :param seed: seed of the prompt's contents (rows use ``seed + 1``).
    :param prompt_config: ``LLMConfig`` properties for the prompt (see :func:`loopback_options`).
    :param decoder_config: the same for the decoder.
    """
    from aio_datadist import LLMDataDist, LLMRole

    async with contextlib.AsyncExitStack() as stack:
        prompt = LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER_ID)
        stack.push_async_callback(prompt.finalize)
        await prompt.init(loopback_options(listen=True, **(prompt_config or {})))
        prompt_blocks, prompt_rows = _prompt_caches(prompt, seed)
        decoder = LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER_ID)
        stack.push_async_callback(decoder.finalize)
        await decoder.init(loopback_options(**(decoder_config or {})))
        decoder_blocks, decoder_rows = _decoder_caches(decoder)
        assert prompt.listen_address is not None
        await _link(decoder, prompt.listen_address)
        pair = DataDistPair(decoder, decoder_blocks, decoder_rows, seed, prompt=prompt,
                            prompt_blocks=prompt_blocks, prompt_rows=prompt_rows)
        del prompt_blocks, prompt_rows, decoder_blocks, decoder_rows
        stack.callback(pair._release)
        yield pair


def _prompt_caches(prompt: LLMDataDist, seed: int) -> tuple[KvCache, KvCache]:
    from aio_datadist import BlocksCacheKey, CacheKey

    kv = prompt.kv_cache_manager
    blocks = kv.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(PROMPT_CLUSTER_ID, MODEL_ID))
    rows = kv.allocate_cache(rows_desc(), [CacheKey(PROMPT_CLUSTER_ID, req_id) for req_id in ROW_REQ_IDS])
    _fill(blocks, seed)
    _fill(rows, seed + 1)
    return blocks, rows


def _decoder_caches(decoder: LLMDataDist) -> tuple[KvCache, KvCache]:
    from aio_datadist import BlocksCacheKey

    kv = decoder.kv_cache_manager
    return (kv.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID)),
            kv.allocate_cache(rows_desc()))


async def _link(decoder: LLMDataDist, address: tuple[str, int]) -> None:
    from aio_datadist import LLMStatusCode

    status, per_cluster = await decoder.link_clusters([_cluster(PROMPT_CLUSTER_ID, address)], timeout=10_000)
    if status != LLMStatusCode.LLM_SUCCESS:
        raise RuntimeError(f"linking the decoder to the prompt at {address[0]}:{address[1]} failed: "
                           f"{per_cluster[0]!s}")


@contextlib.asynccontextmanager
async def open_process_pair(*, seed: int = DEFAULT_SEED, prompt_config: Mapping[str, Any] | None = None,
                            decoder_config: Mapping[str, Any] | None = None,
                            start_timeout: float = START_TIMEOUT_S) -> AsyncIterator[ProcessPair]:
    """The ``datadist_process_pair`` fixture as an async context manager.

    The prompt runs in a process of the ``spawn`` context (it imports torch
    and aio_datadist afresh: a second or two). On exit the decoder is
    finalized (unlinking), the prompt is asked to exit, then terminated, then
    killed, each bounded in time, and always joined. It also exits by itself
    if this process dies.

    :param prompt_config: ``LLMConfig`` properties for the prompt (plain,
        picklable values).
    :param start_timeout: seconds to wait for the prompt process to listen.
    :raises RuntimeError: if the prompt process fails to start or to link.
    """
    from aio_datadist import LLMDataDist, LLMRole

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_prompt_process, name="aio_datadist-prompt", daemon=True,
                          args=(child_conn, seed, dict(prompt_config or {}), os.getpid()))
    try:
        process.start()
        child_conn.close()
        ready = await _recv(conn, start_timeout, "its start")
        if ready[0] != "ready":
            raise RuntimeError(f"the prompt process failed to start:\n{ready[1]}")
        port, cache_ids = ready[1], ready[2]
        async with LLMDataDist(LLMRole.DECODER, DECODER_CLUSTER_ID) as decoder:
            await decoder.init(loopback_options(**(decoder_config or {})))
            decoder_blocks, decoder_rows = _decoder_caches(decoder)
            await _link(decoder, (LOOPBACK, port))
            pair = ProcessPair(decoder, decoder_blocks, decoder_rows, seed, prompt_address=(LOOPBACK, port),
                               prompt_cache_ids=cache_ids, _process=process, _conn=conn)
            del decoder_blocks, decoder_rows
            try:
                yield pair
            finally:
                pair._release()
    finally:
        try:
            await _stop(process, conn)
        finally:
            _reap(process, conn, child_conn)


async def _stop(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection) -> None:
    """Ask the prompt to exit, then terminate it, each with a bounded wait."""
    if process.pid is None:
        return
    if process.is_alive():
        with contextlib.suppress(OSError, ValueError):
            conn.send(("exit",))
        await _ended(process, STOP_GRACE_S)
    if process.is_alive():
        process.terminate()
        await _ended(process, 5.0)


def _reap(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection,
          child_conn: multiprocessing.connection.Connection) -> None:
    """Kill (if still alive) and join at once; close the pipe ends. Never awaits."""
    if process.pid is not None:
        if process.is_alive():
            process.kill()
        process.join(10.0)
        if not process.is_alive():
            process.close()
    conn.close()
    child_conn.close()


async def _ended(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Until ``process`` ends (its sentinel becomes readable), at most ``timeout`` s."""
    await _readable(process.sentinel, timeout)
    process.join(0)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _readable(fd: int, timeout: float | None) -> bool:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(fd, _set_done, ready)
    try:
        async with asyncio.timeout(timeout):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


async def _recv(conn: multiprocessing.connection.Connection, timeout: float, what: str,
                limit: float | None = None) -> Any:
    """The next message from the prompt, within ``timeout`` s (of ``limit`` s in all, for the message)."""
    if not await _readable(conn.fileno(), timeout):
        raise RuntimeError(f"the prompt process did not answer {what} within {timeout if limit is None else limit} s")
    os.set_blocking(conn.fileno(), True)  # uvloop's add_reader made it non-blocking
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"the prompt process ended before answering {what}") from None


# -- the prompt process -----------------------------------------------------------------------


def _prompt_process(conn: multiprocessing.connection.Connection, seed: int, config: dict[str, Any],
                    parent_pid: int) -> None:
    threading.Thread(target=_orphan_watch, args=(parent_pid,), daemon=True).start()
    try:
        asyncio.run(_serve_prompt(conn, seed, config))
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()


def _orphan_watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(70)  # the test process is gone: nobody will stop us


async def _serve_prompt(conn: multiprocessing.connection.Connection, seed: int, config: dict[str, Any]) -> None:
    from aio_datadist import LLMDataDist, LLMException, LLMRole

    async with LLMDataDist(LLMRole.PROMPT, PROMPT_CLUSTER_ID) as prompt:
        await prompt.init(loopback_options(listen=True, **config))
        blocks, rows = _prompt_caches(prompt, seed)
        assert prompt.listen_address is not None
        conn.send(("ready", prompt.listen_address[1], {"blocks": blocks.cache_id, "rows": rows.cache_id}))
        kv = prompt.kv_cache_manager
        while True:
            await _readable(conn.fileno(), None)
            os.set_blocking(conn.fileno(), True)
            try:
                command = conn.recv()
            except EOFError:
                return
            if command[0] == "exit":
                return
            _, seq, src_blocks, dst_blocks, timeout = command
            try:
                from aio_datadist import BlocksCacheKey

                await kv.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID), blocks, src_blocks, dst_blocks,
                                     timeout=timeout)
            except LLMException as exc:
                conn.send((seq, "llm", int(exc.status_code), str(exc)))
            except Exception:
                conn.send((seq, "error", traceback.format_exc()))
            else:
                conn.send((seq, "ok"))


# -- the fixtures ----------------------------------------------------------------------------------

try:
    import pytest_asyncio
except ImportError:  # the fixtures then say what is missing when used
    _HAVE_PYTEST_ASYNCIO = False
else:
    _HAVE_PYTEST_ASYNCIO = True

if _HAVE_PYTEST_ASYNCIO:

    @pytest_asyncio.fixture
    async def datadist_pair() -> AsyncIterator[DataDistPair]:
        """A linked PROMPT and DECODER in this process; see :class:`DataDistPair`."""
        async with open_pair() as pair:
            yield pair

    @pytest_asyncio.fixture
    async def datadist_process_pair() -> AsyncIterator[ProcessPair]:
        """A PROMPT in a spawned process and a linked DECODER here; see :class:`ProcessPair`."""
        async with open_process_pair() as pair:
            yield pair

else:

    @pytest.fixture
    def datadist_pair() -> None:
        """Needs pytest-asyncio."""
        pytest.fail("the datadist_pair fixture needs pytest-asyncio (pip install pytest-asyncio)", pytrace=False)

    @pytest.fixture
    def datadist_process_pair() -> None:
        """Needs pytest-asyncio."""
        pytest.fail("the datadist_process_pair fixture needs pytest-asyncio (pip install pytest-asyncio)",
                    pytrace=False)
