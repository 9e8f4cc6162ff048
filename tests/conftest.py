"""Shared test set-up: both event loops, and a leak check after every test."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import socket

import pytest
import uvloop

from aio_datadist import _core


#: What the fork server imports once, so that each peer forked from it starts in tens of milliseconds
#: instead of the ~2 s a ``spawn`` start with torch costs here (modules of another test folder that is
#: not on the path are skipped by multiprocessing).
FORK_PRELOAD = ["torch", "uvloop", "aio_datadist", "aio_datadist.compat", "peers", "_harness", "_forked",
                "_client_harness", "_v2peer"]


@pytest.fixture
def socket_pair():
    """Two connected non-blocking unix stream sockets, closed after the test."""
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="session")
def fork_server() -> None:
    """Start the fork server (torch and aio_datadist preloaded) before a test snapshots its fds.

    ``peers.EndpointProcess`` and the reliability suite's ``ForkedEndpoint`` fork their processes from it
    once it runs (``peers.process_context``); request this fixture in every module that starts them.
    """
    multiprocessing.set_forkserver_preload(FORK_PRELOAD)
    multiprocessing.forkserver.ensure_running()


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on asyncio's default loop and on uvloop."""
    return LOOPS


def pytest_collection_modifyitems(config, items):
    """A slow test marked ``loops_take_turns`` runs each of its cases on one loop, the loops in turn (its first
    case on asyncio, its second on uvloop, ...), instead of every case on both: every case runs and both loops
    run the test, at half the cost. For tests whose cases are ways to cut a call (a timeout, a cancel, ...),
    where the loop and the way are independent."""
    kept, dropped, seen = [], [], {}
    loops = list(LOOPS)
    for item in items:
        spec = getattr(item, "callspec", None)
        if item.get_closest_marker("loops_take_turns") is None or spec is None:
            kept.append(item)
            continue
        loop = spec.id.split("-", 1)[0]
        assert loop in loops, f"{item.nodeid}: loops_take_turns needs the loop as the first id part"
        key = (item.path, item.originalname, loop)
        turn = seen.setdefault(key, 0)
        seen[key] = turn + 1
        (kept if turn % len(loops) == loops.index(loop) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


# Event loops (and os.urandom) keep these for their own lifetime, which
# pytest-asyncio ends after this fixture; our own fds are eventfds, epoll fds
# of engines (also counted by live_objects), sockets and memfds.
_LOOP_OWNED = ("/dev/urandom", "pipe:")


def _open_fds() -> set[str]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{name}->{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            pass
    return fds


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves native objects, fds or child processes behind."""
    before_fds = _open_fds()
    before_live = _core.live_objects()
    yield
    leaked = _leaked_fds(before_fds)
    if leaked or _core.live_objects() != before_live:
        gc.collect()  # only when needed: a full collection costs ~0.1 s with torch loaded
        leaked = _leaked_fds(before_fds)
    assert _core.live_objects() == before_live, "native objects left open"
    assert not leaked, f"file descriptors left open: {sorted(leaked)}"
    children = multiprocessing.active_children()
    for child in children:
        child.kill()
        child.join(5)
    assert not children, f"child processes left running: {children}"


def _leaked_fds(before: set[str]) -> set[str]:
    return {fd for fd in _open_fds() - before if not any(s in fd for s in _LOOP_OWNED)}
