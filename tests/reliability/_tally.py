"""Counts the reliability suite reports at the end of a run (see ``conftest.py``).

Tests add to :data:`COUNTS` (``count("fault trials", 1)``) and note facts
such as throughput with :func:`note`; ``pytest_terminal_summary`` prints them,
so ``-q`` runs show them too.
"""

from __future__ import annotations

import collections

COUNTS: collections.Counter[str] = collections.Counter()
NOTES: dict[str, str] = {}


def count(what: str, n: int = 1) -> None:
    COUNTS[what] += n


def at_least(what: str, n: int) -> None:
    """Record the largest ``n`` seen (a level reached, such as concurrent peers), not a sum."""
    COUNTS[what] = max(COUNTS[what], n)


def note(what: str, text: str) -> None:
    NOTES[what] = text
