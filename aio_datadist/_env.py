"""Tuning knobs read from the environment at import.

Each knob is an int in a range; a value that is not one is named in a warning and the knob keeps its
default, so a typo in a deployment's environment never stops the library from importing (it raised
``ValueError`` at import before).
"""

from __future__ import annotations

import logging
import os

__all__ = ["env_int"]

log = logging.getLogger("aio_datadist.env")


def env_int(name: str, default: int, *, high: int = 2 ** 64, unit: str = "a size in bytes") -> int:
    """The int in ``[0, high)`` that environment variable ``name`` holds in decimal ASCII digits (spaces around
    them ignored); ``default`` when it is unset or empty, or (with a warning that names the variable and
    ``unit``) anything else."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    # ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits
    # (and no more digits than ``high`` has, leading zeros aside: int() refuses over 4300 digits)
    digits = text.lstrip("0") or "0"
    value = int(digits) if text.isascii() and text.isdigit() and len(digits) <= len(str(high)) else -1
    if not 0 <= value < high:
        log.warning("$%s=%r is not %s (an int in [0, %d)): using %d", name, text, unit, high, default)
        return default
    return value
