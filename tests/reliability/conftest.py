"""Reliability suite set-up: the counts summary (the fork server is tests/conftest.py's ``fork_server``)."""

from __future__ import annotations

from _tally import COUNTS, NOTES

#: What each count means, in the order printed.
_ORDER = ("fault trials", "calls ended by a fault", "fuzz cases (in-process)", "fuzz cases (live socket)",
          "malformed frames (live socket)", "bad-input cases", "concurrent peers", "cancelled transfers")


def pytest_terminal_summary(terminalreporter) -> None:
    if not COUNTS and not NOTES:
        return
    terminalreporter.section("reliability")
    for what in _ORDER + tuple(sorted(set(COUNTS) - set(_ORDER))):
        if what in COUNTS:
            terminalreporter.write_line(f"{what}: {COUNTS[what]}")
    for what, text in sorted(NOTES.items()):
        terminalreporter.write_line(f"{what}: {text}")
