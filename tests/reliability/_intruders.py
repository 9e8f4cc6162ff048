"""Processes that act against an endpoint's listener: a connection flood, and an endpoint living under a
lowered ``RLIMIT_NOFILE``. Forked from the suite's fork server (``_forked.py``); each watches its parent and
exits when the parent is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import resource
import socket
import threading
import time
from typing import Any

import _harness
from _forked import _CTX

HALF_HELLO = 10  # bytes of a HELLO a "half" flooder sends before it stops


class Child:
    """A forked helper process and its pipe; ``async with`` starts it and always reaps it."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.conn, child_conn = _CTX.Pipe(duplex=True)
        self.process = _CTX.Process(target=target, args=(child_conn, os.getpid(), *args), daemon=True)
        self._child_conn: multiprocessing.connection.Connection | None = child_conn

    async def __aenter__(self) -> Child:
        self.process.start()
        assert self._child_conn is not None
        self._child_conn.close()
        self._child_conn = None
        self._fds = {self.conn.fileno(), self.process.sentinel}
        _harness.PROCESS_FDS.update(self._fds)
        return self

    async def recv(self, timeout: float = 30.0) -> Any:
        if not await asyncio.to_thread(self.conn.poll, timeout):
            raise AssertionError(f"{self.process.name} did not answer within {timeout} s")
        answer = self.conn.recv()
        if answer[0] == "error":
            raise AssertionError(f"{self.process.name} failed:\n{answer[1]}")
        return answer

    async def call(self, *command: Any, timeout: float = 30.0) -> Any:
        self.conn.send(command)
        return (await self.recv(timeout))[1]

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("exit",))
        await asyncio.to_thread(self.process.join, 5.0)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5.0)
        _harness.PROCESS_FDS.difference_update(self._fds)
        self.process.close()
        self.conn.close()


def _watch(parent_pid: int) -> None:
    def run() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(70)
            time.sleep(0.2)

    threading.Thread(target=run, daemon=True).start()


# -- a connection flood --------------------------------------------------------------------


def flood_main(conn: multiprocessing.connection.Connection, parent_pid: int, address: tuple[str, int],
               count: int, mode: str) -> None:
    """Open ``count`` connections to ``address`` and hold them, saying nothing (``silent``) or only the
    first bytes of a HELLO (``half``), until told to exit; then close them all."""
    _watch(parent_pid)
    try:
        from aio_datadist import wire
        from aio_datadist.wire import Msg

        hello = wire.encode(Msg.HELLO, 0, nonce=os.urandom(32))[:HALF_HELLO]
        held: list[socket.socket] = []
        for _ in range(count):
            sock = socket.create_connection(address, timeout=5)
            if mode == "half":
                sock.sendall(hello)
            held.append(sock)
        conn.send(("ready", len(held)))
        while conn.recv()[0] != "exit":
            pass
        for sock in held:
            sock.close()
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))
    os._exit(0)


# -- an endpoint under a lowered RLIMIT_NOFILE ----------------------------------------------


def limited_main(conn: multiprocessing.connection.Connection, parent_pid: int, role: Any, cluster_id: int,
                 listen: bool, config: dict[str, Any], room: int, loop: str, slack: int = 2) -> None:
    """An endpoint that starts with a soft ``RLIMIT_NOFILE`` of 256 (to see init raise it), then lowers
    both limits so that ``room`` links fit by the documented formula, and serves commands:
    ``("link", cluster_id, port)``, ``("check", cluster_id)``, ``("unlink", cluster_id, port)``,
    ``("fds",)``, ``("exit",)``. ``slack``: fds of the limit past the ``room`` links' (0: they fit exactly)."""
    _watch(parent_pid)
    try:
        import uvloop

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        factory = uvloop.new_event_loop if loop == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(_limited(conn, role, cluster_id, listen, config, room, slack))
    except BaseException:
        import traceback

        conn.send(("error", traceback.format_exc()))
    os._exit(0)


async def _limited(conn: multiprocessing.connection.Connection, role: Any, cluster_id: int, listen: bool,
                   config: dict[str, Any], room: int, slack: int) -> None:
    from aio_datadist import LLMDataDist, LLMException, fd_budget
    from aio_datadist.admission import ARRIVAL_FACTOR
    from aio_datadist.testing import link_count, runtime_of
    from peers import _next_command, cluster_info

    async with LLMDataDist(role, cluster_id) as dd:
        await dd.init(_harness.options(listen=listen, **config))
        raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        settings = runtime_of(dd).settings
        per_link = fd_budget.per_link(settings.data_channels, settings.transport in ("auto", "local"))
        reserve = fd_budget.RESERVE + ((1 + ARRIVAL_FACTOR) * settings.max_pending_handshakes if listen else 0)
        # links that fit = (limit - fds open - reserve) // per_link = room
        limit = fd_budget.open_count() + reserve + room * per_link + slack
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
        port = dd.listen_address[1] if dd.listen_address else 0
        conn.send(("ready", {"port": port, "raised": raised, "limit": limit, "per_link": per_link}))
        while True:
            command, *args = await _next_command(conn)
            try:
                if command == "exit":
                    break
                if command == "link":
                    status, codes = await dd.link_clusters([cluster_info(args[0], ("127.0.0.1", args[1]))])
                    result: Any = int(codes[0])
                elif command == "unlink":
                    status, codes = await dd.unlink_clusters([cluster_info(args[0], ("127.0.0.1", args[1]))])
                    result = int(codes[0])
                elif command == "check":
                    await dd.check_link_status(args[0])
                    result = None
                elif command == "links":
                    result = link_count(dd)
                elif command == "fds":
                    result = fd_budget.open_count()
                else:
                    raise ValueError(command)
            except LLMException as exc:
                result = ("llm", int(exc.status_code), str(exc))
            conn.send(("ok", result))
