"""Reliability suite set-up: a fork server for cheap peer processes, and the counts summary."""

from __future__ import annotations

import multiprocessing.forkserver

import pytest

import _forked
from _tally import COUNTS, NOTES

#: What each count means, in the order printed.
_ORDER = ("fault trials", "calls ended by a fault", "fuzz cases (in-process)", "fuzz cases (live socket)",
          "malformed frames (live socket)", "bad-input cases", "concurrent peers", "cancelled transfers")


@pytest.fixture(scope="session")
def fork_server() -> None:
    """Start the fork server (torch and aio_datadist preloaded) before any test snapshots its fds.

    Peers forked from it start in tens of milliseconds instead of the 2 s a
    ``spawn`` start with torch costs here.
    """
    _forked.preload()
    multiprocessing.forkserver.ensure_running()


def pytest_terminal_summary(terminalreporter) -> None:
    if not COUNTS and not NOTES:
        return
    terminalreporter.section("reliability")
    for what in _ORDER + tuple(sorted(set(COUNTS) - set(_ORDER))):
        if what in COUNTS:
            terminalreporter.write_line(f"{what}: {COUNTS[what]}")
    for what, text in sorted(NOTES.items()):
        terminalreporter.write_line(f"{what}: {text}")
