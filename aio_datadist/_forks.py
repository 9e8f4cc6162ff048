"""How many ``fork``s lie between the process that imported the package and this one.

Objects that hold memory or threads shared with a parent process (an endpoint, the read ledger) record it
when made: in a forked child they differ, and there such an object only lets go of what it holds. Not the
process id: a descendant may get a dead ancestor's id back.
"""

from __future__ import annotations

import os

__all__ = ["forks"]

_FORKS = 0


def _after_fork_in_child() -> None:
    global _FORKS
    _FORKS += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def forks() -> int:
    """How many ``fork``s lie between the process's start and this process (0 in the first process)."""
    return _FORKS
