"""Counts the reliability suite reports at the end of a run (printed by ``tests/conftest.py``).

Tests add to :data:`COUNTS` (``count("fault trials", 1)``) and note facts
such as throughput with :func:`note`; ``pytest_terminal_summary`` prints them,
so ``-q`` runs show them too. Under pytest-xdist each worker hands its tally
to the controller (:func:`export`), which adds them up (:func:`merge`).
"""

from __future__ import annotations

import collections

COUNTS: collections.Counter[str] = collections.Counter()
NOTES: dict[str, str] = {}
#: Counts recorded with :func:`at_least`: the workers' levels are not added up, the largest is kept.
LEVELS: set[str] = set()


def count(what: str, n: int = 1) -> None:
    COUNTS[what] += n


def at_least(what: str, n: int) -> None:
    """Record the largest ``n`` seen (a level reached, such as concurrent peers), not a sum."""
    LEVELS.add(what)
    COUNTS[what] = max(COUNTS[what], n)


def note(what: str, text: str) -> None:
    NOTES[what] = text


def export() -> dict:
    """This process's tally, in plain types (what an xdist worker sends its controller)."""
    return {"counts": dict(COUNTS), "levels": sorted(LEVELS), "notes": dict(NOTES)}


def merge(tally: dict) -> None:
    """Add another process's :func:`export` to this one's."""
    LEVELS.update(tally["levels"])
    for what, n in tally["counts"].items():
        COUNTS[what] = max(COUNTS[what], n) if what in LEVELS else COUNTS[what] + n
    NOTES.update(tally["notes"])
