"""Peer processes for benchmarks: a function in a spawned process, always cleaned up."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable


class PeerError(RuntimeError):
    """A peer process failed, died, or did not answer in time."""


def _peer_watchdog(parent_pid: int, deadline: float) -> None:
    while True:
        if os.getppid() != parent_pid or time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.2)


def _peer_entry(
    target: Callable[..., Any],
    conn: mp_connection.Connection,
    result_conn: mp_connection.Connection,
    args: tuple[Any, ...],
    parent_pid: int,
    lifetime: float,
) -> None:
    # Exit on our own if the parent vanishes or the lifetime runs out, so a
    # crashed benchmark never leaves a peer behind.
    threading.Thread(
        target=_peer_watchdog, args=(parent_pid, time.monotonic() + lifetime + 5.0), daemon=True
    ).start()
    try:
        value = target(conn, *args)
    except BaseException:
        with contextlib.suppress(Exception):
            result_conn.send(("error", traceback.format_exc()))
        sys.exit(1)
    else:
        result_conn.send(("ok", value))
    finally:
        conn.close()
        result_conn.close()


def _call_without_conn(conn: mp_connection.Connection, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Peer:
    """``target(conn, *args)`` running in a process of the ``spawn`` context.

    ``conn`` is one end of a duplex pipe whose other end is :meth:`send` /
    :meth:`recv` here; the target's return value (picklable) comes back through
    :meth:`result`. The whole peer lives at most ``timeout`` seconds: waits are
    bounded by what is left of it, and :meth:`close` (also on ``with`` exit)
    joins, then terminates, then kills the process, and closes the pipes. The
    peer also exits by itself if this process dies.

    ``target`` and ``args`` must be picklable (a module-level function).
    """

    def __init__(self, target: Callable[..., Any], *args: Any, timeout: float, name: str | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self.name = name or getattr(target, "__name__", "peer")
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._result_conn, child_result = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_peer_entry,
            args=(target, child_conn, child_result, args, os.getpid(), timeout),
            name=self.name,
            daemon=True,
        )
        self._child_ends = (child_conn, child_result)
        self._deadline: float | None = None
        self._result: tuple[str, Any] | None = None
        self._closed = False
        self._exitcode: int | None = None

    def start(self) -> "Peer":
        self._process.start()
        self._deadline = time.monotonic() + self.timeout
        for c in self._child_ends:
            c.close()  # so that our recv sees EOF when the child dies
        return self

    def __enter__(self) -> "Peer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._closed else self._process.exitcode

    def remaining(self) -> float:
        """Seconds left of the peer's lifetime."""
        if self._deadline is None:
            return self.timeout
        return max(0.0, self._deadline - time.monotonic())

    def _wait_for(self, conn: mp_connection.Connection, timeout: float | None, what: str) -> Any:
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        if not conn.poll(limit):
            raise PeerError(f"peer {self.name!r}: no {what} within {limit:.1f}s")
        try:
            return conn.recv()
        except EOFError:
            raise PeerError(self._death_reason(what)) from None

    def _death_reason(self, what: str) -> str:
        self._process.join(1.0)
        detail = ""
        with contextlib.suppress(PeerError, OSError, EOFError):
            if self._result is None and self._result_conn.poll(0.5):
                self._result = self._result_conn.recv()
        if self._result is not None and self._result[0] == "error":
            detail = "\n" + str(self._result[1])
        return f"peer {self.name!r} ended (exit code {self._process.exitcode}) before its {what}{detail}"

    async def _wait_for_async(self, conn: mp_connection.Connection, timeout: float | None, what: str) -> Any:
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        loop = asyncio.get_running_loop()
        readable = loop.create_future()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(conn.fileno(), on_readable)
        try:
            await asyncio.wait_for(readable, limit)
        except TimeoutError:
            raise PeerError(f"peer {self.name!r}: no {what} within {limit:.1f}s") from None
        finally:
            loop.remove_reader(conn.fileno())
        try:
            return conn.recv()
        except EOFError:
            raise PeerError(self._death_reason(what)) from None

    def send(self, obj: Any) -> None:
        """Send a picklable object to the peer's ``conn``."""
        self._conn.send(obj)

    def recv(self, timeout: float | None = None) -> Any:
        """The next object the peer sent on ``conn``.

        Raises:
            PeerError: nothing within ``timeout`` (or the peer's remaining
                lifetime), or the peer ended first (with its traceback).
        """
        return self._wait_for(self._conn, timeout, "message")

    async def recv_async(self, timeout: float | None = None) -> Any:
        """:meth:`recv` for code running on an event loop: waits on the pipe's fd, not in a thread."""
        return await self._wait_for_async(self._conn, timeout, "message")

    async def result_async(self, timeout: float | None = None) -> Any:
        """:meth:`result` for code running on an event loop."""
        if self._result is None:
            self._result = await self._wait_for_async(self._result_conn, timeout, "result")
        return self.result()

    def result(self, timeout: float | None = None) -> Any:
        """The target's return value.

        Raises:
            PeerError: the target raised (its traceback is in the message), the
                peer died, or no result within ``timeout`` / its lifetime.
        """
        if self._result is None:
            self._result = self._wait_for(self._result_conn, timeout, "result")
        status, value = self._result
        if status != "ok":
            raise PeerError(f"peer {self.name!r} failed:\n{value}")
        return value

    def close(self, grace: float = 5.0) -> None:
        """Join (up to ``grace`` s), then terminate, then kill; close the pipes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        p = self._process
        if p.pid is not None:
            p.join(min(grace, max(self.remaining(), 0.5)))
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
            self._exitcode = p.exitcode
            if not p.is_alive():
                p.close()
        for c in (self._conn, self._result_conn, *self._child_ends):
            c.close()


def run_in_subprocess(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``fn(*args)`` in a fresh spawned process; its return value.

    Raises:
        PeerError: ``fn`` raised, the process died, or it took longer than ``timeout``.
    """
    with Peer(_call_without_conn, fn, *args, timeout=timeout, name=getattr(fn, "__name__", None)) as peer:
        return peer.result()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
