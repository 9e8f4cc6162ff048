"""How much one run of the reliability suite does.

CI runs the defaults (``SCALE == 1``, ``SEED == 0``: fixed seeds, derandomized
hypothesis). ``tools/soak.py`` sets ``AIO_RELIABILITY_SCALE`` (more trials,
examples, waves and seconds) and ``AIO_RELIABILITY_SEED`` (other seeds, random
hypothesis examples) for each of its rounds.
"""

from __future__ import annotations

import os

SCALE = max(1, int(os.environ.get("AIO_RELIABILITY_SCALE", "1")))
SEED = int(os.environ.get("AIO_RELIABILITY_SEED", "0"))


def scaled(n: int) -> int:
    return n * SCALE
