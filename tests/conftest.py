"""Shared test set-up: both event loops, a leak check after every test, and the reliability summary."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys

import pytest
import uvloop

from aio_datadist import _core

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "reliability"))
import _tally  # tests/reliability/_tally.py: the counts the reliability suite reports

#: On a machine with a CUDA device, ``aio.DeviceType=auto`` (the default) opens it, so every test that takes the
#: default would put its ``Placement.DEVICE`` caches on the GPU, where the host-path tests and their byte checks
#: on host tensors do not expect them (a lent H200 failed dozens so). The suite therefore hides the device from
#: itself and every peer process it starts, unless ``AIO_DATADIST_TEST_CUDA=1``, which the GPU tests need
#: (``tests/gpu``, ``tests/test_triton_kernels.py``; ``benchmarks/gpu.py`` sets it). Set before anything
#: initialises CUDA: tests/gpu/conftest.py asks torch at import, after this file.
CUDA_OPT_IN = "AIO_DATADIST_TEST_CUDA"
if os.environ.get(CUDA_OPT_IN) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


#: What the fork server imports once, so that each peer forked from it starts in tens of milliseconds
#: instead of the ~2 s a ``spawn`` start with torch costs here (modules of a test folder that is not on the
#: path are skipped by multiprocessing; tests/reliability always is, for ``_tally`` below).
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
LOOP_PARAM = "_asyncio_loop_factory"  # pytest-asyncio's parameter for the factories above


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on asyncio's default loop and on uvloop."""
    return LOOPS


def pytest_collection_modifyitems(config, items):
    """A slow test marked ``loops_take_turns`` runs each of its cases on one loop instead of both, the loops
    taking the cases in a checkerboard over its parameters (the loop is the parity of the sum of the cases'
    value positions): every case runs, and every value of every parameter runs on both loops where another
    parameter gives it two cases, at half the cost. For tests whose cases are ways to cut a call (a timeout, a
    cancel, ...) and paths, where the loop and the way are independent. A case named by its id on the command
    line runs whatever its loop."""
    marked = [item for item in items if item.get_closest_marker("loops_take_turns") is not None
              and getattr(item, "callspec", None) is not None]
    if not marked:
        return
    values: dict[tuple, dict[str, list[str]]] = {}  # per test function: each parameter's values, in order
    for item in marked:
        seen = values.setdefault((item.path, item.originalname), {})
        for name, value in item.callspec.params.items():
            if name != LOOP_PARAM and repr(value) not in seen.setdefault(name, []):
                seen[name].append(repr(value))
    loops = list(LOOPS)
    named = {arg.replace(os.sep, "/").split("::", 1)[0].rsplit("tests/", 1)[-1] + "::" + arg.split("::", 1)[1]
             for arg in config.args if "::" in arg and "[" in arg}
    dropped = set()
    for item in marked:
        path, _, name = item.nodeid.partition("::")
        if path.rsplit("tests/", 1)[-1] + "::" + name in named:
            continue  # asked for by its id: it runs
        seen = values[(item.path, item.originalname)]
        params = item.callspec.params
        loop = item.callspec.id.split("-", 1)[0]
        assert loop in loops and LOOP_PARAM in params, f"{item.nodeid}: loops_take_turns needs both loops"
        turn = sum(seen[name].index(repr(value)) for name, value in params.items() if name != LOOP_PARAM)
        if turn % len(loops) != loops.index(loop):
            dropped.add(item)
    config.hook.pytest_deselected(items=[item for item in items if item in dropped])
    items[:] = [item for item in items if item not in dropped]


# Event loops (and os.urandom) keep these for their own lifetime, which
# pytest-asyncio ends after this fixture; our own fds are eventfds, epoll fds
# of engines (also counted by live_objects), sockets and memfds. With a CUDA device
# visible, the driver opens its device files lazily and keeps them for the process.
_LOOP_OWNED = ("/dev/urandom", "pipe:", "/dev/nvidia")


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


#: What the reliability section prints first, in this order; other counts follow sorted, then the notes.
_TALLY_ORDER = ("fault trials", "calls ended by a fault", "fuzz cases (in-process)", "fuzz cases (live socket)",
                "malformed frames (live socket)", "bad-input cases", "concurrent peers", "cancelled transfers")


def pytest_sessionfinish(session) -> None:
    """On a pytest-xdist worker: hand this worker's reliability counts to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["reliability_tally"] = _tally.export()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the pytest-xdist controller: add up a finished worker's counts (``pytest -n 2``)."""
    tally = getattr(node, "workeroutput", {}).get("reliability_tally")
    if tally is not None:
        _tally.merge(tally)


def pytest_terminal_summary(terminalreporter) -> None:
    """The ``reliability`` section: what the reliability suite did (counts, seeds' facts), also under ``-q``."""
    counts, notes = _tally.COUNTS, _tally.NOTES
    if not counts and not notes:
        return
    terminalreporter.section("reliability")
    for what in _TALLY_ORDER + tuple(sorted(set(counts) - set(_TALLY_ORDER))):
        if what in counts:
            terminalreporter.write_line(f"{what}: {counts[what]}")
    for what, text in sorted(notes.items()):
        terminalreporter.write_line(f"{what}: {text}")
